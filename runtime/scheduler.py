"""Which requests run in the next step, and how many tokens each: admission, the token budget,
chunked prefill, preemption by recompute, and the order policy (FCFS or priority)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .config import EngineOptions
from .context import ResponseContext, Status
from .kv_cache import BlockAllocator


@dataclass
class StepPlan:
    """The work of one step: each scheduled request with the number of tokens it computes.
    Decodes (one token each) come first, then prefill chunks."""

    work: list[tuple[ResponseContext, int]] = field(default_factory=list)
    num_decodes: int = 0

    def __bool__(self):
        return bool(self.work)

    def order(self) -> None:
        """One-token entries (decodes, and any 1-token chunk) first, longest context first, so that
        batch.build can group them by length for the batched decode attention."""
        self.work.sort(key=lambda w: (w[1] != 1, -w[0].num_computed if w[1] == 1 else 0))
        self.num_decodes = sum(1 for _, n in self.work if n == 1)

    def drop(self, ctx: ResponseContext) -> int:
        """Take a preempted request out of the plan; returns the tokens it had been given."""
        for i, (c, n) in enumerate(self.work):
            if c is ctx:
                del self.work[i]
                return n
        return 0


class Scheduler:
    def __init__(self, options: EngineOptions, allocator: BlockAllocator):
        self.options = options
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.waiting: list[ResponseContext] = []  # sorted by precedence
        self.running: list[ResponseContext] = []
        self.watermark = max(1, allocator.num_blocks // 100)
        self.num_preemptions = 0
        self.prompt_tokens = 0  # tokens of admitted requests, and how many came from the prefix cache
        self.cached_tokens = 0

    def precedence(self, ctx: ResponseContext):
        if self.options.policy == "priority":
            return (-ctx.config.priority, ctx.arrival)
        return (ctx.arrival,)

    def has_work(self) -> bool:
        return any(self.runnable(c) for c in self.running) or any(self.runnable(c) for c in self.waiting)

    def runnable(self, ctx: ResponseContext) -> bool:
        """False while the request's consumer lags too far behind: it must fetch first."""
        return ctx.queue.qsize() < self.options.max_unfetched_tokens

    def add(self, ctx: ResponseContext) -> None:
        ctx.status = Status.WAITING
        bisect.insort(self.waiting, ctx, key=self.precedence)

    def remove(self, ctx: ResponseContext) -> None:
        """Drop a request from whichever list holds it and free its blocks."""
        if ctx in self.running:
            self.running.remove(ctx)
        elif ctx in self.waiting:
            self.waiting.remove(ctx)
        self.allocator.release(ctx.block_table)
        ctx.block_table = []

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.options.max_batch_tokens
        self.running.sort(key=self.precedence)
        # Decodes first, so that a long prefill never starves the requests already streaming.
        for ctx in sorted(self.running, key=lambda c: len(c.tokens) - c.num_computed > 1):
            if ctx.status is not Status.RUNNING or budget == 0:
                continue
            n = min(len(ctx.tokens) - ctx.num_computed, budget)
            need = self.blocks_for(ctx.num_computed + n) - len(ctx.block_table)
            while need > self.allocator.num_free:
                victim = self.running[-1]
                self.preempt(victim)
                budget += plan.drop(victim)
                if victim is ctx:
                    break
            else:
                ctx.block_table += self.allocator.allocate(need)
                plan.work.append((ctx, n))
                budget -= n
        self.admit(plan, budget)
        plan.order()
        return plan

    def admit(self, plan: StepPlan, budget: int) -> None:
        for ctx in list(self.waiting):
            if budget == 0 or len(self.running) >= self.options.max_batch_size:
                return
            if not self.runnable(ctx):
                continue
            cached = self.allocator.match_prefix(ctx.tokens)
            ctx.block_table = cached
            ctx.num_computed = ctx.num_cached = len(cached) * self.block_size
            ctx.hashed = (len(cached), self.allocator.chain_hash(cached))
            n = min(len(ctx.tokens) - ctx.num_computed, budget)
            need = self.blocks_for(ctx.num_computed + n) - len(cached)
            # The watermark keeps room for running requests to grow; an idle engine needs none.
            reserve = self.watermark if self.running else 0
            if need > self.allocator.num_free - reserve:
                self.allocator.release(cached)
                ctx.block_table, ctx.num_computed, ctx.num_cached = [], 0, 0
                return  # head-of-line: later requests do not overtake it
            ctx.block_table += self.allocator.allocate(need)
            self.waiting.remove(ctx)
            ctx.status = Status.RUNNING
            self.running.append(ctx)
            self.prompt_tokens += len(ctx.tokens)
            self.cached_tokens += ctx.num_cached
            plan.work.append((ctx, n))
            budget -= n

    def preempt(self, ctx: ResponseContext) -> None:
        """Free a running request's blocks and send it back to wait; it recomputes its tokens later."""
        self.running.remove(ctx)
        self.allocator.release(ctx.block_table)
        ctx.block_table, ctx.num_computed, ctx.hashed = [], 0, (0, None)
        self.num_preemptions += 1
        self.add(ctx)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
