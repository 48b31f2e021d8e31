"""llama-server's batched decode against where its streams sit (docs/benchmarks-history.md, "Shared cores and
W6 after the pool's pages, and llama.cpp's slots"): W6's llama-server (a KV buffer per slot, a slot
per stream of the widest cell) runs four streams of 64 tokens pinned to chosen slots (`id_slot`),
each placement in turn, ``--rounds`` times. Run from a checkout's root:

    python docs/bench/llama_slots.py --llama-server PATH/llama-server [--rounds 2] [--slots 64]
"""

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.getcwd())

from runtime.bench import peers  # noqa: E402
from runtime.bench.workloads import peer_texts  # noqa: E402

from models.checkpoints.gguf import default_model_path  # noqa: E402


async def cell(server: peers.OpenAIServer, prompts: list[str], slots: list[int]) -> float:
    """tok/s of one stream per slot, all at once, through llama-server's own /completion."""
    import aiohttp

    async def stream(session, prompt: str, slot: int) -> int:
        body = {"prompt": prompt, "n_predict": 64, "temperature": 0, "ignore_eos": True, "id_slot": slot}
        async with session.post(server.url + "/completion", json=body) as response:
            response.raise_for_status()
            return (await response.json())["tokens_predicted"]

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
        start = time.perf_counter()
        tokens = await asyncio.gather(*(stream(session, p, s) for p, s in zip(prompts, slots)))
        return sum(tokens) / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--slots", type=int, default=64, help="llama-server's slots (W6: its widest cell)")
    args = parser.parse_args()
    args.llama_kv_type = "f16"  # llama.cpp's default, as W6 runs it
    last = args.slots - 1
    placements = {"0-3": [0, 1, 2, 3], f"{last - 3}-{last}": list(range(last - 3, last + 1)),
                  f"0, {last // 3}, {2 * last // 3}, {last}": [0, last // 3, 2 * last // 3, last]}
    prompts = peer_texts(4)
    gguf = default_model_path()
    with peers.llama_server(peers.f32_gguf(gguf, args.llama_server), "F32", args.slots, args) as server:
        asyncio.run(cell(server, prompts[:1], [0]))  # warm-up
        print("| round | slots | tok/s |\n| --- | --- | --- |")
        for round_ in range(args.rounds):
            for name, slots in placements.items():
                print(f"| {round_} | {name} | {asyncio.run(cell(server, prompts, slots)):.1f} |", flush=True)


if __name__ == "__main__":
    main()
