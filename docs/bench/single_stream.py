"""Loom against its own pure forward at 1 and 4 streams on the default model: the per-step cost of
scheduling, sampling and delivery where it weighs most (docs/benchmarks-history.md, "Single stream").
Each round runs Loom (a thread per request, 64 new tokens, EOS ignored) and then the pure forward
(the same steps, model.forward alone over prebuilt inputs); the median of 3 rounds is printed.
Run from a checkout's root:

    python docs/bench/single_stream.py [--weights float32|float16|int8|int8-dynamic|int4]
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.getcwd())

from runtime import Engine  # noqa: E402
from runtime.bench import harness  # noqa: E402
from runtime.bench.harness import Request  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", default="float32")
    args = parser.parse_args()
    engine = Engine.from_pretrained(None, weights=args.weights)
    print("| weights | streams | Loom tok/s (3 rounds) | pure forward tok/s | Loom / pure (medians) |")
    print("| --- | --- | --- | --- | --- |")
    for streams in (1, 4):
        prompts = [engine.encode([{"role": "user", "content": f"Question {i}: tell me a story."}])
                   for i in range(streams)]
        requests = [Request(p, 64) for p in prompts]
        loom, pure = [], []
        for _ in range(3):
            loom.append(harness.run_loom(engine, requests, "single").summary()["throughput"])
            pure.append(harness.run_pure_forward(engine.model, requests, "single").summary()["throughput"])
        ratio = statistics.median(loom) / statistics.median(pure)
        print(f"| {args.weights} | {streams} | {', '.join(f'{x:.1f}' for x in loom)} | "
              f"{', '.join(f'{x:.1f}' for x in pure)} | {ratio:.2f} |", flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
