"""The Llama family over the paged KV cache: Llama, Qwen2, Qwen3, Mistral, Ministral 3, ERNIE 4.5, Phi-3, SmolLM3,
Granite, GLM and GLM-4, EXAONE 3.5, Arcee's AFM, Seed-OSS, HunYuan's dense models, StarCoder2, StableLM, Phi-2, Cohere's
Command R and R7B, OLMo 1, Nemotron-4 (Minitron), GPT-NeoX (Pythia), Falcon, Jais-2 and Apertus (an MLP of xIELU(up)),
and the mixture-of-experts Mixtral, Qwen2-MoE, Qwen3-MoE, Granite MoE (and MoE Shared), OLMoE, ERNIE 4.5's, gpt-oss and
GLM-4.5 (and 4.6: GQA over half of each head rotated, q/k/v biases, q/k norms in some, DeepSeek-V3's routing), dots.llm1
(Qwen3's attention, DeepSeek-V3's routing), Hunyuan-A13B (HunYuan's attention, a shared MLP beside its experts),
MiniMax-M2 (q/k norms across heads, sigmoid routing), Arcee's Trinity (AFMoE: gated attention, norms before and after
the attention and the MLP, global layers unrotated), DBRX (clamped q/k/v), K-EXAONE (window layers alone rotating),
Llama 4 (chunked attention in its rotating layers, their q/k normed without weights after the rotation, its unrotated
layers' temperature, experts weighing their inputs beside a shared one) and Cohere2-MoE (Cohere2's parallel layers, a
dense prefix, then experts averaged with shared ones). GQA, RoPE (rope.py), RMSNorm, SwiGLU; per family: q/k norms (per
head: Qwen3; across heads: OLMoE; per head after the rotation: HunYuan; LayerNorms a head with weights of their own:
StableLM 2 12B, Command R+), sliding windows for all or some layers, layers without rotary (SmolLM3's every fourth),
queries scaled by position past the original context (Ministral 3), fused checkpoint tensors (Phi-3; GPT-NeoX's and
Falcon's in their own orders), rotary pairs side by side in the checkpoint (ERNIE 4.5), scaled embeddings, residuals and
logits (Granite), attention sinks (gpt-oss), an MLP of relu(up)^2 or gelu(up) and no gate (Arcee's, Nemotron's,
Jais-2's; StarCoder2's, Phi-2's, GPT-NeoX's, Falcon's), LayerNorms (StarCoder2's, StableLM's, Phi-2's, Cohere's,
GPT-NeoX's, Falcon's, DBRX's, Jais-2's; Nemotron's of 1 + their weights), the attention and the MLP beside each other on
one normed input (Phi-2's, Cohere's) or on norms of their own (GPT-NeoX's, Falcon 40B's), routed and shared experts
(moe.py). Which of these a family takes, its config says: llama_spec.py."""

from __future__ import annotations

import torch
from torch import nn

from .layers import (GATE_UP, QKV, AttentionMasks, DecoderModel, ExactGeluMLP, GeluMLP, HeadLayerNorm, RMSNorm,
                     SquaredReLU, SwiGLU, XieluMLP, alibi_slopes, decoder_tensors, fused, paged_attention,
                     renamed)
from .llama_kin import HUB_NAMES
from .llama_spec import LlamaSpec
from .moe import SparseMoE
from .rope import Rotary, apply_rotary, halves_from_pairs, query_scales_at, sequence_ends

# each activation a config names (LlamaSpec.mlp_activation) and the MLP it makes
MLPS = {"silu": SwiGLU, "relu2": SquaredReLU, "gelu_pytorch_tanh": GeluMLP, "gelu_new": GeluMLP, "gelu_fast": GeluMLP,
        "gelu": ExactGeluMLP, "xielu": XieluMLP}


