"""StepPlan -> StepInput: the flattened tensors of one forward.

Every token of the step sits in one 1-D sequence: first the one-token entries (decodes), longest
context first, then each prefill chunk. Nothing is padded to the longest request. Decode attention
runs as a few batched calls, one per group of similar context lengths, each padding its block
tables only to the longest in its group.
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
class DecodeGroup:
    start: int                  # its one-token entries are tokens [start, end) of the batch
    end: int
    block_tables: torch.Tensor  # [end - start, max_blocks], padded with block 0
    context_lens: torch.Tensor  # [end - start] keys each token attends to


# A decode whose table is shorter than this share of its group's longest starts a new group:
# padding costs copies and attention over masked keys, a group costs a few calls per layer.
GROUP_FILL = 0.6
MAX_GROUPS = 4


@dataclass
class StepInput:
    input_ids: torch.Tensor            # [T]
    positions: torch.Tensor            # [T]
    slot_mapping: torch.Tensor         # [T] where each token's K/V is written in the pool
    num_decodes: int                   # the first num_decodes tokens are one-token entries
    decode_groups: list[DecodeGroup]
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

    as_tensor = lambda data: torch.tensor(data, dtype=torch.long).to(device, non_blocking=True)
    groups = []
    for start, end in group_by_length([len(t) for t in tables]):
        width = len(tables[start])
        padded = [t + [0] * (width - len(t)) for t in tables[start:end]]
        groups.append(DecodeGroup(start, end, as_tensor(padded).view(end - start, width),
                                  as_tensor(context_lens[start:end])))
    return StepInput(
        input_ids=as_tensor(ids),
        positions=as_tensor(positions),
        slot_mapping=as_tensor(slots),
        num_decodes=plan.num_decodes,
        decode_groups=groups,
        prefills=prefills,
        sample_indices=as_tensor(samples),
        block_size=block_size,
    )


def group_by_length(widths: list[int]) -> list[tuple[int, int]]:
    """Split decodes (sorted by block-table width, longest first) into ranges of similar width."""
    groups, start = [], 0
    for i, width in enumerate(widths):
        if width < GROUP_FILL * widths[start] and len(groups) < MAX_GROUPS - 1:
            groups.append((start, i))
            start = i
    return groups + [(start, len(widths))] if widths else []


def sampling_contexts(plan: StepPlan):
    """The requests that sample this step, in the order of StepInput.sample_indices."""
    return [ctx for ctx, n in plan.work if ctx.num_computed + n == len(ctx.tokens)]
