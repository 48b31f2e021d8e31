"""A Mamba2 layer's CPU kernel (mamba_scan.h, built by native.py), called through ctypes: between the layer's
products, the convolution, the scan through each head's state matrix and the gated norm, every sequence's
state read and written in place in the pool's state slots."""

from __future__ import annotations

import ctypes

import torch

from . import native

_int64, _pointer = ctypes.c_int64, ctypes.c_void_p
ARGTYPES = [_pointer, _int64] + [_pointer] * 12 + [_int64] * 6 + [ctypes.c_double]


supports = native.supports_states  # (by this module's name, which the layers ask and tests set aside)


def mixer(projected: torch.Tensor, layer, states: list[torch.Tensor], runs) -> torch.Tensor:
    """[rows, inner]: the layer's answers, gated and normed, before its output product. ``projected`` [rows,
    z, x B C, dt] (the input product's); ``layer``: the mamba2.Mamba2Mixer whose parameters it reads;
    ``states``: the layer's [slots, taps - 1, conv width] and [slots, heads, head width, state width]
    (KVCache.state_layer); ``runs``: recurrent.StateRuns."""
    m, rows = layer.shape, projected.shape[0]
    projected = projected.contiguous()
    params = [None if t is None else t.detach().contiguous() for t in (
        layer.conv, layer.conv_bias, layer.dt_bias, layer.decay, layer.skip, layer.norm)]
    address = lambda t: None if t is None else t.data_ptr()
    conv_states, matrices = states
    convolved = torch.empty(rows, m.conv_width, dtype=projected.dtype)
    out = torch.empty(rows, m.inner, dtype=projected.dtype)
    conv, conv_bias, dt_bias, decay, skip, norm = map(address, params)
    native.function("loom_mamba_mixer", projected.dtype, ARGTYPES)(
        projected.data_ptr(), projected.shape[1], conv, conv_bias, conv_states.data_ptr(), dt_bias, decay, skip, norm,
        matrices.data_ptr(), convolved.data_ptr(), out.data_ptr(), runs.row_slots.data_ptr(), runs.row_lens.data_ptr(),
        rows, m.heads, m.head_dim, m.state_size, m.groups, m.conv_size, ctypes.c_double(m.eps))
    return out
