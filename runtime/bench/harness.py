"""The systems the benchmark runs, each on a list of Requests: Loom through its public API,
transformers' generate() one request at a time behind a lock, as one static padded batch,
transformers' continuous batching, and the pure model forward with no runtime around it (built
through the model contract, models/step.py, as Loom's steps are)."""

from __future__ import annotations

import queue
import random
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from models.step import KVCache, Sequence, StepInput
from runtime import GenerationConfig, openmp


@dataclass
class Request:
    prompt: list[int]
    new_tokens: int
    arrival: float = 0.0  # seconds after the start of the run


@dataclass
class Run:
    """One system on one workload: what was produced, when, and how long it took."""

    system: str
    workload: str
    concurrency: int
    tokens: int = 0
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    handoff: list[float] = field(default_factory=list)
    steal: float | None = None  # % of CPU time the hypervisor gave to other guests meanwhile
    competitors: int = 0        # busy processes the bench ran on the same cores meanwhile
    cpu_seconds: float | None = None  # CPU time this process used during the run, all threads
    note: str = ""

    def record(self, start: float, times: list[float]) -> None:
        self.tokens += len(times)
        if times:
            self.ttft.append(times[0] - start)
        if len(times) > 1:
            self.tpot.append((times[-1] - times[0]) / (len(times) - 1))

    def summary(self) -> dict:
        pct = lambda xs, q: float(np.percentile(xs, q)) * 1000 if xs else None
        return {
            "system": self.system, "workload": self.workload, "concurrency": self.concurrency,
            "tokens": self.tokens, "seconds": round(self.seconds, 3),
            "throughput": self.tokens / self.seconds if self.seconds else None,
            "ttft_p50_ms": pct(self.ttft, 50), "ttft_p99_ms": pct(self.ttft, 99),
            "tpot_p50_ms": pct(self.tpot, 50), "tpot_p99_ms": pct(self.tpot, 99),
            "handoff_p50_ms": pct(self.handoff, 50), "handoff_p99_ms": pct(self.handoff, 99),
            "steal_pct": self.steal, "competitors": self.competitors,
            "cpu_ms_per_token": 1000 * self.cpu_seconds / self.tokens if self.cpu_seconds and self.tokens else None,
            "note": self.note,
        }


class Competitors:
    """``count`` processes that keep a core busy each (a busy loop, as an application's other
    work or a neighbour would), for as long as the ``with`` block runs."""

    def __init__(self, count: int):
        self.count, self.processes = count, []

    def __enter__(self):
        import subprocess
        import sys
        self.processes = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.count)]
        time.sleep(0.5 if self.count else 0)  # let them start spinning
        return self

    def __exit__(self, *exc):
        for process in self.processes:
            process.kill()
            process.wait()


