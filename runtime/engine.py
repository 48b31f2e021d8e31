"""Engine: launch / fetch / abort / shutdown / stats. Owns the lock, the contexts and the one
main-loop thread that runs every live request in a single batched forward per step."""

from __future__ import annotations

import asyncio
import atexit
import copy
import functools
import os
import queue
import threading
import time
import warnings
import weakref
from collections import OrderedDict, deque
from collections.abc import Iterator

import torch

import models
from models.step import KVCache, StepInput

from . import loop, openmp, sampler
from .cpu_threads import CpuThreads
from .block_allocator import BlockAllocator
from .pool_commit import PoolCommitter
from .config import EngineOptions, GenerationConfig, check_int, check_config, check_prompt, check_token_ids
from .constraints import Grammars
from .context import END, Failure, Handle, ResponseContext
from .errors import ContextLimitWarning, EngineBusy, EngineClosed, GenerationFailed, HandleReleased
from .scheduler import Scheduler, StepPlan
from .text import TextAPI

_live_engines: weakref.WeakSet = weakref.WeakSet()
atexit.register(lambda: [engine.shutdown() for engine in list(_live_engines)])

ENDED_REMEMBERED = 4096  # ended handles whose reason a later fetch can still name


def _resolve(future: asyncio.Future) -> None:
    if not future.done():  # a timed-out wait cancelled it
        future.set_result(None)


