"""NVIDIA's Nemotron-H hybrids (Nemotron-H 4B/8B/47B/56B, Nemotron Nano 9B v2 and 12B v2, Nemotron 3 Nano): a
stack of single-purpose layers, each a norm, then a Mamba2 mixer (mamba2.py), an attention without positions, a
squared-ReLU MLP or (Nemotron 3's) a mixture of squared-ReLU experts, then the residual. Loom runs them as Granite
4's hybrids' blocks (granite_hybrid.py): a mixer layer and the MLP or experts layer after it make one block (norm,
mixer, residual; norm, MLP, residual), a mixer that no such layer follows a block without an MLP.

Mamba2's own language models (state-spaces' mamba2-130m to 2.7b, Mistral's Mamba-Codestral-7B) are such a stack of
Mamba2 layers alone, by the same checkpoint names: their configs are read as Nemotron-H's (``from_mamba2``). Their
pool holds no K/V, only a state a sequence.

Nemotron 3's experts (moe.py, MoESpec.squared_relu) are DeepSeek-V3's routing over Nemotron-H's MLPs: each
expert's probability the sigmoid of its logit, chosen by it plus a bias of the expert's, within the best groups
(the sum of each group's best two) where there are several; the chosen renormalised and scaled; a shared expert
beside them. Nemotron 3 Super's experts work in a narrower space (moe_latent_size): the hidden state projected down
to it before them, their weighted sum back up after; its router and shared expert read the hidden state itself."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .granite_hybrid import GraniteHybrid, GraniteHybridSpec
from .layers import QKV, fused
from .llama_spec import LlamaSpec
from .mamba2 import Mamba2Mixer, Mamba2Shape
from .moe import MoESpec, SparseMoE
from .recurrent import UNBOUNDED_CONTEXT

FAMILIES = ("nemotron_h", "mamba2")
# the hub configs' hybrid_override_pattern, a letter a layer -> transformers' layer types
PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
MIXERS = {"linear_attention": True, "full_attention": False}  # a mixer layer type -> whether it is a Mamba2 layer


def layer_types(c: dict) -> list[str]:
    """Each layer's type: transformers' layers_block_type (layer_types), else the hub's pattern."""
    types = c.get("layers_block_type") or c.get("layer_types")
    if types is None:
        pattern = c.get("hybrid_override_pattern")
        if pattern is None:
            raise ValueError("a Nemotron-H config needs layers_block_type or hybrid_override_pattern")
        if unknown := set(pattern) - set(PATTERN):
            raise ValueError(f"hybrid_override_pattern has letters {sorted(unknown)} Loom does not know; "
                             f"it knows {', '.join(PATTERN)}")
        types = [PATTERN[letter] for letter in pattern]
    return list(types)


def from_mamba2(c: dict) -> dict:
    """A Mamba2 language model's config (transformers' Mamba2Config names and defaults) as a Nemotron-H's of Mamba2
    layers alone."""
    c = {"num_heads": 128, "head_dim": 64, "state_size": 128, "n_groups": 8, "expand": 2, "conv_kernel": 4,
         "layer_norm_epsilon": 1e-5, "use_bias": False, "use_conv_bias": True, "hidden_act": "silu", **c}
    if c["hidden_act"] != "silu":
        raise ValueError(f"Mamba2 with hidden_act {c['hidden_act']!r} is not supported; supported: silu")
    inner = int(c["expand"] * c["hidden_size"])
    if c["num_heads"] * c["head_dim"] != inner:
        raise ValueError(f"Mamba2's {c['num_heads']} heads of {c['head_dim']} must make its inner width {inner} "
                         f"(expand x hidden_size)")
    return {**c, "hybrid_override_pattern": "M" * c["num_hidden_layers"], "mamba_num_heads": c["num_heads"],
            "mamba_head_dim": c["head_dim"], "ssm_state_size": c["state_size"],
            "max_position_embeddings": c.get("max_position_embeddings", UNBOUNDED_CONTEXT)}


