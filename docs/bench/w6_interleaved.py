"""W6's systems taking turns, for quiet cells on a machine whose speed drifts between runs
(docs/benchmarks-history.md, "An Intel Xeon"): Loom in-process, Loom's server and llama-server on a
GGUF file (--model, default the embedded one; as it is, or its F32 copy with --weights float32)
are started together, and at each stream
count the three run in turn, ``--rounds`` times, each round starting with the next system. It
prints each system's tok/s per round and the median (W6's prompts, 64 tokens each), then Loom's
ratios to llama.cpp round by round. Each cell's prompts are its own (W6's with the round and the
stream count in front), so that every system prefills every prompt it is measured on: with the
same prompts in every round, llama-server's slots served a repeated prompt from their cache (11 of
its 12 tokens), Loom's prefix cache (whole 16-token blocks) none of it, and one stream of the 1.7B
Q4_K_M file measured that prompt cache more than either's speed (its prefill took 540 ms on one
Zen 5 core against 80 ms cached, beside 32 decode steps of 54 ms). The bench (`python -m runtime bench --workloads w6`) runs each
system through all its cells before the next, minutes apart. Run from a
checkout's root:

    python docs/bench/w6_interleaved.py --llama-server PATH/llama-server [--model FILE.gguf] [--streams 1,4,16,64]
        [--rounds 3] [--weights stored|float32|int4] [--tokens 64] [--kv-dtype float16] [--llama-kv-type f16|f32]
        [--busy K] [--loom in-process,server] [--apart]

--loom names the Loom systems measured (both by default): one alone where two copies of a model
Loom holds in memory of its own (the 1.7B F32 file's padded rows with AVX2) and llama-server's
mapping of the file do not fit in the machine's memory. With --apart, the servers (Loom's, then
llama-server; --loom server) are held one at a time: each round starts each in turn, runs its cells
and stops it, for files of which two runtimes' copies do not fit in memory together (llama.cpp
repacks a Q4_K file's weights into memory of its own on AVX2 and AVX-512: a 30B mixture's 17 GB, beside
which the other runtime's mapped pages of the same file were read from disk again and again).
With --busy K, K busy competitor processes (the bench's Competitors) run while the systems are
measured (not while they load).
"""

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.getcwd())

from runtime import Engine  # noqa: E402
from runtime.bench import peers  # noqa: E402
from runtime.bench.harness import Competitors, Request, run_loom  # noqa: E402
from runtime.bench.workloads import peer_texts  # noqa: E402

from models.checkpoints.gguf import default_model_path  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--streams", default="1,4,16,64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None, help="a GGUF file (default: the embedded model)")
    parser.add_argument("--weights", default="stored", choices=("stored", "float32", "int4"),
                        help="Loom's weights; llama-server runs the file as it is, or an F32 copy with float32")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens a stream")
    parser.add_argument("--kv-dtype", default=None, help="Loom's KV pool (default: the model's dtype)")
    parser.add_argument("--llama-kv-type", default="f16", choices=("f16", "f32"), help="llama-server's KV cache")
    parser.add_argument("--busy", type=int, default=0, help="busy competitor processes while measuring")
    parser.add_argument("--loom", default="in-process,server",
                        help="Loom's systems to measure: in-process, server or both (each holds its own copy of "
                             "what Loom keeps in its own memory)")
    parser.add_argument("--apart", action="store_true",
                        help="hold one server at a time, started and stopped in its turn (with --loom server)")
    args = parser.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    chosen = set(args.loom.split(","))
    if not chosen <= {"in-process", "server"}:
        parser.error(f"--loom takes in-process, server or both, not {args.loom!r}")
    if args.apart and chosen != {"server"}:
        parser.error("--apart starts and stops servers: measure Loom's server alone (--loom server)")
    engine = None
    if "in-process" in chosen:
        engine = Engine.from_pretrained(args.model, weights=args.weights, kv_dtype=args.kv_dtype)
    gguf = Path(args.model) if args.model else default_model_path()
    label = gguf.stem.rsplit(".", 1)[-1] if args.model is None else gguf.stem  # the default's: its format, Q4_1
    peer = (gguf, label) if args.weights != "float32" else (peers.f32_gguf(gguf, args.llama_server), "F32")
    servers = [peers.loom_server(args, args.weights)] if "server" in chosen else []
    servers.append(peers.llama_server(*peer, max(streams), args))
    rates: dict[tuple[str, int], list[float]] = {}
    held = [] if args.apart else servers  # the servers running now
    for server in held:
        server.start()
    try:
        new = args.tokens
        systems = [("loom in-process", lambda texts: run_loom(engine, [Request(engine.encode(t), new) for t in texts],
                                                              f"W6@{len(texts)}"))] if engine is not None else []
        systems += [(server.system, lambda texts, server=server: server.run(texts, new, f"W6@{len(texts)}"))
                    for server in servers]

        def cell(round_: int, c: int, k: int) -> None:
            system, run_cell = systems[k]
            run = run_cell(peer_texts(c, f"{round_}.{c}.{k}"))  # prompts no system has seen
            rates.setdefault((system, c), []).append(run.tokens / run.seconds)

        for round_ in range(args.rounds):
            # Each round starts with the next system: a drift within a round weighs on all alike.
            first = round_ % len(systems)
            order = list(range(first, len(systems))) + list(range(first))
            if not args.apart:
                with Competitors(args.busy):
                    for c in streams:
                        for k in order:
                            cell(round_, c, k)
                continue
            for k in order:  # (systems are the servers here)
                held.append(servers[k].start())
                with Competitors(args.busy):
                    for c in streams:
                        cell(round_, c, k)
                held.pop().stop()
    finally:
        for server in held:
            server.stop()
        if engine is not None:
            engine.shutdown()
    print("| streams | system | tok/s per round | median |")
    print("| --- | --- | --- | --- |")
    for (system, c), values in sorted(rates.items(), key=lambda item: (item[0][1], item[0][0])):
        print(f"| {c} | {system} | {' / '.join(f'{v:.1f}' for v in values)} | {statistics.median(values):.1f} |")
    # Within a round the systems ran minutes apart at most: the ratio of a round's cells is less
    # exposed to the machine's drift than the ratio of medians taken over different rounds.
    # llama-server can also slow down from round to round: it gives a request the slot whose cached
    # prompt matches most, the rounds repeat the prompts, and a batch on scattered slots costs more
    # (docs/bench/llama_slots.py). Its best round shows what it does on the slots it started with.
    peer = servers[-1].system
    looms = ["loom in-process"] * (engine is not None) + [server.system for server in servers[:-1]]
    print(f"\n| streams | {' | '.join(f'{loom} / {peer} (per round: median)' for loom in looms)} "
          f"| Loom's medians / {peer}'s best round ({', '.join(looms)}) |")
    print("|" + " --- |" * (len(looms) + 2))
    for c in streams:
        cells, best = [], []
        for system in looms:
            ratios = [a / b for a, b in zip(rates[(system, c)], rates[(peer, c)])]
            cells.append(f"{' / '.join(f'{r:.2f}' for r in ratios)}: {statistics.median(ratios):.2f}x")
            best.append(f"{statistics.median(rates[(system, c)]) / max(rates[(peer, c)]):.2f}x")
        print(f"| {c} | {' | '.join(cells)} | {', '.join(best)} |")


if __name__ == "__main__":
    main()