def _qkv_rows_in_halves(s: LlamaSpec) -> torch.Tensor:
    """The fused q/k/v rows of a checkpoint that keeps rotary pairs side by side, for each row of the
    rotate-half layout (the values' rows as they are)."""
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    rotary = int(s.head_dim * s.partial_rotary_factor)
    return torch.cat([halves_from_pairs(q, s.num_heads, rotary), q + halves_from_pairs(kv, s.num_kv_heads, rotary),
                      torch.arange(q + kv, q + 2 * kv)])


def _head_norm(hf: dict, prefix: str, which: str, s: LlamaSpec) -> torch.Tensor:
    """The query (``which`` "q") or key norm's weights: a checkpoint's self_attn.q_norm, or StableLM's norm a head
    (q_layernorm.norms.H: stacked); a weight a head's values in the order the rows are put in where the checkpoint
    keeps rotary pairs side by side (Command R+'s)."""
    if f"{prefix}self_attn.{which}_layernorm.norms.0.weight" in hf:
        heads = s.num_heads if which == "q" else s.num_kv_heads
        weight = torch.stack([hf[f"{prefix}self_attn.{which}_layernorm.norms.{h}.weight"] for h in range(heads)])
    else:
        weight = hf[f"{prefix}self_attn.{which}_norm.weight"]
    if s.qk_head_layer_norms and s.interleaved_rotary:
        weight = weight[:, halves_from_pairs(s.head_dim, 1, int(s.head_dim * s.partial_rotary_factor))]
    return weight


def _gated_qkv(hf: dict, prefix: str, kind: str):
    """A gated attention's queries, gates, keys and values as one product's rows (AFMoE's gate_proj between q and k):
    a GGUF file's blocks as parts (gguf.py fuses q/k/v's), floats as one tensor."""
    whole = hf.pop(f"{prefix}{QKV[0]}.{kind}", None)
    q, k, v = whole if whole is not None else (hf.pop(f"{prefix}{part}.{kind}") for part in QKV[1])
    parts = [q, hf.pop(f"{prefix}self_attn.gate_proj.{kind}"), k, v]
    return parts if isinstance(whole, list) or any(part.dtype == torch.uint8 for part in parts) else torch.cat(parts)


def _qkv_in_thirds(s: LlamaSpec) -> torch.Tensor:
    """The fused q/k/v rows of a checkpoint whose layout is s.qkv_layout, for each row of every query's, then
    every key's, then every value's."""
    if s.qkv_layout == "heads":  # (a head's query, key and value rows together)
        return torch.arange(3 * s.num_heads * s.head_dim).view(s.num_heads, 3, s.head_dim).transpose(0, 1).flatten()
    group = s.num_heads // s.num_kv_heads  # (a K/V group's queries, then its key and its value)
    rows = torch.arange((group + 2) * s.num_kv_heads * s.head_dim).view(s.num_kv_heads, group + 2, s.head_dim)
    return torch.cat([rows[:, :group].flatten(), rows[:, group].flatten(), rows[:, group + 1].flatten()])


