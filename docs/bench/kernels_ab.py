"""Two builds of Loom's kernels taking turns in one process: A from another checkout's models/
directory, B from this checkout's. The VM this project measures on drifts by 15-30% from minute to
minute, more than most kernel changes move a step, so a before/after figure alternates the two
builds on one loaded model (docs/benchmarks-history.md, "A few rows, one weight row at a time"). The
Python side is this checkout's: the two builds must share decoder_layer.cpp's interface. Run from a
checkout's root, after e.g. `git archive OLD models | tar -x -C /tmp/old`:

    python docs/bench/kernels_ab.py /tmp/old/models forward --rows 1,2,4 [--panels-from 9,9]
    python docs/bench/kernels_ab.py /tmp/old/models engine --streams 1,4 [--weights int4] [--busy 1]

``forward``: the decode forward alone (decode_forward.py's step), median of 20 per turn.
``engine``: tok/s of a thread per stream, 64 new tokens each (EOS ignored).
The panels start where the model's load measured them with build B; A keeps its build's default
unless --panels-from sets both.
"""

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from models.kernels import native  # noqa: E402
from models.kernels.cpu_linear import ARGTYPES, CpuLinear  # noqa: E402


def builds(other: Path) -> dict:
    """{"A": the other checkout's library, "B": this one's}, B left in use."""
    mine = native.SOURCES, native.HEADERS
    native.SOURCES, native.HEADERS = sorted(other.glob("*.cpp")), sorted(other.glob("*.h"))
    library_a = native._load()
    native.SOURCES, native.HEADERS = mine
    native._library = native._load()
    return {"A": library_a, "B": native._library}


def use(library, model, panel_rows=None) -> None:
    """Every kernel call from now on goes to ``library`` (CpuLinear keeps its function), the model's
    products taking the panels from ``panel_rows`` rows where given (both builds must share the ABI)."""
    native._library = library
    for module in model.modules():
        if isinstance(module, CpuLinear):
            module.kernel = native.function("loom_linear", module.weight.dtype, ARGTYPES)
            if panel_rows is not None:
                module.panel_rows = panel_rows
    if panel_rows is not None and getattr(model, "decoder_layers", None) is not None:
        model.decoder_layers.panel_rows = panel_rows


def forward_times(model, rows: int, turns: dict, rounds: int) -> dict:
    from decode_forward import decode_step

    kv, step = decode_step(model, rows)
    times = {name: [] for name in turns}
    with torch.inference_mode():
        for round_ in range(rounds):
            for name in (list(turns) if round_ % 2 == 0 else list(turns)[::-1]):
                turns[name]()
                for _ in range(3):
                    model(step, kv)
                once = []
                for _ in range(20):
                    start = time.perf_counter()
                    model(step, kv)
                    once.append(time.perf_counter() - start)
                times[name].append(1000 * statistics.median(once))
    return times


def engine_rates(engine, streams: int, turns: dict, rounds: int) -> dict:
    from runtime import GenerationConfig

    prompts = [engine.encode([{"role": "user", "content": f"Question {i}: tell me a story."}]) for i in range(streams)]

    def run() -> float:
        def one(prompt):
            handle = engine.launch_response_tokens(prompt, GenerationConfig(max_new_tokens=64, ignore_eos=True))
            for _ in engine.stream_response_tokens(handle):
                pass
        threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return 64 * streams / (time.perf_counter() - start)

    run()  # warm-up
    rates = {name: [] for name in turns}
    for round_ in range(rounds):
        for name in (list(turns) if round_ % 2 == 0 else list(turns)[::-1]):
            turns[name]()
            rates[name].append(run())
    return rates


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("other", type=Path, help="the other checkout's models/ directory (build A)")
    parser.add_argument("what", choices=("forward", "engine"))
    parser.add_argument("--rows", default="1,2,4", help="forward: rows per step")
    parser.add_argument("--streams", default="1,4", help="engine: concurrent streams")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--weights", default="float32")
    parser.add_argument("--panels-from", default=None, help="forward: A,B row counts from which the panels start")
    parser.add_argument("--busy", type=int, default=0, help="busy competitor processes while measuring")
    args = parser.parse_args()
    libraries = builds(args.other)
    from runtime import Engine
    from runtime.bench.harness import Competitors

    torch.set_num_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    engine = Engine.from_pretrained(None, weights=args.weights)
    model = engine.model
    panels = list(map(int, args.panels_from.split(","))) if args.panels_from else [None] * len(libraries)
    turns = {name: (lambda library=library, rows=rows: use(library, model, rows))
             for (name, library), rows in zip(libraries.items(), panels)}
    counts = args.rows if args.what == "forward" else args.streams
    unit = "ms" if args.what == "forward" else "tok/s"
    print(f"| {'rows' if args.what == 'forward' else 'streams'} | A {unit} | B {unit} | B / A (medians) |")
    print("| --- | --- | --- | --- |")
    with Competitors(args.busy):
        for count in map(int, counts.split(",")):
            if args.what == "forward":
                figures = forward_times(model, count, turns, args.rounds)
            else:
                figures = engine_rates(engine, count, turns, args.rounds)
            a, b = (statistics.median(figures[name]) for name in "AB")
            print(f"| {count} | {' / '.join(f'{x:.2f}' for x in figures['A'])}: {a:.2f} | "
                  f"{' / '.join(f'{x:.2f}' for x in figures['B'])}: {b:.2f} | {b / a:.3f} |", flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
