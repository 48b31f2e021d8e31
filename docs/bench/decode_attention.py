"""Decode attention alone (models/kernels/paged_decode.h) on the default model's shape: 9 query heads over 3
K/V heads of 64, S sequences of 110 cached tokens in blocks of 16, two threads; the median of 300
calls, microseconds per layer (docs/benchmarks-history.md, "An Intel Xeon"). Run from a checkout's root,
alternating checkouts for a before/after:

    python docs/bench/decode_attention.py [--streams 1,16,64] [--context 110] [--kv-dtype float16] [--layers 1]
        [--heads 9 --kv-heads 3]

--layers N cycles through N layers' pools, as a step does, so that they come from memory rather than
the cache.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402

from models.kernels import paged_decode  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="1,16,64")
    parser.add_argument("--context", type=int, default=110)
    parser.add_argument("--kv-dtype", default="float32", help="the pool's dtype (float16 or bfloat16 with kv_dtype)")
    parser.add_argument("--layers", type=int, default=1, help="pools to cycle through")
    parser.add_argument("--heads", type=int, default=9, help="query heads (SmolLM2-1.7B: 32)")
    parser.add_argument("--kv-heads", type=int, default=3, help="K/V heads (SmolLM2-1.7B: 32)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    heads, kv_heads, dim, block_size = args.heads, args.kv_heads, 64, 16
    blocks = (args.context + block_size - 1) // block_size
    cells = []
    for streams in map(int, args.streams.split(",")):
        pools = [tuple(torch.randn(streams * blocks, block_size, kv_heads, dim).to(getattr(torch, args.kv_dtype))
                       for _ in range(2)) for _ in range(args.layers)]
        tables = torch.arange(streams * blocks).view(streams, blocks)
        lens = torch.full((streams,), args.context)
        q = torch.randn(streams, heads, dim)
        out = torch.empty_like(q)
        times = []
        for call in range(300):
            k_cache, v_cache = pools[call % args.layers]
            start = time.perf_counter()
            paged_decode.decode_attention(q, k_cache, v_cache, tables, lens, out, dim ** -0.5, None)
            times.append(time.perf_counter() - start)
        cells.append(f"{streams} sequences: {statistics.median(times) * 1e6:.0f} us")
    print("; ".join(cells))


if __name__ == "__main__":
    main()
