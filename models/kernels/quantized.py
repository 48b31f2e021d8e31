"""The ``weights=`` choice and its check, and FBGEMM's linear layers for "float16" (16-bit weights,
float32 activations and sums) and "int8-dynamic" (8-bit weights, activations quantized per row).

Decode reads every weight once a step, so fewer bytes a weight are faster; torch's own weight-only
int8/int4 kernels were 3-50x slower than float32 on an AVX2 CPU, hence FBGEMM's products here and
Loom's block product for "int4"/"int8" and a GGUF file's blocks (block_linear.py). Figures:
docs/benchmarks-history.md, "Smaller weights".
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from . import native

WEIGHTS = ("float32", "stored", "float16", "int8", "int8-dynamic", "int4")
BLOCK_WEIGHTS = {"int4": 4, "int8": 8}  # the layers' bits of Loom's block choices (block_linear.py)


def check_weights(weights: str, device: torch.device, dtype: torch.dtype) -> str:
    """The ``weights=`` choice, checked against the device and dtype before anything loads."""
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights={weights!r}; choose one of {', '.join(WEIGHTS)}")
    if weights not in ("float32", "stored"):  # "stored": the file's blocks where runs_blocks, float elsewhere
        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError(f"weights={weights!r} runs on the CPU with float32 activations; got "
                             f"device={device.type}, dtype={str(dtype).removeprefix('torch.')}")
        if weights in BLOCK_WEIGHTS and native.library() is None:
            raise ValueError(f"weights={weights!r} runs on Loom's CPU kernels, which are not built here (no C++ "
                             "compiler found, LOOM_DISABLE_KERNELS=1, or the build failed: see the warning above)")
        if weights in ("float16", "int8-dynamic") and "fbgemm" not in torch.backends.quantized.supported_engines:
            raise ValueError(f"weights={weights!r} needs torch's FBGEMM backend, which this torch build lacks")
    return weights


def runs_blocks(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether Loom's block kernels run here: on the CPU, float32 activations, the kernels built."""
    return device.type == "cpu" and dtype == torch.float32 and native.library() is not None


class Float16Linear(nn.Module):
    """A linear layer with float16 weights: FBGEMM widens them to float32 in registers, so the
    activations and the sums stay float32 and only the weights lose precision."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.packed = torch.ops.quantized.linear_prepack_fp16(linear.weight.detach().float(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float16 weights"


class Int8Linear(nn.Module):
    """A linear layer whose weight is int8 with one scale per output channel, multiplied by
    FBGEMM's dynamic product, which quantizes its input with one range for the whole tensor.

    One range for a whole step would let a token with large activations (a prompt's first
    token often has them) coarsen every other row of the batch, and make a request's output
    depend on its batch-mates. So each row is divided by its own largest magnitude first, and a
    row holding 1 and -1 is appended: the tensor's range is then always [-1, 1], and each row is
    quantized exactly as it would be alone. The extra row costs nothing at decode sizes."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        scales = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny).double()
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():  # torch marks quantized tensors deprecated; see docs/benchmarks.md
            warnings.filterwarnings("ignore", message=".*deprecated.*")
            quantized = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(quantized, None)
        self.bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.range_row = torch.zeros(1, self.in_features)
        self.range_row[0, :2] = torch.tensor([1.0, -1.0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        magnitude = x.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(x.dtype).tiny)
        rows = torch.cat([x / magnitude, self.range_row])
        # reduce_range: 7-bit activations, so that AVX2's 16-bit pair sums cannot saturate.
        out = torch.ops.quantized.linear_dynamic(rows, self.packed, True)[:-1] * magnitude
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per output channel"


def reduce_linears(module: nn.Module, weights: str) -> None:
    """Swap every nn.Linear inside ``module`` for the ``weights`` kind's layer."""
    layer = {"float16": Float16Linear, "int8-dynamic": Int8Linear}[weights]
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, layer(child))
        else:
            reduce_linears(child, weights)
