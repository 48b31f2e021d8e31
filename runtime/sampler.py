"""Batched sampling: penalties, bias, structured-output masks, temperature, top-k, top-p, min-p
and per-request seeds for the whole step at once, then a single device-to-host transfer (which
carries the step's log-probabilities too, when a request asks for them). A row that verifies a
proposed token (speculative decoding) keeps it or draws another by rejection sampling, so that its
token is distributed as the row's own draw would be (``verify``): for a proposal that came with
certainty (prompt lookup, a greedy draft) or one a draft model drew from its distribution q."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .constraints import apply_masks


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (before penalties, bias, temperature
    and constraints, as OpenAI and vLLM report it) and the most likely alternatives, best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def sample(logits: torch.Tensor, contexts, generator: torch.Generator, bitmask: torch.Tensor | None = None,
           proposals: list[int | None] | None = None, draft_probs: list | None = None
           ) -> tuple[list[int], list[TokenLogprob | None] | None]:
    """One token per row of ``logits`` [S, vocab]; row i belongs to ``contexts[i]``, and row i of
    ``bitmask`` holds its allowed tokens when it has a constraint. ``proposals[i]``, where given
    and not None, is the token proposed for row i (speculative decoding): a sampled row keeps it
    or draws another (``verify``); a greedy row's argmax is compared with it by the caller.
    ``draft_probs[i]``, where given and not None: the distribution [vocab] a draft model drew that
    proposal from (else it came with certainty).
    Returns the tokens, and each row's TokenLogprob (None where not asked) or None when no row asked."""
    configs = [ctx.config for ctx in contexts]
    raw = logits
    logits = apply_penalties(logits, contexts)
    constrained = [i for i, ctx in enumerate(contexts) if ctx.constraint is not None]
    if constrained:
        logits = apply_masks(logits, bitmask, constrained)
    tokens = greedy(logits)
    sampled = [i for i, c in enumerate(configs) if c.sampled]
    # Rows with a top-k or top-p filter draw from sorted probabilities, the others from the
    # vocabulary's order: apart, so that a seeded request draws the same token whatever its batch-mates.
    for rows in ([i for i in sampled if not filters(configs[i])], [i for i in sampled if filters(configs[i])]):
        if rows:
            tokens[torch.tensor(rows, device=logits.device)] = draw(logits, rows, contexts, generator, proposals,
                                                                    draft_probs)
    return transfer(tokens, raw, configs)


def filters(config) -> bool:
    return config.top_k > 0 or config.top_p < 1.0


def draw(logits: torch.Tensor, rows: list[int], contexts, generator: torch.Generator,
         proposals: list[int | None] | None = None, draft_probs: list | None = None) -> torch.Tensor:
    """A sampled token for each of ``rows``: from the request's own generator when it has a seed;
    for a row that verifies a proposed token, by ``verify`` (with the draft's q where given)."""
    index = torch.tensor(rows, device=logits.device)
    probs, order = filtered_probs(logits[index], [contexts[i].config for i in rows])
    seeded = [j for j, i in enumerate(rows) if contexts[i].generator is not None]
    if len(seeded) < len(rows):
        draws = torch.multinomial(probs, 1, generator=generator)[:, 0]
    else:
        draws = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    for j in seeded:  # a request's own generator makes its draws independent of its batch-mates
        draws[j] = torch.multinomial(probs[j], 1, generator=contexts[rows[j]].generator)[0]
    tokens = order.gather(1, draws[:, None])[:, 0] if order is not None else draws
    verifying = [j for j, i in enumerate(rows) if proposals is not None and proposals[i] is not None]
    if verifying:
        at = torch.tensor(verifying, device=logits.device)
        proposed = torch.tensor([proposals[rows[j]] for j in verifying], device=logits.device)
        by_token = probs[at] if order is None else torch.empty_like(probs[at]).scatter_(1, order[at], probs[at])
        drafted = None
        if draft_probs is not None and any(draft_probs[rows[j]] is not None for j in verifying):
            certain = torch.zeros_like(by_token).scatter_(1, proposed[:, None], 1.0)  # a proposal without q
            drafted = torch.stack([certain[n] if draft_probs[rows[j]] is None else draft_probs[rows[j]].to(by_token)
                                   for n, j in enumerate(verifying)])
        tokens[at] = verify(by_token, proposed, generator, drafted)
    return tokens


