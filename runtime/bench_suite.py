"""The workloads of ``python -m runtime bench``, and its table, JSON and plot."""

from __future__ import annotations

import argparse
import json
import platform
from functools import partial
import random
import time
from pathlib import Path

import torch

from . import bench
from .bench import Request

SYSTEMS = ("loom", "pure", "serial", "static", "continuous")


def add_parser(commands, add_model_arguments) -> None:
    p = commands.add_parser("bench", help="benchmark against transformers and the pure forward",
                            description="Run workloads W1-W4 side by side with transformers; print a table, "
                                        "write bench.json and bench.png to --out.")
    p.add_argument("--workloads", default="w1,w2,w3,w4", help="comma-separated subset of w1,w2,w3,w4")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--new-tokens", type=int, default=128, help="W1 tokens per request (default: 128)")
    p.add_argument("--requests", type=int, default=64, help="W1 requests, all launched at once (default: 64)")
    p.add_argument("--serial-limit", type=int, default=4,
                   help="requests the one-at-a-time baseline runs (its rate does not depend on the count)")
    p.add_argument("--w2-window", type=float, default=10.0, help="W2 arrivals spread over this many seconds")
    p.add_argument("--repeat", type=at_least_one, default=1,
                   help="run every W1 system this many times, interleaved; the table shows each one's median run")
    p.add_argument("--sweep", default="1,4,16,64", help="concurrencies for the throughput plot ('' to skip)")
    p.add_argument("--sweep-tokens", type=int, default=64, help="tokens per request in the sweep")
    p.add_argument("--smoke", action="store_true", help="a seconds-long run on a tiny model (for CI)")
    p.add_argument("--out", default="bench-results", help="directory for bench.json and bench.png")
    add_model_arguments(p)
    p.set_defaults(run=main, max_batch_size=128)


def at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def main(args) -> int:
    from tqdm import tqdm

    torch.manual_seed(0)
    systems = set(args.systems.split(","))
    workloads = [w for w in args.workloads.split(",") if w]
    if args.smoke:
        args.requests, args.new_tokens, args.serial_limit, args.w2_window = 4, 4, 2, 0.2
        args.sweep, args.sweep_tokens = "1,4", 4
        workloads = [w for w in workloads if w != "w3"]  # W3 is the real model: seconds to load
    device = torch.device(args.device)
    runs: list[bench.Run] = []

    def measure(name, fn, count):
        counters = bench.cpu_time_counters()
        with tqdm(total=count, desc=name, unit="req", leave=False) as bar:
            run = fn(bar)
        run.steal = bench.steal_percent(counters, bench.cpu_time_counters())
        runs.append(run)
        summary = run.summary()
        if summary["throughput"] is not None:
            tqdm.write(f"  {run.workload:<4} {run.system:<24} {summary['throughput']:9.1f} tok/s")
        else:
            tqdm.write(f"  {run.workload:<4} {run.system:<24} hand-off p99 {summary['handoff_p99_ms']:.3f} ms")
        return run

    if {"w1", "w2", "w4"} & set(workloads) or args.sweep:
        hf = gpt2_small(args.smoke).to(device)
        engine = make_engine(hf, args)
    if "w1" in workloads:
        requests = bench.random_requests(args.requests, 16, args.new_tokens, hf.config.vocab_size)
        compare(measure, engine, hf, requests, "W1", systems, args, args.repeat)
    if "w2" in workloads:
        count = 8 if args.smoke else 256
        rng = random.Random(2)
        lengths = [rng.randint(16, 256) if not args.smoke else rng.randint(2, 8) for _ in range(count)]
        arrivals = sorted(rng.uniform(0, args.w2_window) for _ in range(count))
        requests = bench.random_requests(count, 32, lengths, hf.config.vocab_size, seed=2, arrivals=arrivals)
        if "loom" in systems:
            measure("W2 loom", lambda bar: bench.run_loom(engine, requests, "W2", bar), count)
        if "static" in systems:
            measure("W2 static", lambda bar: bench.run_hf_static(hf, requests, "W2", 32, bar), count)
        if "continuous" in systems:
            measure("W2 continuous", lambda bar: bench.run_hf_continuous(hf, requests, "W2", bar), count)
    if "w4" in workloads:
        prefix_workload(measure, hf, args)
    if args.sweep:
        for c in [int(x) for x in args.sweep.split(",")]:
            requests = bench.random_requests(c, 16, args.sweep_tokens, hf.config.vocab_size, seed=c)
            runners = {"loom": partial(bench.run_loom, engine, requests, "sweep"),
                       "pure": lambda bar, requests=requests: bench.run_pure_forward(engine.model, requests, "sweep"),
                       "static": partial(bench.run_hf_static, hf, requests, "sweep", c)}
            for name, runner in runners.items():
                if name in systems:
                    measure(f"sweep {c} {name}", runner, c)
            if "loom" in systems:
                measure(f"sweep {c} queue floor", lambda bar, c=c: bench.run_queue_floor(c, 5 if args.smoke else 50), c)
    if {"w1", "w2", "w4"} & set(workloads) or args.sweep:
        engine.shutdown()
    if "w3" in workloads:
        real_model_workload(measure, systems, args)
    return report(runs, args)


