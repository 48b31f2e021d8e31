"""Which requests run in the next step, and how many tokens each: admission, the token budget,
chunked prefill, preemption by recompute, the order policy (FCFS or priority), proposed tokens for
decoding requests that speculate (runtime/speculation.py; a draft model's: runtime/draft.py), and applying a step's results to the
requests (recomputing a request whose length passes the model's ``recompute_past``,
models/step.py). The blocks their tokens need come from the KV manager."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from models.step import Sequence

from . import speculation
from .config import EngineOptions
from .context import ResponseContext, Status
from .draft import DraftJob, Drafter
from .kv_manager import KVManager


@dataclass
class Scheduled:
    """A request in a step, computing ``num_tokens`` tokens from ``ctx.num_computed`` on, their
    K/V in the blocks of ``block_table``: its own tokens, then the ``draft`` tokens proposed to
    follow them (speculative decoding; only a decoding request has any). With a draft model, the
    plan holds room for ``reserved`` proposals that its ``drafting`` job makes outside the lock,
    and ``propose`` then puts them in (``draft_probs``: the draft's distribution q of each, for a
    sampled request). ``state_slot``: its state slot where the model keeps one (KVManager.state_slot)."""

    ctx: ResponseContext
    num_tokens: int
    block_table: list[int]
    state_slot: int = -1
    draft: list[int] = field(default_factory=list)
    reserved: int = 0
    drafting: DraftJob | None = None
    draft_probs: list | None = None

    def propose(self, tokens: list[int], probs: list) -> None:
        """The draft model's proposals (at most ``reserved``), and q of each where it drew them."""
        self.draft = tokens
        self.draft_probs = probs[:len(tokens)] if probs else None
        self.num_tokens += len(tokens)

    @property
    def samples(self) -> bool:
        return self.ctx.num_computed + self.num_tokens - len(self.draft) == len(self.ctx.tokens)

    @property
    def num_sampled(self) -> int:
        """Its rows that sample: after its last token and after each proposed one."""
        return 1 + len(self.draft) if self.samples else 0


@dataclass
class StepPlan:
    """The work of one step, one-token entries (decodes) first, longest context first, so that
    the flat batch can group them by length for the batched decode attention."""

    entries: list[Scheduled] = field(default_factory=list)

    def __bool__(self):
        return bool(self.entries)

    def order(self) -> None:
        self.entries.sort(key=lambda e: (e.num_tokens != 1, -e.ctx.num_computed if e.num_tokens == 1 else 0))

    def drop(self, ctx: ResponseContext) -> int:
        """Take a preempted request out of the plan; returns the tokens it had been given."""
        for i, entry in enumerate(self.entries):
            if entry.ctx is ctx:
                del self.entries[i]
                return entry.num_tokens
        return 0

    def sampling(self) -> list[ResponseContext]:
        """The request of each of the step's sampled rows, in their order: a request that
        verifies proposed tokens once for each of its rows."""
        return [e.ctx for e in self.entries for _ in range(e.num_sampled)]

    def proposals(self) -> list[int | None] | None:
        """For each sampled row (as ``sampling``), the proposed token it verifies: row i of a
        request with proposals verifies its proposal i, its last row none; None in a step without
        any."""
        if not any(e.draft for e in self.entries):
            return None
        return [token for e in self.entries if e.samples for token in e.draft + [None]]

    def draft_probs(self) -> list | None:
        """For each sampled row (as ``sampling``), the draft model's distribution q its proposal
        was drawn from, or None (a proposal that came with certainty, or none); None in a step
        without any."""
        if not any(e.draft_probs for e in self.entries):
            return None
        return [q for e in self.entries if e.samples for q in (e.draft_probs or [None] * len(e.draft)) + [None]]

    def drafting(self) -> list[DraftJob]:
        """The draft model's jobs of this step (Drafter.run)."""
        return [e.drafting for e in self.entries if e.drafting is not None]

    def sequences(self) -> list[Sequence]:
        """The plan as the model contract's Sequences (see models/step.py)."""
        sequences = []
        for e in self.entries:
            ctx, own = e.ctx, e.num_tokens - len(e.draft)
            sequences.append(Sequence(ctx.tokens[ctx.num_computed:ctx.num_computed + own] + e.draft, ctx.num_computed,
                                      e.block_table, e.samples, len(ctx.tokens) + len(e.draft), max(e.num_sampled, 1),
                                      e.state_slot))
        return sequences


