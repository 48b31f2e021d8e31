"""Linear layers on the CPU: Loom's own products (cpu_linear.h) for decode steps and short prefill
chunks, oneDNN's for longer chunks.

Decode at a few rows is bound by reading the weights: the kernel streams them once per step whatever the
row count. From 8 or 9 rows up with AVX2 (with AVX-512 from 3 or more: where measure_panel_rows finds
them ahead for the model on this machine, 3 rows on Zen 5, 9 on an Emerald Rapids Xeon) it packs the
input rows into panels and runs register tiles, ~1.1-1.9x oneDNN's product up to 128 rows; at 256-512
rows oneDNN's blocked GEMM is level or ahead (docs/benchmarks-history.md, "Panel products"), so longer
prefill chunks keep it. oneDNN takes the dense weight as it is (as fast as a prepacked copy, which would
double the memory), and beat MKL (torch's F.linear) by up to 30% on output layers.
"""

from __future__ import annotations

import ctypes
import hashlib
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import cache_dir
from . import native

LAST_TIMED_ROWS = 8  # measure_panel_rows times panels against tiles up to this many rows; panels from 9 everywhere
# measure_panel_rows times the products over a model's first weights up to this size: more than the
# caches hold (so they come from memory, as in a step), little enough that a large model loads fast.
MEASURED_BYTES = 512 << 20
KERNEL_ROWS = 128  # the kernel: 1.5-3x oneDNN at 1-8 rows, 1.1-1.9x at 16-128, level or behind from 256

_int64, _pointer = ctypes.c_int64, ctypes.c_void_p
ARGTYPES = [_pointer, _int64, _int64, _pointer, _pointer, _int64, _int64, _pointer, _int64, _int64]


def default_panel_rows() -> int:
    """From how many rows products take the panels where no measurement says otherwise."""
    return native.library().loom_default_panel_min_rows()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           panel_rows: int | None = None) -> torch.Tensor:
    """F.linear for a 2-D ``x`` whose rows are contiguous (they may be a view's rows), on the
    kernel; ``weight`` [out, in] and ``bias`` contiguous, all of one dtype the kernels support.
    ``panel_rows``: from how many rows to take the panels (default: the library's)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    kernel = native.function("loom_linear", x.dtype, ARGTYPES)
    return _product(kernel, x, weight, bias, default_panel_rows() if panel_rows is None else panel_rows)


def _product(kernel, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, panel_rows: int) -> torch.Tensor:
    out, width = weight.shape
    y = torch.empty(x.shape[0], out, dtype=x.dtype)
    kernel(x.data_ptr(), x.stride(0), x.shape[0], weight.data_ptr(), None if bias is None else bias.data_ptr(),
           width, out, y.data_ptr(), out, panel_rows)
    return y


class CpuLinear(nn.Module):
    """nn.Linear whose products of up to KERNEL_ROWS rows run on Loom's kernel. Its forward is lean on purpose:
    a one-row decode step calls it 121 times on the default model."""

    def __init__(self, layer: nn.Linear):
        super().__init__()
        self.weight = nn.Parameter(layer.weight.detach().contiguous(), requires_grad=False)
        self.bias = None if layer.bias is None else nn.Parameter(layer.bias.detach().contiguous(), requires_grad=False)
        self.out_features, self.in_features = self.weight.shape
        self.kernel = native.function("loom_linear", self.weight.dtype, ARGTYPES)
        self.large = large_product(self.weight.dtype)
        self.panel_rows = default_panel_rows()  # the model's measurement replaces it (use_cpu_linears)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or not 0 < x.shape[0] <= KERNEL_ROWS or x.stride(1) != 1 or x.dtype != self.weight.dtype:
            return self.large(x, self.weight, self.bias)
        return _product(self.kernel, x, self.weight, self.bias, self.panel_rows)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def measure_panel_rows(weights: list[torch.Tensor], repeats: int = 2) -> int:
    """From how many rows the kernel's panels beat its row-at-a-time tiles for products over ``weights`` (a
    model's float32 linear weights, in the order a step takes them) on this machine. AVX2 builds time 8
    rows alone (PANEL_MIN_ROWS: fewer take the row-at-a-time products), AVX-512 builds from 3, and a
    panel's multiply-adds do not shrink with its rows: on a Xeon with a third of Zen 5's FMA rate the
    tiles were 1.5x faster at 4 rows, on Zen 5 the panels were ahead from 2 rows. Timing one product on
    cached weights chose the tiles on both machines, where a step reads a model's weights from memory;
    so every row count from the default to 8 is timed both ways over the model's first weights, up to
    MEASURED_BYTES (the two alternating, medians), and the panels start where the counts timed take
    least in all. Each model keeps its own (CpuLinear.panel_rows): two models in one process no longer
    share the last one's."""
    library = native.library()
    first = library.loom_default_panel_min_rows()
    if first > LAST_TIMED_ROWS or not weights:
        return first
    kernel = native.function("loom_linear", torch.float32, ARGTYPES)
    medians = {}
    for rows in range(first, LAST_TIMED_ROWS + 1):
        inputs = {width: torch.randn(rows, width, generator=torch.Generator().manual_seed(rows))
                  for width in {w.shape[1] for w in weights}}
        times = {True: [], False: []}
        for _ in range(repeats + 1):
            for panels in (True, False):
                panel_rows = rows if panels else LAST_TIMED_ROWS + 1
                start = time.perf_counter()
                for weight in weights:
                    _product(kernel, inputs[weight.shape[1]], weight, None, panel_rows)
                times[panels].append(time.perf_counter() - start)
        medians[rows] = {panels: statistics.median(t[1:]) for panels, t in times.items()}  # past a warm-up
    # the threshold under which the timed row counts take least in all: a near tie at one count
    # moves it little either way
    cost = lambda start: sum(m[rows >= start] for rows, m in medians.items())
    return min(range(first, LAST_TIMED_ROWS + 2), key=lambda start: (cost(start), -start))


