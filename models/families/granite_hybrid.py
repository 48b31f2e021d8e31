"""Granite 4's hybrids (Granite 4.0 H: H-350M, H-1B, H-Micro, H-Tiny, H-Small) over the paged KV cache and a
state a sequence: most layers mix their tokens through Mamba2 (mamba2.py), a few attend as Granite does (its
multipliers of the embeddings, residuals, attention and logits), without rotary where the config says so
(Granite 4.0 H's "nope"); every layer then takes a SwiGLU MLP, or a mixture of experts beside a shared expert
(H-Tiny, H-Small)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

from .layers import GATE_UP, QKV, AttentionMasks, DecoderModel, RMSNorm, fused
from .llama import MLPS, Attention
from .llama_spec import LlamaSpec
from .mamba import MambaSpec
from .mamba2 import Mamba2Mixer, Mamba2Shape
from .moe import SparseMoE
from .recurrent import StateRuns, check_state_slots
from .rope import Rotary

FAMILIES = ("granitemoehybrid",)
# transformers' names of the layer kinds, and the hub configs' ("mamba", "attention")
LAYER_TYPES = {"linear_attention": True, "mamba": True, "full_attention": False, "attention": False}
# transformers' GraniteMoeHybridConfig defaults, for a config that leaves them out
DEFAULT_EXPERTS, DEFAULT_SHARED_WIDTH = 8, 1024


@dataclass
class GraniteHybridSpec(LlamaSpec):
    layer_recurrent: tuple[bool, ...] = ()  # whether each layer is a Mamba2 layer (Jamba's: Mamba's; else it attends)
    mamba: Mamba2Shape | MambaSpec | None = None  # the recurrent layers' sizes (MambaSpec: Jamba's)
    layer_mlp: tuple[bool, ...] = ()  # whether each layer ends with an MLP (empty: every one; Nemotron-H's)

    @classmethod
    def from_hf(cls, c: dict) -> "GraniteHybridSpec":
        layers = c["num_hidden_layers"]
        types = c.get("layer_types") or c.get("layers_block_type") or ["mamba"] * layers
        if len(types) != layers:
            raise ValueError(f"layer_types lists {len(types)} layers of {layers}")
        if unknown := set(types) - set(LAYER_TYPES):
            raise ValueError(f"Granite 4 layer types {sorted(unknown)} are not supported; supported: "
                             f"{', '.join(LAYER_TYPES)}")
        recurrent = tuple(LAYER_TYPES[t] for t in types)
        rope = c.get("position_embedding_type") == "rope"
        # (transformers' defaults where a config leaves them out)
        c = {"num_local_experts": DEFAULT_EXPERTS, "shared_intermediate_size": DEFAULT_SHARED_WIDTH, **c}
        dense = not c["num_local_experts"]
        base = LlamaSpec.from_hf({**c, "no_rope_layers": [int(rope)] * layers,
                                  # (a dense model's MLP is its shared one)
                                  "intermediate_size": c["shared_intermediate_size"] if dense else c["intermediate_size"]})
        return cls(**{f.name: getattr(base, f.name) for f in fields(LlamaSpec)}, layer_recurrent=recurrent,
                   mamba=Mamba2Shape.from_hf(c))


class Block(nn.Module):
    def __init__(self, s: GraniteHybridSpec, index: int):
        super().__init__()
        self.recurrent, self.rotates, self.window = s.layer_recurrent[index], s.layer_rotates[index], None
        # its place in the pool: among the Mamba2 layers' states, or the attention layers' K/V
        self.pool_layer = s.layer_recurrent[:index].count(self.recurrent)
        self.residual_scale = s.residual_scale
        self.input_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mamba = self.make_mixer(s) if self.recurrent else None
        self.attn = None if self.recurrent else Attention(s, scale=s.attention_scale)
        self.post_norm, self.mlp = None, None
        if not s.layer_mlp or s.layer_mlp[index]:
            self.post_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
            mlp = MLPS[s.mlp_activation]
            if s.moe is not None and s.moe.routes(index):  # (Nemotron-H's MLP layers beside experts' do not)
                self.mlp = SparseMoE(s.hidden_size, s.moe)
            else:
                self.mlp = mlp(s.hidden_size, s.intermediate_size, s.mlp_bias)

    @staticmethod
    def make_mixer(s: GraniteHybridSpec) -> nn.Module:
        """A recurrent layer's mixer (Jamba's blocks take Mamba's)."""
        return Mamba2Mixer(s.hidden_size, s.mamba)

    def forward(self, x, cos, sin, kv_cache, step, masks, runs):
        h = self.input_norm(x)
        if self.recurrent:
            mixed = self.mamba(h, kv_cache.state_layer(self.pool_layer), runs)
        else:
            mixed = self.attn(h, cos if self.rotates else None, sin, kv_cache, self.pool_layer, step, masks)
        x = x + mixed * self.residual_scale
        return x if self.mlp is None else x + self.mlp(self.post_norm(x)) * self.residual_scale


