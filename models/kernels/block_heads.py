"""Products a head at a time over a GGUF file's per-head stacks: DeepSeek's latent attention projects each head's
query into the latent's space and each head's output out of it by matrices of its own (attn_k_b, attn_v_b), which
a file keeps as one tensor [heads x rows, a row's bytes] in its format, often 8 bits. Multiplied where they lie,
every head in one native call (cpu_linear.cpp's loom_block_heads): in float32 they were a third of the bytes a
GLM-4.7-Flash layer reads a token."""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from . import native
from .block_linear import (FORMAT_NAMES, ROWS16, ROWS16_LAYOUTS, as_bytes, multiplies_rows16, row_bytes, runs_as_stored,
                           stored_format)

_pointer, _int64 = ctypes.c_void_p, ctypes.c_int64
ARGTYPES = [_pointer, _int64, _int64, _int64, _pointer, _int64, _int64, _int64, _int64, _int64, _pointer, _int64,
            _int64]


class HeadProducts(nn.Module):
    """y[t, h] = weight[h] x[t, h]: ``heads`` matrices [out, in] in float, one a head, over each head's values."""

    def __init__(self, heads: int, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(heads, out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, heads, in] (its heads' values may be a view's) -> [tokens, heads, out]."""
        return torch.bmm(x.transpose(0, 1), self.weight.transpose(1, 2)).transpose(0, 1)


class BlockHeadProducts(nn.Module):
    """HeadProducts' call over a file's stack of the heads' matrices in blocks (or its float rows), [heads x out,
    bytes a row of ``in`` values]."""

    def __init__(self, stack: torch.Tensor, heads: int, out_features: int, in_features: int):
        super().__init__()
        self.heads, self.out_features, self.in_features = heads, out_features, in_features
        self.format = stored_format(stack, in_features)
        if stack.shape[0] != heads * out_features:
            raise ValueError(f"a stack of {heads} heads' matrices of {out_features} rows holds {stack.shape[0]} rows")
        if self.format in ROWS16_LAYOUTS and (out_features % ROWS16 or not multiplies_rows16(self.format)):
            raise ValueError(f"{FORMAT_NAMES[self.format]} heads need {ROWS16}-row matrices and a build that "
                             f"multiplies them; a head's has {out_features} rows")
        self.register_buffer("blocks", as_bytes(stack).reshape(-1))
        self.kernel = native.function("loom_block_heads", torch.float32, ARGTYPES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, heads, in] float32, each head's values contiguous -> [tokens, heads, out]."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        tokens = x.shape[0]
        y = torch.empty(tokens, self.heads, self.out_features)
        head_bytes = self.out_features * row_bytes(self.in_features, self.format)
        self.kernel(x.data_ptr(), x.stride(0), x.stride(1), tokens, self.blocks.data_ptr(), head_bytes, self.format,
                    self.in_features, self.out_features, self.heads, y.data_ptr(), y.stride(0), y.stride(1))
        return y

    def extra_repr(self) -> str:
        return f"{self.heads} heads, in={self.in_features}, out={self.out_features}, {FORMAT_NAMES[self.format]}"


def use_stored_heads(model: nn.Module, state: dict, float_rows: bool = False) -> None:
    """Swap each HeadProducts of ``model`` whose stack ``state`` holds as a file's (blocks, or with ``float_rows``
    float rows, [heads x out, ...]) for a BlockHeadProducts over that very tensor, named in ``state`` as it names
    it, for load_state_dict."""
    for prefix, module in list(model.named_modules()):
        stack = state.get(f"{prefix}.weight")
        if not isinstance(module, HeadProducts) or stack is None or stack.dim() != 2 or not runs_as_stored(
                stack, float_rows):
            continue
        heads, out_features, in_features = module.weight.shape
        products = BlockHeadProducts(state.pop(f"{prefix}.weight"), heads, out_features, in_features)
        state[f"{prefix}.blocks"] = products.blocks
        parent_name, _, name = prefix.rpartition(".")
        setattr(model.get_submodule(parent_name), name, products)
