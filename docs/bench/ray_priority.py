"""Loom's Ray Serve replicas beside busy processes, at the priority Loom gives its workers (nice 0)
and at Ray's own default (nice 15): the time from `python -m runtime serve --replicas N` to its
first healthy /health, and the throughput of concurrent streamed requests through its OpenAI route.

Run from a checkout's root (docs/benchmarks-history.md, "Ray replicas on shared cores"):

    python docs/bench/ray_priority.py [--replicas 2] [--streams 16] [--tokens 64] [--busy 0,1] [--rounds 2]

Each cell starts a fresh local Ray instance; the two niceness values take turns inside every
round, so that a VM whose speed drifts between minutes weighs on both alike.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.getcwd())

from runtime.bench.harness import Competitors  # noqa: E402
from runtime.bench.peers import OpenAIServer, ServerDidNotStart, free_port  # noqa: E402
from runtime.serve.ray_app import NICENESS_VARIABLE  # noqa: E402


def cell(niceness: str, replicas: int, streams: int, tokens: int) -> tuple[float, float]:
    """(seconds to a healthy server, tokens/s of ``streams`` streams) with Ray's workers at ``niceness``;
    (inf, 0) where the server did not answer within OpenAIServer's 300 s."""
    os.environ[NICENESS_VARIABLE] = niceness  # the server's process, and so its Ray instance, inherits it
    port = free_port()
    command = [sys.executable, "-m", "runtime", "serve", "--replicas", str(replicas), "--port", str(port),
               "--model-name", "loom"]
    server = OpenAIServer(f"loom ray nice {niceness}", command, port, "loom")
    start = time.perf_counter()
    try:
        with server:
            started = time.perf_counter() - start
            prompts = [f"Tell me about the number {i}." for i in range(streams)]
            run = server.run(prompts, tokens, "ray")
        return started, run.tokens / run.seconds
    except ServerDidNotStart:
        return float("inf"), 0.0
    finally:
        subprocess.run(["ray", "stop", "--force"], capture_output=True)  # nothing left for the next cell


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--busy", default="0,1", help="counts of busy processes, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    cells: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for r in range(args.rounds):
        for busy in map(int, args.busy.split(",")):
            for niceness in ("0", "15") if r % 2 == 0 else ("15", "0"):
                with Competitors(busy):
                    started, throughput = cell(niceness, args.replicas, args.streams, args.tokens)
                cells.setdefault((busy, niceness), []).append((started, throughput))
                print(f"round {r + 1}, {busy} busy, nice {niceness}: healthy after {started:.1f} s, "
                      f"{throughput:.1f} tok/s", flush=True)
    print(f"\n{args.replicas} replicas, {args.streams} streams x {args.tokens} tokens; medians over {args.rounds} rounds")
    print("| busy processes | workers' nice | healthy after (s) | tok/s |")
    print("| --- | --- | --- | --- |")
    for (busy, niceness), runs in sorted(cells.items()):
        print(f"| {busy} | {niceness} | {statistics.median(s for s, _ in runs):.1f} | "
              f"{statistics.median(t for _, t in runs):.1f} |")


if __name__ == "__main__":
    main()
