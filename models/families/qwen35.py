"""Qwen3.5 and Qwen3-Next over the paged KV cache and a state a sequence: three layers in four mix their tokens
through a gated delta rule (linear attention whose memory is a matrix a head, carried from token to token), the
fourth attends as Qwen3 does with an output gate; every layer then takes a SwiGLU MLP (Qwen3.5-MoE's and
Qwen3-Next's: routed experts beside a shared one, moe.py's). Its norms scale by 1 + weight (Gemma's), the rotary
turns the first quarter of each head.

A delta-rule layer's product gives q, k and v (convolved with the three tokens before, a channel at a
time, through a SiLU), a gate z and, a head each, beta and a decay. Each head's state S (key width x
value width) decays, takes the value k would read corrected by beta (S += k (beta (v - S^T k))^T) and
answers q; the answers are normalised, times SiLU(z), and go through the output product. S and the
convolution's last three inputs are the sequence's state, kept in the pool's state slots
(models/step.py's ``state_shapes``): a step reads each sequence's from its slot (zeros at position 0)
and writes it back. Where there are more value heads than key heads, each key head's value heads come side by
side (``DeltaShape.grouped``: Hugging Face's order, and Qwen3-Next files'), or tiled (value head h reads key head
h mod the key heads: llama.cpp's Qwen3.5 files), as the weights hold them: the output product's columns of a
file's blocks cannot be put in another order. Qwen3-Next's checkpoints and files give q, k, v and z from one
product and beta and alpha from another, a key head's rows at a time; they are split as they load."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import delta_rule as native_delta
from .layers import GATE_UP, QKV, AttentionMasks, DecoderModel, DecoderShape, RMSNorm, SwiGLU, fused, paged_attention
from .llama import Attention
from .moe import MoESpec, SparseMoE
from .recurrent import StateRuns, check_state_slots, convolve
from .rope import Rotary, rope_type

FAMILIES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
# transformers' Qwen3.5 (and Qwen3-Next) defaults, for a config that leaves them out
DEFAULT_THETA, DEFAULT_ROTARY_SHARE, DEFAULT_ATTENTION_EVERY, DEFAULT_HEAD_DIM = 10_000_000.0, 0.25, 4, 256
NAMES = {**dict.fromkeys(FAMILIES, "Qwen3.5"), "qwen3_next": "Qwen3-Next"}  # (for messages)
# its decoder norms multiply by 1 + weight (their checkpoints store weight - 1, llama.cpp's files weight)
NORM_OFFSET = 1.0


@dataclass
class DeltaShape:
    """A gated delta-rule layer's sizes."""
    key_heads: int
    value_heads: int  # a multiple of key_heads
    key_dim: int
    value_dim: int
    conv_size: int    # the inputs a convolution reads: this token's and conv_size - 1 before
    grouped: bool = True  # a key head's value heads side by side; else tiled (the module docstring)

    @classmethod
    def from_hf(cls, c: dict) -> "DeltaShape":
        """A config's sizes (transformers' defaults where it leaves them out)."""
        shape = cls(c.get("linear_num_key_heads", 16), c.get("linear_num_value_heads", 32),
                    c.get("linear_key_head_dim", 128), c.get("linear_value_head_dim", 128),
                    c.get("linear_conv_kernel_dim", 4), not c.get("llama_cpp_tiled_value_heads", False))
        if shape.value_heads % shape.key_heads:
            raise ValueError(f"{NAMES[c['model_type']]}'s value heads ({shape.value_heads}) must be a multiple of its "
                             f"key heads ({shape.key_heads})")
        return shape

    @property
    def conv_width(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """A sequence's state: the convolution's earlier inputs, the heads' matrices."""
        return (self.conv_size - 1, self.conv_width), (self.value_heads, self.key_dim, self.value_dim)


@dataclass
class Qwen35Spec(DecoderShape):
    rope_theta: float
    partial_rotary_factor: float
    max_position: int
    tie_word_embeddings: bool
    layer_recurrent: tuple[bool, ...]  # whether each layer is a delta-rule layer (else it attends)
    delta: DeltaShape
    # a GGUF file's layout (gguf_config says so): its query rows split from the gates' as they are read,
    # -exp(A_log) stored
    llama_cpp_layout: bool = False
    moe: MoESpec | None = None  # Qwen3.5-MoE's and Qwen3-Next's experts, in the MLP's place where it routes
    # what llama.Attention reads: each head's query and key normalised, no biases or sinks
    qk_norm = True
    qkv_bias = out_bias = qk_norm_across_heads = attention_sinks = False

    @classmethod
    def from_hf(cls, c: dict) -> "Qwen35Spec":
        c = {**c, **c.get("text_config", {})}  # (a hub directory's config keeps the text model's under text_config)
        layers, heads, name = c["num_hidden_layers"], c["num_attention_heads"], NAMES[c["model_type"]]
        every = c.get("full_attention_interval", DEFAULT_ATTENTION_EVERY)
        types = c.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                         for i in range(layers)]
        if len(types) != layers:
            raise ValueError(f"layer_types lists {len(types)} layers of {layers}")
        if unknown := set(types) - {"full_attention", "linear_attention"}:
            raise ValueError(f"{name} layer types {sorted(unknown)} are not supported; supported: full_attention, "
                             "linear_attention")
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {c['hidden_act']!r} for {name}; supported: silu")
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        if rope_type(rope) != "default":
            raise ValueError(f"{name} with a {rope_type(rope)} rope scaling is not supported; supported: default")
        if c.get("attention_bias"):  # (the published models have none; GatedAttention adds none)
            raise ValueError(f"{name} with attention_bias (biases on the attention's products) is not supported")
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            intermediate_size=c.get("intermediate_size") or c["moe_intermediate_size"],
            num_layers=layers, num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or DEFAULT_HEAD_DIM, rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=float(c.get("rope_theta") or rope.get("rope_theta") or DEFAULT_THETA),
            partial_rotary_factor=float(c.get("partial_rotary_factor") or rope.get("partial_rotary_factor")
                                        or DEFAULT_ROTARY_SHARE),
            max_position=c.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            layer_recurrent=tuple(t == "linear_attention" for t in types), delta=DeltaShape.from_hf(c),
            llama_cpp_layout=bool(c.get("llama_cpp_layout", False)), moe=MoESpec.from_hf(c))