class Attention(nn.Module):
    """GQA over the paged cache, with optional q/k norms: per head (Qwen3), or across all heads
    (OLMo: the spec's qk_norm_across_heads), or per head after the rotation (``norms_after_rotation``: HunYuan's);
    and sinks (gpt-oss); Gemma passes its own norm, scale and soft cap."""

    def __init__(self, s, norm=RMSNorm, scale: float | None = None, softcap: float | None = None,
                 norms_after_rotation: bool = False, qk_norm: bool | None = None):
        """``qk_norm``: whether this layer's queries and keys are normed (None: as the spec says)."""
        super().__init__()
        qk_norm = s.qk_norm if qk_norm is None else qk_norm
        self.heads, self.kv_heads, self.dim = s.num_heads, s.num_kv_heads, s.head_dim
        self.gated = getattr(s, "gated_attention", False)  # (its gates' rows after the queries': [q | gates | k | v])
        self.qkv = nn.Linear(s.hidden_size, ((2 if self.gated else 1) * s.num_heads + 2 * s.num_kv_heads) * s.head_dim,
                             bias=s.qkv_bias)
        self.out = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=s.out_bias)
        self.norms_across_heads = s.qk_norm_across_heads
        q_width, k_width = (s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim) if self.norms_across_heads else (
            s.head_dim, s.head_dim)
        if getattr(s, "qk_head_layer_norms", False):  # (StableLM 2 12B's, Command R+'s: a weight a head)
            self.q_norm = HeadLayerNorm(s.num_heads, s.head_dim, s.rms_norm_eps)
            self.k_norm = HeadLayerNorm(s.num_kv_heads, s.head_dim, s.rms_norm_eps)
        else:
            self.q_norm = norm(q_width, s.rms_norm_eps) if qk_norm else None
            self.k_norm = norm(k_width, s.rms_norm_eps) if qk_norm else None
        self.scale = scale if scale is not None else s.head_dim ** -0.5
        self.softcap = softcap
        self.sinks = nn.Parameter(torch.zeros(s.num_heads)) if s.attention_sinks else None
        self.norms_after_rotation = norms_after_rotation
        self.clip = getattr(s, "clip_qkv", None)  # (OLMo 1.7's bound on the queries, keys and values)
        with torch.device("cpu"):  # (BLOOM's ALiBi: a slope a head, made now whatever device the model is built on)
            slopes = alibi_slopes(s.num_heads, s.alibi_max_bias) if getattr(s, "alibi_max_bias", None) else None
        self.register_buffer("slopes", slopes, persistent=False)

    def forward(self, x, cos, sin, kv_cache, layer, step, masks, query_scales=None):
        """``query_scales``: each row's query scale (rope.query_temperature), or None."""
        queries, keys = self.heads * self.dim, self.kv_heads * self.dim
        qkv = self.qkv(x) if self.clip is None else self.qkv(x).clamp(-self.clip, self.clip)
        q, gates, k, v = qkv.split([queries, queries if self.gated else 0, keys, keys], -1)
        if self.norms_across_heads:  # all heads' queries (keys) normalised as one, before the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(-1, self.heads, self.dim), k.view(-1, self.kv_heads, self.dim)
        if self.norms_after_rotation and self.q_norm is not None:  # rotated here, normalised, then stored as they are
            if cos is not None:
                q, k, cos, sin = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), None, None
            q, k = self.q_norm(q), self.k_norm(k)
        elif self.q_norm is not None and not self.norms_across_heads:  # each head normalised before the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        if query_scales is not None:  # (before the rotation, which it commutes with)
            q = q * query_scales[:, None, None]
        o = paged_attention(q, k, v.view(-1, self.kv_heads, self.dim), kv_cache, layer, step, masks, self.scale,
                            cos, sin, self.softcap, self.sinks, self.slopes)
        return self.out(o.flatten(1) * torch.sigmoid(gates) if self.gated else o.flatten(1))


