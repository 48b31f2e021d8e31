"""Loading a GGUF file: Loom's time to an engine, its peak and after-load resident memory, and its
resident memory once it has run (the file's pages it reads where they lie count then), each in a
fresh process, ``--rounds`` times, and, with --llama-server, both servers' time to a healthy
/health, taking turns. Then Loom in-process at 1 and 16 streams (--tokens new tokens each).

    python docs/bench/gguf_load.py FILE.gguf [FILE.gguf ...] [--weights stored] [--rounds 2]
        [--llama-server PATH/llama-server [--starts-only]] [--tokens 32]

With --starts-only, the servers' starts alone (each round's pair, then the medians).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())

from runtime.bench import peers  # noqa: E402

LOAD = """
import json, resource, sys, threading, time
import psutil
start = time.perf_counter()
import runtime
from runtime import GenerationConfig
imported = time.perf_counter()
process, peak = psutil.Process(), [0]
def watch():
    while True:
        peak[0] = max(peak[0], process.memory_info().rss)
        time.sleep(0.02)
threading.Thread(target=watch, daemon=True).start()
engine = runtime.Engine.from_pretrained(sys.argv[1], weights=sys.argv[2])
loaded = time.perf_counter()
result = {"import_s": imported - start, "load_s": loaded - imported, "rss_after_gb": process.memory_info().rss / 1e9,
          "peak_gb": max(peak[0], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 1e9}
prompt = engine.encode("Write a long story about a lighthouse keeper and the sea.")
for streams in (1, 16):
    config = GenerationConfig(max_new_tokens=int(sys.argv[3]), ignore_eos=True)
    list(engine.stream_response_tokens(engine.launch_response_tokens(prompt, GenerationConfig(max_new_tokens=2))))
    begin = time.perf_counter()
    handles = [engine.launch_response_tokens(prompt, config) for _ in range(streams)]
    tokens = sum(len(list(engine.stream_response_tokens(h))) for h in handles)
    result[f"tok_s_{streams}"] = tokens / (time.perf_counter() - begin)
result["rss_after_run_gb"] = process.memory_info().rss / 1e9  # the file's pages read by now (Q4_K, Q6_K: mapped)
engine.shutdown()
print(json.dumps(result))
"""


def loom_load(path: Path, weights: str, tokens: int) -> dict:
    out = subprocess.run([sys.executable, "-c", LOAD, str(path), weights, str(tokens)], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def healthy_after(server: peers.OpenAIServer) -> float:
    start = time.perf_counter()
    server.start()
    seconds = time.perf_counter() - start
    server.stop()
    return seconds


def start_times(path: Path, args, each_round: bool = False) -> tuple[float, float]:
    """The medians of both servers' times to a healthy /health on ``path``, taking turns (with
    ``each_round``, a line a round printed too)."""
    args.model = str(path)
    loom, llama = [], []
    for round_ in range(args.rounds):
        loom.append(healthy_after(peers.loom_server(args, args.weights)))
        llama.append(healthy_after(peers.llama_server(path, path.stem, 1, args)))
        if each_round:
            print(f"{path.name} round {round_ + 1}: Loom's server {loom[-1]:.2f} s, llama-server {llama[-1]:.2f} s "
                  f"({loom[-1] / llama[-1]:.2f}x)", flush=True)
    return statistics.median(loom), statistics.median(llama)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--weights", default="stored")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--llama-server", default=None)
    parser.add_argument("--starts-only", action="store_true", help="time the two servers' starts alone")
    args = parser.parse_args()
    if args.starts_only and not args.llama_server:
        parser.error("--starts-only compares Loom's server with llama-server's: give --llama-server")
    args.kv_dtype, args.llama_kv_type = None, "f16"
    if not args.starts_only:
        print("| file | size | Loom load (import apart) | peak RSS | RSS after load | after 1 / 16 streams "
              "| 1 / 16 streams tok/s |" + (" Loom serve healthy | llama-server healthy |" if args.llama_server
                                             else ""))
        print("| --- | --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if args.llama_server else ""))
    for path in args.files:
        if args.starts_only:
            loom, llama = start_times(path, args, each_round=True)
            print(f"{path.name} medians: Loom's server {loom:.2f} s, llama-server {llama:.2f} s ({loom / llama:.2f}x)")
            continue
        runs = [loom_load(path, args.weights, args.tokens) for _ in range(args.rounds)]
        median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        row = (f"| {path.name} | {path.stat().st_size / 1e9:.2f} GB | {median['load_s']:.1f} s | "
               f"{median['peak_gb']:.2f} GB | {median['rss_after_gb']:.2f} GB | {median['rss_after_run_gb']:.2f} GB | "
               f"{median['tok_s_1']:.1f} / {median['tok_s_16']:.1f} |")
        if args.llama_server:
            loom, llama = start_times(path, args)
            row += f" {loom:.1f} s | {llama:.1f} s |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