class GatedDeltaNet(nn.Module):
    """The delta-rule layer (the module docstring): products, convolution, recurrence, gated norm, output."""

    def __init__(self, s: Qwen35Spec):
        super().__init__()
        d = self.shape = s.delta
        self.qkv = nn.Linear(s.hidden_size, d.conv_width, bias=False)
        self.z = nn.Linear(s.hidden_size, d.value_heads * d.value_dim, bias=False)
        self.beta = nn.Linear(s.hidden_size, d.value_heads, bias=False)
        self.alpha = nn.Linear(s.hidden_size, d.value_heads, bias=False)
        self.conv = nn.Parameter(torch.empty(d.conv_width, d.conv_size))  # a channel's taps, the oldest first
        self.dt_bias = nn.Parameter(torch.empty(d.value_heads))
        self.decay = nn.Parameter(torch.empty(d.value_heads))  # -exp(A_log): llama.cpp's ssm_a
        self.norm = RMSNorm(d.value_dim, s.rms_norm_eps)
        self.out = nn.Linear(d.value_heads * d.value_dim, s.hidden_size, bias=False)

    def forward(self, x, states: list[torch.Tensor], runs: StateRuns) -> torch.Tensor:
        """``states``: this layer's conv inputs [slots, conv_size - 1, width] and matrices [slots, heads,
        key, value] (KVCache.state_layer); ``runs``: the step's recurrent.StateRuns. On the CPU kernel where it is
        built (kernels/delta_rule.py), else on torch operators."""
        mixed, z, beta, alpha = self.qkv(x), self.z(x), self.beta(x), self.alpha(x)
        if native_delta.supports(mixed, states):
            gated = native_delta.mixer(mixed, self.conv, alpha, beta, self.dt_bias, self.decay, z, self.norm.weight,
                                       self.norm.eps, states, runs, self.shape)
        else:
            gated = self.mix(mixed, z, beta, alpha, states, runs)
        return self.out(gated)

    def mix(self, mixed, z, beta, alpha, states, runs: StateRuns) -> torch.Tensor:
        """The kernel's work on torch operators: [rows, heads x value width]."""
        d = self.shape
        conv_states, matrices = states
        conv = convolve(mixed, self.conv, None, conv_states, runs)
        q, k, v = conv.split([d.key_heads * d.key_dim, d.key_heads * d.key_dim, d.value_heads * d.value_dim], -1)
        repeat = d.value_heads // d.key_heads
        spread = (lambda t: t.repeat_interleave(repeat, 1)) if d.grouped else (lambda t: t.repeat(1, repeat, 1))
        q = spread(unit(q.view(-1, d.key_heads, d.key_dim)))
        k = spread(unit(k.view(-1, d.key_heads, d.key_dim)))
        v = v.view(-1, d.value_heads, d.value_dim)
        decay = torch.exp(self.decay * F.softplus(alpha + self.dt_bias))
        out = delta_rule(q * d.key_dim ** -0.5, k, v, decay, torch.sigmoid(beta), matrices, runs)
        return (self.norm(out) * F.silu(z.view(-1, d.value_heads, d.value_dim))).flatten(1)


