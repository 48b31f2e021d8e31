"""The step, in the loop thread: plan (under the lock), the draft model's proposals where there is
one, build, forward, sample, apply and deliver (under the lock again). The loop thread (runtime/loop.py) calls plan and step; everything else
here serves them, and close ends the loop and every request with it."""

from __future__ import annotations

import threading
import time
import warnings

import torch

from models.step import StepInput

from . import sampler, speculation
from .constraints import Grammars
from .context import END, ResponseContext
from .cpu_host import CpuHost, DeviceHost
from .draft import Drafter
from .errors import GenerationFailed
from .handles import Handles
from .kv_manager import KVManager
from .scheduler import Scheduler, StepPlan


class Worker:
    """Runs one step at a time over ``model``; holds no reference to its engine, so that the loop
    thread, which holds the worker only weakly between steps, lets an engine the application
    dropped go (and then ends)."""

    def __init__(self, model, kv: KVManager, scheduler: Scheduler, handles: Handles, host: CpuHost | DeviceHost,
                 grammars: Grammars, lock: threading.RLock, wakeup: threading.Condition, device: torch.device,
                 seed: int, drafter: Drafter | None = None):
        self.model = model
        self.drafter = drafter
        self.kv, self.scheduler, self.handles, self.host, self.grammars = kv, scheduler, handles, host, grammars
        self.lock, self.wakeup = lock, wakeup  # wakeup: the loop thread sleeps on it (its lock is ``lock``)
        self.device = device
        self.generator = torch.Generator(device).manual_seed(seed)
        self.counters = {"steps": 0, "tokens_generated": 0, "requests_finished": 0, "step_failures": 0}
        self.closed: BaseException | None = None  # why the engine closed, once it has
        self.pauses = 0  # Engine.paused blocks open: no step is planned while above 0

    def plan(self) -> StepPlan | None:
        """Under the lock: the next step's plan; None when there is no runnable work at all."""
        self.handles.release_dropped(self.scheduler.remove)
        runnable = not self.pauses and self.scheduler.has_work()
        plan = self.scheduler.schedule() if runnable else None
        self.kv.commit_ahead()
        if self.drafter is not None:
            self.drafter.kv.commit_ahead()
        return plan

    def step(self, plan: StepPlan) -> None:
        """schedule (done) -> draft (the draft model's proposals) -> build -> forward (beside the
        step's structured-output masks) -> sample -> apply -> deliver."""
        drafted = self.draft(plan)
        sampling = plan.sampling()
        proposals = plan.proposals()
        draft_probs = plan.draft_probs()
        masks = self.grammars.start_masks([ctx.constraint for ctx in sampling], proposals)
        try:
            step = StepInput.flatten(plan.sequences(), self.kv.block_size, self.device)
            self.host.before_forward(step)
            logits = self.model(step, self.kv.cache)
            bitmask = masks.result() if masks is not None else None
        except Exception as error:
            self.fail([e.ctx for e in plan.entries], error)
            return
        tokens, logprobs = self.sample(logits, sampling, bitmask, proposals, draft_probs)
        self.host.after_sampling()
        produced = time.perf_counter()  # hand-off latency counts from here, bookkeeping included
        self.host.before_delivery(sampling)
        with self.lock:
            self.counters["steps"] += 1
            if drafted is not None:
                self.drafter.seconds += drafted
            delivered = self.scheduler.postprocess(plan, sampling, tokens, produced, logprobs)
            streams: dict[ResponseContext, list[int]] = {}  # a request's tokens in order, then its end once
            for ctx, token in delivered:
                streams.setdefault(ctx, []).append(token)
            for ctx, stream in streams.items():
                ctx.deliver(stream)
            self.counters["tokens_generated"] += len(delivered)
            self.counters["requests_finished"] += sum(ctx.finished for ctx in streams)
        self.host.after_delivery(produced)

    def draft(self, plan: StepPlan) -> float | None:
        """Outside the lock: the draft model's forwards for the plan's jobs, and each entry given
        the proposals its job made; returns their time (None without jobs). Where the draft's
        forward raises, no request speculates this step and the step goes on (counted in
        Drafter.failures): a draft never fails a request."""
        jobs = plan.drafting()
        if not jobs:
            return None
        started = time.perf_counter()
        try:
            self.drafter.run(jobs, self.generator)
        except Exception as error:  # noqa: BLE001 - the target's step does not depend on it
            for job in jobs:
                job.proposals, job.probs = [], []
            with self.lock:
                self.drafter.failures += 1
            warnings.warn(f"the draft model's forward failed, its requests go on without proposals: {error!r}",
                          RuntimeWarning, stacklevel=1)
        for entry in plan.entries:
            if entry.drafting is not None and entry.reserved:
                entry.propose(entry.drafting.proposals[:entry.reserved], entry.drafting.probs)
        return time.perf_counter() - started

    def sample(self, logits: torch.Tensor, sampling: list[ResponseContext], bitmask, proposals=None,
               draft_probs=None):
        """The step's tokens (and logprobs, see sampler.sample), each constrained request's grammar
        advanced by its token. ``proposals``: each row's proposed token, or None (StepPlan.proposals);
        ``draft_probs``: the draft model's q of each (StepPlan.draft_probs). If sampling the batch
        raises, each row is sampled alone; only the requests whose own sampling or grammar fails
        are failed (their token is then END)."""
        views = speculation.sampler_rows(sampling, proposals)  # penalties count the proposals before a row
        try:
            tokens, logprobs = sampler.sample(logits, views, self.generator, bitmask, proposals, draft_probs)
        except Exception:
            rows = sampler.sample_each(logits, views, self.generator, bitmask, proposals, draft_probs)
            tokens, logprobs = [token for token, _ in rows], [logprob for _, logprob in rows]
        advanced = set()  # requests whose grammar has taken its last token of the step
        for i, (ctx, token) in enumerate(zip(sampling, tokens)):
            if ctx.constraint is None or isinstance(token, BaseException) or ctx.finished or ctx in advanced:
                continue
            if ctx.constraint.ended:  # nothing after its end is kept (ResponseContext.record)
                advanced.add(ctx)
                continue
            try:
                ctx.constraint.accept(token)
            except ValueError as error:
                tokens[i] = error
            # a row that verifies a proposal and kept it lets the grammar take the next row's token too
            if proposals is None or proposals[i] != token:
                advanced.add(ctx)
        for ctx, error in zip(sampling, tokens):
            if isinstance(error, BaseException):
                self.fail([ctx], error)
        return [END if isinstance(t, BaseException) else t for t in tokens], logprobs

    def fail(self, contexts: list[ResponseContext], error: BaseException) -> None:
        """Fail the unfinished ``contexts`` with GenerationFailed (the cause: ``error``); others go on."""
        with self.lock:
            self.counters["step_failures"] += 1
            for ctx in contexts:
                if not ctx.finished:
                    self.scheduler.remove(ctx)
                    failure = GenerationFailed(f"request {ctx.handle} failed in a step: {error!r}")
                    failure.__cause__ = error
                    ctx.fail(failure)

    def close(self, error: BaseException, cause: BaseException | None = None) -> None:
        """Fail every unfinished request with ``error`` and stop the loop after the step in flight.
        Idempotent: the first error stays."""
        if cause is not None:
            error.__cause__ = cause
        with self.lock:
            if self.closed is not None:
                return
            self.closed = error
            for ctx in self.handles.contexts():
                if not ctx.finished:
                    self.scheduler.remove(ctx)
                    ctx.fail(error)
            self.wakeup.notify_all()
        self.grammars.close()
        self.kv.close()
        if self.drafter is not None:
            self.drafter.kv.close()
