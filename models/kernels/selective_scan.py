"""Mamba's layer kernels (selective_scan.h, built by native.py), called through ctypes: the convolution and the
selective scan between the layer's products, every sequence's state read and written in place in the pool's
state slots."""

from __future__ import annotations

import ctypes

import torch

from . import native

_int64, _pointer = ctypes.c_int64, ctypes.c_void_p
CONVOLVE_ARGTYPES = [_pointer, _int64, _pointer, _pointer, _pointer, _pointer, _pointer, _pointer] + [_int64] * 3
SCAN_ARGTYPES = [_pointer, _pointer, _pointer, _int64, _int64] + [_pointer] * 6 + [_int64] * 3


supports = native.supports_states  # (by this module's name, which the layers ask and tests set aside)


def convolve(projected: torch.Tensor, width: int, taps: torch.Tensor, bias: torch.Tensor | None,
             conv_states: torch.Tensor, runs) -> torch.Tensor:
    """[rows, width]: the first ``width`` channels of ``projected`` [rows, stride] convolved (recurrent.py's
    convolve), the slots' last inputs in ``conv_states`` moved on."""
    rows = projected.shape[0]
    out = torch.empty(rows, width, dtype=projected.dtype)
    taps = taps.detach().contiguous()
    bias = None if bias is None else bias.detach().contiguous()
    native.function("loom_mamba_convolve", projected.dtype, CONVOLVE_ARGTYPES)(
        projected.data_ptr(), projected.stride(0), taps.data_ptr(), None if bias is None else bias.data_ptr(),
        conv_states.data_ptr(), out.data_ptr(), runs.row_slots.data_ptr(), runs.row_lens.data_ptr(), rows, width,
        taps.shape[1])
    return out


def scan(x: torch.Tensor, dt: torch.Tensor, bc: torch.Tensor, bc_offset: int, decay: torch.Tensor,
         skip: torch.Tensor, matrices: torch.Tensor, runs) -> torch.Tensor:
    """[rows, inner]: mamba.py's scan, plus D x (not gated). ``x``, ``dt`` (softplus taken) [rows, inner]; B and C
    at ``bc_offset`` of each row of ``bc`` (contiguous in its last dimension); ``decay`` [state width, inner];
    ``matrices`` the slots' states [slots, state width, inner]."""
    rows, inner = x.shape
    x, dt = x.contiguous(), dt.contiguous()
    decay, skip = decay.detach().contiguous(), skip.detach().contiguous()
    out = torch.empty_like(x)
    native.function("loom_selective_scan", x.dtype, SCAN_ARGTYPES)(
        x.data_ptr(), dt.data_ptr(), bc.data_ptr(), bc.stride(0), bc_offset, decay.data_ptr(), skip.data_ptr(),
        matrices.data_ptr(), out.data_ptr(), runs.row_slots.data_ptr(), runs.row_lens.data_ptr(), rows, inner,
        decay.shape[0])
    return out
