"""One decode step's forward on the default model, timed alone: S sequences of 100 cached tokens (or
--context) each
add one token (model.forward over a prebuilt StepInput, no engine), median of 30 after 5 warm-up
steps, at fixed torch/OpenMP threads, optionally beside K busy processes. It measures the model
side only, so it runs unchanged on older checkouts for before/after figures (docs/benchmarks-history.md,
"Small-batch products"). With --prefill N the step is S prompts of N tokens each instead (W6's
prompts are ~21 tokens), median of --repeats; with --torch-layers the model's native decoder
layers are set aside, so that the torch layers run every step. Run from a checkout's root:

    python docs/bench/decode_forward.py [--streams 1,4,16,64] [--threads 2] [--busy 0] [--weights float32]
        [--context 100] [--kv-dtype float16] [--model FILE.gguf] [--prefill 21] [--repeats 30] [--torch-layers]
"""

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402

import models  # noqa: E402
from models.step import KVCache, Sequence, StepInput  # noqa: E402


def decode_step(model, streams: int, context: int = 100, kv_dtype=torch.float32) -> tuple[KVCache, StepInput]:
    """A pool and a decode-only step: ``streams`` sequences of ``context`` cached tokens adding one each."""
    return step_of(model, streams, [5], context, kv_dtype)


def prefill_step(model, streams: int, tokens: int, kv_dtype=torch.float32) -> tuple[KVCache, StepInput]:
    """A pool and a step of ``streams`` prompts of ``tokens`` tokens each, from their first position."""
    return step_of(model, streams, list(range(100, 100 + tokens)), 0, kv_dtype)


def step_of(model, streams: int, tokens: list[int], start: int, kv_dtype) -> tuple[KVCache, StepInput]:
    """A pool and a step of ``streams`` sequences, each computing ``tokens`` from position ``start``."""
    blocks = (start + len(tokens) - 1) // 16 + 1
    kv = KVCache.for_model(model, blocks * streams, 16, kv_dtype, "cpu", state_slots=streams)
    tables = [list(range(blocks * i, blocks * (i + 1))) for i in range(streams)]
    return kv, StepInput.flatten([Sequence(tokens, start, table, True, state_slot=i) for i, table in enumerate(tables)],
                                 16, torch.device("cpu"))


@contextlib.contextmanager
def busy_processes(count: int):
    """``count`` competitor processes, each busy in a Python loop, for the block's time."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for process in busy:
            process.kill()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="1,4,16,64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--busy", type=int, default=0, help="busy competitor processes on the same cores")
    parser.add_argument("--weights", default="float32")
    parser.add_argument("--model", default=None, help="a checkpoint (a .gguf file or a directory); the default model if left out")
    parser.add_argument("--context", type=int, default=100, help="cached tokens per sequence")
    parser.add_argument("--kv-dtype", default="float32", help="the pool's dtype (float16 or bfloat16 on checkouts with kv_dtype)")
    parser.add_argument("--prefill", type=int, default=0, help="prompts of this many tokens rather than decode rows")
    parser.add_argument("--repeats", type=int, default=30, help="timed forwards (after min(5, repeats) warm-up ones)")
    parser.add_argument("--torch-layers", action="store_true", help="without the native decoder layers")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = models.load(args.model, weights=args.weights).model
    if args.torch_layers:
        model.decoder_layers = None
    with busy_processes(args.busy):
        print(f"| streams | threads | busy procs | forward ms (median of {args.repeats}) | CPU ms per forward (mean) "
              f"| {'prompt ' if args.prefill else ''}tok/s |")
        print("| --- | --- | --- | --- | --- | --- |")
        kv_dtype = getattr(torch, args.kv_dtype)
        for streams in map(int, args.streams.split(",")):
            kv, step = (prefill_step(model, streams, args.prefill, kv_dtype) if args.prefill
                        else decode_step(model, streams, args.context, kv_dtype))
            with torch.inference_mode():
                kv.data.zero_()
                for _ in range(min(5, args.repeats)):
                    model(step, kv)
                times, cpu = [], time.process_time()
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    model(step, kv)
                    times.append(time.perf_counter() - start)
                cpu_ms = (time.process_time() - cpu) / args.repeats * 1e3  # every thread's, the process's only work here
            ms = statistics.median(times) * 1e3
            tokens = len(step.input_ids)
            print(f"| {streams} | {args.threads} | {args.busy} | {ms:.1f} | {cpu_ms:.1f} | {tokens / ms * 1e3:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
