"""A gated delta-rule layer's CPU kernel (delta_rule.h, built by native.py), called through ctypes:
between the layer's products, the convolution, the recurrence through each head's state matrix and the
gated norm, every sequence's state read and written in place in the pool's state slots."""

from __future__ import annotations

import ctypes

import torch

from . import native

_int64, _pointer = ctypes.c_int64, ctypes.c_void_p
ARGTYPES = [_pointer] * 14 + [_int64] * 7 + [ctypes.c_double]


supports = native.supports_states  # (by this module's name, which the layers ask and tests set aside)


def mixer(mixed, conv_weight, alpha, beta, dt_bias, decay_rate, z, norm_weight, eps: float, states, runs, shape):
    """[rows, heads x value width]: the layer's answers, normalised and gated, before its output product.
    ``mixed`` [rows, conv width] (the qkv product's), ``alpha``, ``beta`` [rows, heads], ``z`` [rows, heads x
    value width]; ``states``: the layer's [slots, taps - 1, conv width] and [slots, heads, key, value]
    (KVCache.state_layer); ``runs``: recurrent.StateRuns; ``shape``: qwen35.DeltaShape."""
    rows = mixed.shape[0]
    mixed, alpha, beta, z, conv_weight, dt_bias, decay_rate, norm_weight = (t.contiguous() for t in (
        mixed, alpha, beta, z, conv_weight, dt_bias, decay_rate, norm_weight))
    conv_states, matrices = states
    convolved = torch.empty_like(mixed)
    out = torch.empty(rows, shape.value_heads * shape.value_dim, dtype=mixed.dtype)
    native.function("loom_delta_mixer", mixed.dtype, ARGTYPES)(
        mixed.data_ptr(), conv_weight.data_ptr(), conv_states.data_ptr(), alpha.data_ptr(), beta.data_ptr(),
        dt_bias.data_ptr(), decay_rate.data_ptr(), matrices.data_ptr(), z.data_ptr(), norm_weight.data_ptr(),
        convolved.data_ptr(), out.data_ptr(), runs.row_slots.data_ptr(), runs.row_lens.data_ptr(), rows,
        shape.key_heads, shape.value_heads, shape.key_dim, shape.value_dim, shape.conv_size, int(shape.grouped),
        ctypes.c_double(eps))
    return out
