"""Mamba (state-spaces' mamba-130m to 2.8b) and TII's Falcon-Mamba-7B over a state a sequence: every layer an
RMS norm, then Mamba's selective-scan mixer, then the residual; no attention, no MLP. The mixer's input product
gives x and a gate z; x is convolved with the three inputs before, a channel at a time, through a SiLU; its x
product gives a low-rank time step and B and C (one state's keys and queries, shared by every channel), which
Falcon-Mamba RMS-normalises without weights; the time step's product widens it to a step a channel. Each channel
keeps a state of ``state_size`` values that decay by exp(dt A), A a rate for each (unlike Mamba2's one a head), and
take dt x B every token; its answer is the state dotted with C, plus D x, times SiLU(z), through the output product.
The states and the convolution's last inputs are the sequence's, kept in the pool's state slots (models/step.py's
``state_shapes``); the pool holds no K/V. Decode rows and short prefill chunks run on the native decoder layers
(kernels/decoder_layer.cpp's SelectiveLayer); the torch layers, the reference, call the convolution and scan
kernels (kernels/selective_scan.h) between their products."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import selective_scan as native_scan
from .layers import DecoderModel, DecoderShape, RMSNorm, weightless_norm
from .recurrent import UNBOUNDED_CONTEXT, StateRuns, check_state_slots, convolve

FAMILIES = ("mamba", "falcon_mamba")
# transformers' MambaConfig defaults (FalconMambaConfig's the same, and its mixer_rms_eps), for a config that
# leaves them out
DEFAULTS = {"state_size": 16, "expand": 2, "conv_kernel": 4, "use_bias": False, "use_conv_bias": True,
            "hidden_act": "silu", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True, "time_step_rank": "auto",
            "mixer_rms_eps": 1e-6}


def step_rank_of(hidden: int, rank) -> int:
    """A config's time_step_rank (Jamba's mamba_dt_rank): "auto" for the hidden size over 16, rounded up."""
    return -(-hidden // 16) if rank == "auto" else int(rank)


@dataclass
class MambaSpec(DecoderShape):
    state_size: int = 16
    conv_size: int = 4        # the inputs a convolution reads: this token's and conv_size - 1 before
    time_step_rank: int = 48  # the time step's width before its product widens it to a channel each
    dt_b_c_eps: float | None = None  # Falcon-Mamba's weightless RMS norms of the time step, B and C (None: none)
    dt_b_c_weights: bool = False  # those norms with weights of their own (Jamba's dt_layernorm, b_ and c_layernorm)
    bias: bool = False        # the input and output products add biases
    conv_bias: bool = True
    tie_word_embeddings: bool = True
    max_position: int = UNBOUNDED_CONTEXT

    @classmethod
    def from_hf(cls, c: dict) -> "MambaSpec":
        c = {**DEFAULTS, **c}
        if c["hidden_act"] != "silu":
            raise ValueError(f"Mamba with hidden_act {c['hidden_act']!r} is not supported; supported: silu")
        hidden = c["hidden_size"]
        rank = c["time_step_rank"]
        inner = c.get("intermediate_size") or int(c["expand"] * hidden)
        falcon = c["model_type"] == "falcon_mamba"
        return cls(vocab_size=c["vocab_size"], hidden_size=hidden, intermediate_size=inner,
                   num_layers=c["num_hidden_layers"], num_heads=0, num_kv_heads=0, head_dim=0,
                   rms_norm_eps=c["layer_norm_epsilon"], state_size=c["state_size"], conv_size=c["conv_kernel"],
                   time_step_rank=step_rank_of(hidden, rank),
                   # (a GGUF file's: its norms' epsilon, as llama.cpp reads it)
                   dt_b_c_eps=c.get("dt_b_c_eps", c["mixer_rms_eps"]) if falcon else None,
                   bias=bool(c["use_bias"]), conv_bias=bool(c["use_conv_bias"]),
                   tie_word_embeddings=bool(c["tie_word_embeddings"]),
                   max_position=c.get("max_position_embeddings") or UNBOUNDED_CONTEXT)

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """A sequence's state a layer: the convolution's earlier inputs, the channels' states (a state value's
        channels side by side, as the kernel reads them)."""
        return (self.conv_size - 1, self.intermediate_size), (self.state_size, self.intermediate_size)


class MambaMixer(nn.Module):
    """The layer between its norm and the residual (the module docstring)."""

    def __init__(self, s: MambaSpec):
        super().__init__()
        self.spec = s
        inner = s.intermediate_size
        self.in_proj = nn.Linear(s.hidden_size, 2 * inner, bias=s.bias)
        self.conv = nn.Parameter(torch.empty(inner, s.conv_size))  # a channel's taps, the oldest first
        self.conv_bias = nn.Parameter(torch.empty(inner)) if s.conv_bias else None
        self.x_proj = nn.Linear(inner, s.time_step_rank + 2 * s.state_size, bias=False)
        self.dt_proj = nn.Linear(s.time_step_rank, inner)
        # A = -exp(A_log) (llama.cpp's ssm_a), transposed: a state value's channels' rates side by side
        self.decay = nn.Parameter(torch.empty(s.state_size, inner))
        self.skip = nn.Parameter(torch.empty(inner))  # D
        self.out = nn.Linear(inner, s.hidden_size, bias=s.bias)
        # Jamba's norms of the time step's low rank, B and C (Falcon-Mamba's have no weights: time_steps)
        self.step_norms = nn.ModuleList(RMSNorm(width, s.dt_b_c_eps) for width in self.step_widths) \
            if s.dt_b_c_weights else None

    @property
    def step_widths(self) -> tuple[int, int, int]:
        """The widths of the time step's low rank, B and C in x_proj's output."""
        return self.spec.time_step_rank, self.spec.state_size, self.spec.state_size

    @staticmethod
    def convert(hf: dict[str, torch.Tensor], prefix: str, out_prefix: str, s: MambaSpec) -> dict[str, torch.Tensor]:
        """A layer's transformers parameters under ``prefix`` (or a GGUF file's, as gguf.py names them:
        -exp(A_log) as ssm_a) -> this module's under ``out_prefix``."""
        out = {out_prefix + "conv": hf[prefix + "conv1d.weight"].reshape(s.intermediate_size, s.conv_size)}
        for ours, theirs in (("in_proj", "in_proj"), ("out", "out_proj")):
            for kind in ("weight", "bias") if s.bias else ("weight",):
                out[f"{out_prefix}{ours}.{kind}"] = hf[f"{prefix}{theirs}.{kind}"]
        out[out_prefix + "x_proj.weight"] = hf[prefix + "x_proj.weight"]
        out[out_prefix + "dt_proj.weight"] = hf[prefix + "dt_proj.weight"]
        out[out_prefix + "dt_proj.bias"] = hf[prefix + "dt_proj.bias"]
        if s.conv_bias:
            out[out_prefix + "conv_bias"] = hf[prefix + "conv1d.bias"]
        decay = prefix + "ssm_a"
        out[out_prefix + "decay"] = (hf[decay] if decay in hf else -torch.exp(hf[prefix + "A_log"])).t().contiguous()
        out[out_prefix + "skip"] = hf[prefix + "D"].reshape(-1)
        if s.dt_b_c_weights:
            out |= {f"{out_prefix}step_norms.{i}.weight": hf[f"{prefix}{name}_layernorm.weight"]
                    for i, name in enumerate(("dt", "b", "c"))}
        return out

    def forward(self, x, states: list[torch.Tensor], runs: StateRuns) -> torch.Tensor:
        """``states``: this layer's conv inputs [slots, conv_size - 1, inner] and states [slots, state width,
        inner] (KVCache.state_layer); ``runs``: the step's recurrent.StateRuns. The convolution and the scan on the
        CPU kernels where they are built (kernels/selective_scan.py), else on torch operators."""
        projected = self.in_proj(x)
        if native_scan.supports(projected, states):
            return self.out(self.mix_on_kernels(projected.contiguous(), states, runs))
        return self.out(self.mix(projected, states, runs))

    def time_steps(self, xs):
        """The time steps' low-rank part, B and C of the convolved inputs (normed: Falcon-Mamba's without weights,
        Jamba's with), as one tensor [rows, rank + 2 x state width]."""
        s = self.spec
        bc = self.x_proj(xs)
        if s.dt_b_c_eps is None:
            return bc.contiguous()
        parts = bc.split(self.step_widths, -1)
        if self.step_norms is not None:
            return torch.cat([norm(t) for norm, t in zip(self.step_norms, parts)], -1)
        return torch.cat([weightless_norm(t, s.dt_b_c_eps) for t in parts], -1)

    def mix_on_kernels(self, projected, states, runs: StateRuns) -> torch.Tensor:
        """[rows, inner]: the gated answers before the output product, the convolution and the scan on the
        kernels."""
        s = self.spec
        conv_states, matrices = states
        xs = native_scan.convolve(projected, s.intermediate_size, self.conv, self.conv_bias, conv_states, runs)
        steps = self.time_steps(xs)
        y = native_scan.scan(xs, F.softplus(self.dt_proj(steps[:, :s.time_step_rank])), steps, s.time_step_rank,
                             self.decay, self.skip, matrices, runs)
        return y * F.silu(projected[:, s.intermediate_size:])

    def mix(self, projected, states, runs: StateRuns) -> torch.Tensor:
        """The kernels' work on torch operators: [rows, inner]."""
        conv_states, matrices = states
        xs, z = projected.chunk(2, dim=-1)
        xs = convolve(xs, self.conv, self.conv_bias, conv_states, runs)
        dt, b, c = self.time_steps(xs).split(self.step_widths, -1)
        y = scan(xs, F.softplus(self.dt_proj(dt)), self.decay, b, c, matrices, runs) + xs * self.skip
        return y * F.silu(z)


