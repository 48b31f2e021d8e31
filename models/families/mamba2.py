"""Mamba2's mixer (Granite 4's and Nemotron-H's recurrent layers) over a state a sequence: the layer's one input product gives
a gate z, x with B and C (x a head's values, B and C a group's of heads' keys and queries, in SSD's duality
with attention) and a time step a head. x, B and C are convolved with the three tokens before, a channel at a
time, through a SiLU. Each head keeps a matrix S (head width x state width) that decays by exp(dt A) and takes
dt x B^T every token; its answer is S C, plus D x. The answers, times SiLU(z), are RMS-normed a group of
heads at a time and go through the output product. S and the convolution's last inputs are the sequence's
state, kept in the pool's state slots (models/step.py's ``state_shapes``): a step reads each sequence's from
its slot (zeros at position 0) and writes it back."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import mamba_scan as native_scan
from .recurrent import StateRuns, convolve


# Nemotron-H configs' older names of its Mamba2 fields -> NemotronHConfig's
NEMOTRON_H_OLDER_NAMES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_dt_limit": "time_step_limit",
                          "mamba_conv_bias": "use_conv_bias"}


@dataclass(frozen=True)
class Mamba2Shape:
    """A Mamba2 layer's sizes."""
    heads: int
    head_dim: int
    state_size: int
    groups: int      # B and C a group of heads' (heads // groups consecutive heads read one)
    conv_size: int   # the inputs a convolution reads: this token's and conv_size - 1 before
    eps: float
    bias: bool = False       # the input and output products add biases
    conv_bias: bool = True
    norm: bool = True        # the gated answers RMS-normed a group at a time (Falcon-H1's may be gated alone)

    @classmethod
    def from_hf(cls, c: dict, prefix: str = "mamba_") -> "Mamba2Shape":
        """From Granite 4's (and Falcon-H1's) Mamba2 fields (``mamba_*``), refusing what Loom does not run."""
        get = lambda name, default=None: c.get(prefix + name, default)
        # (Falcon-H1's d_ssm, and a GGUF file's inner width by that name; else expand x hidden)
        inner = get("d_ssm") or round(get("expand", 2) * c["hidden_size"])
        heads = get("n_heads", 128)
        head_dim = get("d_head", "auto")
        head_dim = inner // heads if head_dim in (None, "auto") else head_dim
        if heads * head_dim != inner:
            raise ValueError(f"Mamba2's {heads} heads of {head_dim} must make its inner width {inner} (expand x hidden)")
        return cls.checked(c, heads, head_dim, get("d_state", 256), get("n_groups", 1), get("d_conv", 4),
                           c.get("rms_norm_eps", 1e-6), bool(get("proj_bias", False)), bool(get("conv_bias", True)),
                           bool(get("rms_norm", True)))

    @classmethod
    def from_nemotron_h(cls, c: dict) -> "Mamba2Shape":
        """From Nemotron-H's Mamba2 fields (transformers' NemotronHConfig names and defaults, its older names
        taken first, as it takes them)."""
        c = c | {name: c[older] for older, name in NEMOTRON_H_OLDER_NAMES.items() if older in c}
        return cls.checked(c, c.get("mamba_num_heads", 128), c.get("mamba_head_dim", 64), c.get("ssm_state_size", 128),
                           c.get("n_groups", 8), c.get("conv_kernel", 4), c.get("layer_norm_epsilon", 1e-5),
                           bool(c.get("use_bias", False)), bool(c.get("use_conv_bias", True)))

    @classmethod
    def checked(cls, c: dict, heads: int, head_dim: int, state_size: int, groups: int, conv_size: int, eps: float,
                bias: bool, conv_bias: bool, norm: bool = True) -> "Mamba2Shape":
        """The shape, or a ValueError for groups that do not divide the heads or time steps ``c`` clamps."""
        if heads % groups:
            raise ValueError(f"Mamba2's groups ({groups}) must divide its heads ({heads})")
        # (a saved config.json keeps infinity as {"__float__": "Infinity"})
        limit = tuple(float(v["__float__"] if isinstance(v, dict) else v)
                      for v in c.get("time_step_limit") or (0.0, float("inf")))
        if limit != (0.0, float("inf")):
            raise ValueError(f"Mamba2 with time steps clamped to {list(limit)} is not supported; llama.cpp's and Loom's "
                             "run them unclamped (time_step_limit (0, inf))")
        return cls(heads, head_dim, state_size, groups, conv_size, eps, bias, conv_bias, norm)

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_width(self) -> int:
        return self.inner + 2 * self.groups * self.state_size

    @property
    def projection(self) -> int:
        """The input product's rows: [z; x, B, C; dt]."""
        return self.inner + self.conv_width + self.heads

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """A sequence's state: the convolution's earlier inputs, the heads' matrices."""
        return (self.conv_size - 1, self.conv_width), (self.heads, self.head_dim, self.state_size)


