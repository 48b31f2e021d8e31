"""A burst's prefill in Loom (docs/benchmarks-history.md, "Against the targets"): the W1 shape at 64 requests
(GPT-2 small, random weights, 16 prompt tokens, 64 new), launched at once from a thread each, as
the bench's sweep does, ``--bursts`` times in one fresh engine. For each burst: the milliseconds a
prompt token took in the steps that carried more than one token per request on average (the
prefill), the loop thread's page faults in them, time to first token (p50) and tokens/s. Run from a
checkout's root, once per variant, in fresh processes taking turns:

    python docs/bench/burst_prefill.py [--bursts 3] [--mallopt]
    THP_MEM_ALLOC_ENABLE=1 python docs/bench/burst_prefill.py   # torch's large tensors in 2 MB pages

--mallopt has glibc keep freed memory (a fixed 32 MB mmap threshold, a 1 GB trim threshold) before
anything is allocated.
"""

import argparse
import ctypes
import os
import resource
import sys
import time

sys.path.insert(0, os.getcwd())

import runtime  # noqa: E402,F401  (before torch: Loom's OpenMP settings, as an application would have them)
import torch  # noqa: E402

from runtime import Engine  # noqa: E402
from runtime.bench import harness  # noqa: E402
from runtime.bench.workloads import gpt2_small  # noqa: E402

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--mallopt", action="store_true")
    args = parser.parse_args()
    if args.mallopt:
        libc = ctypes.CDLL("libc.so.6")
        assert libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
    torch.manual_seed(0)
    hf = gpt2_small(smoke=False)
    engine = Engine.from_pretrained(hf, kv_cache_bytes=4 << 30, max_batch_size=128)
    steps = []  # (seconds, tokens, the loop thread's page faults) of each forward
    forward = engine.model.forward

    def timed(step, kv_cache, *rest, **options):
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        start = time.perf_counter()
        out = forward(step, kv_cache, *rest, **options)
        steps.append((time.perf_counter() - start, step.input_ids.numel(),
                      resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults))
        return out

    engine.model.forward = timed
    requests = harness.random_requests(64, 16, 64, hf.config.vocab_size, seed=64)
    print("| burst | prefill ms a token | page faults | TTFT p50 ms | tok/s |\n| --- | --- | --- | --- | --- |")
    for burst in range(args.bursts):
        steps.clear()
        summary = harness.run_loom(engine, requests, "burst").summary()
        prefill = [s for s in steps if s[1] > len(requests)]  # more tokens than requests: prompts in it
        seconds, tokens, faults = (sum(s[i] for s in prefill) for i in range(3))
        print(f"| {burst} | {1000 * seconds / tokens:.3f} | {faults} | {summary['ttft_p50_ms']:.0f} | "
              f"{summary['throughput']:.1f} |", flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
