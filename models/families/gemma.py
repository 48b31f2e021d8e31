"""Gemma 2 and Gemma 3 (text) over the paged KV cache: four norms per block in Gemma's (1 + weight)
convention, a GELU-tanh gated MLP, embeddings scaled by sqrt(hidden), attention scaled by
query_pre_attn_scalar, layers with a sliding window between layers without. Gemma 2 soft-caps its
attention scores and every layer rotates alike; Gemma 3 normalises each head's query and key and
its sliding-window layers rotate with a rope base of their own."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .layers import GATE_UP, QKV, AttentionMasks, DecoderModel, DecoderShape, RMSNorm, fused
from .llama import Attention
from .rope import Rotary, rope_type

# when the config lists no layer types: Gemma 2's layers alternate, a local one first; Gemma 3 has
# five local layers, then a global one
SLIDING_PATTERNS = {"gemma2": 2, "gemma3_text": 6}


@dataclass
class GemmaSpec(DecoderShape):
    global_rope: dict          # rope parameters of the global layers (theta and scaling)
    local_theta: float | None  # rope base of the sliding-window layers (Gemma 3); None: they rotate as the others
    layer_windows: tuple[int | None, ...]
    query_scale: float
    attn_softcap: float | None  # the attention scores' soft cap (Gemma 2)
    final_softcap: float | None
    qk_norm: bool              # per-head q/k norms (Gemma 3)
    max_position: int
    tie_word_embeddings: bool
    # what llama.Attention reads: no biases, per-head norms, no sinks
    qkv_bias = out_bias = qk_norm_across_heads = attention_sinks = False

    @classmethod
    def from_hf(cls, c: dict) -> "GemmaSpec":
        kind = c["model_type"]
        if c.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"unsupported hidden_activation {c['hidden_activation']!r} for {kind}")
        if c.get("use_bidirectional_attention"):
            raise ValueError(f"{kind} with bidirectional attention is not supported")
        rope = c.get("rope_parameters") or {}
        if "full_attention" in rope:  # transformers 5's Gemma 3: one set per layer type
            global_rope, local_theta = dict(rope["full_attention"]), rope["sliding_attention"]["rope_theta"]
        else:
            global_rope = dict(rope or c.get("rope_scaling") or {})
            global_rope.setdefault("rope_theta", c.get("rope_theta", 10_000.0 if kind == "gemma2" else 1_000_000.0))
            local_theta = c.get("rope_local_base_freq", None if kind == "gemma2" else 10_000.0)
        layers = c["num_hidden_layers"]
        pattern = SLIDING_PATTERNS[kind]
        types = c.get("layer_types") or ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                         for i in range(layers)]
        heads = c["num_attention_heads"]
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
            num_layers=layers, num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or 256, rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            global_rope=global_rope, local_theta=None if local_theta is None else float(local_theta),
            layer_windows=tuple(c.get("sliding_window", 4096) if t == "sliding_attention" else None for t in types),
            query_scale=c.get("query_pre_attn_scalar", 256) ** -0.5,
            # (transformers' defaults where the config names none: Gemma 2's caps, 256-wide heads, 4096-token windows)
            attn_softcap=c.get("attn_logit_softcapping", 50.0 if kind == "gemma2" else None),
            final_softcap=c.get("final_logit_softcapping", 30.0 if kind == "gemma2" else None),
            qk_norm=kind == "gemma3_text",
            max_position=c.get("max_position_embeddings", 32768 if kind == "gemma3_text" else 8192),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", True)))


def gemma_norm(dim: int, eps: float) -> RMSNorm:
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), in float32 (also for a float64 model)."""
    return RMSNorm(dim, eps, offset=1.0)


