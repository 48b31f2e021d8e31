"""The workloads of ``python -m runtime bench`` (W1-W4 and the concurrency sweep), each run by
every chosen system of harness.py on the same requests."""

from __future__ import annotations

import os
import random
import time
from functools import partial
from pathlib import Path

import torch

from runtime import GenerationConfig

from . import harness as bench
from .harness import Request
from .report import report

SYSTEMS = ("loom", "pure", "serial", "static", "continuous")


def main(args, load_engine) -> int:
    """Run the chosen workloads, once for each count of busy competitor processes;
    ``load_engine(args, source, **options)`` builds each engine."""
    torch.manual_seed(0)
    if args.smoke:
        args.requests, args.new_tokens, args.serial_limit, args.w2_window = 4, 4, 2, 0.2
        args.sweep, args.sweep_tokens, args.shared_tokens = "1,4", 4, 4
        args.workloads = ",".join(w for w in args.workloads.split(",") if w not in ("w3", "w5"))  # the real model
    runs: list[bench.Run] = []
    for competitors in args.competitors:
        with bench.Competitors(competitors):
            run_workloads(args, load_engine, Measure(runs, competitors))
    return report(runs, args)


class Measure:
    """Runs one system on one workload with a progress bar and keeps its Run, stamped with the
    CPU time this process used meanwhile, the hypervisor's steal and the busy competitors."""

    def __init__(self, runs: list, competitors: int):
        self.runs, self.competitors = runs, competitors

    def __call__(self, name, fn, count):
        from tqdm import tqdm

        counters, cpu = bench.cpu_time_counters(), time.process_time()
        with tqdm(total=count, desc=f"{name} ({self.competitors} busy)", unit="req", leave=False) as bar:
            run = fn(bar)
        if run.cpu_seconds is None:  # a server's run counts its server process too
            run.cpu_seconds = time.process_time() - cpu
        run.steal = bench.steal_percent(counters, bench.cpu_time_counters())
        run.competitors = self.competitors
        self.runs.append(run)
        summary = run.summary()
        where = f"{run.workload:<6} {run.system:<24} {self.competitors} busy"
        if summary["throughput"] is not None:
            tqdm.write(f"  {where} {summary['throughput']:9.1f} tok/s {summary['cpu_ms_per_token'] or 0:8.1f} CPU ms/token")
        else:
            tqdm.write(f"  {where} hand-off p99 {summary['handoff_p99_ms']:.3f} ms")
        return run


def run_workloads(args, load_engine, measure: Measure) -> None:
    systems = set(args.systems.split(","))
    workloads = [w for w in args.workloads.split(",") if w]
    device = torch.device(args.device)
    if {"w1", "w2", "w4"} & set(workloads) or args.sweep:
        hf = gpt2_small(args.smoke).to(device)
        engine = load_engine(args, hf, kv_cache_bytes=4 << 30)
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
        prefix_workload(measure, hf, args, load_engine)
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
    if "w3" in workloads or "w5" in workloads:
        real_model_workloads(measure, systems, workloads, args, load_engine)
    if "w6" in workloads or args.peers:
        peer_workload(measure, args, load_engine)


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


def real_model_workloads(measure, systems, workloads, args, load_engine) -> None:
    """On the embedded SmolLM2, against transformers' own GGUF load of it. W3: 32 chat questions,
    64 new tokens. W5 (shared cores): 1, 8 and 64 concurrent streams of --shared-tokens tokens,
    EOS ignored, as an embedded runtime's load; run it with --competitors 0,1,2."""
    from models.checkpoints.gguf import default_model_path

    engine = load_engine(args, args.model)
    from transformers import AutoModelForCausalLM
    path = default_model_path() if args.model is None else Path(args.model)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    hf = hf.to(args.device)
    if "w3" in workloads:
        topics = ["rivers", "threads", "bread", "stars", "music", "maps", "glass", "bees"] * 4
        prompts = [engine.encode([{"role": "user", "content": f"Tell me about {t}."}]) for t in topics]
        compare(measure, engine, hf, [Request(p, 64) for p in prompts], "W3", systems, args)
    if "w5" in workloads:
        for c in (1, 8, 64):
            prompts = [engine.encode([{"role": "user", "content": f"Question {i}: tell me a story."}]) for i in range(c)]
            compare(measure, engine, hf, [Request(p, args.shared_tokens) for p in prompts], f"W5@{c}", systems, args)
    engine.shutdown()


def prefix_workload(measure, hf, args, load_engine) -> None:
    """W4: 32 requests sharing a 384-token system prompt, each with a short distinct question."""
    rng = random.Random(4)
    shared = [rng.randrange(hf.config.vocab_size) for _ in range(24 if args.smoke else 384)]
    requests = [Request(shared + [rng.randrange(hf.config.vocab_size) for _ in range(12)], 4 if args.smoke else 16)
                for _ in range(8 if args.smoke else 32)]
    for caching in (False, True):
        engine = load_engine(args, hf, kv_cache_bytes=4 << 30, enable_prefix_caching=caching)

        def run(bar, engine=engine, caching=caching):
            run = bench.run_loom(engine, requests, "W4", bar)
            run.system = f"loom, prefix cache {'on' if caching else 'off'}"
            run.note = f"hit rate {engine.stats()['prefix_cache_hit_rate']:.0%}"
            return run

        measure(f"W4 prefix cache {'on' if caching else 'off'}", run, len(requests))
        engine.shutdown()


