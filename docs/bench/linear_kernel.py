"""Loom's CPU linear kernel (models/kernels/cpu_linear.cpp) against oneDNN's prepacked float32 product (what
Loom used before) and torch's dense one (MKL), on the default model's layer shapes
(docs/benchmarks-history.md, "Small-batch products").

Two measurements: each layer shape alone at 1-512 rows (the output layer to 64; its weights stay
in cache between calls, so this is the arithmetic), and one decode step's worth of products at 1,
4, 16 and 64 rows over 30 distinct layers plus the output layer (538 MB of weights, read from
memory as in a real step). Loom's kernel runs its rows-at-a-time product below 9 rows and its
panels from 9 up; CpuLinear hands more than 128 rows to oneDNN.
Run from a checkout's root:

    python docs/bench/linear_kernel.py
"""

import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())

from models.kernels import cpu_linear  # noqa: E402

SHAPES = {"qkv": (960, 576), "out": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def median_us(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def products():
    return {
        "oneDNN prepacked": lambda x, w, packed: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        "MKL (F.linear)": lambda x, w, packed: F.linear(x, w),
        "Loom kernel": lambda x, w, packed: cpu_linear.linear(x, w),
    }


def per_shape():
    print("| layer | rows | " + " | ".join(f"{name} µs" for name in products()) + " | kernel speed-up vs oneDNN |")
    print("| --- | --- |" + " --- |" * (len(products()) + 1))
    for layer, (out, width) in SHAPES.items():
        weight = torch.randn(out, width)
        packed = weight.to_mkldnn()
        for rows in (1, 4, 8, 16, 32, 64, 128, 256, 512):
            if layer == "lm_head" and rows > 64:
                break
            x = torch.randn(rows, width)
            reps = 10 if layer == "lm_head" else 50
            times = [median_us(lambda: fn(x, weight, packed), reps) for fn in products().values()]
            print(f"| {layer} | {rows} | " + " | ".join(f"{t:.0f}" for t in times) + f" | {times[0] / times[2]:.2f}x |",
                  flush=True)


def whole_step():
    layers = [[torch.randn(*SHAPES[name]) for name in ("qkv", "out", "gate_up", "down")] for _ in range(30)]
    weights = [w for layer in layers for w in layer] + [torch.randn(*SHAPES["lm_head"])]
    packed = [w.to_mkldnn() for w in weights]
    total = sum(w.numel() for w in weights) * 4
    print(f"\nOne step's products, 30 layers + output layer ({total / 1e6:.0f} MB of float32 weights), "
          "ms (GB/s of weights read):\n")
    print("| rows | " + " | ".join(products()) + " |")
    print("| --- |" + " --- |" * len(products()))
    for rows in (1, 4, 16, 64):
        inputs = {width: torch.randn(rows, width) for width in (576, 1536)}
        cells = []
        for fn in products().values():
            ms = median_us(lambda: [fn(inputs[w.shape[1]], w, p) for w, p in zip(weights, packed)], 15) / 1e3
            cells.append(f"{ms:.1f} ({total / ms / 1e6:.0f})")
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    per_shape()
    whole_step()