class Block(nn.Module):
    def __init__(self, s: GemmaSpec, index: int):
        super().__init__()
        self.window = s.layer_windows[index]
        self.input_norm = gemma_norm(s.hidden_size, s.rms_norm_eps)
        self.attn = Attention(s, norm=gemma_norm, scale=s.query_scale, softcap=s.attn_softcap)
        self.post_attn_norm = gemma_norm(s.hidden_size, s.rms_norm_eps)
        self.pre_mlp_norm = gemma_norm(s.hidden_size, s.rms_norm_eps)
        self.gate_up = nn.Linear(s.hidden_size, 2 * s.intermediate_size, bias=False)
        self.down = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)
        self.post_mlp_norm = gemma_norm(s.hidden_size, s.rms_norm_eps)

    def forward(self, x, rotations, kv_cache, layer, step, masks):
        cos, sin = rotations[self.window is None]
        x = x + self.post_attn_norm(self.attn(self.input_norm(x), cos, sin, kv_cache, layer, step, masks[self.window]))
        gate, up = self.gate_up(self.pre_mlp_norm(x)).chunk(2, dim=-1)
        return x + self.post_mlp_norm(self.down(F.gelu(gate, approximate="tanh") * up))


class Gemma(DecoderModel):
    def __init__(self, s: GemmaSpec):
        super().__init__(s, Block, gemma_norm)
        scaling = s.global_rope if rope_type(s.global_rope) != "default" else None
        self.global_rotary = Rotary(s.head_dim, s.global_rope["rope_theta"], scaling, max_position=s.max_position)
        self.local_rotary = None if s.local_theta is None else Rotary(s.head_dim, s.local_theta)
        if self.global_rotary.long_from is not None:
            raise ValueError("Gemma with longrope is not supported")

    def forward(self, step, kv_cache) -> torch.Tensor:
        """Logits [S, vocab] for the step's sampled positions only."""
        x = self.embed(step.input_ids)
        # sqrt(hidden) rounded to float32 first, as transformers keeps it
        x = x * torch.tensor(math.sqrt(self.spec.hidden_size), dtype=torch.float32).to(x.dtype)
        angles = self.global_rotary(step.positions, x.dtype)
        window_angles = None if self.local_rotary is None else self.local_rotary(step.positions, x.dtype)
        rotations = (window_angles or angles, angles)  # by whether a layer has no window
        logits = self.native_decode(x, *angles, step, kv_cache, window_angles=window_angles)
        if logits is None:
            masks = {w: AttentionMasks(step, x.dtype, kv_cache, w) for w in set(self.spec.layer_windows)}
            for i, layer in enumerate(self.layers):
                x = layer(x, rotations, kv_cache, i, step, masks)
            logits = self.lm_head(self.norm(x[step.sample_indices]))
        if self.spec.final_softcap:
            logits = torch.tanh(logits / self.spec.final_softcap) * self.spec.final_softcap
        return logits

    @staticmethod
    def convert(hf: dict[str, torch.Tensor], s: GemmaSpec) -> dict[str, torch.Tensor]:
        """Transformers' parameter names -> this module's, fusing q/k/v and gate/up."""
        hf = {k.removeprefix("model.").removeprefix("language_model."): v for k, v in hf.items()}
        out = {"embed.weight": hf["embed_tokens.weight"], "norm.weight": hf["norm.weight"]}
        out["lm_head.weight"] = hf["embed_tokens.weight"] if s.tie_word_embeddings else hf["lm_head.weight"]
        norms = {"input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
                 "pre_mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}
        if s.qk_norm:
            norms |= {"attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}
        for i in range(s.num_layers):
            p = o = f"layers.{i}."
            for ours, theirs in norms.items():
                out[o + ours + ".weight"] = hf[p + theirs + ".weight"]
            out[o + "attn.qkv.weight"] = fused(hf, p, QKV)
            out[o + "attn.out.weight"] = hf[p + "self_attn.o_proj.weight"]
            out[o + "gate_up.weight"] = fused(hf, p, GATE_UP)
            out[o + "down.weight"] = hf[p + "mlp.down_proj.weight"]
        return out
