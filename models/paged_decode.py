"""The CPU decode-attention kernel (paged_decode.cpp, built by native.py), called through ctypes.

It reads each key and value once, straight from the pool through the block tables; the torch path
(gather into a padded buffer, then SDPA) reads the cache twice and writes it once. Where the
kernels are not built, attention stays on the torch path.
"""

from __future__ import annotations

import ctypes

import torch

from . import native

_int64, _pointer = ctypes.c_int64, ctypes.c_void_p
ARGTYPES = [_pointer, _int64, _pointer, _pointer, _pointer, _int64, _pointer, _pointer, _int64,
            _int64, _int64, _int64, _int64, _int64, _int64, ctypes.c_double]


def supports(device: torch.device, dtype: torch.dtype) -> bool:
    return native.supports(device, dtype)


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, out, scale: float, window: int | None):
    """out[s] = attention of q[s] ([heads, dim]) over the first context_lens[s] keys of sequence
    s (its last ``window`` only, if given), found through block_tables[s]. k_cache, v_cache:
    [blocks, block_size, kv_heads, dim] of one layer; q and out may be row slices of larger
    tensors, as long as each row's heads and dims are contiguous."""
    num_seqs, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    for t in (q, out):
        if t.stride(2) != 1 or t.stride(1) != dim:
            raise ValueError("decode_attention needs each row of q and out contiguous")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("decode_attention needs a contiguous KV cache")
    tables = block_tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    native.function("loom_decode_attention", q.dtype, ARGTYPES)(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
        lens.data_ptr(), out.data_ptr(), out.stride(0), num_seqs, heads, kv_heads, dim, block_size,
        window or 0, ctypes.c_double(scale))
    return out
