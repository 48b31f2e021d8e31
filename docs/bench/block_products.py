"""Loom's block products (models/kernels/block_weights.h) per GGUF format, as a layer runs them (F16
and BF16: cpu_linear.h's over 16-bit weights): a
BlockLinear over a file's tensor of ``--shape`` (out x in, default a 1.7B model's 8192 x 2048
gate/up shape), at 1 row (a one-stream decode step: reported as the GB/s of weights read) and at
more (several streams' steps: reported as Gvalue-rows/s, out x in x rows multiply-adds a second).
Enough distinct copies of the tensor are cycled that the weights come from memory (``--megabytes``
in all), as in a real step. The blocks are docs/bench/random_gguf.py's (random bytes with finite
scales for the K-quants; the time of a product does not depend on its values). Run from a
checkout's root:

    python docs/bench/block_products.py [--formats q4_k,q6_k] [--rows 1,16,64] [--rounds 3] [--side-by-side]

With --side-by-side, the formats a GGUF load lays out with sixteen rows side by side where the build
multiplies them so (block_formats.to_rows16: Q4_K, Q5_K, Q4_0, Q4_1, Q5_0, Q8_0, IQ4 and MXFP4; with AVX2 alone
Q6_K) are
measured in that layout, as a model runs them.

Each round measures every format in turn, so that the machine's drift reaches them alike; the best
round of each is printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gguf.constants import GGMLQuantizationType as Q  # noqa: E402

from models.kernels.block_formats import to_blocks, to_rows16  # noqa: E402
from models.kernels.block_linear import BlockLinear  # noqa: E402
from random_gguf import tensor_data  # noqa: E402

FORMATS = {"q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q5_0": Q.Q5_0, "q5_1": Q.Q5_1, "q8_0": Q.Q8_0, "q2_k": Q.Q2_K,
           "q3_k": Q.Q3_K, "q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K, "iq4_nl": Q.IQ4_NL, "iq4_xs": Q.IQ4_XS,
           "mxfp4": Q.MXFP4, "f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16}


def layers_of(kind: Q, out: int, width: int, megabytes: int, side_by_side: bool = False) -> list[BlockLinear]:
    rng = np.random.default_rng(0)

    def layer() -> BlockLinear:
        data = tensor_data(kind, (out, width), rng)
        laid_out = to_rows16(data, kind, width) if side_by_side else None
        return BlockLinear.of_blocks(to_blocks(data, kind, width) if laid_out is None else laid_out, width)

    first = layer()
    copies = max(2, -(-megabytes * 1_000_000 // first.blocks.numel()))
    return [first] + [layer() for _ in range(copies - 1)]


def seconds_per_product(layers: list[BlockLinear], rows: int, passes: int = 3) -> float:
    x = torch.randn(rows, layers[0].in_features)
    for layer in layers:
        layer(x)
    start = time.perf_counter()
    for _ in range(passes):
        for layer in layers:
            layer(x)
    return (time.perf_counter() - start) / (passes * len(layers))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--shape", default="8192x2048", help="out x in")
    parser.add_argument("--megabytes", type=int, default=400, help="of distinct weights cycled per format")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--side-by-side", action="store_true",
                        help="the formats a GGUF load lays out sixteen rows side by side, in that layout")
    args = parser.parse_args()
    out, width = (int(v) for v in args.shape.split("x"))
    names, rows = args.formats.split(","), [int(r) for r in args.rows.split(",")]
    best: dict[tuple[str, int], float] = {}
    for _ in range(args.rounds):
        for name in names:  # built anew each round: only one format's copies are held at a time
            layers = layers_of(FORMATS[name], out, width, args.megabytes, args.side_by_side)
            for r in rows:
                seconds = seconds_per_product(layers, r)
                best[name, r] = min(best.get((name, r), seconds), seconds)
            del layers
    laid = "; the ROWS16 layouts where built" if args.side_by_side else ""
    print(f"{out} x {width}, {torch.get_num_threads()} threads{laid}; 1 row: GB/s of weights; more: Gvalue-rows/s")
    print("format  " + "".join(f"{r:>10}" for r in rows))
    for name in names:
        bytes_per_product = layers_of(FORMATS[name], out, width, 0, args.side_by_side)[0].blocks.numel()
        cells = [bytes_per_product / best[name, r] / 1e9 if r == 1 else out * width * r / best[name, r] / 1e9
                 for r in rows]
        print(f"{name:<8}" + "".join(f"{c:>10.1f}" for c in cells))


if __name__ == "__main__":
    main()
