"""Long prompts: the time to a request's first token (its prompt's prefill) for one prompt of each
length, Loom in-process against llama-server on the same GGUF file, taking turns, ``--rounds``
times; every prompt new to both (each starts with its own words, so neither one's prompt cache
serves it). Reported as the prompt's tokens a second of that time (Loom's tokenizer counts them: the
same file's vocabulary). Run from a checkout's root:

    python docs/bench/long_prompts.py --llama-server PATH --model FILE.gguf [--lengths 128,512,2048]
        [--rounds 3] [--busy 0]
"""

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())

from runtime import Engine, GenerationConfig  # noqa: E402
from runtime.bench import peers  # noqa: E402
from runtime.bench.harness import Competitors  # noqa: E402

WORDS = ("river", "lantern", "harbor", "copper", "meadow", "signal", "winter", "engine", "garden", "ledger",
         "orbit", "canyon", "violet", "thunder", "market", "pilot", "silver", "forest", "anchor", "bridge")


def prompt_text(engine: Engine, tokens: int, seed: int) -> str:
    """Words drawn by ``seed`` (its own first words, so no cache holds its start), about ``tokens``
    long by the engine's tokenizer."""
    rng = random.Random(seed)
    words = [f"Note {seed}:"]
    while len(engine.encode(" ".join(words))) < tokens:
        words += [rng.choice(WORDS) for _ in range(max(1, (tokens - len(engine.encode(" ".join(words)))) // 2))]
    return " ".join(words)


def loom_first_token(engine: Engine, text: str) -> float:
    prompt = engine.encode(text)
    start = time.perf_counter()
    handle = engine.launch_response_tokens(prompt, GenerationConfig(max_new_tokens=1, ignore_eos=True))
    list(engine.stream_response_tokens(handle))
    return time.perf_counter() - start


def server_first_token(server: peers.OpenAIServer, text: str) -> float:
    async def first():
        import aiohttp
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
            _, _, launched, times = await server._stream(session, text, 1)
            return times[0] - launched
    return asyncio.run(first())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--model", required=True, help="a GGUF file")
    parser.add_argument("--lengths", default="128,512,2048", help="prompt lengths in tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--busy", type=int, default=0, help="busy competitor processes while measuring")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    gguf = Path(args.model)
    engine = Engine.from_pretrained(gguf, max_batch_size=1)
    port = peers.free_port()
    command = [peers.llama_binary("llama-server", args.llama_server), "-m", str(gguf), "--port", str(port),
               "--host", "127.0.0.1", "-np", "1", "-c", str(max(lengths) + 256), "-t", str(os.cpu_count()),
               "-b", "2048", "-ub", "512"]
    server = peers.OpenAIServer("llama.cpp server", command, port, gguf.stem).start()
    times: dict[tuple[str, int], list[float]] = {}
    tokens = {}
    try:
        loom_first_token(engine, prompt_text(engine, 16, 0))  # warm-ups, untimed
        server_first_token(server, prompt_text(engine, 16, 1))
        with Competitors(args.busy):
            for r in range(args.rounds):
                for n in lengths:
                    for system in ("loom", "llama.cpp"):  # each its own prompt: neither's cache holds it
                        text = prompt_text(engine, n, hash((r, n, system)) % 1_000_000 + 2)
                        tokens[(system, n)] = len(engine.encode(text))
                        took = loom_first_token(engine, text) if system == "loom" else server_first_token(server, text)
                        times.setdefault((system, n), []).append(took)
                        print(f"round {r + 1}, {n} tokens, {system}: {took:.2f} s", flush=True)
    finally:
        server.stop()
        engine.shutdown()
    print(f"\n{gguf.name}, {args.rounds} rounds{f', beside {args.busy} busy' if args.busy else ''}: "
          "time to the first token (median), prompt tokens a second")
    print("| prompt tokens | Loom | llama.cpp | Loom / llama.cpp |")
    print("| --- | --- | --- | --- |")
    for n in lengths:
        loom, llama = statistics.median(times[("loom", n)]), statistics.median(times[("llama.cpp", n)])
        rate = lambda system, t: tokens[(system, n)] / t
        print(f"| {n} | {loom:.2f} s ({rate('loom', loom):.0f}/s) | {llama:.2f} s ({rate('llama.cpp', llama):.0f}/s) "
              f"| {llama / loom:.2f}x |")


if __name__ == "__main__":
    main()