def cpu_time_counters() -> tuple[int, int] | None:
    """(stolen, total) CPU time since boot, in clock ticks, from /proc/stat; None off Linux.
    Stolen time is what the hypervisor gave to other guests: on a shared VM it explains runs
    that differ by tens of percent."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return fields[7], sum(fields)


def steal_percent(before, after) -> float | None:
    if before is None or after is None or after[1] == before[1]:
        return None
    return 100.0 * (after[0] - before[0]) / (after[1] - before[1])


# The warm-ups' prompt: none of the measured ones, which a prompt cache would then hold.
WARM_UP_TEXT = "Warm-up: say hello."


def warm_up_loom(engine, requests: list[Request]) -> None:
    """Untimed: touch every page of the KV pools once (they are committed lazily, as a long-running
    process would have done long ago) and run one short request (of none of ``requests``' prompts)."""
    engine.kv_cache.zero_()
    if engine.drafter is not None:  # the draft model's pool too
        engine.drafter.kv.cache.zero_()
    # (a model without a tokenizer: one token of the first prompt, which fills no block to reuse)
    prompt = engine.encode(WARM_UP_TEXT) if engine.tokenizer is not None else requests[0].prompt[:1]
    handle = engine.launch_response_tokens(prompt, GenerationConfig(max_new_tokens=2, ignore_eos=True))
    list(engine.stream_response_tokens(handle))


def run_loom(engine, requests: list[Request], workload: str, progress=None) -> Run:
    """Each request in its own worker thread: wait for its arrival, launch, fetch every token."""
    warm_up_loom(engine, requests)
    openmp.release_thread_pool()  # this thread's warm-up and baselines left it workers: openmp.py
    run = Run("loom", workload, len(requests))
    # The figures are summed up after the run: a consumer doing its accounting as its stream ends
    # would hold the GIL while the engine hands tokens to the others, and show up in their hand-off.
    streams = []
    lock = threading.Lock()
    start = time.perf_counter()

    def client(request: Request):
        time.sleep(max(0.0, start + request.arrival - time.perf_counter()))
        launched = time.perf_counter()
        handle = engine.launch_response_tokens(request.prompt, GenerationConfig(
            max_new_tokens=request.new_tokens, ignore_eos=True))
        fetched = []
        while engine.fetch_response_tokens(handle) != -1:
            fetched.append(time.perf_counter())
        streams.append((launched, fetched, handle.token_times))  # list.append is atomic
        if progress:
            with lock:
                progress.update()

    one_thread_each(client, requests, run, start)
    for launched, fetched, sampled in streams:
        run.record(launched, fetched)
        run.handoff += [got - made for got, made in zip(fetched, sampled)]
    return run


def run_queue_floor(consumers: int, rounds: int = 50, pause: float = 0.02) -> Run:
    """The hand-off floor of Python threads on this machine, with no engine: ``consumers``
    threads block on their own SimpleQueue; each round one thread puts a timestamp in every queue
    and then sleeps, holding no GIL, while the consumers wake and take it. Loom's hand-off can
    approach this, not beat it: every woken consumer needs the GIL in turn."""
    run = Run("queue floor", "sweep", consumers, note="threads + SimpleQueue, no engine")
    queues = [queue.SimpleQueue() for _ in range(consumers)]
    lock = threading.Lock()

    def consumer(q: queue.SimpleQueue):
        waits = []
        while (put := q.get()) is not None:
            waits.append(time.perf_counter() - put)
        with lock:
            run.handoff += waits

    threads = [threading.Thread(target=consumer, args=(q,)) for q in queues]
    for t in threads:
        t.start()
    time.sleep(pause)
    for _ in range(rounds):
        for q in queues:
            q.put(time.perf_counter())
        time.sleep(pause)
    for q in queues:
        q.put(None)
    for t in threads:
        t.join()
    run.tokens = len(run.handoff)
    return run


def run_pure_forward(model, requests: list[Request], workload: str, block_size=16, max_batch_tokens=2048) -> Run:
    """The steps Loom takes for requests that all arrive at once, timed around model.forward
    alone: inputs prebuilt, no scheduling, sampling or delivery. Like Loom's scheduler, each
    step gives every unfinished request its next token (decodes first, longest context first)
    and then prefill chunks within the token budget."""
    run = Run("pure forward", workload, len(requests), note="model forward only, Loom's steps")
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    blocks = -(-max(len(r.prompt) + r.new_tokens for r in requests) // block_size)
    kv = KVCache.for_model(model, blocks * len(requests), block_size, dtype, device, state_slots=len(requests))
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(len(requests))]
    tokens = [list(r.prompt) for r in requests]
    computed = [0] * len(requests)
    steps, sampled_by = [], []  # each step, and the requests that gain a token in it
    while True:
        budget, work = max_batch_tokens, []
        for i, r in enumerate(requests):
            n = min(len(tokens[i]) - computed[i], budget)
            if len(tokens[i]) - len(r.prompt) < r.new_tokens and n:
                work.append((i, n))
                budget -= n
        if not work:
            break
        work.sort(key=lambda w: (w[1] != 1, -computed[w[0]] if w[1] == 1 else 0))
        sequences = [Sequence(tokens[i][computed[i]:computed[i] + n], computed[i], tables[i],
                              computed[i] + n == len(tokens[i]), state_slot=i) for i, n in work]
        steps.append(StepInput.flatten(sequences, block_size, device))
        sampled_by.append([i for (i, _), seq in zip(work, sequences) if seq.sample])
        for i, n in work:
            computed[i] += n
            if computed[i] == len(tokens[i]):
                tokens[i].append(tokens[i][-1])
    token_times = [[] for _ in requests]
    with torch.inference_mode():
        kv.zero_()  # commit the lazily allocated pool before the clock starts, as for Loom
        model(steps[-1], kv)  # warm up
        synchronize(device)
        start = time.perf_counter()
        for step, sampled in zip(steps, sampled_by):
            model(step, kv)
            synchronize(device)
            now = time.perf_counter()
            for i in sampled:
                token_times[i].append(now)
        run.seconds = time.perf_counter() - start
    for times in token_times:  # the same arithmetic as Loom's: TTFT from the start, TPOT per request
        run.record(start, times)
    return run


def run_hf_serial(hf, requests: list[Request], workload: str, limit: int, progress=None) -> Run:
    """What a naive multithreaded app does: each thread calls generate() under one shared lock."""
    chosen = requests[:limit]
    run = Run("transformers serial", workload, len(chosen), note=f"first {len(chosen)} requests")
    hf.generate(torch.tensor([chosen[0].prompt], device=hf.device), **greedy(2))  # warm-up, untimed
    lock, record_lock = threading.Lock(), threading.Lock()
    openmp.release_thread_pool()  # generate() runs on other threads, as Loom's forward does
    start = time.perf_counter()

    def client(request: Request):
        launched = time.perf_counter()
        streamer = TimingStreamer()
        with lock:
            hf.generate(torch.tensor([request.prompt], device=hf.device), attention_mask=None, streamer=streamer,
                        **greedy(request.new_tokens))
        with record_lock:
            run.record(launched, streamer.times)
            if progress:
                progress.update()

    return one_thread_each(client, chosen, run, start)


def run_hf_static(hf, requests: list[Request], workload: str, batch_size: int, progress=None) -> Run:
    """Static batches in arrival order: a batch starts when its last request has arrived and the
    previous batch is done, pads prompts on the left, and runs until its longest answer ends."""
    run = Run("transformers static", workload, batch_size, note=f"batches of {batch_size}")
    hf.generate(torch.tensor([requests[0].prompt], device=hf.device), **greedy(2))  # warm-up, untimed
    start = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        group = requests[first:first + batch_size]
        time.sleep(max(0.0, start + max(r.arrival for r in group) - time.perf_counter()))
        width = max(len(r.prompt) for r in group)
        ids = torch.tensor([[0] * (width - len(r.prompt)) + r.prompt for r in group], device=hf.device)
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in group], device=hf.device)
        streamer = TimingStreamer()
        hf.generate(ids, attention_mask=mask, streamer=streamer, **greedy(max(r.new_tokens for r in group)))
        for r in group:
            run.record(start + r.arrival, streamer.times[:r.new_tokens])
        if progress:
            progress.update(len(group))
    run.seconds = time.perf_counter() - start
    return run


