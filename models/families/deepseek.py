"""DeepSeek's family over the paged KV cache: DeepSeek-V2 (and V2-Lite), V3 and the models built on it (Kimi K2,
Moonlight), GLM-4.7-Flash, Mistral 4 (softmax routing, Llama 4's attention temperature), and MiniCPM3 (a dense MLP,
MiniCPM's scales of the embeddings, the residual branches and the logits). Its multi-head latent
attention keeps one latent a token, not keys and values a head: the token's hidden state projected down to
kv_lora_rank values (normed) beside a key part that rotates (rope_dim values, one for all heads). Each head's key and
value are that latent projected up (kv_b_proj's rows), so a head's score q . k_up(latent) is (k_up^T q) . latent: the
queries are taken into the latent's space, the attention runs as one key head of kv_lora_rank + rope_dim values that
every head reads (its values the latents themselves), and each head's output is projected up from the latent after.
The cache holds the latent and the rotated key part, in that key head (and again as its value: the pool keeps K and V
alike); the queries' and keys' rotary parts come first in it, where paged_attention rotates them. The mixtures are
moe.py's (DeepSeek's group-limited routing, its shared experts)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..kernels.block_heads import HeadProducts
from .layers import (GATE_UP, AttentionMasks, DecoderModel, DecoderShape, RMSNorm, SwiGLU, block_norms, decoder_tensors,
                     fused, paged_attention)
from .moe import DEEPSEEK_KINDS, MoESpec, SparseMoE
from .rope import Rotary, halves_from_pairs, query_scales_at, rope_type, sequence_ends, temperature_of, yarn_mscale

FAMILIES = DEEPSEEK_KINDS + ("minicpm3",)
LATENT_NORM_EPS = 1e-6


@dataclass
class DeepSeekSpec(DecoderShape):
    # (DecoderShape's num_kv_heads and head_dim are the cache's: one key head of rope_dim + kv_lora_rank values)
    q_lora_rank: int | None  # the queries' own low rank (V3's, GLM-4.7-Flash's; V2-Lite's queries have none)
    kv_lora_rank: int
    nope_dim: int    # a head's query and key values that do not rotate
    rope_dim: int    # and those that do
    value_dim: int   # a head's value
    rope_theta: float
    rope_scaling: dict | None
    max_position: int
    rope_max_position: int
    attention_scale: float
    tie_word_embeddings: bool
    interleaved_rotary: bool  # the checkpoint's rotary rows in pairs side by side (DeepSeek's), reordered at load
    moe: MoESpec | None
    # the epsilon of the latent's and the low-rank queries' norms: DeepSeek's code and transformers fix 1e-6
    # whatever rms_norm_eps says (GLM-4.7-Flash's 1e-5); llama.cpp takes the file's one epsilon (gguf_config's)
    latent_norm_eps: float = LATENT_NORM_EPS
    # Mistral 4's (Llama 4's) attention temperature: rope.query_temperature's (beta, the original context, 0)
    query_temperature: tuple[float, int, int] | None = None
    # MiniCPM3's scales (Granite's names, llama_spec's): the embeddings times embedding_scale, each residual branch
    # times residual_scale, the logits over logits_divisor
    embedding_scale: float = 1.0
    residual_scale: float = 1.0
    logits_divisor: float = 1.0

    @classmethod
    def from_hf(cls, c: dict) -> "DeepSeekSpec":
        kind = c["model_type"]
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {c['hidden_act']!r} for {kind}; supported: silu")
        if c.get("attention_bias"):
            raise ValueError(f"{kind} with attention_bias (biases on the latent attention's products) is not supported")
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        nope, rotary, latent = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["kv_lora_rank"]
        trained = c.get("max_position_embeddings", 4096)
        minicpm3 = kind == "minicpm3"
        scales = _minicpm3_scales(c) if minicpm3 else {}
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=c["num_attention_heads"],
            num_kv_heads=1,
            head_dim=rotary + latent,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            q_lora_rank=c.get("q_lora_rank") or None,
            kv_lora_rank=latent,
            nope_dim=nope,
            rope_dim=rotary,
            # (MiniCPM3's config may leave it out: the hidden size over the heads, as transformers reads it)
            value_dim=c.get("v_head_dim") or c["hidden_size"] // c["num_attention_heads"] if minicpm3 else
            c["v_head_dim"],
            rope_theta=float(c.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=rope if rope_type(rope) != "default" else None,
            max_position=trained,
            rope_max_position=trained,
            attention_scale=_attention_scale(nope + rotary, rope),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", minicpm3)),  # (transformers' defaults)
            # (V2's rotation is complex numbers of pairs side by side; V3's too, unless rope_interleave says not;
            # a GGUF file's rows are put in halves as they are read; MiniCPM3's rotates halves)
            interleaved_rotary=not minicpm3 and (kind == "deepseek_v2" or c.get("rope_interleave", True))
                               and not c.get("rotary_rows_in_halves", False),
            moe=MoESpec.from_hf(c),
            latent_norm_eps=c.get("latent_norm_eps", LATENT_NORM_EPS),
            query_temperature=temperature_of(rope),
            **scales,
        )


def _minicpm3_scales(c: dict) -> dict:
    """MiniCPM3's scales as transformers' MiniCPM3Config reads them: the embeddings times scale_emb, each residual
    branch times scale_depth over the root of the layers, the logits over hidden_size / dim_model_base (a scale_depth
    of None: the root of the layers; a dim_model_base of None: the hidden size), MiniCPM3-4B's where it says nothing."""
    layers, hidden = c["num_hidden_layers"], c["hidden_size"]
    depth, base = c.get("scale_depth", 1.4), c.get("dim_model_base", 256)
    return {"embedding_scale": float(c.get("scale_emb", 12)),
            "residual_scale": (math.sqrt(layers) if depth is None else depth) / math.sqrt(layers),
            "logits_divisor": hidden / (hidden if base is None else base)}


