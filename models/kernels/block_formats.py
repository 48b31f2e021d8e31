"""GGUF's block formats as the kernels take them (block_codes.h), a tensor at a time.

Q4_K, Q5_K and Q6_K are kept as the file lays them out: the kernels read their super-blocks where they lie
in the memory-mapped file. Q4_0, Q4_1 and Q8_0 hold what Loom's 4- and 8-bit blocks hold (32 values,
a scale, for 4 bits a minimum; Q4_0's w = d (q - 8) is a minimum of -8 d, exact in float32), so
their bytes are rearranged, never widened: the model computes with the file's own numbers. IQ4_NL
and IQ4_XS look their 4-bit codes up in a table of sixteen integers from -127 to 113: those integers
are 8-bit codes, under the block's scale (IQ4_XS: d (ls - 32) per 32 values), so they become 8-bit
blocks, exact too, at twice the file's memory; so do Q5_0's w = d (q - 16), whose codes -16..15 are
8-bit ones. The other formats (Q2_K, Q3_K, Q5_1) are widened a slice of rows at a time and
quantized to Loom's blocks of the nearest width, so that no whole tensor, let alone the model,
passes through float32.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as Q

from .block_linear import GGUF_Q4_K, GGUF_Q5_K, GGUF_Q6_K, GROUP, LOOM_4BIT, LOOM_8BIT, quantize, row_bytes

NATIVE = {Q.Q4_K: GGUF_Q4_K, Q.Q5_K: GGUF_Q5_K, Q.Q6_K: GGUF_Q6_K}
EXACT = {Q.Q4_0: LOOM_4BIT, Q.Q4_1: LOOM_4BIT, Q.Q8_0: LOOM_8BIT, Q.IQ4_NL: LOOM_8BIT, Q.IQ4_XS: LOOM_8BIT,
         Q.Q5_0: LOOM_8BIT}
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
REQUANTIZED = {Q.Q2_K: LOOM_4BIT, Q.Q3_K: LOOM_4BIT, Q.Q5_1: LOOM_8BIT}
WIDENED_VALUES = 16 << 20  # values widened to float32 at a time for the formats requantized


def block_format(kind: Q) -> int | None:
    """The kernel format a GGUF tensor type runs in (block_linear's); None for the float types."""
    return NATIVE.get(kind) or EXACT.get(kind) or REQUANTIZED.get(kind)


def to_blocks(data: np.ndarray, kind: Q, width: int) -> torch.Tensor:
    """A GGUF tensor's raw bytes [rows, bytes per row] in its kernel format [rows, bytes per row]:
    the file's own bytes (a view of the mapped file) for the formats kept, else each row as Loom's
    blocks (its codes, its float32 scales and, for 4 bits, its float32 minimums)."""
    if kind in NATIVE:
        return torch.from_numpy(data)
    if kind in EXACT:
        return torch.from_numpy(_rearranged(data, kind, width))
    bits = REQUANTIZED[kind]
    parts = [quantize(part, bits).view(-1, row_bytes(width, bits)) for _, part in widened_slices(data, kind, width)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def widened_slices(data: np.ndarray, kind: Q, width: int):
    """A GGUF tensor's raw bytes [rows, bytes per row] as float32, WIDENED_VALUES at a time:
    (first row, float32 [rows, width]) pairs. gguf-py's dequantize makes several temporaries the
    size of its input, so a whole tensor at once would cost several times its float32 size."""
    from gguf.quants import dequantize

    step = max(1, WIDENED_VALUES // width)
    for first in range(0, data.shape[0], step):
        part = np.asarray(dequantize(data[first:first + step], kind), dtype=np.float32).reshape(-1, width)
        yield first, torch.from_numpy(np.require(part, requirements="W"))  # F32's are views of the read-only file


def _rearranged(data: np.ndarray, kind: Q, width: int) -> np.ndarray:
    rows, groups = data.shape[0], width // GROUP
    if kind in (Q.IQ4_NL, Q.IQ4_XS):
        return _iq4_rearranged(data, kind, rows, groups)
    if kind == Q.Q5_0:
        return _q5_0_rearranged(data, rows, groups)
    blocks = data.reshape(rows, groups, -1)
    scale = _halves(blocks[..., 0:2])  # [rows, groups, 1]
    if kind == Q.Q8_0:
        return np.concatenate([blocks[..., 2:].reshape(rows, -1), scale.view(np.uint8).reshape(rows, -1)], axis=1)
    if kind == Q.Q4_1:
        low, codes = _halves(blocks[..., 2:4]), blocks[..., 4:]
    else:  # Q4_0: w = d (q - 8), a minimum of -8 d (exact in float32)
        low, codes = scale * -8, blocks[..., 2:]
    # Both keep byte j of a block as values j (low nibble) and j + 16 (high), as block_weights.h does.
    return np.concatenate([codes.reshape(rows, -1), scale.view(np.uint8).reshape(rows, -1),
                           low.view(np.uint8).reshape(rows, -1)], axis=1)


def _halves(field: np.ndarray) -> np.ndarray:
    """A block field of float16s (two bytes each) as float32 values, one per pair of bytes."""
    return field.copy().view(np.float16).astype(np.float32)


def _iq4_rearranged(data: np.ndarray, kind: Q, rows: int, groups: int) -> np.ndarray:
    """IQ4_NL (per 32 values: d, 16 bytes of codes) and IQ4_XS (per 256: d, 6-bit sub-scales in two
    fields, 128 bytes of codes) as 8-bit blocks of the table's values."""
    if kind == Q.IQ4_NL:
        blocks = data.reshape(rows, groups, 18)
        scale = _halves(blocks[..., 0:2]).reshape(rows, groups)
        codes = blocks[..., 2:]
    else:
        blocks = data.reshape(rows, groups // 8, 136)
        d = _halves(blocks[..., 0:2])  # [rows, supers, 1]
        high = blocks[..., 2:4].copy().view(np.uint16)  # [rows, supers, 1]: two bits a sub-block
        low = blocks[..., 4:8]  # four bits a sub-block, two sub-blocks a byte
        low = (low[..., None] >> np.array([0, 4], np.uint8)).reshape(rows, -1, 8) & 0x0F
        high = (high >> (2 * np.arange(8, dtype=np.uint16))) & 3
        scale = (d * ((low | (high.astype(np.uint8) << 4)).astype(np.float32) - 32)).reshape(rows, groups)
        codes = blocks[..., 8:].reshape(rows, groups, 16)
    values = IQ4_VALUES[np.stack([codes & 0x0F, codes >> 4], axis=-2).reshape(rows, groups, 32)]
    return np.concatenate([values.view(np.uint8).reshape(rows, -1), scale.view(np.uint8)], axis=1)


def _q5_0_rearranged(data: np.ndarray, rows: int, groups: int) -> np.ndarray:
    """Q5_0 (per 32 values: d, 32 high bits, 16 bytes of low nibbles) as 8-bit blocks of q - 16."""
    blocks = data.reshape(rows, groups, 22)
    scale = _halves(blocks[..., 0:2]).reshape(rows, groups)
    high = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little")  # bit j: value j's fifth bit
    low = blocks[..., 6:]
    low = np.concatenate([low & 0x0F, low >> 4], axis=-1)  # values 0..15, then 16..31
    values = (low | (high << 4)).astype(np.int8) - np.int8(16)
    return np.concatenate([values.view(np.uint8).reshape(rows, -1), scale.view(np.uint8)], axis=1)