class GraniteHybrid(DecoderModel):
    BLOCK = Block  # (Falcon-H1's blocks attend and run Mamba2 both)

    def __init__(self, s: GraniteHybridSpec):
        super().__init__(s, self.BLOCK, RMSNorm)
        self.rotary = Rotary(s.head_dim, s.rope_theta, s.rope_scaling, s.partial_rotary_factor, s.rope_max_position) \
            if any(s.layer_rotates) else None
        # the pool's geometry: K/V for the blocks that attend, a state a sequence for those that run Mamba2 (none
        # where every layer attends: Granite 4.0's non-hybrid models share the config's model_type)
        self.num_layers = sum(block.attn is not None for block in self.layers)
        self.recurrent_layers = sum(block.mamba is not None for block in self.layers)
        if self.recurrent_layers:
            self.state_shapes = (self.recurrent_layers, s.mamba.state_shapes)

    def forward(self, step, kv_cache) -> torch.Tensor:
        """Logits [S, vocab] for the step's sampled positions only."""
        if self.recurrent_layers:
            check_state_slots(step, kv_cache)
        x = self.embed(step.input_ids) * self.spec.embedding_scale
        cos, sin = self.rotary(step.positions, x.dtype) if self.rotary is not None else (None, None)
        logits = self.native_decode(x, cos, sin, step, kv_cache)
        if logits is None:
            masks = AttentionMasks(step, x.dtype, kv_cache)
            runs = StateRuns(step, self.spec.mamba.conv_size - 1) if self.recurrent_layers else None
            for layer in self.layers:
                x = layer(x, cos, sin, kv_cache, step, masks, runs)
            logits = self.lm_head(self.norm(x[step.sample_indices]))
        return logits / self.spec.logits_divisor

    @staticmethod
    def convert(hf: dict[str, torch.Tensor], s: GraniteHybridSpec, mixer=Mamba2Mixer) -> dict[str, torch.Tensor]:
        """Transformers' parameter names (or a GGUF file's, as gguf.py names them: its MLP as Llama's, its
        experts as Qwen2-MoE's, -exp(A_log) as ssm_a) -> this module's; the recurrent layers' by ``mixer``'s
        convert (Jamba's: Mamba's)."""
        hf = {k.removeprefix("model."): v for k, v in hf.items()}
        out = {"embed.weight": hf["embed_tokens.weight"], "norm.weight": hf["norm.weight"]}
        out["lm_head.weight"] = hf["embed_tokens.weight"] if s.tie_word_embeddings else hf["lm_head.weight"]
        m = s.mamba
        for i, recurrent in enumerate(s.layer_recurrent):
            p = o = f"layers.{i}."
            out[o + "input_norm.weight"] = hf[p + "input_layernorm.weight"]
            out[o + "post_norm.weight"] = hf[p + "post_attention_layernorm.weight"]
            if s.moe and s.moe.routes(i):
                out.update(SparseMoE.convert(hf, p, o + "mlp.", s.moe))
            else:  # (its shared MLP's gate and up rows in one product; a GGUF file's as Llama's)
                gate_up, down = p + "shared_mlp.input_linear.weight", p + "shared_mlp.output_linear.weight"
                out[o + "mlp.gate_up.weight"] = hf.pop(gate_up) if gate_up in hf else fused(hf, p, GATE_UP)
                out[o + "mlp.down.weight"] = hf.pop(down) if down in hf else hf.pop(p + "mlp.down_proj.weight")
            if not recurrent:
                out[o + "attn.qkv.weight"] = fused(hf, p, QKV)
                out[o + "attn.out.weight"] = hf[p + "self_attn.o_proj.weight"]
                continue
            out.update(mixer.convert(hf, p + "mamba.", o + "mamba.", m))
        return out