def unit(x: torch.Tensor) -> torch.Tensor:
    """Each row over its length (as transformers' l2norm: x / sqrt(|x|^2 + 1e-6))."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def delta_rule(q, k, v, decay, beta, matrices: torch.Tensor, runs: StateRuns) -> torch.Tensor:
    """Each run's rows through its heads' matrices (read from and written back to their slots in
    ``matrices``): per row, S = decay S; S += k (beta (v - S^T k))^T; out = S^T q. [rows, heads, value],
    in waves (the t-th row of each run at once), in float32 at least (a 16-bit state rounded every token
    drifts; transformers and llama.cpp keep it in float32)."""
    dtype = v.dtype
    q, k, v, decay, beta = (t.to(torch.promote_types(dtype, torch.float32)) for t in (q, k, v, decay, beta))
    state = matrices[runs.slots].to(q.dtype) * (~runs.fresh)[:, None, None, None]
    out = torch.empty_like(v)
    for rows, which in runs.waves:
        s = state[which] * decay[rows, :, None, None]
        delta = (v[rows] - torch.einsum("rhk,rhkv->rhv", k[rows], s)) * beta[rows, :, None]
        s = s + k[rows, :, :, None] * delta[:, :, None, :]
        out[rows] = torch.einsum("rhk,rhkv->rhv", q[rows], s)
        state[which] = s
    matrices[runs.slots] = state.to(matrices.dtype)
    return out.to(dtype)


class GatedAttention(Attention):
    """Qwen3's attention (q/k norms a head), its output times the sigmoid of a gate that the query
    product also gives: the fused product's rows are [queries; gates; keys; values]."""

    def __init__(self, s: Qwen35Spec):
        super().__init__(s, norm=lambda width, eps: RMSNorm(width, eps, NORM_OFFSET))
        self.qkv = nn.Linear(s.hidden_size, (2 * s.num_heads + 2 * s.num_kv_heads) * s.head_dim, bias=False)

    def forward(self, x, cos, sin, kv_cache, layer, step, masks):
        width, kv_width = self.heads * self.dim, self.kv_heads * self.dim
        q, gate, k, v = self.qkv(x).split([width, width, kv_width, kv_width], -1)
        q, k = self.q_norm(q.view(-1, self.heads, self.dim)), self.k_norm(k.view(-1, self.kv_heads, self.dim))
        o = paged_attention(q, k, v.view(-1, self.kv_heads, self.dim), kv_cache, layer, step, masks, self.scale,
                            cos, sin)
        return self.out(o.flatten(1) * torch.sigmoid(gate))


