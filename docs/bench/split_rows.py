"""A decode step's forward (the default model, or --model) with its threads sharing every phase of
every layer (a barrier after each) or each thread carrying its own rows through all the layers (one
barrier per step), those without and with taking rows from each other (decoder_layer.TAKE_ROWS), at
1 and 2 threads, quiet or beside K busy processes (docs/benchmarks-history.md, "Threads that carry
their own rows", "Float32 rows split on AVX2, not taken", "Threads that take each other's rows"). S
sequences of 100 cached tokens add one token each; no engine. The variants alternate in three
rounds; it prints the median and mean step, the cores the process used (CPU time over wall time) and
the rows a step's threads took from each other. Run from a checkout's root:

    python docs/bench/split_rows.py [--model FILE] [--weights float32] [--streams 1,8,16,32,64] [--busy 0]
        [--threads 1,2] [--steps 30]
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())

import runtime  # noqa: E402,F401  (first: libgomp loads with short spins, as in an application)
from runtime import openmp  # noqa: E402

import torch  # noqa: E402

import models  # noqa: E402
from models.kernels import cpu_linear, decoder_layer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_forward import busy_processes, decode_step  # noqa: E402

NEVER = cpu_linear.KERNEL_ROWS + 1  # more rows per thread than a step of the native layers has


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="1,8,16,32,64")
    parser.add_argument("--busy", type=int, default=0, help="busy competitor processes on the same cores")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--model", default=None, help="a checkpoint (a .gguf file or a directory); the default model if left out")
    parser.add_argument("--weights", default=None, help="as models.load's (default: the checkpoint's own)")
    args = parser.parse_args()
    model = models.load(args.model, weights=args.weights).model
    native_layers = model.decoder_layers
    chosen, taken = native_layers.split_rows, decoder_layer.TAKE_ROWS
    with busy_processes(args.busy):
        time.sleep(0.5)
        print("| streams | busy procs | threads | layers | step ms median (mean) | cores used | rows taken |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for streams in map(int, args.streams.split(",")):
            kv, step = decode_step(model, streams)
            variants = [(t, "shared phases", NEVER, 0) for t in map(int, args.threads.split(","))]
            variants += [(t, "own rows" + taking, 1, take) for t, _, _, _ in variants if t > 1 and streams >= t
                         for taking, take in (("", 0), (", taking", taken))]
            times = {v: [] for v in variants}
            cpu, taken_rows = dict.fromkeys(variants, 0.0), dict.fromkeys(variants, 0)
            with torch.inference_mode():
                for _ in range(3):
                    for variant in variants:
                        threads, _, split, decoder_layer.TAKE_ROWS = variant
                        torch.set_num_threads(threads)
                        native_layers.split_rows = split  # rows per thread from which to split
                        for _ in range(3):
                            model(step, kv)
                            openmp.release_thread_pool()  # as the engine does after every step
                        start_cpu, start_taken = time.process_time(), native_layers.taken_rows
                        for _ in range(args.steps // 3):
                            start = time.perf_counter()
                            model(step, kv)
                            times[variant].append(time.perf_counter() - start)
                            openmp.release_thread_pool()
                        cpu[variant] += time.process_time() - start_cpu
                        taken_rows[variant] += native_layers.taken_rows - start_taken
            native_layers.split_rows, decoder_layer.TAKE_ROWS = chosen, taken
            for variant, seconds in times.items():
                threads, layers, _, _ = variant
                median, mean = statistics.median(seconds) * 1e3, statistics.mean(seconds) * 1e3
                print(f"| {streams} | {args.busy} | {threads} | {layers} | {median:.1f} ({mean:.1f}) | "
                      f"{cpu[variant] / sum(seconds):.2f} | {taken_rows[variant] / len(seconds):.1f} |", flush=True)


if __name__ == "__main__":
    main()
