"""Speculation on the default model (or ``--model``), one stream: decode tok/s after the first token with
``speculative_tokens`` 0 (off) and K, alternating, ``--rounds`` times, on tasks that repeat their input
(edit, repeat) and ones that do not (a story, a chat answer). The proposals come from prompt lookup, or
with ``--draft`` from a draft model: ``stored`` / ``int4`` / ``int8`` / ``float32`` for the embedded model
in those weights (``--draft stored``: its own Q4_1 blocks drafting for its float32 self), or a path
(with ``--draft-weights``). Run from a checkout's root:

    python docs/bench/speculation.py [--k 4] [--rounds 5] [--weights stored|float32] [--temperature 0]
                                     [--model PATH] [--draft stored|int4|PATH [--draft-weights W]]
                                     [--tasks edit,repeat,story,chat] [--max-new-tokens 128]
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
         "story": "Write a short story about a robot who learns to paint.",
         "chat": "What are three good habits for staying healthy? Explain each one briefly."}
DRAFT_WEIGHTS = ("stored", "int4", "int8", "float32")  # --draft: the embedded model in these weights


def decode_rate(engine: Engine, text: str, k: int, temperature: float, max_new_tokens: int) -> tuple[float, int, int]:
    """Tokens per second after the first, and the tokens proposed and accepted."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, speculative_tokens=k, temperature=temperature)
    handle = engine.launch_response([{"role": "user", "content": text}], config)
    list(engine.stream_response_tokens(handle))
    times = handle.token_times
    return (len(times) - 1) / (times[-1] - times[0]), handle.proposed_tokens, handle.accepted_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--weights", default="stored")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--model", default=None, help="the target (default: the embedded model)")
    parser.add_argument("--draft", default=None,
                        help=f"a draft model: one of {', '.join(DRAFT_WEIGHTS)} (the embedded model in those weights) "
                             "or a checkpoint path (default: none, prompt lookup)")
    parser.add_argument("--draft-weights", default=None, help="a --draft path's weights (default: as stored)")
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated, of " + ", ".join(TASKS))
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    draft, draft_weights = args.draft, args.draft_weights
    if draft in DRAFT_WEIGHTS:
        draft, draft_weights = "default", draft
    proposer = "prompt lookup" if draft is None else f"draft {args.draft}" + (f" ({draft_weights})" if
                                                                                  draft_weights and draft != "default" else "")
    with Engine.from_pretrained(args.model, weights=args.weights, draft=draft, draft_weights=draft_weights) as engine:
        engine.complete(TASKS["story"], GenerationConfig(max_new_tokens=8, speculative_tokens=args.k))  # warm both
        print(f"{proposer}, k={args.k}, temperature {args.temperature}")
        print("| task | off tok/s | on tok/s | speed-up | accepted / proposed |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for name in args.tasks.split(","):
            rates = {0: [], args.k: []}
            proposed = accepted = 0
            for _ in range(args.rounds):
                for k in rates:
                    rate, p, a = decode_rate(engine, TASKS[name], k, args.temperature, args.max_new_tokens)
                    rates[k].append(rate)
                    proposed, accepted = proposed + p, accepted + a
            off, on = (statistics.median(rates[k]) for k in (0, args.k))
            print(f"| {name} | {off:.1f} | {on:.1f} | {on / off:.2f}x | {accepted} / {proposed} |", flush=True)
        stats = engine.stats()
        if draft is not None:
            print(f"draft: {stats['draft_forwards']} forwards, {stats['draft_seconds']:.2f} s")


if __name__ == "__main__":
    main()