class Block(nn.Module):
    def __init__(self, s: Qwen35Spec, index: int):
        super().__init__()
        self.recurrent = s.layer_recurrent[index]
        # its place in the pool: among the delta-rule layers' states, or the attention layers' K/V
        self.pool_layer = s.layer_recurrent[:index].count(self.recurrent)
        self.input_norm = RMSNorm(s.hidden_size, s.rms_norm_eps, NORM_OFFSET)
        self.mixer = GatedDeltaNet(s) if self.recurrent else GatedAttention(s)
        self.post_norm = RMSNorm(s.hidden_size, s.rms_norm_eps, NORM_OFFSET)
        routed = s.moe and s.moe.routes(index)  # (Qwen3-Next's mlp_only_layers take a dense MLP)
        self.mlp = SparseMoE(s.hidden_size, s.moe) if routed else SwiGLU(s.hidden_size, s.intermediate_size)

    def forward(self, x, cos, sin, kv_cache, step, masks, runs):
        h = self.input_norm(x)
        if self.recurrent:
            x = x + self.mixer(h, kv_cache.state_layer(self.pool_layer), runs)
        else:
            x = x + self.mixer(h, cos, sin, kv_cache, self.pool_layer, step, masks)
        return x + self.mlp(self.post_norm(x))


class Qwen35(DecoderModel):
    def __init__(self, s: Qwen35Spec):
        super().__init__(s, Block, lambda width, eps: RMSNorm(width, eps, NORM_OFFSET))
        self.rotary = Rotary(s.head_dim, s.rope_theta, None, s.partial_rotary_factor, s.max_position)
        # the pool's geometry: K/V for the attention layers, a state a sequence for the delta-rule layers
        self.num_layers = s.layer_recurrent.count(False)
        self.state_shapes = (s.layer_recurrent.count(True), s.delta.state_shapes)

    def forward(self, step, kv_cache) -> torch.Tensor:
        """Logits [S, vocab] for the step's sampled positions only."""
        check_state_slots(step, kv_cache)
        x = self.embed(step.input_ids)
        cos, sin = self.rotary(step.positions, x.dtype)
        logits = self.native_decode(x, cos, sin, step, kv_cache)
        if logits is not None:
            return logits
        masks = AttentionMasks(step, x.dtype, kv_cache)
        runs = StateRuns(step, self.spec.delta.conv_size - 1)
        for layer in self.layers:
            x = layer(x, cos, sin, kv_cache, step, masks, runs)
        return self.lm_head(self.norm(x[step.sample_indices]))

    @staticmethod
    def convert(hf: dict[str, torch.Tensor], s: Qwen35Spec) -> dict[str, torch.Tensor]:
        """Transformers' parameter names (a hub directory's under model.language_model) -> this module's:
        q/k/v and gate/up fused, Qwen3-Next's qkvz and ba products split, and (where the file is not llama.cpp's,
        whose converter did so) each head's query rows split from its gate rows, A_log read as -exp(A_log)."""
        hf = {k.removeprefix("model.").removeprefix("language_model."): v for k, v in hf.items()}
        out = {"embed.weight": hf["embed_tokens.weight"], "norm.weight": hf["norm.weight"]}
        out["lm_head.weight"] = hf["embed_tokens.weight"] if s.tie_word_embeddings else hf["lm_head.weight"]
        theirs = not s.llama_cpp_layout
        for i, recurrent in enumerate(s.layer_recurrent):
            p = o = f"layers.{i}."
            out[o + "input_norm.weight"] = hf[p + "input_layernorm.weight"]
            out[o + "post_norm.weight"] = hf[p + "post_attention_layernorm.weight"]
            if s.moe and s.moe.routes(i):
                out.update(SparseMoE.convert(hf, p, o + "mlp.", s.moe))
            else:
                out[o + "mlp.gate_up.weight"] = fused(hf, p, GATE_UP)
                out[o + "mlp.down.weight"] = hf[p + "mlp.down_proj.weight"]
            if not recurrent:
                a = p + "self_attn."
                if theirs:
                    hf[a + "q_proj.weight"] = hf[a + "q_proj.weight"][query_then_gate(s.num_heads, s.head_dim)]
                out[o + "mixer.qkv.weight"] = fused(hf, p, QKV)
                out[o + "mixer.out.weight"] = hf[a + "o_proj.weight"]
                out[o + "mixer.q_norm.weight"] = hf[a + "q_norm.weight"]
                out[o + "mixer.k_norm.weight"] = hf[a + "k_norm.weight"]
                continue
            a = p + "linear_attn."
            for whole, (parts, rows) in SPLITS.items():
                if (weight := hf.get(f"{a}{whole}.weight")) is not None:  # (Qwen3-Next's)
                    hf.update({f"{a}{part}.weight": weight[r] for part, r in zip(parts, rows(s.delta))})
            out[o + "mixer.qkv.weight"] = hf[a + "in_proj_qkv.weight"]
            out[o + "mixer.conv"] = hf[a + "conv1d.weight"].reshape(s.delta.conv_width, s.delta.conv_size)
            out[o + "mixer.z.weight"] = hf[a + "in_proj_z.weight"]
            out[o + "mixer.beta.weight"] = hf[a + "in_proj_b.weight"]
            out[o + "mixer.alpha.weight"] = hf[a + "in_proj_a.weight"]
            out[o + "mixer.dt_bias"] = hf[a + "dt_bias"]
            out[o + "mixer.decay"] = -torch.exp(hf[a + "A_log"]) if theirs else hf[a + "ssm_a"]
            out[o + "mixer.norm.weight"] = hf[a + "norm.weight"]
            out[o + "mixer.out.weight"] = hf[a + "out_proj.weight"]
        return out