def run_hf_continuous(hf, requests: list[Request], workload: str, progress=None) -> Run:
    """transformers' own continuous batching manager: each request is added at its arrival time
    with its own max_new_tokens; the manager is started and warmed up before the clock starts."""
    from transformers.generation import ContinuousBatchingConfig

    run = Run("transformers continuous", workload, len(requests))
    # A KV cache for every request at full length at once, as Loom's pool is sized: left to
    # itself the manager takes most of the machine's free memory (14.5 GB here), even for a smoke run.
    # Pages of 32 tokens waste little at each request's end: with 256, W2's cache came to more than the
    # memory the manager allows itself beside the other systems, and it refused to start. W2's
    # lengths (96 requests at once) ran at 195-198 tok/s with either.
    page = 32
    pages = sum(-(-(len(r.prompt) + r.new_tokens) // page) for r in requests)
    memory = ContinuousBatchingConfig(page_size=page, num_blocks=pages + 1, max_batch_tokens=2048)
    manager = hf.init_continuous_batching(generation_config=greedy_config(max(r.new_tokens for r in requests)),
                                          continuous_batching_config=memory)
    manager.start()
    try:
        manager.add_request(requests[0].prompt, request_id="warm-up", max_new_tokens=2)
        next_result(manager, request_id="warm-up")
        openmp.release_thread_pool()  # the manager's thread runs the forwards, as Loom's does
        start = time.perf_counter()
        for i, r in enumerate(requests):
            time.sleep(max(0.0, start + r.arrival - time.perf_counter()))
            manager.add_request(r.prompt, request_id=str(i), max_new_tokens=r.new_tokens, record_timestamps=True)
        for _ in requests:
            out = next_result(manager)
            run.record(out.created_time, list(out.timestamps or []))
            if progress:
                progress.update()
        run.seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    return run


def next_result(manager, request_id: str | None = None):
    """The manager's next result; an error that says why where there is none: its thread died (the
    manager then answers None at once) or 600 s went by."""
    out = manager.get_result(request_id=request_id, timeout=600)
    if out is None:
        status = getattr(manager, "background_thread_status", None)
        error = getattr(status, "fatal_error", None)
        if error is not None:
            raise RuntimeError(f"transformers' continuous batching stopped: {error}") from error
        raise TimeoutError("transformers' continuous batching returned no result within 600 s")
    return out


def one_thread_each(client, requests: list[Request], run: Run, start: float) -> Run:
    """Run ``client(request)`` in a thread per request, as an application would, and time it all."""
    threads = [threading.Thread(target=client, args=(r,)) for r in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    run.seconds = time.perf_counter() - start
    return run


class TimingStreamer:
    """A transformers streamer that notes when each generation step hands out its tokens."""

    def __init__(self):
        self.times, self.prompt_seen = [], False

    def put(self, value):
        if self.prompt_seen:
            self.times.append(time.perf_counter())
        self.prompt_seen = True

    def end(self):
        pass


def greedy_config(new_tokens: int):
    from transformers import GenerationConfig as HFConfig
    return HFConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)


def greedy(new_tokens: int) -> dict:
    return {"generation_config": greedy_config(new_tokens)}


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def random_requests(count, prompt_len, new_tokens, vocab, seed=0, arrivals=None) -> list[Request]:
    rng = random.Random(seed)
    lengths = new_tokens if isinstance(new_tokens, list) else [new_tokens] * count
    return [Request([rng.randrange(vocab) for _ in range(prompt_len)], lengths[i], arrivals[i] if arrivals else 0.0)
            for i in range(count)]
