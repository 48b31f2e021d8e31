"""The Llama family (Llama, Qwen2, Mistral) over the paged KV cache: GQA, RoPE, RMSNorm, SwiGLU."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .layers import AttentionMasks, RMSNorm, Rotary, apply_rotary, paged_attention


@dataclass
class LlamaSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    out_bias: bool
    mlp_bias: bool
    sliding_window: int | None

    @classmethod
    def from_hf(cls, c: dict) -> "LlamaSpec":
        kind = c["model_type"]
        heads = c["num_attention_heads"]
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        theta = c.get("rope_theta") or rope.get("rope_theta") or 10000.0
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {c['hidden_act']!r} for {kind}; supported: silu")
        window = None
        if kind == "mistral":
            window = c.get("sliding_window")
        elif kind == "qwen2" and c.get("use_sliding_window"):
            raise ValueError("qwen2 checkpoints with use_sliding_window=True are not supported")
        bias = bool(c.get("attention_bias", False))
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None,
            max_position=c.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=kind == "qwen2" or bias,
            out_bias=bias,
            mlp_bias=bool(c.get("mlp_bias", False)),
            sliding_window=window,
        )


class Attention(nn.Module):
    def __init__(self, s: LlamaSpec):
        super().__init__()
        self.heads, self.kv_heads, self.dim = s.num_heads, s.num_kv_heads, s.head_dim
        self.qkv = nn.Linear(s.hidden_size, (s.num_heads + 2 * s.num_kv_heads) * s.head_dim, bias=s.qkv_bias)
        self.out = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=s.out_bias)
        self.scale = s.head_dim ** -0.5

    def forward(self, x, cos, sin, kv_cache, layer, step, masks):
        q, k, v = self.qkv(x).split([self.heads * self.dim, self.kv_heads * self.dim, self.kv_heads * self.dim], -1)
        q = apply_rotary(q.view(-1, self.heads, self.dim), cos, sin)
        k = apply_rotary(k.view(-1, self.kv_heads, self.dim), cos, sin)
        o = paged_attention(q, k, v.view(-1, self.kv_heads, self.dim), kv_cache, layer, step, masks, self.scale)
        return self.out(o.flatten(1))


class MLP(nn.Module):
    def __init__(self, s: LlamaSpec):
        super().__init__()
        self.gate_up = nn.Linear(s.hidden_size, 2 * s.intermediate_size, bias=s.mlp_bias)
        self.down = nn.Linear(s.intermediate_size, s.hidden_size, bias=s.mlp_bias)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, s: LlamaSpec):
        super().__init__()
        self.input_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.attn = Attention(s)
        self.post_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = MLP(s)

    def forward(self, x, cos, sin, kv_cache, layer, step, masks):
        x = x + self.attn(self.input_norm(x), cos, sin, kv_cache, layer, step, masks)
        return x + self.mlp(self.post_norm(x))


class Llama(nn.Module):
    def __init__(self, s: LlamaSpec):
        super().__init__()
        self.spec = s
        self.num_layers, self.num_kv_heads, self.head_dim = s.num_layers, s.num_kv_heads, s.head_dim
        self.vocab_size, self.max_position = s.vocab_size, s.max_position
        self.embed = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(Block(s) for _ in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        self.tie_embeddings()
        self.rotary = Rotary(s.head_dim, s.rope_theta, s.rope_scaling)

    def tie_embeddings(self):
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(self, step, kv_cache) -> torch.Tensor:
        """Logits [S, vocab] for the step's sampled positions only."""
        x = self.embed(step.input_ids)
        cos, sin = self.rotary(step.positions, x.dtype)
        masks = AttentionMasks(step, x.dtype, self.spec.sliding_window)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache, i, step, masks)
        return self.lm_head(self.norm(x[step.sample_indices]))

    @staticmethod
    def convert(hf: dict[str, torch.Tensor], s: LlamaSpec) -> dict[str, torch.Tensor]:
        """Transformers' parameter names -> this module's, fusing q/k/v and gate/up."""
        hf = {k.removeprefix("model."): v for k, v in hf.items()}
        out = {"embed.weight": hf["embed_tokens.weight"], "norm.weight": hf["norm.weight"]}
        out["lm_head.weight"] = hf["embed_tokens.weight"] if s.tie_word_embeddings else hf["lm_head.weight"]
        for i in range(s.num_layers):
            p, o = f"layers.{i}.", f"layers.{i}."
            out[o + "input_norm.weight"] = hf[p + "input_layernorm.weight"]
            out[o + "post_norm.weight"] = hf[p + "post_attention_layernorm.weight"]
            for kind in ("weight", "bias") if s.qkv_bias else ("weight",):
                out[o + f"attn.qkv.{kind}"] = torch.cat([hf[p + f"self_attn.{n}_proj.{kind}"] for n in "qkv"])
            for kind in ("weight", "bias") if s.out_bias else ("weight",):
                out[o + f"attn.out.{kind}"] = hf[p + f"self_attn.o_proj.{kind}"]
            for kind in ("weight", "bias") if s.mlp_bias else ("weight",):
                out[o + f"mlp.gate_up.{kind}"] = torch.cat([hf[p + f"mlp.gate_proj.{kind}"], hf[p + f"mlp.up_proj.{kind}"]])
                out[o + f"mlp.down.{kind}"] = hf[p + f"mlp.down_proj.{kind}"]
        return out
