"""Speculative decoding by prompt lookup (n-gram proposals), as vLLM's ``ngram`` method and
llama.cpp's lookup decoding: no second model. A request that repeats text it has seen (a summary
quoting its document, an edit of given code, an extraction) often continues the latest earlier
occurrence of its last few tokens; those next tokens are proposed, and one forward computes the
request's last token and every proposed one, so that a step reads the weights once for up to k + 1
tokens.

The step samples the logits after the last token and after each proposed token; the proposals are
accepted as far as each equals the token sampled before it, and the first sampled token that
differs (or the one after the last proposal) comes with them. For a greedy request every delivered
token is then the one greedy decoding would have produced. A sampled request's rows verify their
proposals by rejection sampling (runtime/sampler.py, ``verify``): a row keeps its proposal with the
probability the request's distribution gives it, else draws from the rest, so each token is
distributed as without speculation (not the same draws: a seeded request, whose draws must not
depend on its batch, does not speculate). The scheduler gives the proposals' K/V slots, and takes
back the blocks that only rejected proposals filled (runtime/scheduler.py, runtime/kv_manager.py).

Structured output: a constrained request's proposals are cut where its grammar refuses them; each
of its rows is masked by the grammar's state after the proposals before it (llguidance computes
those masks and rolls back, runtime/constraints.py); the grammar then takes the kept tokens only,
and a grammar that ends at one of them ends the request there.

Penalties (repetition, presence, frequency) count the proposed tokens before each row: the sampler
sees such a row as its request with those tokens appended (``RowView``).

Who speculates (``max_proposed``): every request but a seeded sampled one, whose draws must not
depend on its batch (and how many rows it gets does). ``logit_bias``, penalties, temperature,
top-k/p, min-p, structured output and ``logprobs`` hold at every position.
"""

from __future__ import annotations

from .config import MAX_SPECULATIVE_TOKENS

# The n-grams looked up, longest first: a longer match predicts better, a one-token match still
# finds the continuation of a word or a repeated line.
NGRAM_MAX = 3
NGRAM_MIN = 1
# How many tokens a request has proposed at first; then, as transformers' assisted generation
# adapts its draft length, 2 more after a step that confirmed every proposal and 1 fewer (down to 1)
# after one that did not. Each proposed token is a row of the step: on the CPU a row costs a tenth
# to a fifth of a one-row step, so proposals that mostly fail must stay short.
FIRST_WIDTH = 2
# After a step that confirmed none of its proposals, a request proposes nothing for 1 step, then 2,
# 4, ... up to this many after each further miss, and from the next confirmed proposal on every step
# again: text that does not repeat (a story, a chat) costs a row now and then, not one every step.
LONGEST_REST = 16


class PromptLookup:
    """One request's index of its n-grams (prompt and output), for proposals in constant time per
    step: each n-gram maps to where its latest occurrence ends, the request's last n tokens
    excluded (their own occurrence would propose nothing new). A request's tokens only grow
    (preemption keeps them), so the index is only ever extended."""

    def __init__(self, longest: int = NGRAM_MAX, shortest: int = NGRAM_MIN):
        if not 1 <= shortest <= longest:
            raise ValueError(f"n-gram sizes must satisfy 1 <= shortest <= longest, got {shortest} and {longest}")
        self.longest, self.shortest = longest, shortest
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> the position of its latest indexed last token
        self.indexed = 0  # n-grams ending before this position are in ``ends``
        self.width = FIRST_WIDTH  # how many to propose next (see FIRST_WIDTH)
        self.rest, self.next_rest = 0, 1  # steps to propose nothing, and after the next miss (LONGEST_REST)

    def learn(self, proposed: int, confirmed: int) -> None:
        """After a step that verified ``proposed`` tokens and confirmed ``confirmed`` of them."""
        self.width = min(self.width + 2, MAX_SPECULATIVE_TOKENS) if confirmed == proposed else max(1, self.width - 1)
        if confirmed:
            self.next_rest = 1
        else:
            self.rest, self.next_rest = self.next_rest, min(2 * self.next_rest, LONGEST_REST)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of
        ``tokens`` (``longest`` down to ``shortest`` tokens) seen before; [] where none was."""
        last = len(tokens) - 1
        for end in range(self.indexed, last):  # every n-gram that ends before the last token
            for n in range(self.shortest, min(self.longest, end + 1) + 1):
                self.ends[tuple(tokens[end - n + 1:end + 1])] = end
        self.indexed = max(self.indexed, last)
        if self.rest:
            self.rest -= 1
            return []
        if k <= 0:
            return []
        for n in range(min(self.longest, len(tokens)), self.shortest - 1, -1):
            end = self.ends.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end + 1:end + 1 + k]
        return []


def max_proposed(ctx, engine_default: int) -> int:
    """How many tokens ``ctx`` may have proposed in a step: its config's ``speculative_tokens``, or
    the engine's default where the config leaves it None; 0 for a request that does not speculate
    (see the module's docstring)."""
    config = ctx.config
    k = engine_default if config.speculative_tokens is None else config.speculative_tokens
    if not k or (config.sampled and config.seed is not None):
        return 0
    return k


def penalised(config) -> bool:
    return config.repetition_penalty != 1.0 or bool(config.presence_penalty) or bool(config.frequency_penalty)


class RowView:
    """A request as the sampler sees one of its rows that follows proposed tokens: its tokens with
    those proposals appended, so that penalties count them as they would once delivered."""

    def __init__(self, ctx, proposed: list[int]):
        self.ctx = ctx
        self.tokens = ctx.tokens + proposed

    def __getattr__(self, name):  # config, num_prompt, constraint, generator: the request's own
        return getattr(self.ctx, name)


def sampler_rows(sampling: list, proposals: list[int | None] | None) -> list:
    """The step's rows as the sampler should see them: a penalised request's rows after its first
    as RowViews with the proposals before them (see RowView); every other row its request."""
    if proposals is None:
        return sampling
    rows, before = [], []
    for i, ctx in enumerate(sampling):
        before = before if i and sampling[i - 1] is ctx else []
        rows.append(RowView(ctx, before) if before and penalised(ctx.config) else ctx)
        if proposals[i] is not None:
            before = before + [proposals[i]]
    return rows


def propose(ctx, k: int) -> list[int]:
    """Up to ``k`` proposed tokens to follow ``ctx``'s tokens, fewer while its recent proposals
    failed (PromptLookup.learn), and no further than its grammar allows (structured output); its
    n-gram index is made on first use."""
    if ctx.lookup is None:
        ctx.lookup = PromptLookup()
    draft = ctx.lookup.propose(ctx.tokens, min(k, ctx.lookup.width))
    if draft and ctx.constraint is not None:
        draft = draft[:ctx.constraint.valid_prefix(draft)]
    return draft


def matched(draft: list[int], sampled: list[int]) -> int:
    """How many of the proposed tokens ``draft`` the step confirms: ``sampled[i]`` is the token
    sampled (greedy, or by rejection sampling) after the request's last token and the first ``i``
    proposals, so proposal ``i`` stands while it equals ``sampled[i]`` and every one before it stood."""
    n = 0
    while n < len(draft) and draft[n] == sampled[n]:
        n += 1
    return n
