"""weights="int4" and "int8": linear layers whose weights are kept in blocks of 32 values with a
scale each, as llama.cpp's Q4_1 and Q8_0 files keep them, multiplied by Loom's own kernel
(block_weights.h). ("int8" keeps every linear layer in the 8-bit blocks described below for the
output layer.)

A layer's weights take 4-bit codes with a scale and a minimum per block (0.75 bytes a value against
float32's 4; w = scale q + min), the output layer 8-bit codes with a scale (1.125 bytes), as
llama.cpp's Q4 files keep theirs: the logits are what sampling reads, and a vocabulary-wide product
is where 4 bits lose the most. The token embeddings take 8-bit blocks too (the output layer's, where
the two are tied). The activations and every sum stay float32. A layer whose input width is not a
multiple of 32 keeps float32 weights (a CpuLinear).

Quantizing (weights="int4"/"int8") is round-to-nearest from the float weights. A GGUF file's blocks
come in as they are instead (weights="stored", block_formats.py: BlockLinear.of_blocks).
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from . import native
from .cpu_linear import KERNEL_ROWS, CpuLinear, large_product

GROUP = 32  # values per block (block_weights.h)
OUTPUT_BITS = 8  # the output layer's and the token embeddings' (the layers': quantized.BLOCK_WEIGHTS)

# Longer products widen the weight to float32 for oneDNN this many values at a time (64 MiB).
WIDENED_ELEMENTS = 16 << 20

_int64, _pointer = ctypes.c_int64, ctypes.c_void_p
ARGTYPES = [_pointer, _int64, _int64, _pointer, _int64, _pointer, _int64, _int64, _pointer, _int64]
WIDEN_ARGTYPES = [_pointer, _int64, _int64, _int64, _int64, _int64, _pointer]


def row_bytes(width: int, bits: int) -> int:
    """Bytes of one row of ``width`` values in ``bits``-bit blocks: its codes, its float32 scales
    and, for 4 bits, its float32 minimums (block_weights.h's BlockWeights.stride)."""
    return width * bits // 8 + width // GROUP * (8 if bits == 4 else 4)


def quantize(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """A [out, in] float weight (in a multiple of GROUP) as block_weights.h's one byte buffer: row by
    row, the row's codes, its scales, and for 4 bits its minimums."""
    out, width = weight.shape
    blocks = weight.detach().float().reshape(out, width // GROUP, GROUP)
    if bits == 4:
        low, high = blocks.amin(-1), blocks.amax(-1)
        scales = (high - low) / 15
        inverse = torch.where(scales > 0, 1 / scales, 0)
        codes = ((blocks - low[..., None]) * inverse[..., None]).round().clamp(0, 15).to(torch.uint8)
        codes = codes[..., :GROUP // 2] | (codes[..., GROUP // 2:] << 4)  # byte j: values j and j + 16
        parts = [codes, scales, low]
    elif bits == 8:
        scales = blocks.abs().amax(-1) / 127
        inverse = torch.where(scales > 0, 1 / scales, 0)
        codes = (blocks * inverse[..., None]).round().clamp(-127, 127).to(torch.int8)
        parts = [codes, scales]
    else:
        raise ValueError(f"blocks hold 4- or 8-bit codes, not {bits}")
    return torch.cat([part.contiguous().view(torch.uint8).reshape(out, -1) for part in parts], dim=1).flatten()


def dequantize(blocks: torch.Tensor, bits: int, out: int, width: int) -> torch.Tensor:
    """The float32 [out, in] weight a block buffer stands for (the reference the tests check the
    kernel and quantize against)."""
    rows = blocks.view(out, -1)
    code_bytes, groups = width * bits // 8, width // GROUP
    codes = rows[:, :code_bytes]
    scales = rows[:, code_bytes:code_bytes + 4 * groups].contiguous().view(torch.float32)[..., None]
    if bits == 4:
        codes = codes.reshape(out, groups, GROUP // 2)
        values = torch.cat([codes & 15, codes >> 4], dim=-1).float()
        mins = rows[:, code_bytes + 4 * groups:].contiguous().view(torch.float32)[..., None]
        return (values * scales + mins).reshape(out, width)
    return (codes.contiguous().view(torch.int8).view(out, groups, GROUP).float() * scales).reshape(out, width)


class BlockLinear(nn.Module):
    """nn.Linear with its weight in blocks of ``bits``-bit codes (float32 activations, on the CPU).
    Products of up to KERNEL_ROWS rows run on Loom's kernel; longer prefill chunks widen the weight
    to float32, WIDENED_ELEMENTS at a time, for oneDNN's product, which at 256-1024 rows ran
    float32 weights 1.1-1.4x faster than the block kernel ran blocks (docs/benchmarks.md, "4-bit
    weights")."""

    def __init__(self, linear: nn.Linear, bits: int):
        super().__init__()
        if linear.in_features % GROUP:
            raise ValueError(f"block weights need an input width that is a multiple of {GROUP}, not {linear.in_features}")
        self._hold(quantize(linear.weight, bits), bits, *linear.weight.shape, linear.bias)

    @classmethod
    def of_blocks(cls, blocks: torch.Tensor, bits: int, width: int, bias: torch.Tensor | None = None) -> "BlockLinear":
        """A layer over blocks already in block_weights.h's layout, [out, bytes per row] (a GGUF
        file's, block_formats.py), taken as they are."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._hold(blocks.reshape(-1), bits, blocks.shape[0], width, bias)
        return layer

    def _hold(self, blocks: torch.Tensor, bits: int, out: int, width: int, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features, self.bits = out, width, bits
        self.register_buffer("blocks", blocks)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)
        self.kernel = native.function("loom_block_linear", torch.float32, ARGTYPES)
        self.widen = native.function("loom_block_widen", torch.float32, WIDEN_ARGTYPES)
        self.large = large_product(torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1 or rows.dtype != torch.float32:
            rows = rows.float().contiguous()
        if rows.shape[0] > KERNEL_ROWS:
            return self._widened_product(rows).view(*x.shape[:-1], self.out_features)
        y = torch.empty(rows.shape[0], self.out_features)
        if rows.shape[0]:
            self.kernel(rows.data_ptr(), rows.stride(0), rows.shape[0], self.blocks.data_ptr(), self.bits,
                        None if self.bias is None else self.bias.data_ptr(), self.in_features, self.out_features,
                        y.data_ptr(), self.out_features)
        return y.view(*x.shape[:-1], self.out_features)

    def _widened_product(self, rows: torch.Tensor) -> torch.Tensor:
        step = max(1, WIDENED_ELEMENTS // self.in_features)
        parts = []
        for first in range(0, self.out_features, step):
            count = min(step, self.out_features - first)
            weight = torch.empty(count, self.in_features)
            self.widen(self.blocks.data_ptr(), self.bits, self.in_features, self.out_features, first, count,
                       weight.data_ptr())
            bias = None if self.bias is None else self.bias[first:first + count]
            parts.append(self.large(rows, weight, bias))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self.bits}-bit blocks of {GROUP}")


class BlockEmbedding(nn.Module):
    """nn.Embedding over a table of blocks (8-bit, or a GGUF file's 4-bit ones): a lookup widens
    only the rows it reads. A tied table shares the output layer's blocks, so the model keeps one
    copy of it."""

    def __init__(self, blocks: torch.Tensor, num_embeddings: int, embedding_dim: int, bits: int = OUTPUT_BITS):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.bits = num_embeddings, embedding_dim, bits
        self.register_buffer("blocks", blocks.reshape(-1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.view(self.num_embeddings, -1)[ids.flatten()]
        return dequantize(rows.flatten(), self.bits, rows.shape[0], self.embedding_dim).view(
            *ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.bits}-bit blocks of {GROUP}"


def use_block_linears(model: nn.Module, layer_bits: int) -> None:
    """Swap every nn.Linear inside ``model`` for a BlockLinear: ``layer_bits``-bit codes in the layers
    (4 for weights="int4", 8 for "int8"), 8-bit in the output layer (``model.lm_head``); float32
    (CpuLinear) where the width is not a multiple of 32.
    The token embeddings (an nn.Embedding as wide as the vocabulary) take 8-bit blocks too, the
    output layer's own where the two are tied: a float32 table would otherwise be the largest thing
    a 4-bit model keeps (113 MB of the default model's 586 MiB)."""
    output = getattr(model, "lm_head", None)
    swapped = {}  # id of an original weight -> its BlockLinear

    def swap(module: nn.Module) -> None:
        for name, child in module.named_children():
            if isinstance(child, nn.Linear) and child.in_features % GROUP == 0:
                layer = BlockLinear(child, OUTPUT_BITS if child is output else layer_bits)
                swapped[id(child.weight)] = layer
                setattr(module, name, layer)
            elif isinstance(child, nn.Linear):
                setattr(module, name, CpuLinear(child))
            else:
                swap(child)

    def swap_embeddings(module: nn.Module) -> None:
        for name, child in module.named_children():
            if (isinstance(child, nn.Embedding) and output is not None and child.embedding_dim % GROUP == 0
                    and child.num_embeddings == output.out_features):
                tied = swapped.get(id(child.weight))
                blocks = tied.blocks if tied is not None and tied.bits == OUTPUT_BITS else quantize(
                    child.weight, OUTPUT_BITS)
                setattr(module, name, BlockEmbedding(blocks, child.num_embeddings, child.embedding_dim))
            else:
                swap_embeddings(child)

    swap(model)
    swap_embeddings(model)


def use_stored_blocks(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Swap each nn.Linear and nn.Embedding of ``model`` whose weight ``state`` holds as blocks (a
    uint8 [rows, bytes per row] tensor in block_weights.h's layout: a checkpoint kept in its own
    formats) for a BlockLinear or BlockEmbedding over those very blocks. ``state`` then names the
    blocks as the new modules do, for load_state_dict. Tied tables stay one tensor."""
    for prefix, module in list(model.named_modules()):
        blocks = state.get(f"{prefix}.weight")
        if blocks is None or blocks.dtype != torch.uint8:
            continue
        parent_name, _, name = prefix.rpartition(".")
        parent = model.get_submodule(parent_name)
        width = module.in_features if isinstance(module, nn.Linear) else module.embedding_dim
        bits = stored_bits(blocks, width)
        if isinstance(module, nn.Linear):
            setattr(parent, name, BlockLinear.of_blocks(blocks, bits, width))
        else:
            setattr(parent, name, BlockEmbedding(blocks, module.num_embeddings, width, bits))
        state[f"{prefix}.blocks"] = state.pop(f"{prefix}.weight").reshape(-1)


def stored_bits(blocks: torch.Tensor, width: int) -> int:
    """4 or 8: which blocks a [rows, bytes per row] buffer holds for rows of ``width`` values."""
    for bits in (4, 8):
        if blocks.shape[-1] == row_bytes(width, bits):
            return bits
    raise ValueError(f"a block buffer of {blocks.shape[-1]} bytes per row holds no rows of {width} values")
