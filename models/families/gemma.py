"""Gemma 1, 2 and 3 (text) over the paged KV cache: norms in Gemma's (1 + weight) convention, a
GELU-tanh gated MLP, embeddings scaled by sqrt(hidden). Gemma 1 has Llama's two norms a block and
attends to the whole context. Gemma 2 and 3 add norms of the attention's and the MLP's outputs (four
a block), scale their attention by query_pre_attn_scalar and put layers with a sliding window between
layers without; Gemma 2 soft-caps its attention scores and every layer rotates alike; Gemma 3
normalises each head's query and key and its sliding-window layers rotate with a rope base of their own."""

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
# five local layers, then a global one; Gemma 1's are all global
SLIDING_PATTERNS = {"gemma": 1, "gemma2": 2, "gemma3_text": 6}


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
    output_norms: bool = True  # the attention's and the MLP's outputs normalised before they are added (not Gemma 1)
    # what llama.Attention reads: no biases, per-head norms, no sinks
    qkv_bias = out_bias = qk_norm_across_heads = attention_sinks = False

    @classmethod
    def from_hf(cls, c: dict) -> "GemmaSpec":
        kind = c["model_type"]
        activation = c.get("hidden_activation") or (c.get("hidden_act") if kind == "gemma" else None)
        if kind == "gemma" and activation == "gelu":  # (Gemma 1's configs' name for it, as transformers reads them)
            activation = "gelu_pytorch_tanh"
        if (activation or "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"unsupported hidden_activation {activation!r} for {kind}; supported: gelu_pytorch_tanh")
        if c.get("use_bidirectional_attention"):
            raise ValueError(f"{kind} with bidirectional attention is not supported")
        rope = c.get("rope_parameters") or {}
        if "full_attention" in rope:  # transformers 5's Gemma 3: one set per layer type
            global_rope, local_theta = dict(rope["full_attention"]), rope["sliding_attention"]["rope_theta"]
        else:
            global_rope = dict(rope or c.get("rope_scaling") or {})
            theta = c.get("rope_theta", 1_000_000.0 if kind == "gemma3_text" else 10_000.0)
            global_rope.setdefault("rope_theta", theta)
            local_theta = c.get("rope_local_base_freq", 10_000.0 if kind == "gemma3_text" else None)
        layers = c["num_hidden_layers"]
        pattern = SLIDING_PATTERNS[kind]
        types = c.get("layer_types") or ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                         for i in range(layers)]
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or 256
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
            num_layers=layers, num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=head_dim, rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            global_rope=global_rope, local_theta=None if local_theta is None else float(local_theta),
            layer_windows=tuple(c.get("sliding_window", 4096) if t == "sliding_attention" else None for t in types),
            # (Gemma 1's: the head size's)
            query_scale=c.get("query_pre_attn_scalar", head_dim if kind == "gemma" else 256) ** -0.5,
            # (transformers' defaults where the config names none: Gemma 2's caps, 256-wide heads, 4096-token windows)
            attn_softcap=c.get("attn_logit_softcapping", 50.0 if kind == "gemma2" else None),
            final_softcap=c.get("final_logit_softcapping", 30.0 if kind == "gemma2" else None),
            qk_norm=kind == "gemma3_text",
            max_position=c.get("max_position_embeddings", 32768 if kind == "gemma3_text" else 8192),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", True)), output_norms=kind != "gemma")


def soft_capped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap tanh(logits / cap) where the model caps its logits (Gemma 2's, 3's and 4's final_logit_softcapping)."""
    return torch.tanh(logits / cap) * cap if cap else logits


def gemma_tensors(hf: dict, s) -> tuple[dict, dict]:
    """A Gemma checkpoint's tensors without their "model." (and a multimodal checkpoint's "language_model.")
    prefix, and the model's own from them: the embeddings, the final norm and the output layer (the embeddings
    where the spec ties them)."""
    hf = {k.removeprefix("model.").removeprefix("language_model."): v for k, v in hf.items()}
    out = {"embed.weight": hf["embed_tokens.weight"], "norm.weight": hf["norm.weight"]}
    out["lm_head.weight"] = hf["embed_tokens.weight"] if s.tie_word_embeddings else hf["lm_head.weight"]
    return hf, out


def gemma_norm(dim: int, eps: float) -> RMSNorm:
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), in float32 (also for a float64 model)."""
    return RMSNorm(dim, eps, offset=1.0)


class Block(nn.Module):
    def __init__(self, s: GemmaSpec, index: int):
        super().__init__()
        self.window = s.layer_windows[index]
        self.input_norm = gemma_norm(s.hidden_size, s.rms_norm_eps)
        self.attn = Attention(s, norm=gemma_norm, scale=s.query_scale, softcap=s.attn_softcap)
        self.post_attn_norm = gemma_norm(s.hidden_size, s.rms_norm_eps) if s.output_norms else None
        self.pre_mlp_norm = gemma_norm(s.hidden_size, s.rms_norm_eps)
        self.gate_up = nn.Linear(s.hidden_size, 2 * s.intermediate_size, bias=False)
        self.down = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)
        self.post_mlp_norm = gemma_norm(s.hidden_size, s.rms_norm_eps) if s.output_norms else None

    def forward(self, x, rotations, kv_cache, layer, step, masks):
        cos, sin = rotations[self.window is None]
        attended = self.attn(self.input_norm(x), cos, sin, kv_cache, layer, step, masks[self.window])
        x = x + (self.post_attn_norm(attended) if self.post_attn_norm is not None else attended)
        gate, up = self.gate_up(self.pre_mlp_norm(x)).chunk(2, dim=-1)
        mixed = self.down(F.gelu(gate, approximate="tanh") * up)
        return x + (self.post_mlp_norm(mixed) if self.post_mlp_norm is not None else mixed)


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
        return soft_capped(logits, self.spec.final_softcap)

    @staticmethod
    def convert(hf: dict[str, torch.Tensor], s: GemmaSpec) -> dict[str, torch.Tensor]:
        """Transformers' parameter names -> this module's, fusing q/k/v and gate/up."""
        hf, out = gemma_tensors(hf, s)
        norms = {"input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
                 "pre_mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}
        if not s.output_norms:  # (Gemma 1's norm after the attention is the MLP's input norm, as Llama's)
            norms = {"input_norm": "input_layernorm", "pre_mlp_norm": "post_attention_layernorm"}
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
