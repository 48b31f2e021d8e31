"""Smaller weights on the CPU: which matrix product to use, and what each ``weights=`` choice gives
on the default model (docs/benchmarks-history.md, "Smaller weights").

Part 1, the products alone, on the default model's layer shapes at 1 to 1024 rows: oneDNN float32
(what Loom used), FBGEMM float16 weights, FBGEMM dynamic int8, torch's weight-only int8/int4
kernels, and Loom's own block product (weights="int4": 4-bit blocks, the output layer 8-bit).
Part 2, each choice in its own process: resident memory after load, tokens/s at 1 and 64
streams of 64 tokens (EOS ignored), and for 4 chat prompts how many greedy tokens (of 64) match
float32's before the first difference. Run from a checkout's root:

    python docs/bench/weights.py [--part products|engine|both]
"""

import argparse
import json
import os
import subprocess
import sys
import time
import warnings

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}
PROMPTS = ["Tell me about rivers.", "What is the capital of France?", "Write a haiku about bread.",
           "Explain threads in Python."]


def timed(fn, reps: int) -> float:
    for _ in range(2):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e6


def products() -> None:
    warnings.filterwarnings("ignore", message=".*deprecated.*")
    torch.manual_seed(0)
    print(f"torch threads {torch.get_num_threads()}; microseconds per product (speed-up over float32)")
    from torch import nn

    from models.kernels.block_linear import OUTPUT_BITS, BlockLinear
    from models.kernels.quantized import BLOCK_WEIGHTS

    print("| layer | rows | float32 (oneDNN) | float16 (FBGEMM) | int8 (FBGEMM dynamic) | Loom blocks (int4) "
          "| int8 weight-only | int4 weight-only |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k) * 0.02
        onednn = w.to_mkldnn()
        fp16 = torch.ops.quantized.linear_prepack_fp16(w, None)
        scales = w.abs().amax(1) / 127
        int8 = torch.ops.quantized.linear_prepack(
            torch.quantize_per_channel(w, scales.double(), torch.zeros(n, dtype=torch.long), 0, torch.qint8), None)
        w8 = torch.round(w / scales[:, None]).to(torch.int8)
        groups = w.view(n, k // 32, 32)
        low, step = groups.amin(-1), (groups.amax(-1) - groups.amin(-1)).clamp(min=1e-8) / 15
        q4 = torch.round((groups - low[..., None]) / step[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
        packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 1)
        scales_zeros = torch.stack([step.t(), (low + 8 * step).t()], -1).contiguous()
        layer = nn.Linear(k, n, bias=False)
        layer.weight.data = w
        blocks = BlockLinear(layer, OUTPUT_BITS if name == "lm_head" else BLOCK_WEIGHTS["int4"])
        for rows in (1, 8, 64, 256, 1024):
            if name == "lm_head" and rows > 64:
                continue
            x = torch.randn(rows, k)
            reps = max(3, 200 // max(1, rows // 8)) if n < 10000 else 10
            base = timed(lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""), reps)
            others = [timed(lambda: torch.ops.quantized.linear_dynamic_fp16(x, fp16), reps),
                      timed(lambda: torch.ops.quantized.linear_dynamic(x, int8, True), reps),
                      timed(lambda: blocks(x), reps)]
            if rows <= 64:  # the weight-only kernels take seconds beyond
                others += [timed(lambda: torch.ops.aten._weight_int8pack_mm(x, w8, scales), max(2, reps // 10)),
                           timed(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed4, 32, scales_zeros),
                                 max(2, reps // 10))]
            cells = " | ".join(f"{t:.0f} ({base / t:.2f}x)" for t in others)
            print(f"| {name} | {rows} | {base:.0f} | {cells} |", flush=True)


def engine_child(weights: str) -> None:
    """One weights choice in this process: prints one JSON line."""
    import ctypes
    import threading

    from runtime import Engine, GenerationConfig

    engine = Engine.from_pretrained(None, weights=weights)
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what loading freed is not the model's
    rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    greedy = []
    for prompt in PROMPTS:
        handle = engine.launch_response_tokens(engine.encode([{"role": "user", "content": prompt}]),
                                               GenerationConfig(max_new_tokens=64, ignore_eos=True))
        greedy.append(list(engine.stream_response_tokens(handle)))
    rates = {}
    for streams in (1, 64):
        config = GenerationConfig(max_new_tokens=64, ignore_eos=True)
        handles = [engine.launch_response_tokens(engine.encode(f"Story {i}: once"), config) for i in range(streams)]
        start = time.perf_counter()
        threads = [threading.Thread(target=lambda h=h: list(engine.stream_response_tokens(h))) for h in handles]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rates[streams] = streams * 64 / (time.perf_counter() - start)
    engine.shutdown()
    print(json.dumps({"weights": weights, "rss_mib": rss, "tok_s": rates, "greedy": greedy}))


def engine_choices() -> None:
    results = {}
    for weights in ("float32", "float16", "int8-dynamic", "int8", "int4"):
        out = subprocess.run([sys.executable, __file__, "--child", weights], capture_output=True, text=True, check=True)
        results[weights] = json.loads(out.stdout.strip().splitlines()[-1])
    reference = results["float32"]["greedy"]
    print("| weights | resident after load | 1 stream tok/s | 64 streams tok/s | greedy tokens equal to float32 (of 64) |")
    print("| --- | ---: | ---: | ---: | --- |")
    for weights, r in results.items():
        agree = [next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), len(ref))
                 for mine, ref in zip(r["greedy"], reference)]
        print(f"| {weights} | {r['rss_mib']:.0f} MiB | {r['tok_s']['1']:.1f} | {r['tok_s']['64']:.1f} | "
              f"{', '.join(map(str, agree))} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("products", "engine", "both"), default="both")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return engine_child(args.child)
    if args.part in ("products", "both"):
        products()
    if args.part in ("engine", "both"):
        engine_choices()


if __name__ == "__main__":
    main()
