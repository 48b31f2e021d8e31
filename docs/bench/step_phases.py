"""Where a Loom step's time goes: W1's shape (64 requests, 16-token prompts, 128 new tokens, GPT-2
small with random weights) with each phase of the worker's step (runtime/worker.py) timed on the
loop thread: building the flat batch, the forward (synchronised, so that a GPU's queued work is
counted where it runs), sampling with its host transfer, and the rest (scheduling, bookkeeping,
delivery, the consumers' grace). Run from a checkout's root (docs/benchmarks-history.md, "GPU"):

    python docs/bench/step_phases.py [--device cuda] [--requests 64] [--new-tokens 128]
"""

import argparse
import collections
import os
import sys
import threading
import time

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from models.step import StepInput  # noqa: E402
from runtime import Engine, GenerationConfig, sampler  # noqa: E402
from runtime.bench.harness import synchronize  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device(args.device)
    hf = GPT2LMHeadModel(GPT2Config()).to(device).eval()
    engine = Engine.from_pretrained(hf, device=device, kv_cache_bytes=4 << 30)
    spent = collections.defaultdict(float)

    def timed(name, fn, sync=False):
        def wrapper(*a, **k):
            start = time.perf_counter()
            out = fn(*a, **k)
            if sync:
                synchronize(device)
            spent[name] += time.perf_counter() - start
            return out
        return wrapper

    flatten = StepInput.flatten
    StepInput.flatten = staticmethod(timed("build the flat batch", flatten))
    engine.model = timed("forward", engine.model, sync=True)
    sampler.sample = timed("sample + host transfer", sampler.sample)
    step = engine._worker.step  # the loop thread calls it through the worker: an attribute here takes its place
    engine._worker.step = timed("whole step", step)

    def run():
        config = GenerationConfig(max_new_tokens=args.new_tokens, ignore_eos=True)
        handles = [engine.launch_response_tokens(torch.randint(0, 50257, (16,)).tolist(), config)
                   for _ in range(args.requests)]
        threads = [threading.Thread(target=lambda h=h: list(engine.stream_response_tokens(h))) for h in handles]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    run()  # warm-up
    time.sleep(0.5)  # the loop thread finishes its last step after the consumers took their last token
    spent.clear()
    steps = engine.stats()["steps"]
    start = time.perf_counter()
    run()
    elapsed, steps = time.perf_counter() - start, engine.stats()["steps"] - steps
    engine.shutdown()  # joins the loop thread: its last step is counted
    print(f"{args.requests} requests x {args.new_tokens} tokens on {device}: {elapsed:.2f} s, {steps} steps, "
          f"{args.requests * args.new_tokens / elapsed:.0f} tok/s")
    print("| phase | ms per step | share of the run |\n| --- | --- | --- |")
    whole = spent.pop("whole step")
    for name, seconds in spent.items():
        print(f"| {name} | {1000 * seconds / steps:.2f} | {100 * seconds / elapsed:.0f}% |")
    rest = whole - sum(spent.values())
    print(f"| the rest of the step (schedule, bookkeeping, delivery, grace) | {1000 * rest / steps:.2f} | "
          f"{100 * rest / elapsed:.0f}% |")
    print(f"| between steps (the loop: plan under the lock, wake-ups) | {1000 * (elapsed - whole) / steps:.2f} | "
          f"{100 * (elapsed - whole) / elapsed:.0f}% |")


if __name__ == "__main__":
    main()
