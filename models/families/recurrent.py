"""What the recurrent layers share (Qwen3.5's gated delta rule, Granite 4's Mamba2): a step's sequences as runs
of rows over their state slots (models/step.py's ``state_shapes``), the check that each names a slot of its
own, and their short causal convolution on torch operators, whose earlier inputs a slot keeps."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# The context of a model whose layers are all recurrent (Mamba2's own, Mamba's): it has no positions to run out of;
# llama.cpp's converters write 2^20 for them, and Loom takes that where a config or file says none.
UNBOUNDED_CONTEXT = 1 << 20


def check_state_slots(step, kv_cache) -> None:
    """A ValueError unless each of the step's sequences names a state slot of its own in the pool and none
    verifies proposals (models/step.py): the layers read and write a slot in place, a sequence's rows at a time."""
    slots = step.state_slots
    own = slots is not None and (not len(slots) or 0 <= int(slots.min()) and int(slots.max()) < kv_cache.num_state_slots
                                 and len(slots.unique()) == len(slots))
    if not own or step.verifies:
        raise ValueError(f"a model with recurrent layers needs each sequence to name one of the pool's "
                         f"{kv_cache.num_state_slots} state slots, its own, and no verified proposals (models/step.py)")


class StateRuns:
    """A step's sequences as runs of rows (each decode row one; each prefill chunk its rows), with what
    every recurrent layer reads of them, built once a step: each row's state slot and context length
    (the kernels'); for the torch operators, each run's slot and whether it starts at its sequence's first
    token (its state then zeros), where each row's convolution inputs lie in [the runs' earlier inputs;
    the step's], and the waves of the recurrence (the t-th row of each run longer than t)."""

    def __init__(self, step, back: int):
        self.back = back
        self.row_slots = step.row_state_slots().contiguous()
        self.row_lens = (step.positions + 1).contiguous()
        self.starts = step.sequence_starts()
        self.lengths = [end - start for start, end in zip(self.starts, self.starts[1:] + [len(step.input_ids)])]
        self.slots = step.state_slots
        self.fresh = self.row_lens[self.starts] == 1

    @functools.cached_property
    def sources(self) -> torch.Tensor:
        """[rows, back]: where the input b + 1 tokens before each row's lies in [earlier inputs (runs x back);
        the step's rows]."""
        runs, back = len(self.starts), self.back
        return self._tensor([[runs * back + start + i - b if i >= b else r * back + back + i - b
                              for b in range(1, back + 1)]
                             for r, (start, n) in enumerate(zip(self.starts, self.lengths)) for i in range(n)], back)

    @functools.cached_property
    def tails(self) -> torch.Tensor:
        """[runs, back]: where each run's last ``back`` inputs lie (its slot's next earlier inputs), as ``sources``."""
        runs, back = len(self.starts), self.back
        return self._tensor([[runs * back + start + n - back + j if n - back + j >= 0 else r * back + n + j
                              for j in range(back)] for r, (start, n) in enumerate(zip(self.starts, self.lengths))], back)

    @functools.cached_property
    def waves(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """For each t, the rows that are their run's t-th and those runs."""
        offsets = torch.cat([torch.arange(n) for n in self.lengths]).to(self.slots.device)
        run_of_row = torch.repeat_interleave(torch.arange(len(self.lengths), device=self.slots.device),
                                             torch.tensor(self.lengths, device=self.slots.device))
        return [((offsets == t).nonzero().flatten(), run_of_row[offsets == t]) for t in range(max(self.lengths))]

    def _tensor(self, rows: list, width: int) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.long, device=self.slots.device).view(-1, width)


def convolve(mixed: torch.Tensor, taps: torch.Tensor, bias: torch.Tensor | None, conv_states: torch.Tensor,
             runs: StateRuns) -> torch.Tensor:
    """SiLU of each channel of ``mixed`` [rows, width] convolved with its ``taps`` [width, length] (the oldest
    first) over the row's input and the length - 1 before it: the run's earlier rows, or its slot's last
    inputs in ``conv_states`` [slots, length - 1, width] (zeros for a run from its sequence's first token),
    which move on to the run's last inputs."""
    keep = (~runs.fresh)[:, None, None]
    earlier = (conv_states[runs.slots] * keep).to(mixed.dtype).flatten(0, 1)
    inputs = torch.cat([earlier, mixed])
    out = mixed * taps[:, -1] if bias is None else mixed * taps[:, -1] + bias
    for b in range(1, taps.shape[1]):
        out = out + inputs[runs.sources[:, b - 1]] * taps[:, -1 - b]
    conv_states[runs.slots] = inputs[runs.tails].to(conv_states.dtype)
    return F.silu(out)
