"""AI21's Jamba (Jamba-v0.1, Jamba 1.5 and 1.6 Mini and Large, Jamba Reasoning 3B) over the paged KV cache and a
state a sequence: Granite 4's hybrid layers (granite_hybrid.py) with Mamba's selective-scan mixer (mamba.py) in the
recurrent layers, its time step, B and C RMS-normed with weights of their own, and no positions anywhere (the
attention layers, one in ``attn_layer_period``, do not rotate). Every layer then takes a SwiGLU MLP, or, one layer
in ``expert_layer_period``, a mixture of experts weighted by the chosen experts' softmax probabilities as they are
(not renormalised)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .granite_hybrid import Block as HybridBlock, GraniteHybrid, GraniteHybridSpec
from .layers import renamed
from .llama_spec import LlamaSpec
from .mamba import MambaMixer, MambaSpec, step_rank_of

FAMILIES = ("jamba",)
# Jamba's checkpoint names by Granite 4's (Llama's), in this order
JAMBA_NAMES = (("final_layernorm.", "norm."), (".pre_ff_layernorm.", ".post_attention_layernorm."),
               (".feed_forward.router.", ".mlp.gate."), (".feed_forward.", ".mlp."))
# transformers' JambaConfig defaults, for a config that leaves them out
DEFAULTS = {"attn_layer_period": 8, "attn_layer_offset": 4, "expert_layer_period": 2, "expert_layer_offset": 1,
            "num_experts": 16, "num_experts_per_tok": 2, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
            "mamba_dt_rank": "auto", "mamba_conv_bias": True, "mamba_proj_bias": False, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "max_position_embeddings": 262144}


def layer_kinds(c: dict) -> tuple[list[str], list[int]]:
    """Each layer's kind ("attention" or "mamba") and expert count (1: a plain MLP), as transformers' JambaConfig
    derives them from the periods and offsets (a GGUF file's config lists them: gguf_config.py)."""
    layers = range(c["num_hidden_layers"])
    kinds = _every(c, "layers_block_type", "attn_layer", "attention", "mamba")
    experts = _every(c, "layers_num_experts", "expert_layer", c["num_experts"], 1)
    if len(kinds) != len(layers) or len(experts) != len(layers):
        raise ValueError(f"a Jamba config lists {len(kinds)} layer kinds and {len(experts)} expert counts for "
                         f"{len(layers)} layers")
    if unknown := set(kinds) - {"attention", "mamba"}:
        raise ValueError(f"Jamba layer kinds {sorted(unknown)} are not supported; supported: attention, mamba")
    return kinds, experts


def _every(c: dict, listed: str, kind: str, on, off) -> list:
    """The config's list ``listed`` where it has one, else a layer's ``on`` every ``kind``_period layers from
    ``kind``_offset, ``off`` between, as JambaConfig derives it."""
    if c.get(listed):
        return c[listed]
    period, offset = c[f"{kind}_period"], c[f"{kind}_offset"]
    if period < 1:
        raise ValueError(f"a Jamba config's {kind}_period is {period}; it is the layers a period, 1 or more")
    return [on if i % period == offset else off for i in range(c["num_hidden_layers"])]


@dataclass
class JambaSpec(GraniteHybridSpec):
    @classmethod
    def from_hf(cls, c: dict) -> "JambaSpec":
        c = {**DEFAULTS, **c}
        kinds, experts = layer_kinds(c)
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Jamba with hidden_act {c['hidden_act']!r} is not supported; supported: silu")
        layers, hidden = c["num_hidden_layers"], c["hidden_size"]
        rank = c["mamba_dt_rank"]
        mamba = MambaSpec(vocab_size=c["vocab_size"], hidden_size=hidden, intermediate_size=c["mamba_expand"] * hidden,
                          num_layers=layers, num_heads=0, num_kv_heads=0, head_dim=0, rms_norm_eps=c["rms_norm_eps"],
                          state_size=c["mamba_d_state"], conv_size=c["mamba_d_conv"],
                          time_step_rank=step_rank_of(hidden, rank),
                          dt_b_c_eps=c["rms_norm_eps"], dt_b_c_weights=True, bias=bool(c["mamba_proj_bias"]),
                          conv_bias=bool(c["mamba_conv_bias"]))
        # (no layer rotates; the experts' layers by their counts: moe.py's MoESpec)
        base = LlamaSpec.from_hf({**c, "no_rope_layers": [0] * layers, "layers_num_experts": experts})
        return cls(**{f.name: getattr(base, f.name) for f in fields(LlamaSpec)},
                   layer_recurrent=tuple(kind == "mamba" for kind in kinds), mamba=mamba)


class Block(HybridBlock):
    @staticmethod
    def make_mixer(s: JambaSpec) -> MambaMixer:
        return MambaMixer(s.mamba)


class Jamba(GraniteHybrid):
    BLOCK = Block

    @staticmethod
    def convert(hf: dict[str, torch.Tensor], s: JambaSpec) -> dict[str, torch.Tensor]:
        """Transformers' parameter names (or a GGUF file's, as gguf.py names them: Mamba's, with the time step's,
        B's and C's norms) -> this module's: Granite 4's once Jamba's feed_forward reads as Llama's mlp (its
        router as the gate) and its pre_ff_layernorm as the post-attention norm."""
        return GraniteHybrid.convert(renamed(hf, JAMBA_NAMES), s, mixer=MambaMixer)