class Scheduler:
    """The waiting and running requests, under the engine's lock. Blocks are the KV manager's: the
    scheduler asks it for room and gives the room back."""

    def __init__(self, options: EngineOptions, kv: KVManager, drafter: Drafter | None = None):
        self.options = options
        self.kv = kv
        self.drafter = drafter  # the draft model's proposer (runtime/draft.py); None: prompt lookup
        self.recompute_past = kv.recompute_past  # the model's (models/step.py), None where it has none
        self.waiting: list[ResponseContext] = []  # sorted by precedence
        self.running: list[ResponseContext] = []
        self.watermark = max(1, kv.num_blocks // 100)
        self.num_preemptions = 0
        self.prompt_tokens = 0  # tokens of admitted requests, and how many came from the prefix cache
        self.cached_tokens = 0
        self.proposed_tokens = 0  # speculative decoding: tokens proposed, and of them delivered
        self.accepted_tokens = 0

    def precedence(self, ctx: ResponseContext):
        if self.options.policy == "priority":
            return (-ctx.config.priority, ctx.handle)
        return (ctx.handle,)  # handles count up: arrival order

    def has_work(self) -> bool:
        return any(self.runnable(c) for c in self.running) or any(self.runnable(c) for c in self.waiting)

    def runnable(self, ctx: ResponseContext) -> bool:
        """False while the request's consumer lags too far behind: it must fetch first."""
        return ctx.num_unfetched < self.options.max_unfetched_tokens

    def add(self, ctx: ResponseContext) -> None:
        ctx.status = Status.WAITING
        bisect.insort(self.waiting, ctx, key=self.precedence)

    def remove(self, ctx: ResponseContext) -> None:
        """Drop a request from whichever list holds it and free its blocks."""
        if ctx in self.running:
            self.running.remove(ctx)
        elif ctx in self.waiting:
            self.waiting.remove(ctx)
        self.free(ctx)

    def free(self, ctx: ResponseContext) -> None:
        """Give back the blocks ``ctx`` holds, in the target's pool and the draft's."""
        self.kv.free(ctx)
        if self.drafter is not None:
            self.drafter.free(ctx)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.options.max_batch_tokens
        self.running.sort(key=self.precedence)
        # Decodes first, so that a long prefill never starves the requests already streaming.
        for ctx in sorted(self.running, key=lambda c: len(c.tokens) - c.num_computed > 1):
            if ctx.status is not Status.RUNNING or budget == 0:
                continue
            n = min(len(ctx.tokens) - ctx.num_computed, budget)
            while (block_table := self.kv.allocate(ctx, ctx.num_computed + n)) is None:
                victim = self.running[-1]
                self.preempt(victim)
                budget += plan.drop(victim)
                if victim is ctx:
                    break
            else:
                plan.entries.append(Scheduled(ctx, n, block_table, self.kv.state_slot(ctx)))
                budget -= n
        budget = self.admit(plan, budget)
        self.speculate(plan, budget)
        plan.order()
        return plan

    def admit(self, plan: StepPlan, budget: int) -> int:
        """Admit waiting requests while the batch, the budget and the blocks allow; returns the budget left."""
        for ctx in list(self.waiting):
            if budget == 0 or len(self.running) >= self.options.max_batch_size:
                break
            if not self.runnable(ctx) or self.follows_unfinished_prefill(ctx):
                continue
            ctx.num_computed = ctx.num_cached = self.kv.take_cached_prefix(ctx)
            n = min(len(ctx.tokens) - ctx.num_computed, budget)
            # The watermark keeps room for running requests to grow; an idle engine needs none.
            reserve = self.watermark if self.running else 0
            block_table = self.kv.allocate(ctx, ctx.num_computed + n, reserve)
            if block_table is None:
                self.kv.free(ctx)
                ctx.num_computed = ctx.num_cached = 0
                break  # head-of-line: later requests do not overtake it
            self.waiting.remove(ctx)
            ctx.status = Status.RUNNING
            self.running.append(ctx)
            self.prompt_tokens += len(ctx.tokens)
            self.cached_tokens += ctx.num_cached
            plan.entries.append(Scheduled(ctx, n, block_table, self.kv.state_slot(ctx)))
            budget -= n
        return budget

    def speculate(self, plan: StepPlan, budget: int) -> None:
        """Give each decoding request that speculates the tokens prompt lookup proposes, or room for
        those the draft model will propose (``draft_room``), from what the budget and the free
        blocks leave once every request has its own tokens: a proposal never preempts a request,
        nor takes the blocks kept for running requests to grow. The step's decode rows, proposals
        (or room for them) included, stay within ``speculation_max_rows`` (EngineOptions)."""
        decoding = [e for e in plan.entries if e.num_tokens == 1 and e.samples]
        rows_left = self.options.speculation_max_rows - len(decoding)
        if self.drafter is not None:
            self.drafter.start_plan()
            if len(decoding) > self.options.draft_max_streams:  # (EngineOptions: why)
                rows_left = 0
        self.propose_for_decodes(decoding, budget, rows_left)
        # After the decodes (a step's catch-up share goes to its proposals first), and only where the
        # requests decoding next step may propose: 16 prompts arriving together had the draft
        # prefill every one (10% of the default model's 16-stream run) for none to propose.
        decoding_next = sum(1 for e in plan.entries if e.samples)
        if self.drafter is not None and decoding_next <= min(self.options.draft_max_streams,
                                                             self.options.speculation_max_rows - 1):
            self.draft_prefills(plan)

    def propose_for_decodes(self, decoding: list[Scheduled], budget: int, rows_left: int) -> None:
        """``speculate``'s proposals (or room for the draft's), request by request."""
        for entry in decoding:
            if rows_left <= 0:
                return
            ctx = entry.ctx
            # Never past the request's last token (max_new_tokens, the context), nor past the model's
            # recompute_past: the step that crosses it must be the one that recomputes.
            room = ctx.max_length - len(ctx.tokens) - 1
            if self.recompute_past is not None and len(ctx.tokens) <= self.recompute_past:
                room = min(room, self.recompute_past - len(ctx.tokens))
            k = min(speculation.max_proposed(ctx, self.options.speculative_tokens), room, budget, rows_left)
            if self.drafter is not None:
                reserved = self.draft_room(entry, k) if k > 0 else 0
                budget -= reserved
                rows_left -= reserved
                continue
            draft = speculation.propose(ctx, k) if k > 0 else []
            if not draft:
                continue
            block_table = self.kv.allocate(ctx, ctx.num_computed + 1 + len(draft), self.watermark)
            if block_table is None:
                continue
            entry.draft, entry.block_table = draft, block_table
            entry.num_tokens += len(draft)
            budget -= len(draft)
            rows_left -= len(draft)

    def draft_prefills(self, plan: StepPlan) -> None:
        """The draft catches up on a prompt in the step that prefills it (the time counts in the time
        to the first token, not between tokens), for requests that will speculate. (One that
        did not, its batch too wide then, catches up at its first proposal: Drafter.reserve.)"""
        for entry in plan.entries:
            ctx = entry.ctx
            if entry.num_tokens > 1 and speculation.max_proposed(ctx, self.options.speculative_tokens):
                entry.drafting = self.drafter.reserve(ctx, 0, ctx.num_computed + entry.num_tokens)

    def draft_room(self, entry: Scheduled, k: int) -> int:
        """Room for up to ``k`` proposals of the draft model after ``entry``'s token: its job (the
        draft's blocks, Drafter.reserve) and the target's blocks for them; returns how many. A
        request whose draft blocks do not fit does not speculate this step; one whose target
        blocks do not fit only lets its draft catch up."""
        job = self.drafter.reserve(entry.ctx, k)
        if job is None:
            return 0
        entry.drafting = job
        if job.width:
            block_table = self.kv.allocate(entry.ctx, entry.ctx.num_computed + 1 + job.width, self.watermark)
            if block_table is None:
                job.width = 0
            else:
                entry.block_table, entry.reserved = block_table, job.width
        return entry.reserved

    def postprocess(self, plan: StepPlan, sampling: list[ResponseContext], tokens: list[int],
                    sampled_at: float, logprobs: list | None = None) -> list[tuple[ResponseContext, int]]:
        """Apply a step's results: each request's computed tokens advance and its full blocks are
        named for the prefix cache; each sampled token is recorded (with proposed tokens: those
        the step's rows confirm, then the token sampled after them, up to a token that ends the
        request; the blocks that held only rejected ones go back); a finished request frees its
        blocks, one whose token takes it past the model's ``recompute_past`` goes back to wait and
        recompute, and one whose consumer lags too far is paused without any blocks. Requests
        aborted during the forward are skipped. ``sampling`` and ``tokens``: the step's rows, as
        StepPlan.sampling gives them. Returns the (request, token) pairs to deliver, in order."""
        delivered = []
        row = 0
        for entry in plan.entries:
            ctx, rows = entry.ctx, range(row, row + entry.num_sampled)
            row = rows.stop
            if ctx.finished:
                continue
            own = entry.num_tokens - len(entry.draft)
            if not rows:
                ctx.num_computed += own
                self.kv.cache_computed_blocks(ctx)
                if entry.drafting is not None:
                    self.drafter.after_step(ctx, entry.drafting, 0)
                continue
            sampled = tokens[rows.start:rows.stop]
            confirmed = speculation.matched(entry.draft, sampled)
            recorded = 0
            for i in rows[:confirmed + 1]:
                delivered.append((ctx, tokens[i]))
                recorded += 1
                if ctx.record(tokens[i], sampled_at, logprobs[i] if logprobs else None):
                    break
            # The confirmed proposals' K/V are the delivered tokens' own; a rejected one's slots are
            # written over later, and blocks that held only rejected ones go back now.
            ctx.num_computed += own + min(confirmed, recorded)
            self.kv.cache_computed_blocks(ctx)
            if entry.drafting is not None:
                self.drafter.after_step(ctx, entry.drafting, min(confirmed, recorded))
            elif entry.draft:
                ctx.lookup.learn(len(entry.draft), confirmed)
            if entry.draft:
                ctx.num_proposed += len(entry.draft)
                self.proposed_tokens += len(entry.draft)
                ctx.num_accepted += min(confirmed, recorded)
                self.accepted_tokens += min(confirmed, recorded)
            if entry.draft or entry.reserved:
                self.kv.trim(ctx, len(ctx.tokens))
            if ctx.finished:
                self.remove(ctx)
            elif self.recompute_past is not None and len(ctx.tokens) == self.recompute_past + 1:
                self.recompute(ctx)  # its K/V hold for the shorter sequence only
            elif not self.runnable(ctx):
                self.preempt(ctx)  # holds no blocks while its consumer catches up
        return delivered

    @staticmethod
    def follows_unfinished_prefill(ctx: ResponseContext) -> bool:
        """A later choice of one prompt waits until the first has computed (and named in the
        prefix cache) the prompt's blocks, and then takes them instead of recomputing them."""
        leader = ctx.leader
        return leader is not None and not leader.finished and leader.num_computed < leader.num_prompt

    def preempt(self, ctx: ResponseContext) -> None:
        """Free a running request's blocks and send it back to wait; it recomputes its tokens later."""
        self.recompute(ctx)
        self.num_preemptions += 1

    def recompute(self, ctx: ResponseContext) -> None:
        """Free a running request's blocks and send it back to wait (ahead of later arrivals): once
        admitted again it computes every token it holds, and samples no token twice."""
        self.running.remove(ctx)
        self.free(ctx)
        ctx.num_computed = 0
        self.add(ctx)
