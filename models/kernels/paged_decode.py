"""The paged pool's CPU kernels (paged_decode.cpp, built by native.py), called through ctypes.

``rotate_and_store`` applies the rotary embedding and writes a step's keys and values into the pool
in one call, where torch took some twenty operators per layer. ``decode_attention`` reads each key
and value once, straight from the pool through the block tables; the torch path (gather into a
padded buffer, then SDPA) reads the cache twice and writes it once. Where the kernels are not
built, attention stays on the torch path.
"""

from __future__ import annotations

import ctypes

import torch

from . import native

_int64, _pointer = ctypes.c_int64, ctypes.c_void_p
ARGTYPES = [_pointer, _int64, _pointer, _pointer, _pointer, _int64, _pointer, _pointer, _int64,
            _int64, _int64, _int64, _int64, _int64, _int64, ctypes.c_double, ctypes.c_double, _pointer, _pointer]
STORE_ARGTYPES = [_pointer, _int64, _pointer, _int64, _pointer, _int64, _pointer, _pointer, _int64, _pointer, _int64,
                  _pointer, _pointer, _pointer, _int64, _int64, _int64]


def _check_rows(kernel: str, **tensors) -> None:
    """The kernels walk each row's heads as one contiguous run."""
    for name, t in tensors.items():
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise ValueError(f"{kernel} needs each row of {name} contiguous")


def _check_pool(kernel: str, k_cache, v_cache) -> None:
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{kernel} needs a contiguous KV cache")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"{kernel} needs K and V of one dtype, got {k_cache.dtype} and {v_cache.dtype}")


def rotate_and_store(q, k, v, cos, sin, slots, k_cache, v_cache) -> torch.Tensor:
    """Write k (rotated by cos and sin, if given) and v into the pool at ``slots``; return q rotated
    (a new [T, heads, dim] tensor), or q itself without cos. q: [T, heads, dim], k, v: [T,
    kv_heads, dim], each row's heads contiguous (views of a fused qkv will do); cos, sin: [T, ...,
    rotary dim]; k_cache, v_cache: one layer's [blocks, block_size, kv_heads, dim], of q's dtype or
    (for float32) float16 or bfloat16, rounded to it as .to() rounds."""
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    _check_rows("rotate_and_store", q=q, k=k, v=v)
    _check_pool("rotate_and_store", k_cache, v_cache)
    rotary_dim = 0 if cos is None else cos.shape[-1]
    q_out = q if cos is None else torch.empty(tokens, heads, dim, dtype=q.dtype)
    if cos is not None:
        cos, sin = cos.reshape(tokens, rotary_dim).contiguous(), sin.reshape(tokens, rotary_dim).contiguous()
    native.function("loom_rotate_and_store", q.dtype, STORE_ARGTYPES, k_cache.dtype)(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(), rotary_dim,
        slots.data_ptr(), tokens, k_cache.data_ptr(), v_cache.data_ptr(), q_out.data_ptr(), heads, kv_heads, dim)
    return q_out


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, out, scale: float, window: int | None,
                     softcap: float | None = None, sinks: torch.Tensor | None = None,
                     slopes: torch.Tensor | None = None):
    """out[s] = attention of q[s] ([heads, dim]) over the first context_lens[s] keys of sequence
    s (its last ``window`` only, if above 0; its last key's chunk of -window positions, if below: layers'
    kernel_window), found through block_tables[s], each score soft-capped
    (softcap tanh(score / softcap), Gemma 2's) if ``softcap`` is given, each head's softmax taking
    its sink's logit in its denominator if ``sinks`` ([heads], gpt-oss's) are, each score plus its
    head's ALiBi slope times the key's position less the query's if ``slopes`` ([heads]) are. k_cache, v_cache:
    [blocks, block_size, kv_heads, dim] of one layer (of q's dtype, or 16-bit as rotate_and_store
    writes them); q and out may be row slices of larger
    tensors, as long as each row's heads and dims are contiguous."""
    num_seqs, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    _check_rows("decode_attention", q=q, out=out)
    _check_pool("decode_attention", k_cache, v_cache)
    tables = block_tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    sinks, slopes = (None if t is None else t.to(q.dtype).contiguous() for t in (sinks, slopes))
    native.function("loom_decode_attention", q.dtype, ARGTYPES, k_cache.dtype)(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
        lens.data_ptr(), out.data_ptr(), out.stride(0), num_seqs, heads, kv_heads, dim, block_size,
        window or 0, ctypes.c_double(scale), ctypes.c_double(softcap or 0), None if sinks is None else sinks.data_ptr(),
        None if slopes is None else slopes.data_ptr())
    return out