def _attention_scale(query_dim: int, rope: dict) -> float:
    """1 / sqrt(a head's query width), times YaRN's mscale squared where the rope has mscale_all_dim: DeepSeek
    scales every score so, not only the rotated parts (transformers' yarn_apply_mscale)."""
    scale = query_dim ** -0.5
    if rope_type(rope) != "default" and rope.get("mscale_all_dim"):
        scale *= yarn_mscale(rope.get("factor") or 1.0, rope["mscale_all_dim"]) ** 2
    return scale


class LatentAttention(nn.Module):
    """Multi-head latent attention (the module's doc says how it runs on the paged cache)."""

    def __init__(self, s: DeepSeekSpec):
        super().__init__()
        self.heads, self.nope, self.rope, self.latent = s.num_heads, s.nope_dim, s.rope_dim, s.kv_lora_rank
        query = s.num_heads * (s.nope_dim + s.rope_dim)
        low_rank = s.q_lora_rank is not None
        self.q = None if low_rank else nn.Linear(s.hidden_size, query, bias=False)
        self.q_down = nn.Linear(s.hidden_size, s.q_lora_rank, bias=False) if low_rank else None
        self.q_norm = RMSNorm(s.q_lora_rank, s.latent_norm_eps) if low_rank else None
        self.q_up = nn.Linear(s.q_lora_rank, query, bias=False) if low_rank else None
        # the latent, then the keys' rotary part
        self.kv_down = nn.Linear(s.hidden_size, s.kv_lora_rank + s.rope_dim, bias=False)
        self.kv_norm = RMSNorm(s.kv_lora_rank, s.latent_norm_eps)
        # each head's keys from the latent, taken backwards (its query into the latent's space), and its values
        self.k_up = HeadProducts(s.num_heads, s.kv_lora_rank, s.nope_dim)
        self.v_up = HeadProducts(s.num_heads, s.value_dim, s.kv_lora_rank)
        self.out = nn.Linear(s.num_heads * s.value_dim, s.hidden_size, bias=False)
        self.scale = s.attention_scale

    def forward(self, x, cos, sin, kv_cache, layer, step, masks, query_scales=None):
        """``query_scales``: each row's query scale (rope.query_temperature), or None."""
        q = self.q(x) if self.q is not None else self.q_up(self.q_norm(self.q_down(x)))
        q_nope, q_rope = q.view(-1, self.heads, self.nope + self.rope).split([self.nope, self.rope], -1)
        latent, k_rope = self.kv_down(x).split([self.latent, self.rope], -1)
        # each head's query in the latent's space: q . (K latent) = (K^T q) . latent
        query = torch.cat([q_rope, self.k_up(q_nope)], -1)
        if query_scales is not None:  # (before the rotation, which it commutes with)
            query = query * query_scales[:, None, None]
        key = torch.cat([k_rope, self.kv_norm(latent)], -1)[:, None]
        attended = paged_attention(query, key, key, kv_cache, layer, step, masks, self.scale, cos, sin)
        # each head's weighted latents (its output past the rotary part) projected up to its values
        return self.out(self.v_up(attended[..., self.rope:]).flatten(1))

    @staticmethod
    def convert(hf: dict, p: str, o: str, s: DeepSeekSpec) -> dict:
        """The attention's tensors under ``p`` (transformers' names, or a GGUF file's k_b_proj and v_b_proj, kv_b_proj's
        rows split as llama.cpp's converter splits them, the keys' transposed: as k_up and v_up take them, a head's
        matrix [out, in] each, in float or as the file's stacks of blocks), the rotary rows put in halves."""
        p, o = p + "self_attn.", o + "attn."
        heads, query = s.num_heads, s.nope_dim + s.rope_dim
        in_halves = lambda t, rows, start, count: t[halves_from_pairs(rows, count, s.rope_dim, start)] \
            if s.interleaved_rotary else t
        out = {o + "kv_down.weight": in_halves(hf.pop(p + "kv_a_proj_with_mqa.weight"), s.kv_lora_rank + s.rope_dim,
                                               s.kv_lora_rank, 1),
               o + "kv_norm.weight": hf.pop(p + "kv_a_layernorm.weight"),
               o + "out.weight": hf.pop(p + "o_proj.weight")}
        if s.q_lora_rank is None:
            out[o + "q.weight"] = in_halves(hf.pop(p + "q_proj.weight"), heads * query, s.nope_dim, heads)
        else:
            out[o + "q_down.weight"] = hf.pop(p + "q_a_proj.weight")
            out[o + "q_norm.weight"] = hf.pop(p + "q_a_layernorm.weight")
            out[o + "q_up.weight"] = in_halves(hf.pop(p + "q_b_proj.weight"), heads * query, s.nope_dim, heads)
        if p + "kv_b_proj.weight" in hf:
            keys, values = hf.pop(p + "kv_b_proj.weight").view(heads, s.nope_dim + s.value_dim, -1).split(
                [s.nope_dim, s.value_dim], 1)
            k_up, v_up = keys.transpose(1, 2).contiguous(), values.contiguous()
        else:
            k_up, v_up = hf.pop(p + "k_b_proj.weight"), hf.pop(p + "v_b_proj.weight")
        return out | {o + "k_up.weight": k_up, o + "v_up.weight": v_up}


