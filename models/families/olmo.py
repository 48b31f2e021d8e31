"""OLMo 2 and OLMo 3, and EXAONE 4, over the paged KV cache: Llama's attention and SwiGLU MLP with the
norms moved after them (each output normalised before it is added; the attention and the MLP read the
residual stream as it is), the queries and keys each normalised across all heads at once (EXAONE 4: a
head at a time, as Qwen3's), and (OLMo 3, EXAONE 4's 32B) three layers in four attending through a
sliding window: OLMo 3's rotating without the rope scaling of the global layers, EXAONE 4's as the
global layers would, whose own attend without rotary."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .layers import GATE_UP, QKV, AttentionMasks, DecoderModel, DecoderShape, RMSNorm, SwiGLU, fused
from .llama import Attention
from .rope import Rotary, rope_type

FAMILIES = ("olmo2", "olmo3", "exaone4")
# OLMo 3's layers where the config lists none: three with a window, then one without
OLMO3_GLOBAL_EVERY = 4
EXAONE4_GLOBAL_EVERY = 4  # (transformers' sliding_window_pattern where a windowed config names none)


@dataclass
class OlmoSpec(DecoderShape):
    global_rope: dict         # the global layers' rope parameters (theta and scaling)
    local_theta: float        # the sliding-window layers' rope base (their rope never scaled)
    layer_windows: tuple[int | None, ...]
    max_position: int
    rope_max_position: int    # the checkpoint's max_position_embeddings, which rope scalings refer to
    tie_word_embeddings: bool
    qkv_bias: bool
    out_bias: bool
    qk_norm_across_heads: bool = True  # (EXAONE 4's a head at a time)
    # EXAONE 4's: its window layers rotate as its global ones would; its global layers, where some slide, not at all
    global_nope: bool = False
    # what llama.Attention reads: norms of the queries and keys, no sinks
    qk_norm = True
    attention_sinks = False

    @classmethod
    def from_hf(cls, c: dict) -> "OlmoSpec":
        kind = c["model_type"]
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {c['hidden_act']!r} for {kind}; supported: silu")
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        if "full_attention" in rope:  # transformers 5's OLMo 3: one set per layer type
            if rope_type(rope["sliding_attention"]) != "default":
                raise ValueError(f"{kind} whose sliding-window layers scale their rope "
                                 f"({rope_type(rope['sliding_attention'])}) is not supported; supported: the "
                                 "global layers' scaling alone")
            global_rope, local_theta = dict(rope["full_attention"]), rope["sliding_attention"]["rope_theta"]
        else:
            global_rope = dict(rope)
            global_rope.setdefault("rope_theta", c.get("rope_theta", 10000.0))
            local_theta = c.get("rope_local_base_freq", global_rope["rope_theta"])
        layers, heads = c["num_hidden_layers"], c["num_attention_heads"]
        exaone = kind == "exaone4"
        window = c.get("sliding_window", None if exaone else 4096)
        types = c.get("layer_types")
        if types is None:  # a global layer every few (OLMo 3's; EXAONE 4's where it has a window), else all global
            if kind == "olmo3":
                every = OLMO3_GLOBAL_EVERY
            else:
                every = (c.get("sliding_window_pattern") or EXAONE4_GLOBAL_EVERY) if exaone and window else 0
            types = ["sliding_attention" if every and (i + 1) % every else "full_attention" for i in range(layers)]
        if len(types) != layers:
            raise ValueError(f"layer_types lists {len(types)} layers of {layers}")
        trained = c.get("max_position_embeddings", 4096)
        bias = bool(c.get("attention_bias", False))
        if exaone:  # (one rotary for every layer: the window layers' base is the global layers')
            local_theta = global_rope["rope_theta"]
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
            num_layers=layers, num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads, rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            global_rope=global_rope, local_theta=float(local_theta),
            layer_windows=tuple(window if t == "sliding_attention" else None for t in types),
            max_position=trained, rope_max_position=trained,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)), qkv_bias=bias, out_bias=bias,
            qk_norm_across_heads=not exaone, global_nope=exaone and window is not None)

    @property
    def local_rotation(self) -> bool:
        """Whether the sliding-window layers rotate otherwise than the global ones (OLMo 3's: by the
        global base without its scaling; EXAONE 4's window layers rotate as its global ones would)."""
        return any(w is not None for w in self.layer_windows) and not self.global_nope and (
            rope_type(self.global_rope) != "default" or self.local_theta != self.global_rope["rope_theta"])


class Block(nn.Module):
    def __init__(self, s: OlmoSpec, index: int):
        super().__init__()
        self.window = s.layer_windows[index]
        self.rotates = not (s.global_nope and self.window is None)
        self.attn = Attention(s)
        self.post_attn_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = SwiGLU(s.hidden_size, s.intermediate_size)  # (without biases)
        self.post_mlp_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def forward(self, x, rotations, kv_cache, layer, step, masks):
        cos, sin = rotations[self.window is None] if self.rotates else (None, None)
        x = x + self.post_attn_norm(self.attn(x, cos, sin, kv_cache, layer, step, masks[self.window]))
        return x + self.post_mlp_norm(self.mlp(x))


class Olmo(DecoderModel):
    def __init__(self, s: OlmoSpec):
        super().__init__(s, Block, RMSNorm)
        theta = s.global_rope["rope_theta"]
        scaling = s.global_rope if rope_type(s.global_rope) != "default" else None
        self.global_rotary = Rotary(s.head_dim, theta, scaling, max_position=s.rope_max_position)
        self.local_rotary = Rotary(s.head_dim, s.local_theta) if s.local_rotation else None
        if self.global_rotary.per_sequence:
            raise ValueError(f"OLMo with a {rope_type(scaling)} rope scaling is not supported; supported: default, "
                             "linear, llama3, yarn")

    def forward(self, step, kv_cache) -> torch.Tensor:
        """Logits [S, vocab] for the step's sampled positions only."""
        x = self.embed(step.input_ids)
        angles = self.global_rotary(step.positions, x.dtype)
        window_angles = None if self.local_rotary is None else self.local_rotary(step.positions, x.dtype)
        logits = self.native_decode(x, *angles, step, kv_cache, window_angles=window_angles)
        if logits is None:
            rotations = (window_angles or angles, angles)  # by whether a layer has no window
            masks = {w: AttentionMasks(step, x.dtype, kv_cache, w) for w in set(self.spec.layer_windows)}
            for i, layer in enumerate(self.layers):
                x = layer(x, rotations, kv_cache, i, step, masks)
            logits = self.lm_head(self.norm(x[step.sample_indices]))
        return logits

    @staticmethod
    def convert(hf: dict[str, torch.Tensor], s: OlmoSpec) -> dict[str, torch.Tensor]:
        """Transformers' parameter names -> this module's, fusing q/k/v and gate/up."""
        hf = {k.removeprefix("model."): v for k, v in hf.items()}
        out = {"embed.weight": hf["embed_tokens.weight"], "norm.weight": hf["norm.weight"]}
        out["lm_head.weight"] = hf["embed_tokens.weight"] if s.tie_word_embeddings else hf["lm_head.weight"]
        named = {"attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight",
                 "post_attn_norm.weight": "post_attention_layernorm.weight",
                 "post_mlp_norm.weight": "post_feedforward_layernorm.weight",
                 "mlp.down.weight": "mlp.down_proj.weight"}
        if s.out_bias:
            named["attn.out.bias"] = "self_attn.o_proj.bias"
        for i in range(s.num_layers):
            p = o = f"layers.{i}."
            out.update({o + ours: hf[p + theirs] for ours, theirs in named.items()})
            out[o + "attn.out.weight"] = hf[p + "self_attn.o_proj.weight"]
            for kind in ("weight", "bias") if s.qkv_bias else ("weight",):
                out[o + f"attn.qkv.{kind}"] = fused(hf, p, QKV, kind)
            out[o + "mlp.gate_up.weight"] = fused(hf, p, GATE_UP)
        return out
