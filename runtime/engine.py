"""Engine, the facade: launch / fetch / abort / shutdown / stats for any number of threads. It
builds the parts and hands each call to the one that owns it: the handle table (handles.py), the
scheduler and its KV manager (scheduler.py, kv_manager.py), the step (worker.py), run by one loop
thread (loop.py) started on the first launch, with the host's work around it (cpu_host.py)."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import functools
import os
import queue
import threading
import weakref
from collections.abc import Iterator

import torch

import models

from . import loop
from .config import EngineOptions, GenerationConfig, check_int
from .constraints import Grammars
from .context import END, Handle, ResponseContext
from .draft import Drafter, check_draft
from .cpu_host import host_for
from .errors import EngineClosed
from .handles import Handles
from .kv_manager import KVManager
from .request_checks import as_config, check_backlog, check_prompt, check_room, check_token_ids
from .scheduler import Scheduler
from .text import TextAPI
from .worker import Worker

_live_engines: weakref.WeakSet = weakref.WeakSet()
atexit.register(lambda: [engine.shutdown() for engine in list(_live_engines)])


def _resolve(future: asyncio.Future) -> None:
    if not future.done():  # a timed-out wait cancelled it
        future.set_result(None)


class Engine(TextAPI):
    """Continuous batching for many threads over one model.

    Every public method is thread-safe. The loop thread starts on the first launch and holds
    the lock only to schedule and to deliver, never across the forward. Between steps it holds
    the engine's worker only weakly: an engine the application drops (without shutdown) is
    collected, and its loop thread ends.
    """

    def __init__(self, checkpoint: models.Checkpoint, device: torch.device, options: EngineOptions,
                 draft: models.Checkpoint | None = None):
        """``draft``: a model that proposes tokens for speculating requests (runtime/draft.py), loaded
        on ``device``; ValueError where its vocabulary or tokenizer differs from ``checkpoint``'s."""
        model = checkpoint.model
        if draft is not None:
            check_draft(checkpoint, draft)
        self.tokenizer = checkpoint.tokenizer
        self.eos_token_ids = checkpoint.eos_token_ids
        self.name = checkpoint.name
        self.device = device
        self.options = options
        self.kv_manager = KVManager.for_model(model, options, device)
        if self.kv_manager.keeps_state and (draft is not None or options.speculative_tokens):
            raise ValueError(f"{checkpoint.name} carries a state a sequence through its recurrent layers, which cannot "
                             "take back rejected proposals: it runs without speculative decoding (no draft, "
                             "speculative_tokens=0)")
        if draft is not None and getattr(draft.model, "state_shapes", None):
            raise ValueError(f"the draft {draft.name} carries a state a sequence through its recurrent layers, which "
                             "cannot take back rejected proposals: draft with a model of attention layers")
        self.drafter = (Drafter.for_model(draft.model, options, device, self.kv_manager.num_blocks)
                        if draft is not None else None)
        self.scheduler = Scheduler(options, self.kv_manager, self.drafter)
        self.vocab_size, self.max_position = model.vocab_size, model.max_position
        self.max_context = min(model.max_position, self.kv_manager.num_blocks * options.block_size)
        splits_rows = getattr(model, "splits_rows", None)  # models/step.py
        splits = functools.partial(splits_rows, kv_cache=self.kv_cache) if splits_rows is not None else None
        self._host = host_for(device, options.cpu_threads, splits)
        # Reentrant: the weakref callback that wakes the loop may run wherever the last reference
        # to the worker goes, even in the loop thread while it holds the lock.
        self._lock = threading.RLock()
        self._wakeup = threading.Condition(self._lock)
        self._handles = Handles(self._lock, self._wakeup, options.max_unfetched_tokens, self._host.took)
        self._grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._worker = Worker(model, self.kv_manager, self.scheduler, self._handles, self._host, self._grammars,
                              self._lock, self._wakeup, device, options.seed, self.drafter)
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        _live_engines.add(self)

    @property
    def model(self):
        """The model the steps run (replaceable, say by a wrapper that times its forward)."""
        return self._worker.model

    @model.setter
    def model(self, model) -> None:
        self._worker.model = model

    @property
    def kv_cache(self):
        """The KV pool's tensors (models.step.KVCache)."""
        return self.kv_manager.cache

    @classmethod
    def from_pretrained(cls, source=None, *, device="cpu", dtype=None, weights=None, tokenizer=None, draft=None,
                        draft_weights=None, **options) -> "Engine":
        """Load ``source`` (None: the embedded SmolLM2; a Hugging Face directory; a .gguf file;
        an in-memory transformers model) and build an engine. ``weights``: None (the default: "stored",
        models.DEFAULT_WEIGHTS says why), "stored" (as the checkpoint
        holds them, a GGUF file's quantized blocks included, on the CPU; see
        models/kernels/block_formats.py), "float32" (everything widened to ``dtype``), or on the CPU
        linear layers with smaller weights: "int4" / "int8" (4- or 8-bit blocks as llama.cpp's
        Q4_1 / Q8_0, the input rounded to 8 bits; models/kernels/block_linear.py), "float16", or
        "int8-dynamic" (FBGEMM's int8 product, activations quantized too; models/kernels/quantized.py).
        ``tokenizer``: a transformers tokenizer to use instead of the checkpoint's (an in-memory
        model has none). ``options`` are EngineOptions.

        ``draft``: a smaller model of the same vocabulary and tokenizer that proposes the tokens
        speculating requests verify (``speculative_tokens``), in place of prompt lookup: a source as
        ``source`` is ("default": the embedded model) or a models.Checkpoint, loaded with
        ``draft_weights`` (as ``weights``) and ``dtype``; its paged KV cache is its own
        (``draft_num_kv_blocks``). The embedded model in "stored" weights (its Q4_1 blocks) can draft
        for itself in float32 (``weights="float32"``). Raises ValueError/TypeError for a bad option, source or choice before
        anything loads, ValueError for a draft whose vocabulary or tokenizer differs from the target's."""
        engine_options = EngineOptions.from_kwargs(options)  # bad options fail before a slow load
        device = torch.device(device)
        if draft_weights is not None and draft is None:
            raise ValueError("draft_weights needs a draft model (draft=...)")
        resolved = lambda asked: asked or models.DEFAULT_WEIGHTS  # (None: the default)
        if draft == "default" and source is None and resolved(weights) == resolved(draft_weights):
            raise ValueError("draft='default' in the target's own weights would propose just what the target computes, "
                             "at a second model's cost: give the target other weights (weights='float32', "
                             "draft_weights='stored') or another draft")
        checkpoint = models.load(source, device=device, dtype=dtype, weights=weights)
        if tokenizer is not None:
            checkpoint.tokenizer = tokenizer
        if draft is not None and not isinstance(draft, models.Checkpoint):
            draft = models.load(None if draft == "default" else draft, device=device, dtype=dtype,
                                weights=draft_weights)
        return cls(checkpoint, device, engine_options, draft)

    # -- the application's side -------------------------------------------------------------

    def launch_response_tokens(self, input_tokens, config: GenerationConfig | None = None) -> Handle:
        """Register a request and return its handle at once; never blocks on generation.

        Keep the returned Handle while you fetch: dropping it releases the request. Raises
        TypeError/ValueError for a bad prompt or config (an invalid json_schema, regex or grammar
        with the grammar engine's message), EngineBusy when the waiting queue is full,
        EngineClosed after shutdown. Warns (ContextLimitWarning) when the context ends before
        ``max_new_tokens`` could be generated.
        """
        return self._launch(input_tokens, config, 1)[0]

    def launch_choices(self, input_tokens, config: GenerationConfig | None = None, n: int = 2) -> list[Handle]:
        """Launch ``n`` completions of one prompt (OpenAI's ``n``) and return their handles. The
        first computes the prompt; the others then take its KV blocks from the prefix cache
        (with enable_prefix_caching) rather than computing them again. With a ``seed``, choice i
        samples with seed + i, so that the choices differ yet repeat. Raises as launch_response_tokens."""
        check_int("n", n, 1)
        return self._launch(input_tokens, config, n)

    def _launch(self, input_tokens, config, n: int) -> list[Handle]:
        config = as_config(config)
        check_token_ids(config, self.vocab_size)
        if config.speculative_tokens and self.kv_manager.keeps_state:
            raise ValueError(f"speculative_tokens={config.speculative_tokens}: {self.name} carries a state a sequence "
                             "through its recurrent layers, which cannot take back rejected proposals; leave it 0")
        prompt = check_prompt(input_tokens, self.vocab_size)
        check_room(len(prompt), config.max_new_tokens, max_context=self.max_context, max_position=self.max_position,
                   num_blocks=self.kv_manager.num_blocks, block_size=self.options.block_size)
        constraint = self._grammars.compile(config)  # in the caller's thread: the loop never waits for it
        with self._lock:
            closed = self._worker.closed
            if closed is not None:
                raise EngineClosed(f"the engine is closed; no new requests ({closed})") from closed
            # Abandoned handles go at the latest when the next request comes.
            self._handles.release_dropped(self.scheduler.remove)
            check_backlog(len(self.scheduler.waiting), len(self.scheduler.running), n, self.options)
            contexts = []
            for choice in range(n):
                ctx = ResponseContext(self._handles.next_number(), prompt, self._choice_config(config, choice),
                                      self.max_context, self.eos_token_ids, self.device,
                                      constraint=constraint.copy() if constraint and choice else constraint,
                                      leader=contexts[0] if choice else None)
                self._handles.add(ctx)
                self.scheduler.add(ctx)
                contexts.append(ctx)
            self._wakeup.notify()
        self._ensure_loop()
        return [self._handles.handle(ctx) for ctx in contexts]

    @staticmethod
    def _choice_config(config: GenerationConfig, choice: int) -> GenerationConfig:
        # A greedy config draws nothing, so its choices share it (a copy would only warn again
        # about a do_sample=False beside a sampling knob).
        if choice == 0 or config.seed is None or not config.sampled:
            return config
        return dataclasses.replace(config, seed=(config.seed + choice) % 2**64)  # wrapped into the seed's range

    def fetch_response_tokens(self, handle: int, timeout: float | None = None) -> int:
        """Block until ``handle``'s next token and return it; -1 once the stream has ended (also
        after an abort), which releases the handle. Raises KeyError for a handle never launched
        or already released (HandleReleased says which), TimeoutError when ``timeout`` seconds
        pass first, GenerationFailed or EngineClosed (with the cause) when the request failed."""
        ctx = self._handles.find(handle)
        try:
            item = ctx.get(timeout)
        except queue.Empty:
            raise TimeoutError(f"no token for handle {handle} within {timeout} s") from None
        return self._handles.take(handle, ctx, item)

    async def fetch_async(self, handle: int, timeout: float | None = None) -> int:
        """fetch_response_tokens for asyncio: awaits without blocking the event loop or a thread.
        The loop thread wakes the awaiting task through call_soon_threadsafe; nothing polls."""
        ctx = self._handles.find(handle)
        event_loop = asyncio.get_running_loop()
        while True:
            try:
                return self._handles.take(handle, ctx, ctx.queue.get_nowait())
            except queue.Empty:
                pass
            ready = event_loop.create_future()
            ctx.waker = functools.partial(event_loop.call_soon_threadsafe, _resolve, ready)
            if not ctx.queue.empty():  # a token arrived before the waker was in place
                ctx.waker = None
                continue
            try:
                await (ready if timeout is None else asyncio.wait_for(ready, timeout))
            except asyncio.TimeoutError:
                ctx.waker = None
                raise TimeoutError(f"no token for handle {handle} within {timeout} s") from None

    def stream_response_tokens(self, handle: int, timeout: float | None = None) -> Iterator[int]:
        """Iterate over ``handle``'s tokens until the end of its stream (not yielding -1)."""
        while (token := self.fetch_response_tokens(handle, timeout)) != END:
            yield token

    def abort_response(self, handle: int) -> None:
        """Stop a request at the next step boundary: its blocks are freed, unfetched tokens are
        discarded, and the next fetch returns -1. Idempotent, and a no-op once the stream's -1 was
        fetched or the handle released; KeyError only for a handle this engine never launched."""
        with self._lock:
            ctx = self._handles.open_context(handle)
            if ctx is None:
                return
            # Safe while a forward runs: freed blocks are handed out again only by the next schedule.
            self.scheduler.remove(ctx)
            ctx.discard_unfetched()
            if not ctx.finished:
                ctx.finish("abort")
            ctx.put(END)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No step starts inside this block (the one in flight finishes): requests launched in it
        wait, and are scheduled together as it ends, in launch order (or by priority), however
        their launching threads were timed. Fetching inside it waits for the block to end. Nests."""
        with self._lock:
            self._worker.pauses += 1
        try:
            yield
        finally:
            with self._lock:
                self._worker.pauses -= 1
                self._wakeup.notify()

    def shutdown(self) -> None:
        """Stop the loop (after the step in flight) and fail every unfinished request with
        EngineClosed, waking its blocked fetchers. Idempotent; later launches raise."""
        self._worker.close(EngineClosed("the engine was shut down"))
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    @property
    def closed(self) -> bool:
        """Whether the engine has shut down (or its loop died): launches raise EngineClosed."""
        return self._worker.closed is not None

    def stats(self) -> dict:
        with self._lock:
            s = self.scheduler
            return {
                "running": len(s.running),
                "waiting": len(s.waiting),
                "free_kv_blocks": self.kv_manager.num_free,
                "total_kv_blocks": self.kv_manager.num_blocks,
                "block_size": self.options.block_size,
                "open_handles": len(self._handles),
                "preemptions": s.num_preemptions,
                "prompt_tokens": s.prompt_tokens,
                "cached_prompt_tokens": s.cached_tokens,
                "prefix_cache_hit_rate": s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
                "speculative_proposed_tokens": s.proposed_tokens,
                "speculative_accepted_tokens": s.accepted_tokens,
                **self._draft_stats(),
                "cpu_threads": self._host.thread_count,
                **self._worker.counters,
            }

    def _draft_stats(self) -> dict:
        """The draft model's side (zeros without one): its batched forwards, their seconds in all,
        those that raised (the step went on without proposals), and its KV pool."""
        d = self.drafter
        if d is None:
            return {"draft_forwards": 0, "draft_seconds": 0.0, "draft_failures": 0, "free_draft_kv_blocks": 0,
                    "total_draft_kv_blocks": 0}
        return {"draft_forwards": d.forwards, "draft_seconds": d.seconds, "draft_failures": d.failures,
                "free_draft_kv_blocks": d.kv.num_free, "total_draft_kv_blocks": d.kv.num_blocks}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def _ensure_loop(self) -> None:
        if self._thread is None:  # double-checked: the common path takes no lock
            with self._lock:
                if self._thread is None and self._worker.closed is None:
                    self._thread = loop.start(self._worker, self._wakeup)

    def _after_fork_in_child(self) -> None:
        """The loop thread did not survive os.fork(), and the lock may have been held by a thread
        that no longer exists: give the child fresh ones and a closed engine that says why."""
        self._lock = self._handles.lock = self._worker.lock = threading.RLock()
        self._wakeup = self._handles.wakeup = self._worker.wakeup = threading.Condition(self._lock)
        self._host.after_fork_in_child()
        self.kv_manager.after_fork_in_child()
        if self.drafter is not None:
            self.drafter.kv.after_fork_in_child()
        self._thread = None
        self._worker.close(EngineClosed(f"this engine was created in process {self._pid} and cannot be used in the "
                                        f"forked child {os.getpid()} (its loop thread does not survive os.fork()); "
                                        "create a new Engine in the child"))


def _after_fork_in_child() -> None:
    for engine in list(_live_engines):
        engine._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