def scan(x, dt, decay, b, c, matrices: torch.Tensor, runs: StateRuns) -> torch.Tensor:
    """Each run's rows through its channels' states (read from and written back to their slots in ``matrices``
    [slots, state width, inner]): per row, S = exp(dt A) S + dt x b; y = S . c. x, dt [rows, inner], A [state width,
    inner], b, c [rows, state width]; [rows, inner], in waves (the t-th row of each run at once), in float32 at least (as transformers,
    llama.cpp)."""
    dtype = x.dtype
    work = torch.promote_types(dtype, torch.float32)
    x, dt, b, c, decay = (t.to(work) for t in (x, dt, b, c, decay))
    state = matrices[runs.slots].to(work) * (~runs.fresh)[:, None, None]
    out = torch.empty_like(x)
    for rows, which in runs.waves:
        step = dt[rows, None, :]
        s = state[which] * torch.exp(step * decay) + (step * x[rows, None, :]) * b[rows, :, None]
        out[rows] = torch.einsum("rnc,rn->rc", s, c[rows])
        state[which] = s
    matrices[runs.slots] = state.to(matrices.dtype)
    return out.to(dtype)


class Block(nn.Module):
    def __init__(self, s: MambaSpec, index: int):
        super().__init__()
        self.pool_layer = index  # (its state slot's layer)
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mixer = MambaMixer(s)

    def forward(self, x, kv_cache, runs):
        return x + self.mixer(self.norm(x), kv_cache.state_layer(self.pool_layer), runs)


