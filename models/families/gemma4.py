"""Gemma 4 (text) over the paged KV cache. Gemma 3's block (four norms, a GELU-tanh gated MLP, embeddings
scaled by sqrt(hidden), sliding-window layers between global ones), with norms that multiply by their
weight (not 1 + weight) and attention unscaled (queries and keys normalised per head instead). New:

- the global layers' heads are wider (global_head_dim) and may be fewer (num_global_key_value_heads), so
  the pool keeps each layer's K/V in its own shape (``kv_layer_shapes``, models/step.py); they rotate a
  quarter of each head's frequency pairs (proportional rope: the other pairs' frequencies are zero), and
  with attention_k_eq_v their values are their keys' projection, normalised without a weight;
- the last num_kv_shared_layers layers keep no K/V: each attends over the K/V of the last earlier layer of
  its kind (their pool layer is that one's), and with use_double_wide_mlp their MLPs are twice as wide;
- per-layer embeddings (the E2B and E4B sizes): a second token table, hidden_size_per_layer_input values a
  layer, mixed with a projection of the embedded input and fed to each layer after its MLP through a gate;
- each layer's output scaled by a learned scalar (layer_scalar), and the logits soft-capped;
- in the 26B-A4B, a mixture of experts beside each layer's MLP (enable_moe_block): routed on the layer's input
  normalised without a weight and scaled (router.scale), each chosen expert's weight times its own scale
  (per_expert_scale), the experts' GELU-gated products over the input normalised by a norm of their own, their
  sum normalised, and the MLP's output normalised too before the two are added."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .gemma import gemma_tensors, soft_capped
from .layers import (GATE_UP, QKV, AttentionMasks, DecoderModel, DecoderShape, RMSNorm, fused, paged_attention,
                     weightless_norm)
from .moe import Experts, MoESpec, _routed_experts, run_experts
from .rope import Rotary, rope_type

FAMILIES = ("gemma4_text",)
# transformers' defaults where a config leaves them out (Gemma4TextConfig's)
DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}}
GLOBAL_ROPES = ("proportional", "default", "frequency_factors")  # (a GGUF file's: llama.cpp's rope_freqs)


@dataclass
class Gemma4Spec(DecoderShape):
    # num_kv_heads and head_dim are the sliding-window layers'; the global layers' are these
    global_kv_heads: int
    global_head_dim: int
    layer_windows: tuple[int | None, ...]  # each layer's window; None: a global layer
    values_are_keys: bool      # the global layers' values are their keys' projection (attention_k_eq_v)
    first_shared: int          # the layers from this one on keep no K/V and read an earlier layer's
    double_wide_mlp: bool      # those layers' MLPs twice as wide
    sliding_theta: float
    global_rope: dict          # the global layers' rope parameters (theta; proportional's share, or factors)
    per_layer_width: int       # per-layer embeddings' values a layer (0: none)
    per_layer_vocab: int
    final_softcap: float | None
    max_position: int
    tie_word_embeddings: bool
    moe: MoESpec | None = None  # the experts beside each layer's MLP (the 26B-A4B's)

    @classmethod
    def from_hf(cls, c: dict) -> "Gemma4Spec":
        activation = c.get("hidden_activation") or "gelu_pytorch_tanh"
        if activation != "gelu_pytorch_tanh":
            raise ValueError(f"unsupported hidden_activation {activation!r} for gemma4; supported: gelu_pytorch_tanh")
        if c.get("use_bidirectional_attention") == "all":
            raise ValueError("gemma4 with bidirectional attention (use_bidirectional_attention='all') is not supported")
        if c.get("attention_bias"):
            raise ValueError("gemma4 with attention biases is not supported")
        layers = c["num_hidden_layers"]
        types = list(c.get("layer_types") or ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                              for i in range(layers)])
        types[-1] = "full_attention"  # (as transformers forces it)
        rope = {**DEFAULT_ROPE, **(c.get("rope_parameters") or {})}
        global_rope = dict(rope["full_attention"])
        if rope_type(global_rope) not in GLOBAL_ROPES:
            raise ValueError(f"unsupported rope {rope_type(global_rope)!r} for gemma4's global layers; supported: "
                             f"{', '.join(GLOBAL_ROPES)}")
        if rope_type(rope["sliding_attention"]) != "default":
            raise ValueError(f"unsupported rope {rope_type(rope['sliding_attention'])!r} for gemma4's sliding-window "
                             "layers; supported: default")
        heads = c["num_attention_heads"]
        kv_heads = c.get("num_key_value_heads") or heads
        head_dim = c.get("head_dim") or 256
        values_are_keys = bool(c.get("attention_k_eq_v", False))
        global_kv_heads, global_head_dim = _global_shape(c, types, kv_heads, head_dim, values_are_keys)
        shared = c.get("num_kv_shared_layers") or 0
        first_shared = layers - shared
        if shared and set(types[first_shared:]) - set(types[:first_shared]):
            raise ValueError("gemma4's layers sharing K/V need an earlier layer of their kind to read")
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
            num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6), global_kv_heads=global_kv_heads, global_head_dim=global_head_dim,
            layer_windows=tuple(c.get("sliding_window", 512) if t == "sliding_attention" else None for t in types),
            values_are_keys=values_are_keys, first_shared=first_shared,
            double_wide_mlp=bool(c.get("use_double_wide_mlp", False)),
            sliding_theta=float(rope["sliding_attention"].get("rope_theta", 10_000.0)), global_rope=global_rope,
            per_layer_width=c.get("hidden_size_per_layer_input") or 0,
            per_layer_vocab=c.get("vocab_size_per_layer_input") or c["vocab_size"],
            final_softcap=c.get("final_logit_softcapping"), max_position=c.get("max_position_embeddings", 131_072),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", True)), moe=_experts(c))

    def is_global(self, layer: int) -> bool:
        return self.layer_windows[layer] is None

    def kv_shape(self, layer: int) -> tuple[int, int]:
        """(kv heads, head size) of a layer."""
        return (self.global_kv_heads, self.global_head_dim) if self.is_global(layer) else (self.num_kv_heads,
                                                                                           self.head_dim)

    def pool_layer(self, layer: int) -> int:
        """The pool layer a layer writes (its own index) or, sharing K/V, reads: the last layer before
        the shared ones of its kind."""
        if layer < self.first_shared:
            return layer
        return max(i for i in range(self.first_shared) if self.is_global(i) == self.is_global(layer))


def _experts(c: dict) -> MoESpec | None:
    """The mixture beside each MLP where the config enables it: every layer routes, the chosen weights
    renormalised (then each times its expert's scale), the experts GELU-gated."""
    if not c.get("enable_moe_block"):
        return None
    missing = [k for k in ("num_experts", "top_k_experts", "moe_intermediate_size") if not c.get(k)]
    if missing:
        raise ValueError(f"a gemma4 config with enable_moe_block names no {', '.join(missing)}")
    return MoESpec(c["num_experts"], c["top_k_experts"], c["moe_intermediate_size"], True, frozenset(), 1, gelu=True)


def _global_shape(c: dict, types: list[str], kv_heads: int, head_dim: int, values_are_keys: bool) -> tuple[int, int]:
    """(kv heads, head size) of the global layers: a hub config's global_head_dim and num_global_key_value_heads
    (the latter where values are keys), or what transformers resolves them to, per_layer_config's overrides (by
    layer index); the sliding-window layers' must be the config's own."""
    overrides = {int(i): o for i, o in (c.get("per_layer_config") or {}).items()}
    if not overrides:
        global_kv = (c.get("num_global_key_value_heads") or kv_heads) if values_are_keys else kv_heads
        return global_kv, c.get("global_head_dim") or 512
    shapes = {(t, o.get("num_key_value_heads", kv_heads), o.get("head_dim", head_dim))
              for i, t in enumerate(types) for o in [overrides.get(i, {})]}
    if {(kv, dim) for t, kv, dim in shapes if t == "sliding_attention"} - {(kv_heads, head_dim)} or len(shapes) > 2:
        raise ValueError(f"gemma4 layers of one kind with different heads (per_layer_config {c['per_layer_config']}) "
                         "are not supported")
    return next(((kv, dim) for t, kv, dim in shapes if t == "full_attention"), (kv_heads, head_dim))


class Attention(nn.Module):
    """Queries (and, but in a layer sharing K/V, keys and values) from one product; each head's query and
    key normalised and rotated, each head's value normalised without a weight; attention unscaled."""

    def __init__(self, s: Gemma4Spec, index: int):
        super().__init__()
        self.heads = s.num_heads
        self.kv_heads, self.head_dim = s.kv_shape(index)
        self.shares = index >= s.first_shared
        self.values_are_keys = s.values_are_keys and s.is_global(index)
        kv_rows = 0 if self.shares else self.kv_heads * self.head_dim * (1 if self.values_are_keys else 2)
        self.qkv = nn.Linear(s.hidden_size, self.heads * self.head_dim + kv_rows, bias=False)
        self.out = nn.Linear(self.heads * self.head_dim, s.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, s.rms_norm_eps)
        self.k_norm = None if self.shares else RMSNorm(self.head_dim, s.rms_norm_eps)
        self.eps = s.rms_norm_eps

    def forward(self, x, cos, sin, kv_cache, pool_layer: int, step, masks):
        tokens, queries = x.shape[0], self.heads * self.head_dim
        qkv = self.qkv(x)
        q = self.q_norm(qkv[:, :queries].view(tokens, self.heads, self.head_dim))
        k = v = None
        if not self.shares:
            keys = qkv[:, queries:queries + self.kv_heads * self.head_dim].view(tokens, self.kv_heads, self.head_dim)
            values = keys if self.values_are_keys else qkv[:, queries + keys.shape[1] * self.head_dim:].view(
                tokens, self.kv_heads, self.head_dim)
            k, v = self.k_norm(keys), weightless_norm(values, self.eps)
        out = paged_attention(q, k, v, kv_cache, pool_layer, step, masks, 1.0, cos, sin)
        return self.out(out.flatten(1))


class MixtureBeside(nn.Module):
    """The experts beside a layer's MLP, over the same input (the residual after the attention): routed on it
    normalised without a weight, times ``router_scale`` and 1 / sqrt(hidden); each chosen weight (softmax,
    renormalised over the chosen) times its expert's ``expert_scales``; the experts over the input normalised by
    ``pre_norm``, their weighted sum normalised by ``post_norm`` and added to the MLP's output normalised by
    ``dense_norm``."""

    def __init__(self, s: Gemma4Spec):
        super().__init__()
        self.spec = s.moe
        self.router = nn.Linear(s.hidden_size, s.moe.num_experts, bias=False)
        self.router_scale = nn.Parameter(torch.ones(s.hidden_size))
        self.expert_scales = nn.Parameter(torch.ones(s.moe.num_experts))
        self.experts = Experts(s.moe.num_experts, s.hidden_size, s.moe.intermediate_size, gelu=True)
        self.pre_norm, self.post_norm, self.dense_norm = (RMSNorm(s.hidden_size, s.rms_norm_eps) for _ in range(3))
        self.eps, self.root = s.rms_norm_eps, s.hidden_size ** -0.5

    def forward(self, x, dense):
        """The MLP's output ``dense`` with the experts' over ``x`` (the MLP's input before its norm)."""
        # Routing in float32, as transformers does: its top-k and weights then match exactly.
        probs = self.router(weightless_norm(x, self.eps) * self.router_scale * self.root).float().softmax(-1)
        weights, chosen = probs.topk(self.spec.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True) * self.expert_scales.float()[chosen]
        return self.dense_norm(dense) + self.post_norm(run_experts(self.experts, self.pre_norm(x), weights.to(x.dtype),
                                                                   chosen, self.spec.num_experts))


class Block(nn.Module):
    def __init__(self, s: Gemma4Spec, index: int):
        super().__init__()
        self.index, self.window = index, s.layer_windows[index]
        self.pool_layer = s.pool_layer(index)
        inner = s.intermediate_size * (2 if s.double_wide_mlp and index >= s.first_shared else 1)
        norm = lambda: RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.input_norm, self.post_attn_norm, self.pre_mlp_norm, self.post_mlp_norm = norm(), norm(), norm(), norm()
        self.attn = Attention(s, index)
        self.gate_up = nn.Linear(s.hidden_size, 2 * inner, bias=False)
        self.down = nn.Linear(inner, s.hidden_size, bias=False)
        self.moe = MixtureBeside(s) if s.moe is not None else None
        if s.per_layer_width:  # the per-layer input: gated by the hidden state, projected back, normalised
            self.per_layer_gate = nn.Linear(s.hidden_size, s.per_layer_width, bias=False)
            self.per_layer_out = nn.Linear(s.per_layer_width, s.hidden_size, bias=False)
            self.per_layer_norm = norm()
        self.scalar = nn.Parameter(torch.ones(1))

    def forward(self, x, per_layer_input, rotations, kv_cache, step, masks):
        cos, sin = rotations[self.window is None]
        x = x + self.post_attn_norm(self.attn(self.input_norm(x), cos, sin, kv_cache, self.pool_layer, step,
                                              masks[self.window]))
        gate, up = self.gate_up(self.pre_mlp_norm(x)).chunk(2, dim=-1)
        mixed = self.down(F.gelu(gate, approximate="tanh") * up)
        if self.moe is not None:
            mixed = self.moe(x, mixed)
        x = x + self.post_mlp_norm(mixed)
        if per_layer_input is not None:
            gated = F.gelu(self.per_layer_gate(x), approximate="tanh") * per_layer_input
            x = x + self.per_layer_norm(self.per_layer_out(gated))
        return x * self.scalar


class Gemma4(DecoderModel):
    block = Block  # (Gemma 3n's own, gemma3n.py)

    def __init__(self, s: Gemma4Spec):
        super().__init__(s, self.block, lambda width, eps: RMSNorm(width, eps))
        self.num_layers = s.first_shared  # (the layers that keep K/V)
        self.kv_layer_shapes = tuple(s.kv_shape(i) for i in range(s.first_shared))
        self.local_rotary = Rotary(s.head_dim, s.sliding_theta)
        scaling = s.global_rope if rope_type(s.global_rope) != "default" else None
        self.global_rotary = Rotary(s.global_head_dim, s.global_rope.get("rope_theta", 1_000_000.0), scaling)
        if s.per_layer_width:
            width = s.num_layers * s.per_layer_width
            self.per_layer_embed = nn.Embedding(s.per_layer_vocab, width, _weight=torch.empty(s.per_layer_vocab, width))
            self.per_layer_project = nn.Linear(s.hidden_size, width, bias=False)
            self.per_layer_project_norm = RMSNorm(s.per_layer_width, s.rms_norm_eps)

    def per_layer_inputs(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[T, layers, width]: each token's rows of the per-layer table (scaled by sqrt(width)) and the
        normalised projection of its embedded input (scaled by 1 / sqrt(hidden)), averaged so (1 / sqrt 2)."""
        s = self.spec
        scale = lambda value: torch.tensor(value, dtype=torch.float32).to(x.dtype)
        ids = ids.where(ids < s.per_layer_vocab, 0)  # (Gemma 3n's table is shorter than its vocabulary, as transformers)
        rows = self.per_layer_embed(ids).to(x.dtype) * scale(math.sqrt(s.per_layer_width))
        projected = self.per_layer_project(x) * scale(s.hidden_size ** -0.5)
        projected = self.per_layer_project_norm(projected.view(len(ids), s.num_layers, s.per_layer_width))
        return (projected + rows.view_as(projected)) * scale(2 ** -0.5)

    def forward(self, step, kv_cache) -> torch.Tensor:
        """Logits [S, vocab] for the step's sampled positions only."""
        s = self.spec
        x = self.embed(step.input_ids)
        x = x * torch.tensor(math.sqrt(s.hidden_size), dtype=torch.float32).to(x.dtype)
        per_layer = self.per_layer_inputs(step.input_ids, x) if s.per_layer_width else None
        hidden = self.spread(x)
        rotations = (self.local_rotary(step.positions, x.dtype), self.global_rotary(step.positions, x.dtype))
        logits = self.native_decode(hidden, *rotations[1], step, kv_cache, window_angles=rotations[0],
                                    per_layer_inputs=per_layer)
        if logits is None:
            masks = {w: AttentionMasks(step, x.dtype, kv_cache, w) for w in set(s.layer_windows)}
            for i, layer in enumerate(self.layers):
                hidden = layer(hidden, None if per_layer is None else per_layer[:, i], rotations, kv_cache, step,
                               masks)
            logits = self.lm_head(self.norm(self.merge(hidden[step.sample_indices])))
        return soft_capped(logits, s.final_softcap)

    def spread(self, x: torch.Tensor) -> torch.Tensor:
        """The layers' hidden state from the embedded input: the input itself (Gemma 3n's: its AltUp streams)."""
        return x

    def merge(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm's input from the last layer's hidden state: that state (Gemma 3n's: its streams merged)."""
        return hidden

    @staticmethod
    def convert(hf: dict[str, torch.Tensor], s: Gemma4Spec) -> dict[str, torch.Tensor]:
        """Transformers' parameter names -> this module's, fusing q/k/v and gate/up."""
        hf, out = gemma_tensors(hf, s)
        if s.per_layer_width:
            out |= per_layer_table(hf)
        for i in range(s.num_layers):
            p = o = f"layers.{i}."
            shares = i >= s.first_shared
            out |= renamed(hf, p, o, BLOCK_NAMES | (PER_LAYER_NAMES if s.per_layer_width else {}) | (
                {} if shares else {"attn.k_norm": "self_attn.k_norm"}))
            out[o + "attn.qkv.weight"] = shared_queries(hf, p) if shares else fused(hf, p, (QKV[0], (
                ("self_attn.q_proj", "self_attn.k_proj") if s.values_are_keys and s.is_global(i) else QKV[1])))
            out[o + "gate_up.weight"] = fused(hf, p, GATE_UP)
            out[o + "scalar"] = hf[p + "layer_scalar"].reshape(1)
            if s.moe is not None:
                out |= _mixture_beside(hf, p, o, s)
        return out


# a block's weights, this module's names -> transformers' (Gemma 3n's blocks have them too), and a block's
# per-layer input's
BLOCK_NAMES = {"input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
               "pre_mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm",
               "attn.q_norm": "self_attn.q_norm", "attn.out": "self_attn.o_proj", "down": "mlp.down_proj"}
PER_LAYER_NAMES = {"per_layer_gate": "per_layer_input_gate", "per_layer_out": "per_layer_projection",
                   "per_layer_norm": "post_per_layer_input_norm"}


def renamed(hf: dict, p: str, o: str, names: dict) -> dict:
    """The weights ``names`` lists (ours -> theirs) of transformers' layer ``p`` under this module's ``o``."""
    return {o + ours + ".weight": hf[p + theirs + ".weight"] for ours, theirs in names.items()}


def per_layer_table(hf: dict) -> dict:
    """The per-layer inputs' token table, the embedded input's projection and its norm, by this module's names."""
    return {"per_layer_embed.weight": hf["embed_tokens_per_layer.weight"],
            "per_layer_project.weight": hf["per_layer_model_projection.weight"],
            "per_layer_project_norm.weight": hf["per_layer_projection_norm.weight"]}


def shared_queries(hf: dict, p: str):
    """The query product of a layer that reads an earlier layer's K/V: its q_proj, or the first of the parts gguf.py
    fused where a file keeps the layer's K/V products too (llama.cpp's loader takes them and reads none; the layer's
    product gives queries alone)."""
    whole = hf.get(p + QKV[0] + ".weight")
    return hf[p + "self_attn.q_proj.weight"] if whole is None else whole[:1]


def _mixture_beside(hf: dict, p: str, o: str, s: Gemma4Spec) -> dict:
    """A layer's experts, router and their norms by MixtureBeside's names: transformers' (router.proj,
    router.scale, router.per_expert_scale; experts.gate_up_proj and down_proj stacks) or a GGUF file's as gguf.py
    names them (the router and its scale under mlp.gate, the expert scales under the down stack's name; the stacks
    as moe.py reads a file's)."""
    renamed = {"router.proj.weight": "mlp.gate.weight", "experts.gate_up_proj": "mlp.experts.gate_up_proj",
               "experts.down_proj": "mlp.experts.down_proj"}
    for theirs, ours in renamed.items():
        if p + theirs in hf:
            hf[p + ours] = hf.pop(p + theirs)
    scale = lambda *names: next(hf.pop(p + n) for n in names if p + n in hf).reshape(-1)
    return _routed_experts(hf, p, o + "moe.", s.moe) | {o + "moe.router_scale": scale("router.scale", "mlp.gate.scale"),
                  o + "moe.expert_scales": scale("router.per_expert_scale", "mlp.experts.down_proj.scale"),
                  o + "moe.pre_norm.weight": hf[p + "pre_feedforward_layernorm_2.weight"],
                  o + "moe.post_norm.weight": hf[p + "post_feedforward_layernorm_2.weight"],
                  o + "moe.dense_norm.weight": hf[p + "post_feedforward_layernorm_1.weight"]}