class Mamba2Mixer(nn.Module):
    """The layer between its two norms (the module docstring): products, convolution, scan, gated norm."""

    def __init__(self, hidden_size: int, m: Mamba2Shape):
        super().__init__()
        self.shape = m
        self.in_proj = nn.Linear(hidden_size, m.projection, bias=m.bias)
        self.conv = nn.Parameter(torch.empty(m.conv_width, m.conv_size))  # a channel's taps, the oldest first
        self.conv_bias = nn.Parameter(torch.empty(m.conv_width)) if m.conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(m.heads))
        self.decay = nn.Parameter(torch.empty(m.heads))  # A = -exp(A_log): llama.cpp's ssm_a
        self.skip = nn.Parameter(torch.empty(m.heads))   # D
        self.norm = nn.Parameter(torch.empty(m.inner)) if m.norm else None
        self.out = nn.Linear(m.inner, hidden_size, bias=m.bias)

    @staticmethod
    def convert(hf: dict[str, torch.Tensor], prefix: str, out_prefix: str, m: Mamba2Shape) -> dict[str, torch.Tensor]:
        """A layer's transformers parameters under ``prefix`` (or a GGUF file's, as gguf.py names them:
        -exp(A_log) as ssm_a) -> this module's under ``out_prefix``."""
        out = {}
        for kind in ("weight", "bias") if m.bias else ("weight",):
            out[out_prefix + f"in_proj.{kind}"] = hf[prefix + f"in_proj.{kind}"]
            out[out_prefix + f"out.{kind}"] = hf[prefix + f"out_proj.{kind}"]
        out[out_prefix + "conv"] = hf[prefix + "conv1d.weight"].reshape(m.conv_width, m.conv_size)
        if m.conv_bias:
            out[out_prefix + "conv_bias"] = hf[prefix + "conv1d.bias"]
        out[out_prefix + "dt_bias"] = hf[prefix + "dt_bias"].reshape(-1)
        decay = prefix + "ssm_a"
        out[out_prefix + "decay"] = hf[decay].reshape(-1) if decay in hf else -torch.exp(hf[prefix + "A_log"])
        out[out_prefix + "skip"] = hf[prefix + "D"].reshape(-1)
        if m.norm:
            out[out_prefix + "norm"] = hf[prefix + "norm.weight"].reshape(-1)
        return out

    def forward(self, x, states: list[torch.Tensor], runs: StateRuns) -> torch.Tensor:
        """``states``: this layer's conv inputs [slots, conv_size - 1, conv width] and matrices [slots, heads,
        head width, state width] (KVCache.state_layer); ``runs``: the step's recurrent.StateRuns. On the CPU
        kernel where it is built (kernels/mamba_scan.py), else on torch operators."""
        projected = self.in_proj(x)
        if native_scan.supports(projected, states):
            return self.out(native_scan.mixer(projected, self, states, runs))
        return self.out(self.mix(projected, states, runs))

    def mix(self, projected, states, runs: StateRuns) -> torch.Tensor:
        """The kernel's work on torch operators: [rows, inner]."""
        m = self.shape
        conv_states, matrices = states
        z, xbc, dt = projected.split([m.inner, m.conv_width, m.heads], -1)
        x, b, c = convolve(xbc, self.conv, self.conv_bias, conv_states, runs).split(
            [m.inner, m.groups * m.state_size, m.groups * m.state_size], -1)
        x = x.view(-1, m.heads, m.head_dim)
        per_group = m.heads // m.groups  # (consecutive heads read one group's B and C)
        b, c = (t.view(-1, m.groups, m.state_size).repeat_interleave(per_group, dim=1) for t in (b, c))
        y = scan(x, F.softplus(dt + self.dt_bias), self.decay, b, c, matrices, runs) + x * self.skip[:, None]
        return gated_norm(y.flatten(1), z, self.norm, m.groups, m.eps)


def scan(x, dt, decay, b, c, matrices: torch.Tensor, runs: StateRuns) -> torch.Tensor:
    """Each run's rows through its heads' matrices (read from and written back to their slots in
    ``matrices``): per row, S = exp(dt A) S + dt x b^T; y = S c. x [rows, heads, head width], dt [rows, heads],
    b, c [rows, heads, state width]; [rows, heads, head width], in waves (the t-th row of each run at once),
    in float32 at least (as transformers, llama.cpp)."""
    dtype = x.dtype
    work = torch.promote_types(dtype, torch.float32)
    x, dt, b, c = (t.to(work) for t in (x, dt, b, c))
    state = matrices[runs.slots].to(work) * (~runs.fresh)[:, None, None, None]
    decays = torch.exp(dt * decay.to(work))
    out = torch.empty_like(x)
    for rows, which in runs.waves:
        s = state[which] * decays[rows, :, None, None] + (dt[rows, :, None] * x[rows])[..., None] * b[rows, :, None, :]
        out[rows] = torch.einsum("rhpn,rhn->rhp", s, c[rows])
        state[which] = s
    matrices[runs.slots] = state.to(matrices.dtype)
    return out.to(dtype)


def gated_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor | None, groups: int, eps: float) -> torch.Tensor:
    """y SiLU(z), RMS-normed a group at a time (in float32 at least, as transformers), times ``weight`` (None: not
    normed)."""
    dtype = y.dtype
    work = torch.promote_types(dtype, torch.float32)
    h = (y.to(work) * F.silu(z.to(work))).view(y.shape[0], groups, -1)
    if weight is None:
        return h.flatten(1).to(dtype)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.flatten(1).to(dtype)
