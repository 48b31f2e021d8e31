"""The gated delta rule's CPU kernel (delta_rule.cpp, built by native.py), called through ctypes: each
run's rows through its heads' state matrices, read and written in place in the pool's state slots."""

from __future__ import annotations

import ctypes

import torch

from . import native

_int64, _pointer = ctypes.c_int64, ctypes.c_void_p
ARGTYPES = [_pointer] * 11 + [_int64] * 4


def supports(q: torch.Tensor, matrices: torch.Tensor) -> bool:
    """Whether the kernel runs rows of ``q``'s dtype over states of ``matrices``' (the same: the pool keeps a
    float32 model's in float32, a float64 model's in float64)."""
    return native.supports(q.device, q.dtype) and matrices.dtype == q.dtype and matrices.is_contiguous()


def delta_rule(q, k, v, decay, beta, matrices, slots, fresh, starts, lengths) -> torch.Tensor:
    """[rows, heads, value width]: q, k [rows, heads, key width] (a value head's key head repeated to it),
    v [rows, heads, value width], decay and beta [rows, heads]; ``matrices`` [slots, heads, key width, value
    width], run r's read from and written back to slot ``slots[r]`` (zeros first where ``fresh[r]``), its
    rows ``starts[r]`` to ``starts[r] + lengths[r]``, one after another."""
    rows, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    q, k, v, decay, beta = (t.contiguous() for t in (q, k, v, decay, beta))
    out = torch.empty(rows, heads, value_dim, dtype=q.dtype)
    slots = slots.to(torch.int64).contiguous()
    fresh = fresh.to(torch.uint8).contiguous()
    starts = torch.tensor(starts, dtype=torch.int64)
    lengths = torch.tensor(lengths, dtype=torch.int64)
    native.function("loom_delta_rule", q.dtype, ARGTYPES)(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), decay.data_ptr(), beta.data_ptr(), matrices.data_ptr(),
        out.data_ptr(), slots.data_ptr(), fresh.data_ptr(), starts.data_ptr(), lengths.data_ptr(), len(starts),
        heads, key_dim, value_dim)
    return out
