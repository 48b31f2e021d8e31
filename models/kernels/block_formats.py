"""GGUF's block formats as the kernels take them (block_codes.h), a tensor at a time: every one with
the file's own numbers. (F32, F16 and BF16 matrices too: kept as the file has them, views of the
mapped file that the products read in place, widening the 16-bit ones as they read them.)

The K-quants (Q2_K to Q6_K) and MXFP4 are kept as the file lays them out: the kernels read their
blocks where they lie in the memory-mapped file. (But where the kernels multiply a format with sixteen rows
side by side, as with AVX-512 or AVX2 they do Q4_K, Q5_K, Q4_0, Q4_1, Q5_0 and (AVX-512 with VNNI) Q8_0 and
MXFP4, and with AVX2 alone Q6_K, the loader lays a linear layer's matrix out so, straight from the file:
to_rows16.) Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 hold what Loom's 4-, 5- and 8-bit blocks hold (32
values, a scale, for 4 and 5 bits a minimum; Q4_0's w = d (q - 8) is a minimum of -8 d and Q5_0's
w = d (q - 16) one of -16 d, exact in float32), so their bytes are rearranged, never widened. IQ4_NL and
IQ4_XS look their 4-bit codes up in a table of sixteen integers from -127 to 113 under a block's scale
(IQ4_XS: d (ls - 32) per 32 values): their codes stay as they are, with d and a multiplier k a block
(LOOM_IQ4; side by side where the build multiplies them so, GGUF_IQ4_ROWS16, 19 bytes a block against
the file's 18 and 17), which the kernels look up as 8-bit codes. The kernels rearrange them in one
pass (gguf_blocks.cpp); without a compiler numpy does, the same bytes.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as Q

from . import native
from ..pages import fresh_zeros
from .block_linear import (GGUF_MXFP4, GGUF_Q2_K, GGUF_Q3_K, GGUF_Q4_K, GGUF_Q5_K, GGUF_Q6_K, GROUP, FLOAT_FORMATS, LOOM_4BIT,
                           LOOM_5BIT, LOOM_8BIT, LOOM_IQ4, ROWS16, ROWS16_LAYOUT_OF, WIDEN_ARGTYPES, multiplies_rows16,
                           rounding, row_bytes)

NATIVE = {Q.Q2_K: GGUF_Q2_K, Q.Q3_K: GGUF_Q3_K, Q.Q4_K: GGUF_Q4_K, Q.Q5_K: GGUF_Q5_K, Q.Q6_K: GGUF_Q6_K,
          Q.MXFP4: GGUF_MXFP4}
EXACT = {Q.Q4_0: LOOM_4BIT, Q.Q4_1: LOOM_4BIT, Q.Q5_0: LOOM_5BIT, Q.Q5_1: LOOM_5BIT, Q.Q8_0: LOOM_8BIT,
         Q.IQ4_NL: LOOM_IQ4, Q.IQ4_XS: LOOM_IQ4}
FLOATS = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}  # the dtype each float type is kept in
WIDENED_VALUES = 16 << 20  # values widened to float32 at a time (weights="float32", a float tensor)


def block_format(kind: Q) -> int | None:
    """The kernel format a GGUF tensor type runs in (block_linear's)."""
    if kind in FLOATS:
        return FLOAT_FORMATS[FLOATS[kind]]
    return NATIVE.get(kind) or EXACT.get(kind)


def to_blocks(data: np.ndarray, kind: Q, width: int) -> torch.Tensor:
    """A GGUF tensor's raw bytes [rows, bytes per row] in its kernel format [rows, bytes per row]:
    the file's own bytes (a view of the mapped file) for the K-quants and MXFP4, else each row as Loom's blocks
    (its codes, its float32 scales and, for 4 and 5 bits, its float32 minimums); F32, F16 and BF16 as
    a float32, float16 or bfloat16 [rows, width] view of the file (the dtype tells them apart)."""
    if kind in NATIVE:
        return torch.from_numpy(data)
    if kind in FLOATS:
        return torch.from_numpy(data).view(FLOATS[kind])
    library = native.library()
    if library is None or not len(data):
        return torch.from_numpy(_rearranged(data, kind, width))
    source = np.ascontiguousarray(data)
    size = row_bytes(width, EXACT[kind])
    # (in 2 MB pages where the system allows: one-row products read them faster, models/pages.py)
    out = fresh_zeros(source.shape[0] * size).view(source.shape[0], size)
    library.loom_rearrange_gguf_blocks(ctypes.c_void_p(source.ctypes.data), ctypes.c_int64(kind),
                                       ctypes.c_int64(width), ctypes.c_int64(source.shape[0]),
                                       ctypes.c_void_p(out.data_ptr()))
    return out


def to_rows16(data: np.ndarray, kind: Q, width: int, order: torch.Tensor | None = None) -> torch.Tensor | None:
    """A GGUF tensor's raw bytes [rows, bytes per row] with sixteen rows side by side, in the ROWS16
    layout of its kernel format (block_linear.ROWS16_LAYOUTS: over it a one-row product reads the
    weights at the memory's rate, and many rows take fewer instructions a product), made in one copy
    from the file's bytes; row i is the file's row order[i] (a permutation; None: row i). None where
    this build does not multiply that layout, the rows are not a multiple of sixteen, or the numbers
    do not fit it (a Q4_0 minimum, -8 d, beyond float16's range; Q5_1's own minimums): to_blocks' is
    the tensor then."""
    format = block_format(kind)
    layout = ROWS16_LAYOUT_OF.get(format)
    if (layout is None or not multiplies_rows16(layout) or data.ndim != 2 or not len(data) or len(data) % ROWS16
            or width % rounding(format)):
        return None
    source = np.ascontiguousarray(data)
    if order is not None:
        order = order.to(torch.int64).contiguous()
    size = row_bytes(width, layout)
    out = fresh_zeros(source.shape[0] * size).view(source.shape[0], size)  # (2 MB pages, as to_blocks')
    fits = native.library().loom_lay_out_gguf_rows16(
        ctypes.c_void_p(source.ctypes.data), ctypes.c_int64(kind), ctypes.c_int64(width),
        ctypes.c_int64(source.shape[0]), ctypes.c_void_p(None if order is None else order.data_ptr()),
        ctypes.c_int64(layout), ctypes.c_void_p(out.data_ptr()))
    return out if fits else None


def widened(data: np.ndarray, kind: Q, width: int) -> torch.Tensor:
    """A GGUF tensor's raw bytes [rows, bytes per row] as float32 [rows, width], WIDENED_VALUES at a
    time: by the kernels' own widening where they are built (the same float32 values as gguf-py's,
    5-10x faster: it was most of a float32 load of the default model), else by gguf-py's, whose
    temporaries are several times its input, hence the slices."""
    out = torch.empty(data.shape[0], width, dtype=torch.float32)
    step = max(1, WIDENED_VALUES // width)
    widen = native.function("loom_block_widen", torch.float32, WIDEN_ARGTYPES) if native.library() else None
    for first in range(0, data.shape[0], step):
        rows, into = data[first:first + step], out[first:first + step]
        if kind in FLOATS:
            into.copy_(torch.from_numpy(rows).view(FLOATS[kind]))
        elif widen is not None:
            blocks = to_blocks(rows, kind, width).contiguous()
            widen(blocks.data_ptr(), block_format(kind), width, rows.shape[0], 0, rows.shape[0], into.data_ptr())
        else:
            from gguf.quants import dequantize
            into.copy_(torch.from_numpy(np.asarray(dequantize(rows, kind), dtype=np.float32).reshape(-1, width)))
    return out


def _rearranged(data: np.ndarray, kind: Q, width: int) -> np.ndarray:
    rows, groups = data.shape[0], width // GROUP
    if kind in (Q.IQ4_NL, Q.IQ4_XS):
        return _iq4_rearranged(data, kind, rows, groups)
    if kind in (Q.Q5_0, Q.Q5_1):
        return _q5_rearranged(data, kind, rows, groups)
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
    fields, 128 bytes of codes) as LOOM_IQ4: the codes, each block's d as float32, and its multiplier."""
    if kind == Q.IQ4_NL:
        blocks = data.reshape(rows, groups, 18)
        halves, codes = blocks[..., 0:2], blocks[..., 2:]
        multipliers = np.ones((rows, groups), np.int8)
    else:
        blocks = data.reshape(rows, groups // 8, 136)
        halves = np.repeat(blocks[..., 0:2], 8, axis=1)  # the super-block's d, for each of its blocks
        high = blocks[..., 2:4].copy().view(np.uint16)  # [rows, supers, 1]: two bits a sub-block
        low = blocks[..., 4:8]  # four bits a sub-block, two sub-blocks a byte
        low = (low[..., None] >> np.array([0, 4], np.uint8)).reshape(rows, -1, 8) & 0x0F
        high = (high >> (2 * np.arange(8, dtype=np.uint16))) & 3
        multipliers = ((low | (high.astype(np.uint8) << 4)).astype(np.int16) - 32).astype(np.int8).reshape(rows, groups)
        codes = blocks[..., 8:]
    scales = _halves(halves.reshape(rows, groups, 2)).view(np.uint8).reshape(rows, -1)
    return np.concatenate([codes.reshape(rows, -1), scales, multipliers.view(np.uint8)], axis=1)


def _q5_rearranged(data: np.ndarray, kind: Q, rows: int, groups: int) -> np.ndarray:
    """Q5_1 (per 32 values: d, m, 32 fifth bits, 16 bytes of low nibbles: w = d q + m) and Q5_0 (the
    same without m: w = d (q - 16), a minimum of -16 d) as 5-bit blocks: the nibbles and fifth bits as
    they are, the scales and minimums widened to float32."""
    head = 4 if kind == Q.Q5_1 else 2
    blocks = data.reshape(rows, groups, head + 20)
    scale = _halves(blocks[..., 0:2])  # [rows, groups, 1]
    low = _halves(blocks[..., 2:4]) if kind == Q.Q5_1 else scale * -16
    high, nibbles = blocks[..., head:head + 4], blocks[..., head + 4:]
    return np.concatenate([nibbles.reshape(rows, -1), high.reshape(rows, -1), scale.view(np.uint8).reshape(rows, -1),
                           low.view(np.uint8).reshape(rows, -1)], axis=1)