class Mamba(DecoderModel):
    def __init__(self, s: MambaSpec):
        super().__init__(s, Block, RMSNorm)
        self.num_layers = 0  # the pool's K/V layers: none; a state a layer
        self.state_shapes = (s.num_layers, s.state_shapes)

    def forward(self, step, kv_cache) -> torch.Tensor:
        """Logits [S, vocab] for the step's sampled positions only."""
        check_state_slots(step, kv_cache)
        x = self.embed(step.input_ids)
        logits = self.native_decode(x, None, None, step, kv_cache)
        if logits is not None:
            return logits
        runs = StateRuns(step, self.spec.conv_size - 1)
        for layer in self.layers:
            x = layer(x, kv_cache, runs)
        return self.lm_head(self.norm(x[step.sample_indices]))

    @staticmethod
    def convert(hf: dict[str, torch.Tensor], s: MambaSpec) -> dict[str, torch.Tensor]:
        """Transformers' parameter names (under backbone; or a GGUF file's, as gguf.py names them: the embeddings
        and final norm as Llama's, a layer's norm its input_layernorm, its mixer's products under mamba.) -> this
        module's."""
        hf = {k.removeprefix("backbone.").removeprefix("model."): v for k, v in hf.items()}
        embed = hf.get("embeddings.weight", hf.get("embed_tokens.weight"))
        out = {"embed.weight": embed, "norm.weight": hf.get("norm_f.weight", hf.get("norm.weight"))}
        out["lm_head.weight"] = embed if s.tie_word_embeddings else hf["lm_head.weight"]
        for i in range(s.num_layers):
            p, o = f"layers.{i}.", f"layers.{i}."
            norm, mixer = (p + "norm.weight", p + "mixer.") if p + "norm.weight" in hf else \
                (p + "input_layernorm.weight", p + "mamba.")
            out[o + "norm.weight"] = hf[norm]
            out.update(MambaMixer.convert(hf, mixer, o + "mixer.", s))
        return out
