"""Batched sampling: penalties, temperature, top-k, top-p and per-request seeds for the whole
step at once, then a single device-to-host transfer."""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, contexts, generator: torch.Generator) -> list[int]:
    """One token per row of ``logits`` [S, vocab]; row i belongs to ``contexts[i]``."""
    configs = [ctx.config for ctx in contexts]
    penalised = [i for i, c in enumerate(configs) if c.repetition_penalty != 1.0]
    if penalised:
        logits = apply_repetition_penalty(logits, [contexts[i] for i in penalised], penalised)
    tokens = greedy(logits)
    sampled = [i for i, c in enumerate(configs) if c.sampled]
    if sampled:
        rows = torch.tensor(sampled, device=logits.device)
        probs, order = filtered_probs(logits[rows], [configs[i] for i in sampled])
        seeded = [j for j, i in enumerate(sampled) if contexts[i].generator is not None]
        if len(seeded) < len(sampled):
            draws = torch.multinomial(probs, 1, generator=generator)[:, 0]
        else:
            draws = torch.empty(len(sampled), dtype=torch.long, device=logits.device)
        for j in seeded:  # a request's own generator makes its draws independent of its batch-mates
            draws[j] = torch.multinomial(probs[j], 1, generator=contexts[sampled[j]].generator)[0]
        tokens[rows] = order.gather(1, draws[:, None])[:, 0] if order is not None else draws
    return tokens.tolist()


def sample_each(logits: torch.Tensor, contexts, generator: torch.Generator) -> list[int | BaseException]:
    """``sample`` one row at a time, for a step whose batched sampling raised: each row gets its
    token, or the exception its own sampling raised, so that one request's failure stays its own."""
    out = []
    for i, ctx in enumerate(contexts):
        try:
            out += sample(logits[i:i + 1], [ctx], generator)
        except Exception as error:  # noqa: BLE001 - handed to that request's consumer
            out.append(error)
    return out


def greedy(logits: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """The index of each row's largest logit; the first one on ties, as ``torch.argmax``. On the
    CPU, argmax is not vectorised while amax is (docs/benchmarks.md): the max of each 256-wide
    chunk, the first chunk that holds the row's max, then argmax inside that chunk alone."""
    vocab = logits.shape[-1]
    whole = vocab // chunk
    if logits.device.type != "cpu" or whole < 2:
        return logits.argmax(dim=-1)
    maxes = logits[:, :whole * chunk].unflatten(1, (whole, chunk)).amax(-1)
    if whole * chunk < vocab:
        maxes = torch.cat([maxes, logits[:, whole * chunk:].amax(-1, keepdim=True)], 1)
    first = maxes.argmax(-1)
    # Columns past the vocabulary (in a short last chunk) repeat its last column, after it: argmax
    # still finds the first place of the max.
    cols = (first[:, None] * chunk + torch.arange(chunk, device=logits.device)).clamp_max(vocab - 1)
    return first * chunk + logits.gather(1, cols).argmax(-1)


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
    """Probabilities after temperature, top-k and top-p. When a filter is on, they come in
    descending order with the permutation that maps back to vocabulary ids; else order is None.
    The row's max is subtracted before dividing by the temperature: every logit is then <= 0 and
    the max is exactly 0, so no temperature that validation lets through overflows the softmax."""
    device, vocab = logits.device, logits.shape[-1]
    logits = (logits - logits.amax(-1, keepdim=True)).float()  # in the logits' own dtype: no overflow
    temperature = torch.tensor([c.sampling_temperature for c in configs], dtype=logits.dtype, device=device)[:, None]
    logits = logits / temperature
    if all(c.top_k == 0 and c.top_p >= 1.0 for c in configs):
        return logits.softmax(-1), None
    logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    top_k = torch.tensor([min(c.top_k, vocab) or vocab for c in configs], device=device)[:, None]
    logits = logits.masked_fill(ranks >= top_k, float("-inf"))
    probs = logits.softmax(-1)
    top_p = torch.tensor([c.top_p for c in configs], dtype=probs.dtype, device=device)[:, None]
    # The first token is always kept, also where top_p rounds to 0 in float32 (5e-324, say).
    outside = ((probs.cumsum(-1) - probs) >= top_p) & (ranks > 0)
    probs = probs.masked_fill(outside, 0.0)
    return probs / probs.sum(-1, keepdim=True), order
