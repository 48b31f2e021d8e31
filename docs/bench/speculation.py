"""Prompt-lookup speculation on the default model, one stream: decode tok/s after the first token with
``speculative_tokens`` 0 (off) and K, alternating, ``--rounds`` times, on tasks that repeat their input
(edit, repeat) and one that does not (a story). Run from a checkout's root:

    python docs/bench/speculation.py [--k 4] [--rounds 5] [--weights stored|float32] [--temperature 0]
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.getcwd())

from runtime import Engine, GenerationConfig  # noqa: E402

PARAGRAPH = ("The committee met on Tuesday to discuss the budget for the coming year. After a long debate, the "
             "members agreed to increase funding for the library and to reduce spending on office supplies. The "
             "chair thanked everyone for their work and closed the meeting at five o'clock.")
TASKS = {"edit": "Fix the spelling in this paragraph and return the whole paragraph: "
                 + PARAGRAPH.replace("committee", "comittee").replace("library", "libary"),
         "repeat": "Repeat this text exactly: " + PARAGRAPH,
         "story": "Write a short story about a robot who learns to paint."}


def decode_rate(engine: Engine, text: str, k: int, temperature: float) -> float:
    config = GenerationConfig(max_new_tokens=128, speculative_tokens=k, temperature=temperature)
    handle = engine.launch_response([{"role": "user", "content": text}], config)
    list(engine.stream_response_tokens(handle))
    times = handle.token_times
    return (len(times) - 1) / (times[-1] - times[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--weights", default="stored")
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    with Engine.from_pretrained(weights=args.weights) as engine:
        engine.complete(TASKS["story"], GenerationConfig(max_new_tokens=8))  # warm
        print("| task | off tok/s | on tok/s | speed-up |")
        print("| --- | ---: | ---: | ---: |")
        for name, text in TASKS.items():
            rates = {0: [], args.k: []}
            for _ in range(args.rounds):
                for k in rates:
                    rates[k].append(decode_rate(engine, text, k, args.temperature))
            off, on = (statistics.median(rates[k]) for k in (0, args.k))
            print(f"| {name} | {off:.1f} | {on:.1f} | {on / off:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