def remembered_panel_rows(weights: list[torch.Tensor]) -> int:
    """measure_panel_rows, measured once per build of the kernels (their sources, flags and
    processor), thread count and set of weight shapes, then read back from the cache directory:
    measuring took 1.0 s of a 1.9 s load of the default model."""
    shapes = [tuple(w.shape) for w in weights]
    key = hashlib.sha256(repr((native.build_name(), torch.get_num_threads(), shapes)).encode()).hexdigest()[:16]
    path = cache_dir() / "panel_rows" / key
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        pass
    rows = measure_panel_rows(weights)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(str(rows))
    except OSError:
        pass  # a read-only home measures again at the next load
    return rows


def large_product(dtype: torch.dtype):
    """F.linear's signature for products beyond KERNEL_ROWS rows: oneDNN's for float32 where torch
    has it, F.linear otherwise."""
    return _onednn_linear if dtype == torch.float32 and _has_onednn() else F.linear


def _onednn_linear(x, weight, bias):
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _has_onednn() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def use_cpu_linears(model: nn.Module) -> None:
    """Swap every nn.Linear inside ``model`` for a CpuLinear (tied weights stay shared), then time
    where the panels start over its float32 weights (measure_panel_rows, once per machine and set of
    shapes: remembered_panel_rows): its layers' threshold."""
    _swap_linears(model)
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, CpuLinear)}
    timed, size = [], 0
    for weight in (w for w in weights.values() if w.dtype == torch.float32):
        if size >= MEASURED_BYTES:
            break
        timed.append(weight)
        size += weight.numel() * weight.element_size()
    rows = remembered_panel_rows(timed)
    for layer in model.modules():
        if isinstance(layer, CpuLinear):
            layer.panel_rows = rows


def _swap_linears(module: nn.Module) -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, CpuLinear(child))
        else:
            _swap_linears(child)
