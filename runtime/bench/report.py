"""The benchmark's outputs: bench.json (every run), bench.md (a table of each system's median
run) and bench.png (throughput against concurrency)."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch


def report(runs: list, args) -> int:
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
        groups.setdefault((r["workload"], r["system"], r["concurrency"], r["competitors"]), []).append(r)
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
    lines = ["| workload | busy procs | system | requests | tokens | s | tok/s | CPU ms/token | TTFT p50/p99 ms | "
             "TPOT p50/p99 ms | hand-off p50/p99 ms | steal % | note |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['competitors']} | {r['system']} | {r['concurrency']} | {r['tokens']} | "
            f"{r['seconds']:.2f} | {fmt(r['throughput'], '.1f')} | {fmt(r['cpu_ms_per_token'], '.1f')} | "
            f"{fmt(r['ttft_p50_ms'], '.0f')}/{fmt(r['ttft_p99_ms'], '.0f')} | "
            f"{fmt(r['tpot_p50_ms'], '.1f')}/{fmt(r['tpot_p99_ms'], '.1f')} | "
            f"{fmt(r['handoff_p50_ms'], '.3f')}/{fmt(r['handoff_p99_ms'], '.3f')} | "
            f"{fmt(r['steal_pct'], '.1f')} | {r['note']} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    sweep = [r for r in rows if r["workload"] == "sweep" and r["throughput"] is not None and not r["competitors"]]
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
    if ax.get_legend_handles_labels()[0]:  # a run without the sweep has nothing to plot
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