def verify(probs: torch.Tensor, proposed: torch.Tensor, generator: torch.Generator,
           draft_probs: torch.Tensor | None = None) -> torch.Tensor:
    """Rejection sampling of proposed tokens (Leviathan et al.), exact: each row keeps its proposal
    x with probability min(1, p(x) / q(x)), p its row of ``probs`` [rows, vocab] (vocabulary
    order, filters applied) and q the distribution x was drawn from (its row of ``draft_probs``,
    a draft model's), else draws from max(0, p - q) renormalised; every token is then distributed
    as p, as likely as in a draw of its own (over x drawn from q as it is). ``draft_probs`` None:
    every proposal taken as certain (prompt lookup, a greedy draft; q one-hot at x), and the rule
    is keep x with p(x), else draw from p without x: p(x) + (1 - p(x)) p(y) / (1 - p(x)) = p(y)
    for each x on its own, however it was chosen; the p/q rule keeps more where q is known. A row that keeps x
    makes the next row's proposal stand as its context; the scheduler keeps the rows up to the
    first that drew something else. The request's own generator is not used: seeded requests do
    not speculate, so that their draws stay what they are without it."""
    chance = probs.gather(1, proposed[:, None])[:, 0]
    if draft_probs is not None:  # q(x) > 0: x was drawn from q
        chance = chance / draft_probs.gather(1, proposed[:, None])[:, 0].clamp_min(torch.finfo(probs.dtype).tiny)
    keep = torch.rand(len(proposed), generator=generator, device=probs.device, dtype=probs.dtype) < chance
    rest = probs.scatter(1, proposed[:, None], 0.0) if draft_probs is None else (probs - draft_probs).clamp_min(0)
    # where x held all the mass it is always kept (rand < 1), and where q >= p everywhere p = q and
    # x is always kept too: any valid row will do for the draw
    rest = torch.where(rest.sum(-1, keepdim=True) > 0, rest, probs)
    other = torch.multinomial(rest, 1, generator=generator)[:, 0]
    return torch.where(keep, proposed, other)


def sample_each(logits: torch.Tensor, contexts, generator: torch.Generator, bitmask: torch.Tensor | None = None,
                proposals: list[int | None] | None = None, draft_probs: list | None = None):
    """``sample`` one row at a time, for a step whose batched sampling raised: each row gets its
    (token, logprob), or the exception its own sampling raised, so that one request's failure
    stays its own."""
    out = []
    for i, ctx in enumerate(contexts):
        try:
            tokens, logprobs = sample(logits[i:i + 1], [ctx], generator, None if bitmask is None else bitmask[i:i + 1],
                                      None if proposals is None else proposals[i:i + 1],
                                      None if draft_probs is None else draft_probs[i:i + 1])
            out.append((tokens[0], logprobs[0] if logprobs else None))
        except Exception as error:  # noqa: BLE001 - handed to that request's consumer
            out.append((error, None))
    return out


def transfer(tokens: torch.Tensor, raw: torch.Tensor, configs) -> tuple[list[int], list[TokenLogprob | None] | None]:
    """The step's tokens on the host, with the log-probabilities of the rows that ask for them,
    in one transfer: a step's logprobs are packed beside its tokens (exact in float64)."""
    rows = [i for i, c in enumerate(configs) if c.logprobs is not None]
    if not rows:
        return tokens.tolist(), None
    k = max(configs[i].logprobs for i in rows)
    index = torch.tensor(rows, device=raw.device)
    logprobs = raw[index].to(torch.promote_types(raw.dtype, torch.float32)).log_softmax(-1)
    chosen = logprobs.gather(1, tokens[index, None])[:, 0]
    top_values, top_ids = logprobs.topk(k, dim=-1)
    packed = torch.cat([tokens.double(), chosen.double(), top_ids.flatten().double(), top_values.flatten().double()])
    values = packed.tolist()
    n, r = len(configs), len(rows)
    host_tokens = [int(t) for t in values[:n]]
    ids, scores = values[n + r:n + r + r * k], values[n + r + r * k:]
    out: list[TokenLogprob | None] = [None] * n
    for j, i in enumerate(rows):
        top = tuple((int(ids[j * k + m]), scores[j * k + m]) for m in range(configs[i].logprobs))
        out[i] = TokenLogprob(host_tokens[i], values[n + j], top)
    return host_tokens, out


# Up to this many rows, greedy() is one argmax: after a forward has streamed the weights through the
# caches each torch operator runs cold, and the chunked path is six of them; from a few rows on the
# vectorised chunks win again (docs/benchmarks-history.md, "4-bit weights").
ARGMAX_ROWS = 2


