"""llama.cpp's own speculative decoding beside Loom's (docs/bench/speculation.py), on the same GGUF and
the same tasks: `llama-server` with one slot, without and with its speculation options (by default
`--spec-type ngram-simple`, its prompt lookup; or a draft model, `--spec-args "-md DRAFT.gguf"`), taking
turns, ``--rounds`` times; each task's decode tok/s (llama-server's own `predicted_per_second`) is the
median over the rounds. Run from a checkout's root:

    python docs/bench/llama_speculation.py --llama-server PATH [--model FILE.gguf]
        [--spec-args "--spec-type ngram-simple --spec-draft-n-max 4"] [--rounds 3] [--tasks edit,repeat,story,chat]
"""

import argparse
import json
import os
import shlex
import statistics
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "docs", "bench"))

from speculation import TASKS  # noqa: E402

from models.checkpoints.gguf import default_model_path  # noqa: E402
from runtime.bench import peers  # noqa: E402


def decode_rate(server: peers.OpenAIServer, text: str, max_tokens: int) -> float:
    """llama-server's decode tok/s for one greedy chat answer."""
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0}
    request = urllib.request.Request(f"{server.url}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)["timings"]["predicted_per_second"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--model", default=None, help="a GGUF file (default: the embedded model's)")
    parser.add_argument("--spec-args", default="--spec-type ngram-simple --spec-draft-n-max 4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    args.llama_kv_type = "f16"
    gguf = Path(args.model) if args.model else default_model_path()
    plain = peers.llama_server(gguf, "off", 1, args)
    speculating = peers.llama_server(gguf, "on", 1, args)
    speculating.command += shlex.split(args.spec_args)
    servers = {"off": plain, "on": speculating}
    for server in servers.values():
        server.start()
    try:
        for server in servers.values():
            decode_rate(server, TASKS["story"], 8)  # warm-up
        print(f"llama-server {gguf.name}, {args.spec_args}")
        print("| task | off tok/s | on tok/s | speed-up |")
        print("| --- | ---: | ---: | ---: |")
        for name in args.tasks.split(","):
            rates = {"off": [], "on": []}
            for round_ in range(args.rounds):
                for key in (("off", "on") if round_ % 2 == 0 else ("on", "off")):
                    rates[key].append(decode_rate(servers[key], TASKS[name], args.max_new_tokens))
            off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
            print(f"| {name} | {off:.1f} | {on:.1f} | {on / off:.2f}x |", flush=True)
    finally:
        for server in servers.values():
            server.stop()


if __name__ == "__main__":
    main()
