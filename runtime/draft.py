"""Speculative decoding with a draft model: a smaller model of the target's vocabulary (the same
model in 4-bit blocks, or a small one of its family) proposes the next tokens, and the target
verifies them exactly as it verifies prompt lookup's (runtime/speculation.py): one forward for a
request's last token and every proposal, the rows confirmed up to the first that differs.

The draft keeps a paged KV cache of its own (a KVManager over its own pool, no prefix cache) and,
per request, how many of the request's tokens that cache holds (``DraftState.computed``). Where
things run:

- **Plan** (under the engine's lock, Scheduler.speculate): ``reserve`` gives a speculating request
  a DraftJob: the tokens its draft cache lacks (the prompt on first use, then the tokens each step
  confirmed) and room for up to ``width`` proposals, in the draft's pool and in the target's.
  A request whose draft blocks do not fit does not speculate this step; nothing waits for them.
  A request that will speculate catches up on its prompt in the step that prefills it (a job
  without proposals), so that the time counts before its first token, not between tokens.
- **Draft** (the loop thread, outside the lock, before the target's forward: Worker.step): ``run``
  makes every job's proposals in batched forwards, one per proposal position; the first also
  catches each request up. The plan's entries then take the proposals made (Scheduled.propose).
- **Apply** (under the lock again, Scheduler.postprocess): ``after_step`` keeps the draft's K/V
  of the confirmed proposals (a kept proposal is the request's token at that position), gives
  back the blocks past them, and adapts the request's width. Every way out of the running list
  (finish, abort, failure, preemption, recompute) frees the request's draft blocks (``free``);
  an abort during the draft's forward is as safe as during the target's: freed blocks are handed
  out again only by the next plan.

Proposals and the target's distribution: a greedy request's proposals are the draft's argmax
(after the request's penalties and bias), and the target's argmax confirms them, so its tokens
are those of greedy decoding. A sampled request draws each proposal x from the draft's own
distribution q (its logits with the request's penalties, bias, temperature and filters), and the
target keeps x with probability min(1, p(x) / q(x)), else draws from max(0, p - q) renormalised
(sampler.verify, Leviathan et al.): every token is then distributed as the target's p, whatever
the draft. Prompt lookup's rule (keep x with p(x), else draw from p without x) would be exact
too, for any x, drawn or not; the p/q rule keeps more: sum min(p, q) of the proposals against
sum p q (a draft close to its target keeps nearly all, where the other rule keeps what the
target's own draw would have matched). The p/q rule is exact only over x drawn from q as it
is, so a request with structured output, whose proposals are cut where its grammar refuses
them, drafts greedily and is verified by the other rule. Seeded sampled requests do not
speculate (speculation.max_proposed).

With a draft, it proposes for every speculating request and prompt lookup does not: one source of
proposals per engine, whose cost and acceptance the stats measure alone; a draft of the target's
family continues repeated text as well as lookup does (the draft attends to the earlier occurrence).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from models.step import Sequence, StepInput

from . import sampler
from .config import MAX_SPECULATIVE_TOKENS, EngineOptions
from .kv_manager import KVManager
from .speculation import RowView, penalised

# Proposals a request makes at first; then 2 more after a step that confirmed all of them and 1
# fewer (down to 1) after one that did not (transformers' assisted generation). No rests as prompt
# lookup has: a draft that missed once usually proposes well again at the next token.
FIRST_WIDTH = 2
# A catch-up of up to this many tokens before proposals runs as rows (each sampled), longer ones as a
# prefill chunk: up to a few rows a step is bound by reading the weights (cpu_threads.NARROW_ROWS).
ROWS = 8
# Strings whose token ids a draft's tokenizer must give as the target's does.
PROBES = ("Hello, world!", "The quick brown fox jumps over the lazy dog.", " def f(x):\n    return x * 2",
          "Größe, naïve café — 東京 123.45")


@dataclass
class DraftState:
    """One request's standing in the draft's cache (its blocks are the draft KVManager's, by handle)."""

    computed: int = 0         # the draft's cache holds the K/V of the request's first ``computed`` tokens
    width: int = FIRST_WIDTH  # proposals to make next (see FIRST_WIDTH)
    long: bool = False        # computed past the draft model's recompute_past (models/step.py)


@dataclass
class DraftJob:
    """One request's share of a step's draft forwards: catch up on ``ctx.tokens[start:end]``, then
    propose up to ``width`` tokens (0: only catch up). Made under the lock; ``run`` fills the rest."""

    ctx: object
    start: int
    end: int
    width: int
    table: list[int]                                         # its draft blocks (a copy)
    proposals: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)  # q of each proposal (sampled requests)
    caught_up: bool = False    # the first forward ran: the draft holds ctx.tokens[:end]
    written: int = 0           # proposals whose K/V the forwards wrote (all but the last made)

    @property
    def sampled(self) -> bool:
        """Draws its proposals from q (else greedy): a sampled request without a grammar."""
        return self.ctx.config.sampled and self.ctx.constraint is None


