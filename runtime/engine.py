"""Engine: launch / fetch / abort / shutdown / stats. Owns the lock, the contexts and the one
main-loop thread that runs every live request in a single batched forward per step."""

from __future__ import annotations

import asyncio
import atexit
import functools
import itertools
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator

import numpy as np
import torch

import models

from . import batch, openmp, sampler
from .config import EngineOptions, GenerationConfig
from .context import END, Failure, Handle, ResponseContext
from .errors import EngineBusy, EngineClosed, GenerationFailed
from .kv_cache import BlockAllocator, KVCache
from .scheduler import Scheduler
from .text import TextAPI

_live_engines: weakref.WeakSet = weakref.WeakSet()
atexit.register(lambda: [engine.shutdown() for engine in list(_live_engines)])


# How long after sampling, at most, the loop thread leaves the CPU to consumers blocked in fetch
# (Engine._let_consumers_take): on 2 cores the 64th consumer holds its token about 2 ms after
# sampling. A consumer slower than that costs its step this much, no more.
CONSUMER_GRACE_S = 0.003


def _resolve(future: asyncio.Future) -> None:
    if not future.done():  # a timed-out wait cancelled it
        future.set_result(None)


class Engine(TextAPI):
    """Continuous batching for many threads over one model.

    Every public method is thread-safe. The loop thread starts on the first launch and holds
    the lock only to schedule and to deliver, never across the forward.
    """

    def __init__(self, checkpoint: models.Checkpoint, device: torch.device, options: EngineOptions):
        self.model = checkpoint.model
        self.tokenizer = checkpoint.tokenizer
        self.eos_token_ids = checkpoint.eos_token_ids
        self.name = checkpoint.name
        self.device = device
        self.options = options
        dtype = next(self.model.parameters()).dtype
        geometry = (self.model.num_layers, options.block_size, self.model.num_kv_heads, self.model.head_dim)
        num_blocks = options.num_kv_blocks or self._blocks_in_budget(KVCache.bytes_per_block(*geometry, dtype))
        self.kv_cache = KVCache(self.model.num_layers, num_blocks, options.block_size,
                                self.model.num_kv_heads, self.model.head_dim, dtype, device)
        self.allocator = BlockAllocator(num_blocks, options.block_size, options.enable_prefix_caching)
        self.scheduler = Scheduler(options, self.allocator)
        self.vocab_size, self.max_position = self.model.vocab_size, self.model.max_position
        self.max_context = min(self.model.max_position, num_blocks * options.block_size)
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._contexts: dict[int, ResponseContext] = {}
        self._dropped: deque[int] = deque()  # handles the application let go of (see Handle)
        self._handles = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed: BaseException | None = None
        self._generator = torch.Generator(device).manual_seed(options.seed)
        self._counters = {"steps": 0, "tokens_generated": 0, "requests_finished": 0, "step_failures": 0}
        _live_engines.add(self)
        if device.type == "cpu":
            # Loading ran on this thread and left it a pool of OpenMP workers; beside the loop
            # thread's own, libgomp would stop letting either spin (see openmp.py).
            openmp.release_thread_pool()

    @classmethod
    def from_pretrained(cls, source=None, *, device="cpu", dtype=None, **options) -> "Engine":
        """Load ``source`` (None: the embedded SmolLM2; a Hugging Face directory; a .gguf file;
        an in-memory transformers model) and build an engine. ``options`` are EngineOptions."""
        engine_options = EngineOptions.from_kwargs(options)  # bad options fail before a slow load
        device = torch.device(device)
        return cls(models.load(source, device=device, dtype=dtype), device, engine_options)

    # -- the application's side -------------------------------------------------------------

    def launch_response_tokens(self, input_tokens, config: GenerationConfig | None = None) -> int:
        """Register a request and return its handle at once; never blocks on generation.

        Raises TypeError/ValueError for a bad prompt or config, EngineBusy when the waiting
        queue is full, EngineClosed after shutdown.
        """
        config = self._check_config(config)
        prompt = self._check_prompt(input_tokens)
        with self._lock:
            if self._closed is not None:
                raise EngineClosed("the engine is shut down; no new requests") from self._closed
            self._release_dropped()  # abandoned handles go at the latest when the next request comes
            bound = self.options.max_waiting
            if bound is not None and self._backlog() >= bound:
                raise EngineBusy(f"{bound} requests are already waiting (max_waiting={bound}); retry later")
            number = next(self._handles)
            ctx = ResponseContext(number, prompt, config, number, self.max_context, self.eos_token_ids, self.device)
            self._contexts[number] = ctx
            self.scheduler.add(ctx)
            self._wakeup.notify()
        self._ensure_loop()
        handle = Handle(number)
        handle.dropped, handle.context = self._dropped, ctx
        return handle

    def fetch_response_tokens(self, handle: int, timeout: float | None = None) -> int:
        """Block until ``handle``'s next token and return it; -1 once the stream has ended,
        which releases the handle. Raises KeyError for an unknown or released handle,
        TimeoutError when ``timeout`` seconds pass first, GenerationFailed or EngineClosed
        (with the cause) when the request failed."""
        ctx = self._context(handle)
        try:
            item = ctx.get(timeout)
        except queue.Empty:
            raise TimeoutError(f"no token for handle {handle} within {timeout} s") from None
        return self._take(handle, ctx, item)

    async def fetch_async(self, handle: int, timeout: float | None = None) -> int:
        """fetch_response_tokens for asyncio: awaits without blocking the event loop or a thread.
        The loop thread wakes the awaiting task through call_soon_threadsafe; nothing polls."""
        ctx = self._context(handle)
        loop = asyncio.get_running_loop()
        while True:
            try:
                return self._take(handle, ctx, ctx.queue.get_nowait())
            except queue.Empty:
                pass
            ready = loop.create_future()
            ctx.waker = functools.partial(loop.call_soon_threadsafe, _resolve, ready)
            if not ctx.queue.empty():  # a token arrived before the waker was in place
                ctx.waker = None
                continue
            try:
                await asyncio.wait_for(ready, timeout)
            except asyncio.TimeoutError:
                ctx.waker = None
                raise TimeoutError(f"no token for handle {handle} within {timeout} s") from None

    def _context(self, handle: int) -> ResponseContext:
        ctx = self._contexts.get(handle)  # a single dict read is atomic; no lock needed
        if ctx is None:
            raise KeyError(f"unknown handle {handle!r}: never launched, or its stream already ended")
        return ctx

    def _take(self, handle: int, ctx: ResponseContext, item) -> int:
        if item == END or isinstance(item, Failure):
            with self._lock:
                self._contexts.pop(handle, None)
            if isinstance(item, Failure):
                raise item.error
            return END
        if ctx.queue.qsize() == self.options.max_unfetched_tokens - 1:
            with self._lock:  # the consumer caught up: a paused request may run again
                self._wakeup.notify()
        return item

    def stream_response_tokens(self, handle: int, timeout: float | None = None) -> Iterator[int]:
        """Iterate over ``handle``'s tokens until the end of its stream (not yielding -1)."""
        while (token := self.fetch_response_tokens(handle, timeout)) != END:
            yield token

    def abort_response(self, handle: int) -> None:
        """Stop a request at the next step boundary: its blocks are freed, unfetched tokens are
        discarded, and the next fetch returns -1. Raises KeyError for an unknown handle."""
        with self._lock:
            ctx = self._context(handle)
            # Safe while a forward runs: freed blocks are handed out again only by the next schedule.
            self.scheduler.remove(ctx)
            ctx.discard_unfetched()
            ctx.finish("abort")

    def shutdown(self) -> None:
        """Stop the loop (after the step in flight) and fail every unfinished request with
        EngineClosed, waking its blocked fetchers. Idempotent; later launches raise."""
        self._close(EngineClosed("the engine was shut down"))
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def stats(self) -> dict:
        with self._lock:
            s = self.scheduler
            return {
                "running": len(s.running),
                "waiting": len(s.waiting),
                "free_kv_blocks": self.allocator.num_free,
                "total_kv_blocks": self.allocator.num_blocks,
                "block_size": self.options.block_size,
                "open_handles": len(self._contexts),
                "preemptions": s.num_preemptions,
                "prompt_tokens": s.prompt_tokens,
                "cached_prompt_tokens": s.cached_tokens,
                "prefix_cache_hit_rate": s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
                **self._counters,
            }

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # -- the loop thread -------------------------------------------------------------------------

    def _ensure_loop(self) -> None:
        if self._thread is None:  # double-checked: the common path takes no lock
            with self._lock:
                if self._thread is None and self._closed is None:
                    self._thread = threading.Thread(target=self._loop, name="loom-engine-loop", daemon=True)
                    self._thread.start()

    def _loop(self) -> None:
        try:
            with torch.inference_mode():
                while True:
                    with self._lock:
                        while self._closed is None and not self.scheduler.has_work():
                            self._wakeup.wait()
                        if self._closed is not None:
                            return
                        self._release_dropped()
                        plan = self.scheduler.schedule()
                        if not plan:  # work exists but none fits yet; wait for a change
                            self._wakeup.wait(0.01)
                            continue
                    self._step(plan)
        except BaseException as error:  # the loop cannot go on: nobody may wait forever
            self._close(EngineClosed(f"the engine loop died: {error!r}"), cause=error)

    def _step(self, plan) -> None:
        sampling = batch.sampling_contexts(plan)
        try:
            step = batch.build(plan, self.options.block_size, self.device)
            logits = self.model(step, self.kv_cache)
            tokens = sampler.sample(logits, sampling, self._generator)
            produced = time.perf_counter()  # hand-off latency counts from here, bookkeeping included
        except Exception as error:
            with self._lock:
                self._counters["step_failures"] += 1
                for ctx, _ in plan.work:
                    if not ctx.finished:
                        self.scheduler.remove(ctx)
                        failure = GenerationFailed(f"request {ctx.handle} failed in a step: {error!r}")
                        failure.__cause__ = error
                        ctx.fail(failure)
            return
        if self.device.type == "cpu":  # its idle worker would spin on the core a consumer needs next
            openmp.release_thread_pool()
        with self._lock:
            self._counters["steps"] += 1
            for ctx, n in plan.work:
                if not ctx.finished:  # aborted during the forward: its blocks are gone
                    ctx.num_computed += n
                    ctx.hashed = self.allocator.register_full_blocks(
                        ctx.tokens, ctx.block_table, ctx.num_computed, *ctx.hashed)
            waiting = [ctx for ctx in sampling if ctx.consumer_waiting and not ctx.finished]
            for ctx, token in zip(sampling, tokens):
                if not ctx.finished:
                    self._counters["tokens_generated"] += 1
                    if ctx.append(token, produced):
                        self._counters["requests_finished"] += 1
                        self.scheduler.remove(ctx)
                    elif not self.scheduler.runnable(ctx):
                        self.scheduler.preempt(ctx)  # holds no blocks while its consumer catches up
        if self.device.type == "cpu":
            self._let_consumers_take(waiting, produced + CONSUMER_GRACE_S)

    @staticmethod
    def _let_consumers_take(waiting: list[ResponseContext], deadline: float) -> None:
        """Hold the next forward until the consumers that were blocked in fetch have their tokens
        (or the deadline passes). On the CPU the forward occupies every core: a consumer woken
        during it waits for a core and then for the GIL, which the loop thread keeps between
        operators, and the tail of the hand-off grows to milliseconds. Their work is done on
        these cores either way; doing it first costs the forward little."""
        while any(not ctx.queue.empty() for ctx in waiting) and time.perf_counter() < deadline:
            # Sleeping releases the GIL, which each woken consumer needs in turn. Polling every 50 us
            # instead made them wait for it more often (p99 at 16 consumers 0.97-1.20 ms, not 0.82-0.91).
            time.sleep(200e-6)

    def _backlog(self) -> int:
        """Waiting requests beyond the batch's free slots: those the next step cannot admit."""
        free_slots = max(0, self.options.max_batch_size - len(self.scheduler.running))
        return max(0, len(self.scheduler.waiting) - free_slots)

    def _release_dropped(self) -> None:
        while self._dropped:
            ctx = self._contexts.pop(self._dropped.popleft(), None)
            if ctx is not None:
                self.scheduler.remove(ctx)
                if not ctx.finished:
                    ctx.finish("abort")
                ctx.discard_unfetched()

    def _close(self, error: BaseException, cause: BaseException | None = None) -> None:
        if cause is not None:
            error.__cause__ = cause
        with self._lock:
            if self._closed is not None:
                return
            self._closed = error
            for ctx in self._contexts.values():
                if not ctx.finished:
                    self.scheduler.remove(ctx)
                    ctx.fail(error)
            self._wakeup.notify_all()

    # -- validation ---------------------------------------------------------------------------

    @staticmethod
    def _check_config(config) -> GenerationConfig:
        if config is None:
            return GenerationConfig()
        if isinstance(config, dict):
            return GenerationConfig(**config)
        if not isinstance(config, GenerationConfig):
            raise TypeError(f"config must be a GenerationConfig, a dict or None, got {type(config).__name__}")
        return config

    def _check_prompt(self, tokens) -> list[int]:
        if isinstance(tokens, (torch.Tensor, np.ndarray)):
            if tokens.ndim != 1:
                raise ValueError(f"input_tokens must be 1-D, got shape {tuple(tokens.shape)}")
            if tokens.dtype.is_floating_point if isinstance(tokens, torch.Tensor) else tokens.dtype.kind not in "iu":
                raise TypeError(f"input_tokens must hold integers, got dtype {tokens.dtype}")
            tokens = tokens.tolist()
        if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__iter__"):
            raise TypeError(f"input_tokens must be a sequence of token ids, got {type(tokens).__name__}"
                            + (" (use launch_response for text)" if isinstance(tokens, str) else ""))
        tokens = list(tokens)
        if not tokens:
            raise ValueError("input_tokens is empty: a prompt needs at least one token")
        vocab = self.vocab_size
        for i, t in enumerate(tokens):
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise TypeError(f"input_tokens[{i}] is {t!r} ({type(t).__name__}), not an int token id")
            if not 0 <= t < vocab:
                raise ValueError(f"input_tokens[{i}] = {t} is outside the vocabulary [0, {vocab})")
        if len(tokens) >= self.max_context:
            raise ValueError(f"the prompt has {len(tokens)} tokens; the context holds {self.max_context} "
                             f"(model limit {self.max_position}, KV pool {self.allocator.num_blocks} "
                             f"blocks of {self.options.block_size}), leaving no room to generate")
        return [int(t) for t in tokens]

    def _blocks_in_budget(self, block_bytes: int) -> int:
        budget = self.options.kv_cache_bytes
        if budget is None:
            budget = int(torch.cuda.mem_get_info(self.device)[0] * 0.6) if self.device.type == "cuda" else 2 << 30
        # More blocks than every running request at full context could use would be idle memory.
        useful = self.options.max_batch_size * -(-self.model.max_position // self.options.block_size)
        blocks = min(budget // block_bytes, useful)
        if blocks < 1:
            raise ValueError(f"kv_cache_bytes={budget} cannot hold one KV block of {block_bytes} bytes")
        return blocks
