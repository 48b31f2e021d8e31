"""StepPlan -> StepInput: the flattened tensors of one forward.

Every token of the step sits in one 1-D sequence: first the one-token entries (decodes), then
each prefill chunk. Nothing is padded to the longest request; only the decode block tables are
padded, to the longest table, so that decode attention is one batched call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .scheduler import StepPlan


@dataclass
class PrefillChunk:
    start: int                 # where its tokens begin in the flat batch
    end: int
    first_position: int        # position of its first token in its sequence
    block_table: torch.Tensor  # the blocks that hold positions [0, first_position + end - start)


@dataclass
class StepInput:
    input_ids: torch.Tensor            # [T]
    positions: torch.Tensor            # [T]
    slot_mapping: torch.Tensor         # [T] where each token's K/V is written in the pool
    num_decodes: int                   # the first num_decodes tokens are one-token entries
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks], padded with block 0
    decode_context_lens: torch.Tensor  # [num_decodes] keys each decode token attends to
    prefills: list[PrefillChunk]
    sample_indices: torch.Tensor       # [S] flat positions whose logits are sampled
    block_size: int

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def build(plan: StepPlan, block_size: int, device: torch.device) -> StepInput:
    ids, positions, slots, samples = [], [], [], []
    tables, context_lens, prefills = [], [], []
    for ctx, n in plan.work:
        start, first = len(ids), ctx.num_computed
        span = range(first, first + n)
        ids += ctx.tokens[first:first + n]
        positions += span
        table = ctx.block_table
        slots += [table[p // block_size] * block_size + p % block_size for p in span]
        used = table[:-(-(first + n) // block_size)]
        if n == 1:
            tables.append(used)
            context_lens.append(first + 1)
        else:
            prefills.append(PrefillChunk(start, start + n, first, torch.tensor(used, device=device)))
        if first + n == len(ctx.tokens):
            samples.append(start + n - 1)

    width = max(map(len, tables), default=0)
    as_tensor = lambda data: torch.tensor(data, dtype=torch.long).to(device, non_blocking=True)
    return StepInput(
        input_ids=as_tensor(ids),
        positions=as_tensor(positions),
        slot_mapping=as_tensor(slots),
        num_decodes=plan.num_decodes,
        decode_block_tables=as_tensor([t + [0] * (width - len(t)) for t in tables]).view(len(tables), width),
        decode_context_lens=as_tensor(context_lens),
        prefills=prefills,
        sample_indices=as_tensor(samples),
        block_size=block_size,
    )


def sampling_contexts(plan: StepPlan):
    """The requests that sample this step, in the order of StepInput.sample_indices."""
    return [ctx for ctx, n in plan.work if ctx.num_computed + n == len(ctx.tokens)]