def blocks_of(types: list[str]) -> tuple[tuple[int, int | None], ...]:
    """(the mixer layer, the MLP or experts layer after it or None) for each block, or a ValueError for an
    MLP or experts layer that follows no mixer."""
    if unknown := set(types) - set(PATTERN.values()):
        raise ValueError(f"Nemotron-H layer types {sorted(unknown)} are not supported; supported: "
                         f"{', '.join(PATTERN.values())}")
    blocks = []
    for i, kind in enumerate(types):
        if kind in MIXERS:
            blocks.append((i, None))
        elif not blocks or blocks[-1][1] is not None:
            what = "an MLP" if kind == "mlp" else "a mixture of experts"
            raise ValueError(f"Nemotron-H layer {i} is {what} that follows no Mamba2 or attention layer; Loom runs "
                             "an MLP or experts layer after a mixer layer only")
        else:
            blocks[-1] = (blocks[-1][0], i)
    return tuple(blocks)


@dataclass
class NemotronHSpec(GraniteHybridSpec):
    # each block's layers in the checkpoint: its mixer's, and its MLP's (None: the block has none)
    block_layers: tuple[tuple[int, int | None], ...] = ()

    @classmethod
    def from_hf(cls, c: dict) -> "NemotronHSpec":
        if c["model_type"] == "mamba2":
            c = from_mamba2(c)
        types = layer_types(c)
        blocks = blocks_of(types)
        for key, supported in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
            if c.get(key, supported) != supported:
                raise ValueError(f"Nemotron-H with {key} {c[key]!r} is not supported; supported: {supported}")
        recurrent = tuple(MIXERS[types[mixer]] for mixer, _ in blocks)
        base = LlamaSpec.from_hf({
            "model_type": "nemotron_h", "vocab_size": c["vocab_size"], "hidden_size": c["hidden_size"],
            "intermediate_size": c.get("intermediate_size", 21504), "num_hidden_layers": len(blocks),
            "num_attention_heads": c.get("num_attention_heads", 32), "num_key_value_heads": c.get("num_key_value_heads", 8),
            "head_dim": c.get("head_dim") or c.get("attention_head_dim") or 128,  # (older configs' name)
            "rms_norm_eps": c.get("layer_norm_epsilon", 1e-5),
            "max_position_embeddings": c.get("max_position_embeddings", 4096),
            "tie_word_embeddings": c.get("tie_word_embeddings", False), "mlp_bias": c.get("mlp_bias", False),
            # (transformers' attention has no biases whatever attention_bias says; a GGUF file's config says
            # whether it has them, as llama.cpp reads them)
            "attention_bias": c.get("attention_biases_in_file", False),
            "no_rope_layers": [0] * len(blocks)})
        spec = {f.name: getattr(base, f.name) for f in fields(LlamaSpec)} | {"moe": _experts(c, types, blocks),
                                                                            "mlp_activation": "relu2"}
        return cls(**spec, layer_recurrent=recurrent, mamba=Mamba2Shape.from_nemotron_h(c),
                   layer_mlp=tuple(mlp is not None for _, mlp in blocks), block_layers=blocks)


def _experts(c: dict, types: list[str], blocks: tuple[tuple[int, int | None], ...]) -> MoESpec | None:
    """Nemotron 3's experts (the module's doc) as transformers runs them, in the blocks whose second layer is an
    experts layer; None where no layer is one."""
    if "moe" not in types:
        return None
    if c.get("mlp_bias"):  # (transformers' shared expert would take biases, which SparseMoE's has not)
        raise ValueError("Nemotron-H experts with mlp_bias are not supported; Loom runs Nemotron 3's, which have none")
    groups = c.get("n_group") or 1
    return MoESpec(c.get("n_routed_experts") or c["num_local_experts"], c["num_experts_per_tok"],
                   c["moe_intermediate_size"], bool(c.get("norm_topk_prob", True)),
                   frozenset(b for b, (_, second) in enumerate(blocks) if second is None or types[second] != "moe"), 1,
                   shared_intermediate_size=c.get("moe_shared_expert_intermediate_size") or 0, selection_bias=True,
                   sigmoid=True, routed_scale=float(c.get("routed_scaling_factor") or 1.0),
                   groups=(groups, c.get("topk_group") or 1, 2) if groups > 1 else None, squared_relu=True,
                   latent_size=c.get("moe_latent_size") or 0)