def gpt2_small(smoke: bool):
    """The GPT-2 small architecture with random weights (speed does not depend on them)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4) if smoke else GPT2Config()
    return GPT2LMHeadModel(config).eval()


def peer_workload(measure, args, load_engine) -> None:
    """W6: the default model beside the runtimes users would pick instead, at --peer-streams
    concurrent streams of 64 new tokens, EOS ignored: in-process, Loom and fastllm (float32);
    through OpenAI-compatible servers with one shared client, Loom's and llama-server (its F32
    GGUF and the Q4_1 GGUF as shipped). First, each system's greedy output for 3 prompts is
    compared with Loom's; the agreement goes in each system's note."""
    from models.checkpoints.gguf import default_model_path

    from . import peers

    gguf = default_model_path() if args.model is None else Path(args.model)
    if gguf.suffix != ".gguf":
        raise SystemExit("W6 runs the peers on a GGUF checkpoint; pass --model FILE.gguf or none (the default)")
    available = []
    for peer in args.peers:
        if (why := peers.missing(peer, args.llama_server)) is not None:
            print(f"W6: skipping {peer}: {why}")
        else:
            available.append(peer)
    streams = [int(c) for c in args.peer_streams.split(",")]
    texts = peer_texts(max(streams))
    checks = texts[:3]
    engine = load_engine(args, args.model)
    prompts = [engine.encode(t) for t in texts]
    greedy32 = GenerationConfig(max_new_tokens=32, ignore_eos=True)
    reference = [engine.response(t, greedy32) for t in checks]
    checks_ids = prompts[:len(checks)]

    def agreement(outputs: list[str]) -> str:
        same = [len(os.path.commonprefix([mine, ours])) for mine, ours in zip(outputs, reference)]
        return "greedy text equal to Loom's for " + ", ".join(f"{n}/{len(r)}" for n, r in zip(same, reference)) + " chars"

    for c in streams:
        requests = [Request(p, 64) for p in prompts[:c]]
        measure(f"W6@{c} loom", lambda bar, r=requests, c=c: label(bench.run_loom(engine, r, f"W6@{c}", bar),
                                                                  f"loom {args.weights or 'default'}{peers.kv_label(args)}", ""), c)
    engine.shutdown()
    servers = [peers.loom_server(args, args.weights)]
    if "llama.cpp" in available:
        servers += [peers.llama_server(peers.f32_gguf(gguf, args.llama_server), "F32", max(streams), args),
                    peers.llama_server(gguf, gguf.stem.rsplit(".", 1)[-1], max(streams), args)]
    for server in servers:
        try:
            server.start()
        except peers.ServerDidNotStart as error:  # e.g. a peer built for another processor: the others still run
            print(f"W6: skipping {server.system}: {error}")
            continue
        try:
            note = agreement([server.complete(t, 32)[0] for t in checks])
            for c in streams:
                measure(f"W6@{c} {server.system}", lambda bar, s=server, c=c, note=note: label(
                    s.run(texts[:c], 64, f"W6@{c}"), s.system, note), c)
        finally:
            server.stop()
    if "fastllm" in available:  # last: its library's threads stay in this process
        fast = peers.FastLLM(peers.hf_directory(gguf), FASTLLM_DTYPES[args.weights or "stored"], args.fastllm_threads)
        note = agreement([engine.tokenizer.decode(fast.generate(p, 32), skip_special_tokens=True) for p in checks_ids])
        for c in streams:
            requests = [Request(p, 64) for p in prompts[:c]]
            measure(f"W6@{c} fastllm", lambda bar, r=requests, c=c, note=note: label(
                fast.run(r, f"W6@{c}"), f"fastllm {fast.dtype}", note), c)


# fastllm's dtype for each of Loom's weights choices: the nearest it has (int4g32: 4-bit groups of 32 with a
# scale and a minimum each, as Loom's int4 blocks and the default model's stored Q4_1 ones).
FASTLLM_DTYPES = {"stored": "int4g32", "float32": "float32", "float16": "float16", "int8": "int8", "int8-dynamic": "int8",
                  "int4": "int4g32"}


def peer_texts(count: int, run: str | None = None) -> list[str]:
    """W6's prompts, one per stream; with ``run``, prompts of that run's own (from their first
    tokens on), which no cache of an earlier run's prompts can serve."""
    first = f"Run {run}. " if run is not None else ""
    return [f"{first}Question {i}: tell me a story about a river." for i in range(count)]


def label(run, system: str, note: str):
    run.system = system
    run.note = "; ".join(n for n in (run.note, note) if n)
    return run
