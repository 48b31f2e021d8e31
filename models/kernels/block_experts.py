"""A mixture of experts' products over a GGUF file's own stacks: llama.cpp keeps each of an MoE
layer's three products (gate, up, down) as one tensor of every expert's matrix, and so does Loom,
in the file's blocks (or its floats), an expert's matrix a run of the stack's rows. Expert ``e``'s
SwiGLU multiplies rows e x inner .. (e + 1) x inner of the gate and up stacks, and rows e x hidden ..
of the down stack, on the block kernel (block_linear.py's), where they lie: no expert is copied
out, and a file's quantized experts never pass through float32. Nemotron 3's experts have no gate: an up
and a down stack."""

from __future__ import annotations

import torch
from torch import nn

from . import native
from ..families.moe import activated
from .block_linear import (ARGTYPES, FORMAT_NAMES, ROWS16, ROWS16_LAYOUTS, as_bytes, multiplies_rows16, row_bytes,
                           stored_format)


class BlockExperts(nn.Module):
    """moe.Experts' call over three stacks kept as a file holds them: gate and up [experts x inner,
    bytes a row of hidden values], down [experts x hidden, bytes a row of inner values]; with
    moe.Experts' biases (float [experts, 2 x inner] and [experts, hidden], or None) and activation."""

    def __init__(self, gate: torch.Tensor | None, up: torch.Tensor | None, down: torch.Tensor, count: int,
                 hidden: int, inner: int, gate_up_bias: torch.Tensor | None = None,
                 down_bias: torch.Tensor | None = None, clamped_swiglu: tuple[float, float] | None = None,
                 gelu: bool = False):
        """``up`` None: ``gate`` is both stacks as one file keeps them, each expert's gate rows, then its up rows.
        ``gate`` None: the experts have none, their up rows activated by relu(up)^2 (moe.MoESpec.squared_relu)."""
        super().__init__()
        self.count, self.hidden, self.inner = count, hidden, inner
        self.register_buffer("gate_up_bias", gate_up_bias)  # (None: no bias)
        self.register_buffer("down_bias", down_bias)
        self.clamped_swiglu, self.squared_relu, self.gelu = clamped_swiglu, gate is None, gelu
        self.formats = {}
        self.fused = up is None
        if self.fused:
            stacks = (("gate_up", gate, hidden, 2 * inner),)
        else:
            stacks = (("up", up, hidden, inner),) if self.squared_relu else (("gate", gate, hidden, inner),
                                                                             ("up", up, hidden, inner))
        for name, stack, width, rows in (*stacks, ("down", down, inner, hidden)):
            format = stored_format(stack, width)
            if stack.shape[0] != count * rows:
                raise ValueError(f"the experts' {name} stack holds {stack.shape[0]} rows, not {count} x {rows}")
            each = inner if name == "gate_up" else rows  # (a run may not cross from an expert's gate to its up)
            if format in ROWS16_LAYOUTS and (each % ROWS16 or not multiplies_rows16(format)):
                raise ValueError(f"{FORMAT_NAMES[format]} experts need {ROWS16}-row runs and a build that multiplies "
                                 f"them; an expert's {name} has {each} rows")
            self.formats[name] = format
            self.register_buffer(name, as_bytes(stack).reshape(-1))
        if self.fused:
            self.formats["gate"] = self.formats["up"] = self.formats["gate_up"]
        self.kernel = native.function("loom_block_linear", torch.float32, ARGTYPES)

    def expert_rows(self, name: str, index: int) -> tuple[int, int, int]:
        """(address, format, rows) of expert ``index``'s matrix ``name`` (gate, up or down)."""
        format = self.formats[name]
        if name == "down":
            return self.down.data_ptr() + index * self.hidden * row_bytes(self.inner, format), format, self.hidden
        row = row_bytes(self.hidden, format)
        if self.fused:  # (expert e's 2 x inner rows: its gate's, then its up's)
            first = index * 2 * self.inner + (self.inner if name == "up" else 0)
            return self.gate_up.data_ptr() + first * row, format, self.inner
        return getattr(self, name).data_ptr() + index * self.inner * row, format, self.inner

    def forward(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``index`` over all the step's tokens routed to it (float32 rows)."""
        x = x.float().contiguous()
        tokens, inner = x.shape[0], self.inner
        names = ("up",) if self.squared_relu else ("gate", "up")
        first = torch.empty(tokens, len(names) * inner)
        for part, name in enumerate(names):
            address, format, rows = self.expert_rows(name, index)
            self.kernel(x.data_ptr(), self.hidden, tokens, address, format, None, self.hidden, rows,
                        first[:, part * inner:].data_ptr(), first.shape[1])
        if self.gate_up_bias is not None:
            first += self.gate_up_bias[index].float()
        hidden = activated(first, self.clamped_swiglu, self.squared_relu, self.gelu).contiguous()
        out = torch.empty(tokens, self.hidden)
        address, format, rows = self.expert_rows("down", index)
        self.kernel(hidden.data_ptr(), inner, tokens, address, format, None, inner, rows, out.data_ptr(), self.hidden)
        return out if self.down_bias is None else out + self.down_bias[index].float()

    def extra_repr(self) -> str:
        kinds = ", ".join(f"{name} {FORMAT_NAMES[f]}" for name, f in self.formats.items() if name != "gate_up")
        return f"{self.count} experts, hidden={self.hidden}, inner={self.inner}, {kinds}"


def use_stored_experts(model: nn.Module, state: dict) -> None:
    """Swap each float moe.Experts of ``model`` whose stacks ``state`` holds as a file's (gate_up as
    the two stacks [gate, up], the one stack of both, or of experts without a gate [up]; kept blocks or float
    rows) for a BlockExperts over those very tensors, and name them in ``state`` as it does, for load_state_dict."""
    from ..families.moe import Experts

    for prefix, module in list(model.named_modules()):
        stacks = state.get(f"{prefix}.gate_up")
        if not isinstance(module, Experts) or not isinstance(stacks, list):
            continue
        count, hidden, inner = module.down.shape
        # (one: a file's gate and up as one stack, or experts' up without a gate)
        gate, up = stacks if len(stacks) == 2 else (None, stacks[0]) if module.squared_relu else (stacks[0], None)
        biases = [state.pop(f"{prefix}.{name}", None) for name in ("gate_up_bias", "down_bias")]
        experts = BlockExperts(gate, up, state.pop(f"{prefix}.down"), count, hidden, inner, *biases,
                               module.clamped_swiglu, module.gelu)
        del state[f"{prefix}.gate_up"]
        state.update({f"{prefix}.{name}": buffer for name, buffer in experts.named_buffers()})
        parent_name, _, name = prefix.rpartition(".")
        setattr(model.get_submodule(parent_name), name, experts)
