"""Loom on shared cores: the default model at 1, 8 and 64 concurrent streams, with K busy
competitor processes on the same cores (K = 0, 1, 2), reporting tokens/s and CPU ms per token.

Run from a checkout's root, so that the checkout's own ``runtime`` is imported; running the same
file from an older checkout measures that version the same way (docs/benchmarks-history.md, "Shared cores"):

    python docs/bench/shared_cores.py [--cpu-threads N] [--tokens 24] [--label NAME] [--rounds R]

With --rounds R the counts of busy processes take turns R times and each cell reports the median
(with every round's figure), so that a VM whose speed drifts between minutes weighs on quiet and
shared cells alike; the ratio column is each cell's median over the quiet one's.
"""

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.getcwd())

from runtime import Engine, GenerationConfig  # noqa: E402


def run(engine, streams: int, tokens: int) -> tuple[float, float]:
    """tokens/s and CPU seconds per token of ``streams`` requests, each fetched by its own thread."""
    config = GenerationConfig(max_new_tokens=tokens, ignore_eos=True)
    handles = [engine.launch_response_tokens([1 + i, 2, 3, 4], config) for i in range(streams)]

    def drain(handle):
        for _ in engine.stream_response_tokens(handle):
            pass

    start, cpu = time.perf_counter(), time.process_time()
    threads = [threading.Thread(target=drain, args=(h,)) for h in handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return streams * tokens / (time.perf_counter() - start), (time.process_time() - cpu) / (streams * tokens)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-threads", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--label", default="loom")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    options = {"cpu_threads": args.cpu_threads} if args.cpu_threads else {}
    engine = Engine.from_pretrained(**options)
    run(engine, 1, 4)  # warm-up
    cells: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for competitors in (0, 1, 2):
            busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(competitors)]
            time.sleep(0.5)
            try:
                for streams in (1, 8, 64):
                    cells.setdefault((competitors, streams), []).append(run(engine, streams, args.tokens))
            finally:
                for process in busy:
                    process.kill()
    print("| system | busy procs | streams | tok/s (median; rounds) | CPU ms/token | of quiet |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (competitors, streams), results in cells.items():
        rate = statistics.median(r for r, _ in results)
        cpu = statistics.median(c for _, c in results)
        rounds = " / ".join(f"{r:.1f}" for r, _ in results)
        quiet = statistics.median(r for r, _ in cells[0, streams])
        print(f"| {args.label} | {competitors} | {streams} | {rate:.1f} ({rounds}) | {1000 * cpu:.1f} | "
              f"{rate / quiet:.2f} |", flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
