"""A mixture of experts' products over a GGUF file's own stacks: llama.cpp keeps each of an MoE
layer's three products (gate, up, down) as one tensor of every expert's matrix, and so does Loom,
in the file's blocks (or its floats), an expert's matrix a run of the stack's rows. Expert ``e``'s
SwiGLU multiplies rows e x inner .. (e + 1) x inner of the gate and up stacks, and rows e x hidden ..
of the down stack, on the block kernel (block_linear.py's), where they lie: no expert is copied
out, and a file's quantized experts never pass through float32."""

from __future__ import annotations

import torch
from torch import nn

from . import native
from ..families.moe import gated
from .block_linear import (ARGTYPES, FORMAT_NAMES, ROWS16, ROWS16_LAYOUTS, as_bytes, multiplies_rows16, row_bytes,
                           stored_format)


class BlockExperts(nn.Module):
    """moe.Experts' call over three stacks kept as a file holds them: gate and up [experts x inner,
    bytes a row of hidden values], down [experts x hidden, bytes a row of inner values]; with
    moe.Experts' biases (float [experts, 2 x inner] and [experts, hidden], or None) and activation."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, count: int, hidden: int, inner: int,
                 gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                 clamped_swiglu: tuple[float, float] | None = None):
        super().__init__()
        self.count, self.hidden, self.inner = count, hidden, inner
        self.register_buffer("gate_up_bias", gate_up_bias)  # (None: no bias)
        self.register_buffer("down_bias", down_bias)
        self.clamped_swiglu = clamped_swiglu
        self.formats = {}
        for name, stack, width, rows in (("gate", gate, hidden, inner), ("up", up, hidden, inner),
                                         ("down", down, inner, hidden)):
            format = stored_format(stack, width)
            if stack.shape[0] != count * rows:
                raise ValueError(f"the experts' {name} stack holds {stack.shape[0]} rows, not {count} x {rows}")
            if format in ROWS16_LAYOUTS and (rows % ROWS16 or not multiplies_rows16(format)):
                raise ValueError(f"{FORMAT_NAMES[format]} experts need {ROWS16}-row runs and a build that multiplies "
                                 f"them; an expert's {name} has {rows} rows")
            self.formats[name] = format
            self.register_buffer(name, as_bytes(stack).reshape(-1))
        self.kernel = native.function("loom_block_linear", torch.float32, ARGTYPES)

    def expert_rows(self, name: str, index: int) -> tuple[int, int, int]:
        """(address, format, rows) of expert ``index``'s matrix in stack ``name``."""
        format = self.formats[name]
        rows, width = (self.hidden, self.inner) if name == "down" else (self.inner, self.hidden)
        return getattr(self, name).data_ptr() + index * rows * row_bytes(width, format), format, rows

    def forward(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``index``'s SwiGLU over all the step's tokens routed to it (float32 rows)."""
        x = x.float().contiguous()
        tokens, inner = x.shape[0], self.inner
        gate_up = torch.empty(tokens, 2 * inner)
        for half, name in enumerate(("gate", "up")):
            address, format, rows = self.expert_rows(name, index)
            self.kernel(x.data_ptr(), self.hidden, tokens, address, format, None, self.hidden, rows,
                        gate_up[:, half * inner:].data_ptr(), 2 * inner)
        if self.gate_up_bias is not None:
            gate_up += self.gate_up_bias[index].float()
        hidden = gated(gate_up[:, :inner], gate_up[:, inner:], self.clamped_swiglu).contiguous()
        out = torch.empty(tokens, self.hidden)
        address, format, rows = self.expert_rows("down", index)
        self.kernel(hidden.data_ptr(), inner, tokens, address, format, None, inner, rows, out.data_ptr(), self.hidden)
        return out if self.down_bias is None else out + self.down_bias[index].float()

    def extra_repr(self) -> str:
        kinds = ", ".join(f"{name} {FORMAT_NAMES[f]}" for name, f in self.formats.items())
        return f"{self.count} experts, hidden={self.hidden}, inner={self.inner}, {kinds}"


def use_stored_experts(model: nn.Module, state: dict) -> None:
    """Swap each float moe.Experts of ``model`` whose stacks ``state`` holds as a file's (gate_up as
    the two stacks [gate, up]; kept blocks or float rows) for a BlockExperts over those very tensors,
    and name them in ``state`` as it does, for load_state_dict."""
    from ..families.moe import Experts

    for prefix, module in list(model.named_modules()):
        stacks = state.get(f"{prefix}.gate_up")
        if not isinstance(module, Experts) or not isinstance(stacks, list):
            continue
        count, hidden, inner = module.down.shape
        gate, up = stacks
        biases = [state.pop(f"{prefix}.{name}", None) for name in ("gate_up_bias", "down_bias")]
        experts = BlockExperts(gate, up, state.pop(f"{prefix}.down"), count, hidden, inner, *biases,
                               module.clamped_swiglu)
        del state[f"{prefix}.gate_up"]
        state.update({f"{prefix}.{name}": buffer for name, buffer in experts.named_buffers()})
        parent_name, _, name = prefix.rpartition(".")
        setattr(model.get_submodule(parent_name), name, experts)
