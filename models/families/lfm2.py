"""LFM2 (Liquid's hybrid models) over the paged KV cache: most layers mix their tokens through a short
convolution in attention's place, the others attend as Qwen3 does (each head's query and key
normalised); every layer then takes a SwiGLU MLP, or (LFM2-MoE, past its dense leading layers) routed
experts chosen by the sigmoid of their logits plus a bias each (moe.py).

A convolution layer's product gives three rows a token, B, C and x; B x is convolved over this token
and the ``conv_size - 1`` before it, a channel at a time, and C times that goes through the output
product. The B x rows of earlier tokens live in the KV pool, a row a token (models/step.py's
``conv_rows``), written and read by slot as K and V are: a prefill chunk, a preempted request's
recompute, a prefix taken from the cache and a speculative verification each find the rows before
them where a later chunk finds earlier keys, where a recurrent state kept a sequence would have
to be carried, snapshot and rolled back. The price is memory: a token keeps ``hidden`` values a
convolution layer where llama.cpp keeps ``conv_size - 1`` rows a sequence."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .layers import QKV, AttentionMasks, DecoderModel, DecoderShape, RMSNorm, SwiGLU, fused
from .llama import Attention
from .moe import MoESpec, SparseMoE
from .rope import Rotary, rope_type

FAMILIES = ("lfm2", "lfm2_moe")
# transformers' LFM2 defaults, for a config that leaves them out
DEFAULT_THETA, DEFAULT_EPS, DEFAULT_CONTEXT = 1_000_000.0, 1e-5, 128_000
# llama.cpp's and transformers' names of LFM2's gate and up products, fused as Llama's are
FEED_FORWARD = ("feed_forward.w1_w3", ("feed_forward.w1", "feed_forward.w3"))


@dataclass
class Lfm2Spec(DecoderShape):
    rope_theta: float
    rope_scaling: dict | None
    max_position: int
    tie_word_embeddings: bool
    layer_convolves: tuple[bool, ...]  # whether each layer is a short convolution (else it attends)
    conv_size: int                     # the tokens a convolution reads: this one and conv_size - 1 before
    conv_bias: bool
    moe: MoESpec | None                # LFM2-MoE's experts
    # what llama.Attention reads: each head's query and key normalised, no biases, no sinks; and the
    # native layers of a Llama block: outputs added as they are
    qk_norm = True
    qkv_bias = out_bias = qk_norm_across_heads = attention_sinks = False
    residual_scale = 1.0

    @classmethod
    def from_hf(cls, c: dict) -> "Lfm2Spec":
        layers, heads = c["num_hidden_layers"], c["num_attention_heads"]
        types = c.get("layer_types")
        if types is None:
            attends = set(c.get("full_attn_idxs") or range(layers))
            types = ["full_attention" if i in attends else "conv" for i in range(layers)]
        if len(types) != layers:
            raise ValueError(f"layer_types lists {len(types)} layers of {layers}")
        if unknown := set(types) - {"full_attention", "conv"}:
            raise ValueError(f"LFM2 layer types {sorted(unknown)} are not supported; supported: full_attention, conv")
        if c.get("sliding_window"):
            raise ValueError("LFM2 with a sliding window is not supported; supported: attention over the whole context")
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        trained = c.get("max_position_embeddings", DEFAULT_CONTEXT)
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=feed_forward_width(c),
            num_layers=layers, num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=c.get("norm_eps", c.get("rms_norm_eps", DEFAULT_EPS)),
            rope_theta=float(c.get("rope_theta") or rope.get("rope_theta") or DEFAULT_THETA),
            rope_scaling=rope if rope_type(rope) != "default" else None, max_position=trained,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", c.get("tie_embedding", True))),
            layer_convolves=tuple(t == "conv" for t in types), conv_size=c.get("conv_L_cache", 3),
            conv_bias=bool(c.get("conv_bias", False)), moe=MoESpec.from_hf(c))


def feed_forward_width(c: dict) -> int:
    """The MLP's width as transformers' Lfm2MLP derives it from the config: two thirds of
    intermediate_size, times block_ffn_dim_multiplier, rounded up to block_multiple_of, unless
    block_auto_adjust_ff_dim is off (a GGUF file's, which keeps the width itself); LFM2-MoE's dense
    layers take intermediate_size as it is."""
    width = c["intermediate_size"]
    if not c.get("block_auto_adjust_ff_dim", True) or c["model_type"] == "lfm2_moe":
        return width
    width = int(2 * width / 3)
    multiplier, multiple = c.get("block_ffn_dim_multiplier"), c.get("block_multiple_of", 256)
    if multiplier is not None:
        width = int(multiplier * width)
    return multiple * -(-width // multiple)


def earlier_slots(step, back: int) -> torch.Tensor:
    """[T, back]: where in the pool the row of the token 1, 2, ..., ``back`` positions before each of
    the step's tokens lies (its sequence's block table at that position), -1 before the sequence's
    first token."""
    device = step.positions.device
    slots = torch.full((len(step.positions), back), -1, dtype=torch.long, device=device)
    offsets = torch.arange(1, back + 1, device=device)
    runs = [(g.start, g.end, g.block_tables) for g in step.decode_groups]
    runs += [(c.start, c.end, c.block_table.expand(c.end - c.start, -1)) for c in step.prefills]
    for start, end, tables in runs:
        earlier = step.positions[start:end, None] - offsets
        known = earlier >= 0
        earlier = earlier.clamp(min=0)
        blocks = tables.gather(1, earlier // step.block_size)
        slots[start:end] = torch.where(known, blocks * step.block_size + earlier % step.block_size, -1)
    return slots


class ShortConv(nn.Module):
    """in_proj's B, C and x; B x convolved over this token and the ones before it (their rows in the
    pool), a channel at a time; C times that through the output product."""

    def __init__(self, s: Lfm2Spec):
        super().__init__()
        self.in_proj = nn.Linear(s.hidden_size, 3 * s.hidden_size, bias=s.conv_bias)
        self.weight = nn.Parameter(torch.empty(s.hidden_size, s.conv_size))  # a channel's taps, the oldest first
        self.bias = nn.Parameter(torch.empty(s.hidden_size)) if s.conv_bias else None
        self.out = nn.Linear(s.hidden_size, s.hidden_size, bias=s.conv_bias)

    def forward(self, x, pool: torch.Tensor, step, earlier: torch.Tensor) -> torch.Tensor:
        """``pool``: this layer's rows in the KV pool (KVCache.conv_layer); ``earlier``: earlier_slots(step,
        conv_size - 1)."""
        b, c, h = self.in_proj(x).chunk(3, dim=-1)
        bx = b * h
        pool = pool.flatten(0, 1)
        pool.index_copy_(0, step.slot_mapping, bx.to(pool.dtype))  # every row written before any is read
        rows = pool[earlier.clamp(min=0)].to(x.dtype) * (earlier >= 0)[..., None]  # [T, taps - 1, hidden]
        mixed = bx * self.weight[:, -1]
        for back in range(1, self.weight.shape[1]):
            mixed = mixed + rows[:, back - 1] * self.weight[:, -1 - back]
        if self.bias is not None:
            mixed = mixed + self.bias
        return self.out(c * mixed)


class Block(nn.Module):
    window, rotates = None, True  # (what the native layers read of an attention layer, as of Llama's)

    def __init__(self, s: Lfm2Spec, index: int):
        super().__init__()
        self.convolves = s.layer_convolves[index]
        # its place in the pool: among the convolution layers' rows, or the attention layers' K/V
        place = s.layer_convolves[:index].count(self.convolves)
        self.input_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.attn = None if self.convolves else Attention(s)
        self.conv = ShortConv(s) if self.convolves else None
        self.pool_layer = place
        self.post_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = SparseMoE(s.hidden_size, s.moe) if s.moe and s.moe.routes(index) else \
            SwiGLU(s.hidden_size, s.intermediate_size)

    def forward(self, x, cos, sin, kv_cache, step, masks, earlier):
        h = self.input_norm(x)
        if self.convolves:
            x = x + self.conv(h, kv_cache.conv_layer(self.pool_layer), step, earlier)
        else:
            x = x + self.attn(h, cos, sin, kv_cache, self.pool_layer, step, masks)
        return x + self.mlp(self.post_norm(x))


class Lfm2(DecoderModel):
    def __init__(self, s: Lfm2Spec):
        super().__init__(s, Block, RMSNorm)
        self.rotary = Rotary(s.head_dim, s.rope_theta, s.rope_scaling, max_position=s.max_position)
        if self.rotary.per_sequence:
            raise ValueError(f"LFM2 with a {rope_type(s.rope_scaling)} rope scaling is not supported; supported: "
                             "default, linear, llama3, yarn")
        # the pool's geometry: K/V for the attention layers, a row a token for the convolution layers
        self.num_layers = s.layer_convolves.count(False)
        self.conv_rows = (s.layer_convolves.count(True), s.hidden_size)

    def forward(self, step, kv_cache) -> torch.Tensor:
        """Logits [S, vocab] for the step's sampled positions only."""
        x = self.embed(step.input_ids)
        cos, sin = self.rotary(step.positions, x.dtype)
        logits = self.native_decode(x, cos, sin, step, kv_cache)
        if logits is None:
            masks = AttentionMasks(step, x.dtype, kv_cache)
            earlier = earlier_slots(step, self.spec.conv_size - 1)
            for layer in self.layers:
                x = layer(x, cos, sin, kv_cache, step, masks, earlier)
            logits = self.lm_head(self.norm(x[step.sample_indices]))
        return logits

    @staticmethod
    def convert(hf: dict[str, torch.Tensor], s: Lfm2Spec) -> dict[str, torch.Tensor]:
        """Transformers' parameter names -> this module's, fusing q/k/v and gate/up; a routed layer's
        feed_forward read as a mixture's mlp (moe.py's layouts)."""
        hf = {k.removeprefix("model."): v for k, v in hf.items()}
        out = {"embed.weight": hf["embed_tokens.weight"], "norm.weight": hf["embedding_norm.weight"]}
        out["lm_head.weight"] = hf["embed_tokens.weight"] if s.tie_word_embeddings else hf["lm_head.weight"]
        kinds = ("weight", "bias") if s.conv_bias else ("weight",)
        for i, convolves in enumerate(s.layer_convolves):
            p = o = f"layers.{i}."
            out[o + "input_norm.weight"] = hf[p + "operator_norm.weight"]
            out[o + "post_norm.weight"] = hf[p + "ffn_norm.weight"]
            if convolves:
                for kind in kinds:
                    out[o + f"conv.in_proj.{kind}"] = hf[p + f"conv.in_proj.{kind}"]
                    out[o + f"conv.out.{kind}"] = hf[p + f"conv.out_proj.{kind}"]
                out[o + "conv.weight"] = hf[p + "conv.conv.weight"].reshape(s.hidden_size, s.conv_size)
                if s.conv_bias:
                    out[o + "conv.bias"] = hf[p + "conv.conv.bias"]
            else:
                out[o + "attn.qkv.weight"] = fused(hf, p, QKV)
                out[o + "attn.out.weight"] = hf[p + "self_attn.out_proj.weight"]
                out[o + "attn.q_norm.weight"] = hf[p + "self_attn.q_layernorm.weight"]
                out[o + "attn.k_norm.weight"] = hf[p + "self_attn.k_layernorm.weight"]
            if s.moe and s.moe.routes(i):
                for name in [n for n in hf if n.startswith(p + "feed_forward.")]:
                    hf[name.replace(p + "feed_forward.", p + "mlp.", 1)] = hf.pop(name)
                out.update(SparseMoE.convert(hf, p, o + "mlp.", s.moe))
                continue
            out[o + "mlp.gate_up.weight"] = fused(hf, p, FEED_FORWARD)
            out[o + "mlp.down.weight"] = hf[p + "feed_forward.w2.weight"]
        return out
