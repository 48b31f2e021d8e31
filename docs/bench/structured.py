"""What structured output costs a step: 64 concurrent chat requests on the default model, each
generating 64 tokens, free or constrained to a JSON schema (an array of at least 40 records, so
that no request ends before its 64th token and every step holds all 64), and free with logprobs=5.
Each mode runs --repeat times, alternating; the table shows the median ms per step (wall time of
the run over its steps), tokens/s and the mask time, beside K busy competitor processes (K = 0, 2).
Run from a checkout's root (docs/benchmarks-history.md, "Structured output"):

    python docs/bench/structured.py [--repeat 3] [--streams 64] [--tokens 64]
"""

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.getcwd())

from runtime import Engine, GenerationConfig  # noqa: E402
from runtime.bench.harness import Competitors  # noqa: E402

RECORDS = {"type": "array", "minItems": 40, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "city", "member"],
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "city": {"type": "string", "maxLength": 16}, "member": {"type": "boolean"}}}}
MODES = {"free": {"ignore_eos": True}, "json_schema": {"json_schema": RECORDS},
         "free + logprobs=5": {"ignore_eos": True, "logprobs": 5}}


def run(engine, streams: int, tokens: int, fields: dict) -> tuple[float, float, int]:
    """(ms per step, tokens/s, tokens) for ``streams`` requests, each fetched by its own thread."""
    config = GenerationConfig(max_new_tokens=tokens, **fields)
    prompts = [[{"role": "user", "content": f"List people (record {i}) as JSON: name, age, city, member."}]
               for i in range(streams)]
    handles = [engine.launch_response(p, config) for p in prompts]
    done = []

    def drain(handle):
        done.append(len(list(engine.stream_response_tokens(handle))))

    steps, start = engine.stats()["steps"], time.perf_counter()
    threads = [threading.Thread(target=drain, args=(h,)) for h in handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed, steps = time.perf_counter() - start, engine.stats()["steps"] - steps
    return 1000 * elapsed / steps, sum(done) / elapsed, sum(done)


def mask_ms(engine, streams: int) -> float:
    """The mean time to compute one step's masks for ``streams`` constrained requests, alone."""
    grammars = engine._grammars
    constraints = [grammars.compile(GenerationConfig(json_schema=RECORDS)) for _ in range(streams)]
    grammars.start_masks(constraints).result()  # the helper thread and executor exist from here on
    start = time.perf_counter()
    for _ in range(20):
        grammars.start_masks(constraints).result()
    return (time.perf_counter() - start) / 20 * 1000


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    engine = Engine.from_pretrained(max_batch_size=args.streams)
    for fields in MODES.values():  # warm-up, and the grammar engine's tokenizer
        run(engine, 4, 4, fields)
    print(f"masks of one step, {args.streams} constrained requests at their first token: "
          f"{mask_ms(engine, args.streams):.2f} ms")
    print("| busy procs | mode | ms/step (median) | runs | tok/s (median) | vs free |")
    print("| --- | --- | --- | --- | --- | --- |")
    for competitors in (0, 2):
        with Competitors(competitors):
            results = {mode: [] for mode in MODES}
            for _ in range(args.repeat):
                for mode, fields in MODES.items():
                    step, rate, produced = run(engine, args.streams, args.tokens, fields)
                    assert produced == args.streams * args.tokens, (mode, produced)
                    results[mode].append((step, rate))
        free = statistics.median(s for s, _ in results["free"])
        for mode, runs in results.items():
            step = statistics.median(s for s, _ in runs)
            print(f"| {competitors} | {mode} | {step:.1f} | {', '.join(f'{s:.1f}' for s, _ in runs)} | "
                  f"{statistics.median(r for _, r in runs):.1f} | {100 * (step / free - 1):+.1f}% |", flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
