"""The engine's forward beside an application thread that has run a torch operator
(docs/benchmarks-history.md, "An Intel Xeon"). Such a thread keeps a pool of OpenMP workers, so libgomp
manages more threads than there are CPUs and cuts its spins short for every thread (to 100
iterations, or 1,000 under OMP_WAIT_POLICY=ACTIVE, which Loom now loads it with). Each round runs S
streams of 24 tokens through the engine, lets the main thread run one 512x512 product, runs them
again, and gives the main thread's pool back; it prints the median forward (ms) of both runs, quiet
or beside K busy processes. Run from a checkout's root, on older checkouts too:

    python docs/bench/app_torch_pool.py [--streams 1,16] [--busy 0] [--rounds 3]
"""

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.getcwd())

from runtime import Engine, GenerationConfig, openmp  # noqa: E402  (first: Loom chooses how libgomp spins)

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_forward import busy_processes  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="1,16")
    parser.add_argument("--busy", type=int, default=0, help="busy competitor processes on the same cores")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    engine = Engine.from_pretrained()
    forwards, started = [], [0.0]
    engine.model.register_forward_pre_hook(lambda module, inputs: started.__setitem__(0, time.perf_counter()))
    engine.model.register_forward_hook(lambda module, inputs, out: forwards.append(time.perf_counter() - started[0]))
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)

    def median_forward(prompts) -> float:
        forwards.clear()

        def stream(prompt):
            handle = engine.launch_response_tokens(prompt, config)
            while engine.fetch_response_tokens(handle) != -1:
                pass

        threads = [threading.Thread(target=stream, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return statistics.median(forwards[5:]) * 1e3  # past the prefill and the first steps

    with busy_processes(args.busy):
        print("| streams | busy procs | forward ms | after the main thread ran a torch op |")
        print("| --- | --- | --- | --- |")
        for streams in map(int, args.streams.split(",")):
            prompts = [engine.encode(f"Question {i}: tell me a story about a river.") for i in range(streams)]
            for _ in range(args.rounds):
                alone = median_forward(prompts)
                x = torch.randn(512, 512)
                (x @ x).sum()  # the application's own operator: its thread now keeps a pool
                beside = median_forward(prompts)
                openmp.release_thread_pool()
                print(f"| {streams} | {args.busy} | {alone:.2f} | {beside:.2f} |", flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