class Engine(TextAPI):
    """Continuous batching for many threads over one model.

    Every public method is thread-safe. The loop thread starts on the first launch and holds
    the lock only to schedule and to deliver, never across the forward. Between steps it holds
    the engine only weakly: an engine the application drops (without shutdown) is collected,
    and its loop thread ends.
    """

    def __init__(self, checkpoint: models.Checkpoint, device: torch.device, options: EngineOptions):
        self.model = checkpoint.model
        self.tokenizer = checkpoint.tokenizer
        self.eos_token_ids = checkpoint.eos_token_ids
        self.name = checkpoint.name
        self.device = device
        self.options = options
        dtype = getattr(torch, options.kv_dtype) if options.kv_dtype else next(self.model.parameters()).dtype
        geometry = (self.model.num_layers, options.block_size, self.model.num_kv_heads, self.model.head_dim)
        num_blocks = options.num_kv_blocks or self._blocks_in_budget(KVCache.bytes_per_block(*geometry, dtype))
        self.kv_cache = KVCache(self.model.num_layers, num_blocks, *geometry[1:], dtype, device)
        self.allocator = BlockAllocator(num_blocks, options.block_size, options.enable_prefix_caching)
        # Its thread starts with the loop's first plan: an engine never used costs no thread and no memory.
        self._pool_committer = PoolCommitter(self.kv_cache) if device.type == "cpu" else None
        self.scheduler = Scheduler(options, self.allocator, getattr(self.model, "recompute_past", None))
        self.vocab_size, self.max_position = self.model.vocab_size, self.model.max_position
        self.max_context = min(self.model.max_position, num_blocks * options.block_size)
        # Reentrant: the weakref callback that wakes the loop may run wherever the last reference
        # to the engine goes, even in the loop thread while it holds the lock.
        self._lock = threading.RLock()
        self._wakeup = threading.Condition(self._lock)
        self._handoff = loop.Handoff()
        self._contexts: dict[int, ResponseContext] = {}
        self._ended: OrderedDict[int, str] = OrderedDict()  # recent handles gone, and why
        self._dropped: deque[int] = deque()  # handles the application let go of (see Handle)
        self._launched = 0  # handles are 0, 1, 2, ... in launch order
        self._pid = os.getpid()
        self._thread: threading.Thread | None = None
        self._closed: BaseException | None = None
        self._generator = torch.Generator(device).manual_seed(options.seed)
        self._counters = {"steps": 0, "tokens_generated": 0, "requests_finished": 0, "step_failures": 0}
        layers = getattr(self.model, "decoder_layers", None)
        splits = functools.partial(layers.splits, kv_cache=self.kv_cache) if layers is not None else None
        self._cpu_threads = CpuThreads(options.cpu_threads, splits) if device.type == "cpu" else None
        self._grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
        _live_engines.add(self)
        if device.type == "cpu":
            # Loading ran on this thread and left it a pool of OpenMP workers; beside the loop
            # thread's own, libgomp would stop letting either spin (see openmp.py).
            openmp.release_thread_pool()

    @classmethod
    def from_pretrained(cls, source=None, *, device="cpu", dtype=None, weights="stored", tokenizer=None,
                        **options) -> "Engine":
        """Load ``source`` (None: the embedded SmolLM2; a Hugging Face directory; a .gguf file;
        an in-memory transformers model) and build an engine. ``weights``: "stored" (the default:
        as the checkpoint holds them, a GGUF file's quantized blocks included, on the CPU; see
        models/kernels/block_formats.py), "float32" (everything widened to ``dtype``), or on the CPU
        linear layers with smaller weights: "int4" / "int8" (4- or 8-bit blocks as llama.cpp's
        Q4_1 / Q8_0, float32 activations; models/kernels/block_linear.py), "float16", or
        "int8-dynamic" (FBGEMM's int8 product, activations quantized too; models/kernels/quantized.py).
        ``tokenizer``: a transformers tokenizer to use instead of the checkpoint's (an in-memory
        model has none). ``options`` are EngineOptions. Raises ValueError/TypeError for a bad
        option, source or choice before anything loads."""
        engine_options = EngineOptions.from_kwargs(options)  # bad options fail before a slow load
        device = torch.device(device)
        checkpoint = models.load(source, device=device, dtype=dtype, weights=weights)
        if tokenizer is not None:
            checkpoint.tokenizer = tokenizer
        return cls(checkpoint, device, engine_options)

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
        config = check_config(config)
        check_token_ids(config, self.vocab_size)
        prompt = check_prompt(input_tokens, self.vocab_size)
        self._check_room(len(prompt), config.max_new_tokens)
        constraint = self._grammars.compile(config)  # in the caller's thread: the loop never waits for it
        with self._lock:
            if self._closed is not None:
                raise EngineClosed(f"the engine is closed; no new requests ({self._closed})") from self._closed
            self._release_dropped()  # abandoned handles go at the latest when the next request comes
            bound = self.options.max_waiting
            if bound is not None and self._backlog() + n > bound:
                raise EngineBusy(f"{bound} requests are already waiting (max_waiting={bound}); retry later")
            contexts = []
            for choice in range(n):
                number, self._launched = self._launched, self._launched + 1
                ctx = ResponseContext(number, prompt, self._choice_config(config, choice), self.max_context,
                                      self.eos_token_ids, self.device,
                                      constraint=constraint.copy() if constraint and choice else constraint,
                                      leader=contexts[0] if choice else None)
                self._contexts[number] = ctx
                self.scheduler.add(ctx)
                contexts.append(ctx)
            self._wakeup.notify()
        self._ensure_loop()
        handles = []
        for ctx in contexts:
            handle = Handle(ctx.handle)
            handle.dropped, handle.context = self._dropped, ctx
            handles.append(handle)
        return handles

    @staticmethod
    def _choice_config(config: GenerationConfig, choice: int) -> GenerationConfig:
        if choice == 0 or config.seed is None:
            return config
        config = copy.copy(config)  # already validated; a seed + choice stays in the generator's range
        config.seed = (config.seed + choice) % 2**64
        return config

    def fetch_response_tokens(self, handle: int, timeout: float | None = None) -> int:
        """Block until ``handle``'s next token and return it; -1 once the stream has ended (also
        after an abort), which releases the handle. Raises KeyError for a handle never launched
        or already released (HandleReleased says which), TimeoutError when ``timeout`` seconds
        pass first, GenerationFailed or EngineClosed (with the cause) when the request failed."""
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
        event_loop = asyncio.get_running_loop()
        while True:
            try:
                return self._take(handle, ctx, ctx.queue.get_nowait())
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
            ctx = self._contexts.get(handle)
            if ctx is None:
                if handle in self._ended or self._was_launched(handle):
                    return
                raise KeyError(f"unknown handle {handle!r}: this engine never launched it")
            # Safe while a forward runs: freed blocks are handed out again only by the next schedule.
            self.scheduler.remove(ctx)
            ctx.discard_unfetched()
            if not ctx.finished:
                ctx.finish("abort")
            ctx.put(END)

    def shutdown(self) -> None:
        """Stop the loop (after the step in flight) and fail every unfinished request with
        EngineClosed, waking its blocked fetchers. Idempotent; later launches raise."""
        self._close(EngineClosed("the engine was shut down"))
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    @property
    def closed(self) -> bool:
        """Whether the engine has shut down (or its loop died): launches raise EngineClosed."""
        return self._closed is not None

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
                "cpu_threads": self._cpu_threads.count if self._cpu_threads else None,
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
                    wakeup = self._wakeup
                    owner = weakref.ref(self, lambda _: loop.notify(wakeup))
                    self._thread = threading.Thread(target=loop.run, args=(owner, wakeup),
                                                    name="loom-engine-loop", daemon=True)
                    self._thread.start()

    def _plan(self) -> StepPlan | None:
        """Under the lock: the next step's plan; None when there is no runnable work at all."""
        self._release_dropped()
        plan = self.scheduler.schedule() if self.scheduler.has_work() else None
        if self._pool_committer is not None:
            self._pool_committer.keep_ahead_of(self.allocator.high_water)
        return plan

    def _step(self, plan: StepPlan) -> None:
        """schedule (done) -> build -> forward (beside the step's structured-output masks) ->
        sample -> apply -> deliver."""
        sampling = plan.sampling()
        threads = self._cpu_threads
        masks = self._grammars.start_masks([ctx.constraint for ctx in sampling])
        try:
            step = StepInput.flatten(plan.sequences(), self.options.block_size, self.device)
            if threads is not None:
                threads.before_forward(step)
            logits = self.model(step, self.kv_cache)
            bitmask = masks.result() if masks is not None else None
        except Exception as error:
            self._fail_step([e.ctx for e in plan.entries], error)
            return
        tokens, logprobs = self._sample(logits, sampling, bitmask)
        if threads is not None:
            threads.after_sampling()  # its team's workers are asleep again: the load sampled sees others only
        produced = time.perf_counter()  # hand-off latency counts from here, bookkeeping included
        if self.device.type == "cpu" and not openmp.SHORT_SPIN:  # its idle worker would spin on the core a
            openmp.release_thread_pool()                           # consumer needs next (openmp.py)
        with self._lock:
            self._counters["steps"] += 1
            if self.device.type == "cpu":
                self._handoff.expect([ctx for ctx in sampling if ctx.consumer_waiting and not ctx.finished])
            delivered = self.scheduler.postprocess(plan, sampling, tokens, produced, logprobs)
            for ctx, token in delivered:
                ctx.deliver(token)
            self._counters["tokens_generated"] += len(delivered)
            self._counters["requests_finished"] += sum(ctx.finished for ctx, _ in delivered)
        if self.device.type == "cpu":
            self._handoff.wait(produced + loop.CONSUMER_GRACE_S)

    def _sample(self, logits: torch.Tensor, sampling: list[ResponseContext], bitmask):
        """The step's tokens (and logprobs, see sampler.sample), each constrained request's grammar
        advanced by its token. If sampling the batch raises, each row is sampled alone; only the
        requests whose own sampling or grammar fails are failed (their token is then END)."""
        try:
            tokens, logprobs = sampler.sample(logits, sampling, self._generator, bitmask)
        except Exception:
            rows = sampler.sample_each(logits, sampling, self._generator, bitmask)
            tokens, logprobs = [token for token, _ in rows], [logprob for _, logprob in rows]
        for i, (ctx, token) in enumerate(zip(sampling, tokens)):
            if ctx.constraint is not None and not isinstance(token, BaseException) and not ctx.finished:
                try:
                    ctx.constraint.accept(token)
                except ValueError as error:
                    tokens[i] = error
        for ctx, error in zip(sampling, tokens):
            if isinstance(error, BaseException):
                self._fail_step([ctx], error)
        return [END if isinstance(t, BaseException) else t for t in tokens], logprobs

    def _fail_step(self, contexts: list[ResponseContext], error: BaseException) -> None:
        with self._lock:
            self._counters["step_failures"] += 1
            for ctx in contexts:
                if not ctx.finished:
                    self.scheduler.remove(ctx)
                    failure = GenerationFailed(f"request {ctx.handle} failed in a step: {error!r}")
                    failure.__cause__ = error
                    ctx.fail(failure)

    # -- bookkeeping under the lock ----------------------------------------------------------

    def _context(self, handle: int) -> ResponseContext:
        ctx = self._contexts.get(handle)  # a single dict read is atomic; no lock needed
        if ctx is None:
            reason = self._ended.get(handle)
            if reason is not None:
                raise HandleReleased(f"handle {handle} was released: {reason}")
            if self._was_launched(handle):
                raise HandleReleased(f"handle {handle} was released long ago (its stream ended, or its "
                                     "Handle was dropped)")
            raise KeyError(f"unknown handle {handle!r}: this engine never launched it")
        return ctx

    def _take(self, handle: int, ctx: ResponseContext, item) -> int:
        self._handoff.took(ctx)
        if item == END or isinstance(item, Failure):
            self._forget(handle, "its stream ended and -1 was fetched" if item == END else "its request failed")
            if isinstance(item, Failure):
                raise item.error
            return END
        ctx.num_fetched += 1
        if ctx.num_unfetched == self.options.max_unfetched_tokens - 1:
            with self._lock:  # the consumer caught up: a paused request may run again
                self._wakeup.notify()
        return item

    def _forget(self, handle: int, reason: str) -> None:
        with self._lock:
            if self._contexts.pop(handle, None) is not None:
                # The number, not the Handle: a Handle kept here would keep its whole context.
                self._ended[int(handle)] = reason
                if len(self._ended) > ENDED_REMEMBERED:
                    self._ended.popitem(last=False)

    def _was_launched(self, handle) -> bool:
        return isinstance(handle, int) and 0 <= handle < self._launched

    def _backlog(self) -> int:
        """Waiting requests beyond the batch's free slots: those the next step cannot admit."""
        free_slots = max(0, self.options.max_batch_size - len(self.scheduler.running))
        return max(0, len(self.scheduler.waiting) - free_slots)

    def _release_dropped(self) -> None:
        """Release the requests whose Handle the application dropped; a thread blocked fetching
        one by its int id wakes with HandleReleased."""
        while self._dropped:
            handle = self._dropped.popleft()
            ctx = self._contexts.get(handle)
            if ctx is None:
                continue
            self.scheduler.remove(ctx)
            if not ctx.finished:
                ctx.finish("abort")
            ctx.discard_unfetched()
            reason = "its Handle object was dropped (keep the Handle, not int(handle), while you fetch)"
            ctx.put(Failure(HandleReleased(f"handle {handle} was released: {reason}")))
            self._forget(handle, reason)

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
        self._grammars.close()
        if self._pool_committer is not None:
            self._pool_committer.close()

    def _after_fork_in_child(self) -> None:
        """The loop thread did not survive os.fork(), and the lock may have been held by a thread
        that no longer exists: give the child fresh ones and a closed engine that says why."""
        self._lock = threading.RLock()
        self._wakeup = threading.Condition(self._lock)
        self._handoff = loop.Handoff()
        self._thread = None
        self._pool_committer = None  # its thread did not survive either, and its lock may be held
        self._close(EngineClosed(f"this engine was created in process {self._pid} and cannot be used in the "
                                 f"forked child {os.getpid()} (its loop thread does not survive os.fork()); "
                                 "create a new Engine in the child"))

    # -- validation ---------------------------------------------------------------------------

    def _check_room(self, prompt_length: int, max_new_tokens: int) -> None:
        if prompt_length >= self.max_context:
            raise ValueError(f"the prompt has {prompt_length} tokens; the context holds {self.max_context} "
                             f"(model limit {self.max_position}, KV pool {self.allocator.num_blocks} "
                             f"blocks of {self.options.block_size}), leaving no room to generate")
        room = self.max_context - prompt_length
        if max_new_tokens > room:
            warnings.warn(f"max_new_tokens={max_new_tokens}, but the context holds {self.max_context} tokens and "
                          f"the prompt has {prompt_length}: at most {room} tokens will be generated "
                          "(finish_reason 'length')", ContextLimitWarning, stacklevel=4)

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


def _after_fork_in_child() -> None:
    for engine in list(_live_engines):
        engine._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