class Block(nn.Module):
    def __init__(self, s: LlamaSpec, index: int):
        super().__init__()
        self.window, self.rotates = s.layer_windows[index], s.layer_rotates[index]
        self.residual_scale, self.parallel = s.residual_scale, s.parallel
        # whether the step's query scales apply here (Llama 4's in its unrotated layers alone)
        self.scales_queries = not (s.temperature_where_unrotated and self.rotates)
        self.input_norm = norm_of(s)(s.hidden_size, s.rms_norm_eps)
        self.attn = Attention(s, scale=s.attention_scale, norms_after_rotation=s.qk_norm_after_rotation,
                              qk_norm=_normed_queries(s, index))
        self.post_norm = None if s.parallel and not s.parallel_norm else norm_of(s)(s.hidden_size, s.rms_norm_eps)
        self.mlp = SparseMoE(s.hidden_size, s.moe) if s.moe and s.moe.routes(index) else \
            MLPS[s.mlp_activation](s.hidden_size, s.intermediate_size, s.mlp_bias)
        norm = lambda: RMSNorm(s.hidden_size, s.rms_norm_eps) if s.output_norms else None
        self.attn_out_norm, self.mlp_out_norm = norm(), norm()

    def forward(self, x, cos, sin, kv_cache, layer, step, masks, query_scales=None):
        if not self.rotates:
            cos = sin = None
        h = self.input_norm(x)
        attended = self.scaled(self.attn(h, cos, sin, kv_cache, layer, step, masks[self.window],
                                         query_scales if self.scales_queries else None), self.attn_out_norm)
        if self.parallel:  # (the MLP beside the attention, on its input or a norm of its own of x)
            return x + attended + self.scaled(self.mlp(h if self.post_norm is None else self.post_norm(x)),
                                              self.mlp_out_norm)
        x = x + attended
        return x + self.scaled(self.mlp(self.post_norm(x)), self.mlp_out_norm)

    def scaled(self, output: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        """An attention's or MLP's output as it is added: normed (GLM-4's), times the residual multiplier
        (Granite's)."""
        output = output if norm is None else norm(output)
        return output * self.residual_scale if self.residual_scale != 1.0 else output


def _normed_queries(s: LlamaSpec, layer: int) -> bool:
    """Whether ``layer`` norms its queries and keys (Llama 4's in its rotating layers alone)."""
    return s.qk_norm and (s.layer_rotates[layer] or not s.l2_qk_norms)


def norm_of(s: LlamaSpec, final: bool = False):
    """The spec's norm, (width, eps) -> the module: RMSNorm, or a LayerNorm (with its bias where norm_bias, or for
    the ``final`` norm where final_norm_bias: MPT's)."""
    if s.layer_norm:
        return lambda width, eps: nn.LayerNorm(width, eps, bias=s.norm_bias or (final and s.final_norm_bias))
    return RMSNorm


def _llama_named(hf: dict[str, torch.Tensor], renames: tuple = ()) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors by Llama's names (the family's ``renames`` first, then HUB_NAMES: EXAONE 3.5's,
    StarCoder2's and Phi-2's renamed)."""
    return renamed(hf, renames + HUB_NAMES)


class Llama(DecoderModel):
    def __init__(self, s: LlamaSpec):
        super().__init__(s, Block, norm_of(s, final=True))
        self.embed_norm = norm_of(s)(s.hidden_size, s.rms_norm_eps) if s.embedding_norm else None  # (BLOOM's)
        if s.lm_head_bias:
            self.lm_head = nn.Linear(s.hidden_size, s.vocab_size)
        self.rotary = Rotary(s.head_dim, s.rope_theta, s.rope_scaling, s.partial_rotary_factor, s.rope_max_position)
        # longrope: past the original context every key rotates with the long factors, so a sequence
        # that grows past it is recomputed from its first token (models/step.py), as transformers'
        # Phi3ForCausalLM drops its cache there.
        self.recompute_past = self.rotary.long_from

    def forward(self, step, kv_cache) -> torch.Tensor:
        """Logits [S, vocab] for the step's sampled positions only."""
        x = self.embed(step.input_ids)
        if self.spec.embedding_scale != 1.0:
            x = x * self.spec.embedding_scale
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        ends = sequence_ends(step) if self.rotary.per_sequence else None
        cos, sin = self.rotary(step.positions, x.dtype, ends)
        scales = query_scales_at(step.positions, self.spec.query_temperature, x.dtype)
        logits = self.native_decode(x, cos, sin, step, kv_cache, query_scales=scales)
        if logits is None:
            masks = {w: AttentionMasks(step, x.dtype, kv_cache, w) for w in set(self.spec.layer_windows)}
            for i, layer in enumerate(self.layers):
                x = layer(x, cos, sin, kv_cache, i, step, masks, scales)
            logits = self.lm_head(self.norm(x[step.sample_indices]))
        return logits / self.spec.logits_divisor if self.spec.logits_divisor != 1.0 else logits

    @staticmethod
    def convert(hf: dict[str, torch.Tensor], s: LlamaSpec) -> dict[str, torch.Tensor]:
        """Transformers' parameter names (HUB_NAMES' too) -> this module's, fusing q/k/v and gate/up (Phi-3's
        checkpoints hold them fused already); the norms' biases (a LayerNorm's), and the output layer's (Phi-2's)."""
        hf = _llama_named(hf, s.renames)
        if not s.norm_weight:  # (OLMo 1's norms: weightless, as ones)
            hf |= {f"{name}.weight": torch.ones(s.hidden_size) for name in (
                "norm", *(f"layers.{i}.{kind}" for i in range(s.num_layers)
                          for kind in ("input_layernorm", "post_attention_layernorm")))}
        hf, out = decoder_tensors(hf, s)
        if s.norm_plus_one:  # (Nemotron's: the weights its norms multiply by, as the module's)
            hf = {name: t + 1 if name.endswith("norm.weight") else t for name, t in hf.items()}
            out["norm.weight"] = hf["norm.weight"]
        out |= {f"{name}.bias": hf[f"{name}.bias"] for name, kept in (("norm", s.norm_bias),
                                                                       ("lm_head", s.lm_head_bias)) if kept}
        if s.embedding_norm:
            out |= {f"embed_norm.{kind}": hf[f"embedding_norm.{kind}"] for kind in ("weight", "bias")}
        if s.final_norm_bias and not s.norm_bias:  # (MPT's: a hub checkpoint and a file may leave it out, zeros)
            out["norm.bias"] = hf.get("norm.bias", torch.zeros(s.hidden_size))
        norms = (("input_norm", "input_layernorm"),) + (
            () if s.parallel and not s.parallel_norm else (("post_norm", "post_attention_layernorm"),))
        for i in range(s.num_layers):
            p = o = f"layers.{i}."
            out |= {f"{o}{mine}.{kind}": hf[f"{p}{theirs}.{kind}"] for mine, theirs in norms
                    for kind in (("weight", "bias") if s.norm_bias else ("weight",))}
            if s.output_norms:
                out[o + "attn_out_norm.weight"] = hf[p + "post_self_attn_layernorm.weight"]
                out[o + "mlp_out_norm.weight"] = hf[p + "post_mlp_layernorm.weight"]
            for kind in ("weight", "bias") if s.qkv_bias else ("weight",):
                if s.gated_attention:  # (AFMoE's gates between the queries and the keys)
                    out[o + f"attn.qkv.{kind}"] = _gated_qkv(hf, p, kind)
                    continue
                qkv = fused(hf, p, QKV, kind)
                if s.qkv_layout:  # (GPT-NeoX's and Falcon's rows, as every query's, key's, value's)
                    qkv = qkv[_qkv_in_thirds(s)]
                out[o + f"attn.qkv.{kind}"] = qkv[_qkv_rows_in_halves(s)] if s.interleaved_rotary else qkv
            for kind in ("weight", "bias") if s.out_bias else ("weight",):
                out[o + f"attn.out.{kind}"] = hf[p + f"self_attn.o_proj.{kind}"]
            if s.attention_sinks:
                out[o + "attn.sinks"] = hf[p + "self_attn.sinks"]
            if _normed_queries(s, i):  # (Llama 4's without weights: ones)
                out |= {f"{o}attn.{n}_norm.weight": torch.ones(s.head_dim) if s.l2_qk_norms else _head_norm(hf, p, n, s)
                        for n in ("q", "k")}
            if s.moe and s.moe.routes(i):
                out.update(SparseMoE.convert(hf, p, o + "mlp.", s.moe))
                continue
            for kind in ("weight", "bias") if s.mlp_bias else ("weight",):
                if s.mlp_activation != "silu":  # (ungated)
                    out[o + f"mlp.up.{kind}"] = hf[p + f"mlp.up_proj.{kind}"]
                else:
                    out[o + f"mlp.gate_up.{kind}"] = fused(hf, p, GATE_UP, kind)
                out[o + f"mlp.down.{kind}"] = hf[p + f"mlp.down_proj.{kind}"]
            if s.mlp_activation == "xielu":  # (Apertus's: its layer's own alphas, beta and eps)
                out |= {o + f"mlp.{n}": hf[p + f"mlp.act_fn.{n}"].reshape(1)
                        for n in ("alpha_p", "alpha_n", "beta", "eps")}
        return out