class Block(nn.Module):
    def __init__(self, s: DeepSeekSpec, index: int):
        super().__init__()
        self.residual_scale = s.residual_scale
        self.input_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.attn = LatentAttention(s)
        self.post_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = SparseMoE(s.hidden_size, s.moe) if s.moe and s.moe.routes(index) else \
            SwiGLU(s.hidden_size, s.intermediate_size)

    def forward(self, x, cos, sin, kv_cache, layer, step, masks, query_scales=None):
        x = x + self.scaled(self.attn(self.input_norm(x), cos, sin, kv_cache, layer, step, masks, query_scales))
        return x + self.scaled(self.mlp(self.post_norm(x)))

    def scaled(self, branch: torch.Tensor) -> torch.Tensor:
        """A residual branch times MiniCPM3's scale (the others': as it is, no copy)."""
        return branch * self.residual_scale if self.residual_scale != 1.0 else branch


class DeepSeek(DecoderModel):
    def __init__(self, s: DeepSeekSpec):
        super().__init__(s, Block, RMSNorm)
        self.rotary = Rotary(s.rope_dim, s.rope_theta, s.rope_scaling, 1.0, s.rope_max_position)
        # longrope (MiniCPM3's): a sequence that grows past the original context is recomputed from its first token
        # with the long factors, as Llama's (models/step.py)
        self.recompute_past = self.rotary.long_from

    def forward(self, step, kv_cache) -> torch.Tensor:
        """Logits [S, vocab] for the step's sampled positions only."""
        x = self.embed(step.input_ids)
        if self.spec.embedding_scale != 1.0:  # (MiniCPM3's)
            x = x * self.spec.embedding_scale
        cos, sin = self.rotary(step.positions, x.dtype, sequence_ends(step) if self.rotary.per_sequence else None)
        scales = query_scales_at(step.positions, self.spec.query_temperature, x.dtype)
        logits = self.native_decode(x, cos, sin, step, kv_cache, query_scales=scales)
        if logits is None:
            masks = AttentionMasks(step, x.dtype, kv_cache)
            for i, layer in enumerate(self.layers):
                x = layer(x, cos, sin, kv_cache, i, step, masks, scales)
            logits = self.lm_head(self.norm(x[step.sample_indices]))
        return logits / self.spec.logits_divisor if self.spec.logits_divisor != 1.0 else logits

    @staticmethod
    def convert(hf: dict[str, torch.Tensor], s: DeepSeekSpec) -> dict[str, torch.Tensor]:
        """Transformers' parameter names -> this module's (a checkpoint's multi-token prediction layers, past
        num_layers, unread)."""
        hf, out = decoder_tensors(hf, s)
        for i in range(s.num_layers):
            p = o = f"layers.{i}."
            out |= block_norms(hf, p) | LatentAttention.convert(hf, p, o, s)
            if s.moe and s.moe.routes(i):
                out |= SparseMoE.convert(hf, p, o + "mlp.", s.moe)
            else:
                out[o + "mlp.gate_up.weight"] = fused(hf, p, GATE_UP)
                out[o + "mlp.down.weight"] = hf[p + "mlp.down_proj.weight"]
        return out