def greedy(logits: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """The index of each row's largest logit; the first one on ties, as ``torch.argmax``. On the
    CPU, argmax is not vectorised while amax is (docs/benchmarks-history.md, "What changed
    performance, measured"): beyond ARGMAX_ROWS rows, the max of each 256-wide chunk, the first
    chunk that holds the row's max, then argmax inside that chunk alone."""
    vocab = logits.shape[-1]
    whole = vocab // chunk
    if logits.device.type != "cpu" or whole < 2 or logits.shape[0] <= ARGMAX_ROWS:
        return logits.argmax(dim=-1)
    maxes = logits[:, :whole * chunk].unflatten(1, (whole, chunk)).amax(-1)
    if whole * chunk < vocab:
        maxes = torch.cat([maxes, logits[:, whole * chunk:].amax(-1, keepdim=True)], 1)
    first = maxes.argmax(-1)
    # Columns past the vocabulary (in a short last chunk) repeat its last column, after it: argmax
    # still finds the first place of the max.
    cols = (first[:, None] * chunk + torch.arange(chunk, device=logits.device)).clamp_max(vocab - 1)
    return first * chunk + logits.gather(1, cols).argmax(-1)


def apply_penalties(logits: torch.Tensor, contexts) -> torch.Tensor:
    """Repetition, presence and frequency penalties and logit_bias, each on the rows that set it."""
    configs = [ctx.config for ctx in contexts]
    repeated = [i for i, c in enumerate(configs) if c.repetition_penalty != 1.0]
    if repeated:
        logits = apply_repetition_penalty(logits, [contexts[i] for i in repeated], repeated)
    occurring = [i for i, c in enumerate(configs) if c.presence_penalty or c.frequency_penalty]
    if occurring:
        logits = apply_occurrence_penalties(logits, [contexts[i] for i in occurring], occurring)
    biased = [i for i, c in enumerate(configs) if c.logit_bias]
    if biased:
        logits = apply_logit_bias(logits, [configs[i].logit_bias for i in biased], biased)
    return logits


def apply_occurrence_penalties(logits, contexts, rows):
    """OpenAI's rule, over the generated tokens (not the prompt): a token's logit drops by
    frequency_penalty for each time it occurred, and by presence_penalty once if it did."""
    outputs = [ctx.tokens[ctx.num_prompt:] for ctx in contexts]
    width = max(map(len, outputs))
    if width == 0:
        return logits
    device, dtype = logits.device, logits.dtype
    ids = torch.tensor([o + [0] * (width - len(o)) for o in outputs], device=device)
    present = torch.tensor([[1.0] * len(o) + [0.0] * (width - len(o)) for o in outputs], dtype=dtype, device=device)
    counts = torch.zeros(len(rows), logits.shape[-1], dtype=dtype, device=device).scatter_add_(1, ids, present)
    frequency = torch.tensor([ctx.config.frequency_penalty for ctx in contexts], dtype=dtype, device=device)[:, None]
    presence = torch.tensor([ctx.config.presence_penalty for ctx in contexts], dtype=dtype, device=device)[:, None]
    index = torch.tensor(rows, device=device)
    logits = logits.clone()
    logits[index] -= counts * frequency + (counts > 0).to(dtype) * presence
    return logits


def apply_logit_bias(logits, biases: list[dict[int, float]], rows):
    row_ids = [r for r, bias in zip(rows, biases) for _ in bias]
    token_ids = [t for bias in biases for t in bias]
    values = [v for bias in biases for v in bias.values()]
    device = logits.device
    return logits.index_put((torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device)),
                            torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)


def apply_repetition_penalty(logits, contexts, rows):
    """transformers' rule: a token already in the prompt or output has its logit divided by the
    penalty when positive, multiplied when negative. Results stay finite whatever the penalty,
    so that sampling after it never meets inf - inf."""
    logits = logits.clone()
    width = max(len(ctx.tokens) for ctx in contexts)
    ids = torch.tensor([ctx.tokens + ctx.tokens[:1] * (width - len(ctx.tokens)) for ctx in contexts],
                       device=logits.device)
    penalty = torch.tensor([ctx.config.repetition_penalty for ctx in contexts],
                           dtype=torch.float64, device=logits.device)[:, None]
    rows = torch.tensor(rows, device=logits.device)
    scores = logits[rows].gather(1, ids).double()
    scores = torch.where(scores < 0, scores * penalty, scores / penalty)
    limit = torch.finfo(logits.dtype).max
    logits[rows] = logits[rows].scatter(1, ids, scores.clamp(-limit, limit).to(logits.dtype))
    return logits


def filtered_probs(logits, configs):
    """Probabilities after temperature, top-k, top-p and min-p. When a filter is on, they come in
    descending order with the permutation that maps back to vocabulary ids; else order is None.
    The row's max is subtracted before dividing by the temperature: every logit is then <= 0 and
    the max is exactly 0, so no temperature that validation lets through overflows the softmax."""
    device, vocab = logits.device, logits.shape[-1]
    logits = (logits - logits.amax(-1, keepdim=True)).float()  # in the logits' own dtype: no overflow
    temperature = torch.tensor([c.sampling_temperature for c in configs], dtype=logits.dtype, device=device)[:, None]
    logits = logits / temperature
    if not any(filters(c) for c in configs):
        return min_p_filter(logits.softmax(-1), configs), None
    logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    top_k = torch.tensor([min(c.top_k, vocab) or vocab for c in configs], device=device)[:, None]
    logits = logits.masked_fill(ranks >= top_k, float("-inf"))
    probs = logits.softmax(-1)
    top_p = torch.tensor([c.top_p for c in configs], dtype=probs.dtype, device=device)[:, None]
    # The first token is always kept, also where top_p rounds to 0 in float32 (5e-324, say).
    outside = ((probs.cumsum(-1) - probs) >= top_p) & (ranks > 0)
    probs = probs.masked_fill(outside, 0.0)
    return min_p_filter(probs / probs.sum(-1, keepdim=True), configs), order


def min_p_filter(probs, configs):
    """Drop tokens less likely than min_p times the row's most likely one (which always stays)."""
    if all(c.min_p == 0 for c in configs):
        return probs
    min_p = torch.tensor([c.min_p for c in configs], dtype=probs.dtype, device=probs.device)[:, None]
    probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
    return probs / probs.sum(-1, keepdim=True)