def qkvz_rows(d: DeltaShape) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of Qwen3-Next's qkvz product (a key head's at a time: its query, its key, its value heads', their
    gates') that make the qkv product (every query's, every key's, every value's) and the z product."""
    repeat = d.value_heads // d.key_heads
    widths = [d.key_dim, d.key_dim, repeat * d.value_dim, repeat * d.value_dim]
    rows = torch.arange(d.key_heads * sum(widths)).view(d.key_heads, sum(widths)).split(widths, 1)
    return torch.cat([part.flatten() for part in rows[:3]]), rows[3].flatten()


def ba_rows(d: DeltaShape) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of Qwen3-Next's ba product (a key head's at a time: its value heads' betas, then their alphas)
    that give beta and alpha, a value head each."""
    repeat = d.value_heads // d.key_heads
    rows = torch.arange(2 * d.value_heads).view(d.key_heads, 2, repeat)
    return rows[:, 0].flatten(), rows[:, 1].flatten()


# Qwen3-Next's fused products by transformers' names: the names of their parts (Qwen3.5's products), and the rows
# of each
SPLITS = {"in_proj_qkvz": (("in_proj_qkv", "in_proj_z"), qkvz_rows),
          "in_proj_ba": (("in_proj_b", "in_proj_a"), ba_rows)}


def query_then_gate(heads: int, dim: int) -> torch.Tensor:
    """The query product's rows as [every head's query; every head's gate] (each head's come as
    [query, gate] in the checkpoint and in llama.cpp's files)."""
    per_head = torch.arange(2 * heads * dim).view(heads, 2, dim)
    return per_head.transpose(0, 1).flatten()