class NemotronH(GraniteHybrid):
    @staticmethod
    def convert(hf: dict[str, torch.Tensor], s: NemotronHSpec) -> dict[str, torch.Tensor]:
        """Transformers' parameter names (the hub's under backbone, transformers 5's under model: each layer's
        norm, and its mixer's products whatever the layer's kind) or a GGUF file's (as gguf.py names them, by
        kind: input_layernorm, mamba.*, self_attn.*, mlp.*; ssm_a for -exp(A_log)) -> the blocks'."""
        hf = _named_by_kind(hf, s)
        out = {"embed.weight": hf["embed_tokens.weight"], "norm.weight": hf["norm.weight"]}
        out["lm_head.weight"] = hf["embed_tokens.weight"] if s.tie_word_embeddings else hf["lm_head.weight"]
        for block, ((mixer, mlp), recurrent) in enumerate(zip(s.block_layers, s.layer_recurrent)):
            p, o = f"layers.{mixer}.", f"layers.{block}."
            out[o + "input_norm.weight"] = hf[p + "input_layernorm.weight"]
            if recurrent:
                out.update(Mamba2Mixer.convert(hf, p + "mamba.", o + "mamba.", s.mamba))
            else:
                for kind in ("weight", "bias") if s.qkv_bias else ("weight",):
                    out[o + f"attn.qkv.{kind}"] = fused(hf, p, QKV, kind)
                for kind in ("weight", "bias") if s.out_bias else ("weight",):
                    out[o + f"attn.out.{kind}"] = hf[p + f"self_attn.o_proj.{kind}"]
            if mlp is not None:
                p = f"layers.{mlp}."
                out[o + "post_norm.weight"] = hf[p + "input_layernorm.weight"]
                if s.moe and s.moe.routes(block):
                    out.update(SparseMoE.convert(hf, p, o + "mlp.", s.moe))
                    continue
                for kind in ("weight", "bias") if s.mlp_bias else ("weight",):
                    out[o + f"mlp.up.{kind}"] = hf[p + f"mlp.up_proj.{kind}"]
                    out[o + f"mlp.down.{kind}"] = hf[p + f"mlp.down_proj.{kind}"]
        return out


def _named_by_kind(hf: dict[str, torch.Tensor], s: NemotronHSpec) -> dict[str, torch.Tensor]:
    """Transformers' names as a GGUF file's come from gguf.py: the model's prefix dropped, the embeddings and
    final norm as Llama's, a layer's norm as its input_layernorm, its mixer's products under its kind's
    prefix (an MLP's or experts layer's under mlp.); a GGUF file's names as they are."""
    kinds = {}
    for (mixer, mlp), recurrent in zip(s.block_layers, s.layer_recurrent):
        kinds[mixer] = "mamba." if recurrent else "self_attn."
        if mlp is not None:
            kinds[mlp] = "mlp."
    global_names = {"embeddings.weight": "embed_tokens.weight", "norm_f.weight": "norm.weight"}
    named = {}
    for name, tensor in hf.items():
        name = name.removeprefix("backbone.").removeprefix("model.")
        parts = name.split(".", 3)
        if parts[0] == "layers" and parts[2] == "norm":
            name = f"layers.{parts[1]}.input_layernorm.{parts[3]}"
        elif parts[0] == "layers" and parts[2] == "mixer":
            name = f"layers.{parts[1]}.{kinds[int(parts[1])]}{parts[3]}"
        named[global_names.get(name, name)] = tensor
    return named
