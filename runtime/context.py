"""One request's state: its tokens, how far they are computed, and the queue its consumer blocks on.
Its KV blocks are the KV manager's (runtime/kv_manager.py)."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from enum import Enum

import torch

from .config import GenerationConfig

END = -1  # what fetch returns once a stream has ended


class Handle(int):
    """A request's id, equal to (and hashing as) that int. When the application drops its last
    reference, the request is released: aborted if still running, its tokens discarded, and any
    thread blocked fetching it by its int id woken with HandleReleased. The release is queued,
    not done here: __del__ may run in any thread, even one holding the engine's lock."""

    def __del__(self):
        dropped = getattr(self, "dropped", None)
        if dropped is not None:
            dropped.append(int(self))  # deque.append is atomic

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose K/V came from the prefix cache (at the request's last admission)."""
        return self.context.num_cached

    @property
    def token_times(self) -> list[float]:
        """time.perf_counter() at which each token was sampled (its step's sampler returned)."""
        return self.context.token_times

    @property
    def launch_time(self) -> float:
        return self.context.launch_time

    @property
    def finish_reason(self) -> str | None:
        """"stop", "length", "abort", "error", or None while the request runs."""
        return self.context.finish_reason

    @property
    def num_generated(self) -> int:
        return self.context.num_generated

    @property
    def proposed_tokens(self) -> int:
        """Tokens proposed for this request by speculative decoding (GenerationConfig.speculative_tokens)."""
        return self.context.num_proposed

    @property
    def accepted_tokens(self) -> int:
        """Of the proposed tokens, those delivered: each a token the request gained without a step of its own."""
        return self.context.num_accepted

    @property
    def logprobs(self) -> list:
        """With GenerationConfig(logprobs=k): a TokenLogprob for each generated token, in order
        (the i-th is in place once the i-th token has been fetched)."""
        return self.context.logprobs


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class Failure:
    """Put in a queue instead of a token: the fetch that takes it raises ``error``."""

    error: BaseException


class ResponseContext:
    """A request from launch until its consumer has fetched the end of the stream.

    ``tokens`` holds the prompt followed by every generated token. ``num_computed`` counts the
    tokens whose K/V are in the cache; a step processes ``tokens[num_computed:]`` (or a chunk of
    it) and samples when it reaches the end. That one rule covers prefill, chunked prefill,
    decode and recompute after preemption. The loop thread changes it under the engine's lock;
    the consumer only takes from its queue and counts what it took.
    """

    def __init__(self, handle: int, prompt: list[int], config: GenerationConfig, max_context: int,
                 eos_token_ids: frozenset[int], device: torch.device, constraint=None, leader=None):
        self.handle = handle
        self.config = config
        self.tokens = list(prompt)
        self.num_prompt = len(prompt)
        self.num_computed = 0
        self.num_cached = 0        # prompt tokens served from the prefix cache
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        # SimpleQueue is queue's C implementation: its wake-up path is cheaper than Queue's Python
        # conditions (docs/benchmarks-history.md, "What changed performance, measured").
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.num_fetched = 0        # tokens the consumer has taken
        self.waker = None           # set by an asyncio consumer waiting on this queue (Engine.fetch_async)
        self.consumer_blocked = False
        self.max_length = min(max_context, self.num_prompt + config.max_new_tokens)
        stops = set(config.stop_token_ids)
        if not config.ignore_eos:
            stops |= eos_token_ids
        self.stop_ids = frozenset(stops)
        self.generator = None
        if config.sampled and config.seed is not None:
            self.generator = torch.Generator(device).manual_seed(config.seed)
        self.constraint = constraint  # structured output's grammar state (constraints.Constraint)
        self.leader = leader  # another choice of the same prompt, admitted first (Engine.launch_choices)
        self.logprobs: list = []  # a sampler.TokenLogprob per generated token, with config.logprobs
        self.launch_time = time.perf_counter()
        self.token_times: list[float] = []  # when each token was sampled (TTFT, TPOT, hand-off)
        self.lookup = None    # its n-gram index, made when it first speculates (speculation.PromptLookup)
        self.num_proposed = 0  # speculative decoding: tokens proposed ...
        self.num_accepted = 0  # ... and, of them, delivered

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def num_unfetched(self) -> int:
        return self.num_generated - self.num_fetched

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def consumer_waiting(self) -> bool:
        """Whether a consumer (a thread or an asyncio task) is waiting for this stream's next item."""
        return self.consumer_blocked or self.waker is not None

    # -- the loop thread's side (under the engine's lock) -----------------------------------------

    def record(self, token: int, sampled_at: float, logprob=None) -> bool:
        """Add a sampled token; say whether it ends the request (a stop token, the end of its
        constraint, or its length)."""
        self.token_times.append(sampled_at)
        self.tokens.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        if token in self.stop_ids or (self.constraint is not None and self.constraint.ended_at(self.num_generated)):
            self.finish("stop")
        elif len(self.tokens) >= self.max_length:
            self.finish("length")
        return self.finished

    def finish(self, reason: str) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason

    def deliver(self, tokens: list[int]) -> None:
        """Hand a step's recorded tokens (several where proposals were accepted) to the consumer,
        and the end of the stream after the last."""
        for token in tokens:
            self.put(token)
        if self.finished:
            self.put(END)

    def fail(self, error: BaseException) -> None:
        self.finish("error")
        self.put(Failure(error))

    def put(self, item) -> None:
        self.queue.put(item)
        waker, self.waker = self.waker, None
        if waker is not None:
            waker()

    def discard_unfetched(self) -> None:
        while True:
            try:
                self.queue.get_nowait()
            except queue.Empty:
                return

    # -- the consumer's side -------------------------------------------------------------------

    def get(self, timeout: float | None):
        """The consumer's blocking take; raises queue.Empty after ``timeout`` seconds."""
        self.consumer_blocked = True
        try:
            return self.queue.get(timeout=timeout)
        finally:
            self.consumer_blocked = False