class Drafter:
    """The draft model, its cache and each request's place in it. ``max_catch_up``: the tokens a
    step's first draft forward computes beyond proposals, all requests together (a long prompt
    catches up over several steps, proposing nothing until it has)."""

    def __init__(self, model, kv: KVManager, max_catch_up: int):
        self.model = model
        self.kv = kv
        self.max_catch_up = max_catch_up
        self.max_position = model.max_position
        self.recompute_past = kv.recompute_past
        self.states: dict[int, DraftState] = {}  # by handle
        self.catch_up_left = max_catch_up  # this plan's share left (``start_plan``)
        self.forwards = 0        # batched draft forwards run, their time, and those that raised
        self.seconds = 0.0
        self.failures = 0

    @classmethod
    def for_model(cls, model, options: EngineOptions, device: torch.device, num_blocks: int) -> "Drafter":
        """A drafter over ``model`` with a pool of ``options.draft_num_kv_blocks`` blocks, or
        ``num_blocks`` (the target's: room for every request the target holds) where None."""
        blocks = options.draft_num_kv_blocks or num_blocks
        kv = KVManager.for_model(model, EngineOptions(**{**vars(options), "num_kv_blocks": blocks,
                                                         "enable_prefix_caching": False}), device)
        return cls(model, kv, options.max_batch_tokens)

    # -- the scheduler's side (under the engine's lock) -------------------------------------------

    def start_plan(self) -> None:
        self.catch_up_left = self.max_catch_up

    def reserve(self, ctx, k: int, upto: int | None = None) -> DraftJob | None:
        """A job for ``ctx``: the draft blocks to catch up on its tokens up to ``upto`` (None: all of
        them, for a decoding request) and for up to ``k`` proposals after them, fewer while its
        proposals fail (DraftState.width) or where the draft's context ends; k = 0: only catch up
        (the step that prefills the prompt). None where the draft's pool cannot hold them, where
        there is nothing to do, or where a step's share of catching up is spent before ``ctx``'s starts."""
        n = len(ctx.tokens)
        upto = n if upto is None else upto
        # The draft's forwards reach length n + width - 1: within its context, and on one side of its
        # recompute_past (the target's scheduler keeps the target's).
        room = self.max_position - n + 1
        long = self.recompute_past is not None and n > self.recompute_past
        if self.recompute_past is not None and not long:
            room = min(room, self.recompute_past - n + 1)
        if room <= 0:
            return None
        state = self.states.get(ctx.handle)
        if state is not None and state.long != long:  # its K/V hold for the other side of recompute_past
            self.free(ctx)
            state = None
        if state is None:
            self.kv.take_cached_prefix(ctx)  # no prefix cache here: an empty table to grow
            state = self.states[ctx.handle] = DraftState(long=long)
        # a decoding request computes at least its last token: its logits propose the first
        start = min(state.computed, n - 1) if upto == n else state.computed
        end = min(upto, start + self.catch_up_left)
        if end <= start:
            return None
        width = min(k, state.width, room) if end == n else 0
        table = self.kv.allocate(ctx, end + max(width - 1, 0))
        if table is None:
            return None
        self.catch_up_left -= end - start
        return DraftJob(ctx, start, end, width, list(table))

    def after_step(self, ctx, job: DraftJob, confirmed: int) -> None:
        """After the target verified ``job``'s proposals and ``confirmed`` of them were recorded:
        the draft's K/V of those stand (a confirmed proposal is the request's token there), the
        blocks past them go back, and the request's width adapts."""
        state = self.states.get(ctx.handle)
        if state is None:
            return
        if job.caught_up:
            state.computed = min(job.end + min(confirmed, job.written), len(ctx.tokens))
        if job.proposals:
            full = confirmed == len(job.proposals)
            state.width = min(state.width + 2, MAX_SPECULATIVE_TOKENS) if full else max(1, state.width - 1)
        self.kv.trim(ctx, state.computed)

    def free(self, ctx) -> None:
        """Give back every draft block ``ctx`` holds and forget its place; a no-op where it holds none."""
        self.states.pop(ctx.handle, None)
        self.kv.free(ctx)

    # -- the loop thread's side (outside the lock) -------------------------------------------------

    def run(self, jobs: list[DraftJob], generator: torch.Generator) -> None:
        """The jobs' draft forwards: the first catches every job up and proposes each one's first
        token; each next forward proposes every job's next token, for the jobs whose width reaches
        it. A job stops early at a token that would end its request; a constrained job's proposals
        are then cut where its grammar refuses them."""
        jobs = [job for job in jobs if job.end > job.start]
        # A chunk's length is its request's (models choose longrope's factors by it), not where it ends.
        # A few tokens to catch up on before proposing (those a step confirmed) go as rows, as a
        # verification's do: a decode-only step; as a prefill chunk two tokens cost twice one.
        first = [(job, Sequence(job.ctx.tokens[job.start:job.end], job.start, job.table, job.width > 0,
                                len(job.ctx.tokens), job.end - job.start if job.end - job.start <= ROWS else 1))
                 for job in jobs]
        self._propose(first, generator)
        for job in jobs:
            job.caught_up = True
        for j in range(1, max((job.width for job in jobs), default=0)):
            going = [job for job in jobs if len(job.proposals) == j < job.width
                     and job.proposals[-1] not in job.ctx.stop_ids]
            if not going:
                break
            # proposal j - 1 sits at position end + j - 1; its logits propose the next
            self._propose([(job, Sequence([job.proposals[-1]], job.end + j - 1, job.table, True, job.end + j))
                           for job in going], generator)
            for job in going:
                job.written += 1
        for job in jobs:
            if job.proposals and job.ctx.constraint is not None:
                del job.proposals[job.ctx.constraint.valid_prefix(job.proposals):]

    def _propose(self, work: list[tuple[DraftJob, Sequence]], generator: torch.Generator) -> None:
        """One batched forward of ``work``'s sequences; each sampling one adds a proposal to its job."""
        # StepInput.flatten's order: one-token entries first, longest context first, then chunks
        work.sort(key=lambda item: (len(item[1].token_ids) != 1, -item[1].start))
        step = StepInput.flatten([seq for _, seq in work], self.kv.block_size, self.kv.cache.data.device)
        logits = self.model(step, self.kv.cache)
        self.forwards += 1
        proposing = [job for job, seq in work if seq.sample]
        if not proposing:
            return
        last_rows = torch.tensor(list(itertools.accumulate(seq.num_sampled for _, seq in work if seq.sample)),
                                 device=logits.device) - 1
        logits = logits[last_rows] if len(last_rows) < len(logits) else logits  # a sequence's last row proposes
        # penalties count the proposals before a row, as the target's rows will (speculation.RowView)
        views = [RowView(job.ctx, job.proposals) if job.proposals and penalised(job.ctx.config) else job.ctx
                 for job in proposing]
        logits = sampler.apply_penalties(logits, views)
        tokens = sampler.greedy(logits)
        rows = [i for i, job in enumerate(proposing) if job.sampled]
        probs = None
        if rows:
            index = torch.tensor(rows, device=logits.device)
            filtered, order = sampler.filtered_probs(logits[index], [proposing[i].ctx.config for i in rows])
            drawn = torch.multinomial(filtered, 1, generator=generator)[:, 0]
            if order is not None:  # back to the vocabulary's order, where verify compares p with q
                drawn = order.gather(1, drawn[:, None])[:, 0]
                filtered = torch.empty_like(filtered).scatter_(1, order, filtered)
            tokens[index] = drawn
            probs = dict(zip(rows, filtered))
        for i, (job, token) in enumerate(zip(proposing, tokens.tolist())):
            job.proposals.append(token)
            if probs is not None and i in probs:
                job.probs.append(probs[i])


def check_draft(target, draft) -> None:
    """ValueError unless ``draft`` (a models.Checkpoint) can propose for ``target``'s: the same
    vocabulary size, and where both have tokenizers, the same ids for a few probe strings."""
    if draft.model.vocab_size != target.model.vocab_size:
        raise ValueError(f"the draft model's vocabulary has {draft.model.vocab_size} tokens and the target's "
                         f"{target.model.vocab_size}: a draft must share the target's tokenizer and vocabulary")
    if target.tokenizer is None or draft.tokenizer is None:
        return
    for text in PROBES:
        ours, theirs = (t.encode(text, add_special_tokens=False) for t in (target.tokenizer, draft.tokenizer))
        if ours != theirs:
            raise ValueError(f"the draft model's tokenizer encodes {text!r} as {theirs} and the target's as {ours}: "
                             "a draft must share the target's tokenizer")