def compare(measure, engine, hf, requests, name, systems, args, repeat=1) -> None:
    """Every system on the same requests; with ``repeat``, round after round of all of them, so
    that a slow minute of this shared machine falls on one run of each rather than on one system."""
    count = len(requests)
    for _ in range(repeat):
        if "loom" in systems:
            measure(f"{name} loom", lambda bar: bench.run_loom(engine, requests, name, bar), count)
        if "pure" in systems:
            measure(f"{name} pure forward", lambda bar: bench.run_pure_forward(engine.model, requests, name), count)
        if "serial" in systems:
            measure(f"{name} serial", lambda bar: bench.run_hf_serial(hf, requests, name, args.serial_limit, bar),
                    args.serial_limit)
        if "static" in systems:
            measure(f"{name} static", lambda bar: bench.run_hf_static(hf, requests, name, count, bar), count)
        if "continuous" in systems and hasattr(hf, "generate_batch"):
            measure(f"{name} continuous", lambda bar: bench.run_hf_continuous(hf, requests, name, bar), count)


def real_model_workload(measure, systems, args) -> None:
    """W3: the embedded SmolLM2 on chat questions, against transformers' own GGUF load of it."""
    from models.gguf import default_model_path

    from .engine import Engine
    engine = Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype or torch.float32,
                                    max_batch_size=args.max_batch_size)
    topics = ["rivers", "threads", "bread", "stars", "music", "maps", "glass", "bees"] * 4
    prompts = [engine.encode([{"role": "user", "content": f"Tell me about {t}."}]) for t in topics]
    requests = [Request(p, 64) for p in prompts]
    from transformers import AutoModelForCausalLM
    path = default_model_path() if args.model is None else Path(args.model)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    compare(measure, engine, hf.to(args.device), requests, "W3", systems, args)
    engine.shutdown()


def prefix_workload(measure, hf, args) -> None:
    """W4: 32 requests sharing a 384-token system prompt, each with a short distinct question."""
    rng = random.Random(4)
    shared = [rng.randrange(hf.config.vocab_size) for _ in range(24 if args.smoke else 384)]
    requests = [Request(shared + [rng.randrange(hf.config.vocab_size) for _ in range(12)], 4 if args.smoke else 16)
                for _ in range(8 if args.smoke else 32)]
    for caching in (False, True):
        engine = make_engine(hf, args, enable_prefix_caching=caching)

        def run(bar, engine=engine, caching=caching):
            run = bench.run_loom(engine, requests, "W4", bar)
            run.system = f"loom, prefix cache {'on' if caching else 'off'}"
            run.note = f"hit rate {engine.stats()['prefix_cache_hit_rate']:.0%}"
            return run

        measure(f"W4 prefix cache {'on' if caching else 'off'}", run, len(requests))
        engine.shutdown()


def make_engine(hf, args, **options):
    from .engine import Engine
    return Engine.from_pretrained(hf, device=args.device, max_batch_size=args.max_batch_size,
                                  kv_cache_bytes=4 << 30, **options)


def gpt2_small(smoke: bool):
    """The GPT-2 small architecture with random weights (speed does not depend on them)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4) if smoke else GPT2Config()
    return GPT2LMHeadModel(config).eval()


def report(runs: list[bench.Run], args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [r.summary() for r in runs]
    machine = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
               "cpus": torch.get_num_threads(), "torch": torch.__version__, "device": args.device,
               "cuda": torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else None,
               "date": time.strftime("%Y-%m-%d")}
    (out / "bench.json").write_text(json.dumps({"machine": machine, "runs": rows}, indent=1))
    rows = median_runs(rows)
    table = format_table(rows)
    (out / "bench.md").write_text(table + "\n")
    print(table)
    plot(rows, out / "bench.png")
    print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'bench.png'}")
    return 0


def median_runs(rows: list[dict]) -> list[dict]:
    """One row per workload, system and concurrency: the run of median throughput where it ran
    more than once (bench.json keeps them all), its note giving the range."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["system"], r["concurrency"]), []).append(r)
    chosen = []
    for runs in groups.values():
        if len(runs) == 1 or runs[0]["throughput"] is None:
            chosen.append(runs[0])
            continue
        ranked = sorted(runs, key=lambda r: r["throughput"])
        low, high = ranked[0]["throughput"], ranked[-1]["throughput"]
        median = dict(ranked[(len(ranked) - 1) // 2])
        spread = f"median of {len(runs)} runs ({low:.1f}-{high:.1f} tok/s)"
        median["note"] = f"{median['note']}; {spread}" if median["note"] else spread
        chosen.append(median)
    return chosen


def format_table(rows: list[dict]) -> str:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    lines = ["| workload | system | requests | tokens | s | tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms | hand-off p50/p99 ms | steal % | note |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['system']} | {r['concurrency']} | {r['tokens']} | {r['seconds']:.2f} | "
            f"{fmt(r['throughput'], '.1f')} | {fmt(r['ttft_p50_ms'], '.0f')}/{fmt(r['ttft_p99_ms'], '.0f')} | "
            f"{fmt(r['tpot_p50_ms'], '.1f')}/{fmt(r['tpot_p99_ms'], '.1f')} | "
            f"{fmt(r['handoff_p50_ms'], '.3f')}/{fmt(r['handoff_p99_ms'], '.3f')} | "
            f"{fmt(r['steal_pct'], '.1f')} | {r['note']} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    sweep = [r for r in rows if r["workload"] == "sweep" and r["throughput"] is not None]
    for system in dict.fromkeys(r["system"] for r in sweep):
        points = sorted((r["concurrency"], r["throughput"]) for r in sweep if r["system"] == system)
        ax.plot(*zip(*points), marker="o", label=system)
    serial = [r for r in rows if r["system"] == "transformers serial" and r["workload"] == "W1"]
    if serial:
        ax.axhline(serial[0]["throughput"], color="grey", linestyle="--", label="transformers serial (W1)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("tokens / s")
    ax.set_title("Throughput against concurrency (GPT-2 small shape)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
