"""TII's Falcon-H1 (0.5B to 34B, Falcon-H1R) over the paged KV cache and a state a sequence: every layer attends
and mixes through Mamba2 (mamba2.py) side by side, both reading the same normed input, their answers summed into
the residual; then a SwiGLU MLP. Each layer so keeps K/V in the pool and a state in a state slot, at its own
index in both.

A checkpoint's μP multipliers (of the attention's input, keys and output, of Mamba2's input, its input product's
five parts and its output, of the MLP's gate and down products) are folded into the weights as they load, in
float32 at least, as llama.cpp's converter folds them into its files; the embeddings' and the logits' are
Granite's scales (granite_hybrid.py's ``embedding_scale`` and ``logits_divisor``), right for tied embeddings too. A
GGUF file carries them all folded, the embeddings' and the logits' into token_embd and output: a file whose
embeddings are tied (no output tensor) so has its logits scaled by the embeddings' multiplier, in llama.cpp as
here."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import nn

from .granite_hybrid import GraniteHybrid, GraniteHybridSpec
from .layers import GATE_UP, QKV, RMSNorm, SwiGLU, fused
from .llama import Attention
from .llama_spec import LlamaSpec
from .mamba2 import Mamba2Mixer, Mamba2Shape

FAMILIES = ("falcon_h1",)
# transformers' FalconH1Config defaults, for a config that leaves them out
DEFAULTS = {"mamba_rms_norm": False, "mamba_norm_before_gate": True, "mamba_n_heads": 128, "mamba_d_ssm": 1024,
            "mamba_d_state": 256, "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_conv_bias": True,
            "rms_norm_eps": 1e-5, "max_position_embeddings": 8192}
# the products whose weights multipliers are folded into, by transformers' names under a layer, and the
# config's multipliers each takes (mlp_multipliers' two items by names of their own)
FOLDED = {"self_attn.q_proj": ("attention_in_multiplier",),
          "self_attn.k_proj": ("attention_in_multiplier", "key_multiplier"),
          "self_attn.v_proj": ("attention_in_multiplier",), "self_attn.o_proj": ("attention_out_multiplier",),
          "mamba.in_proj": ("ssm_in_multiplier",), "mamba.out_proj": ("ssm_out_multiplier",),
          "mlp.gate_proj": ("mlp_gate_multiplier",), "mlp.down_proj": ("mlp_down_multiplier",)}


@dataclass
class FalconH1Spec(GraniteHybridSpec):
    # each FOLDED product's factor, and Mamba2's input product's z, x, B, C and dt rows' (a GGUF file's: folded)
    scales: tuple[tuple[str, float], ...] = ()
    ssm_multipliers: tuple[float, ...] = (1.0,) * 5

    @classmethod
    def from_hf(cls, c: dict) -> "FalconH1Spec":
        c = {**DEFAULTS, **c}
        if c["mamba_rms_norm"] and c["mamba_norm_before_gate"]:
            raise ValueError("Falcon-H1 with mamba_norm_before_gate (its Mamba2 answers normed before their gate) is "
                             "not supported; Loom, as llama.cpp, gates them first")
        biases = [key for key in ("attention_bias", "mlp_bias", "projectors_bias", "mamba_proj_bias") if c.get(key)]
        if biases:  # (Falcon-H1's models have none; a bias would take the multipliers apart from its weights)
            raise ValueError(f"Falcon-H1 with biases ({', '.join(biases)}) is not supported")
        gate, down = c.get("mlp_multipliers") or (1.0, 1.0)
        given = {**c, "mlp_gate_multiplier": gate, "mlp_down_multiplier": down}
        factor = lambda name: 1.0 if given.get(name) is None else float(given[name])
        base = LlamaSpec.from_hf({**c, "logits_scaling": 1 / factor("lm_head_multiplier")})
        return cls(**{f.name: getattr(base, f.name) for f in fields(LlamaSpec)},
                   # (every layer runs Mamba2, and attends too: read by Granite's Block alone, not Falcon-H1's)
                   layer_recurrent=(True,) * c["num_hidden_layers"],
                   mamba=Mamba2Shape.from_hf(c),
                   scales=tuple((product, math.prod(map(factor, names))) for product, names in FOLDED.items()),
                   ssm_multipliers=tuple(float(v) for v in c.get("ssm_multipliers") or (1.0,) * 5))


class Block(nn.Module):
    def __init__(self, s: FalconH1Spec, index: int):
        super().__init__()
        self.pool_layer = index  # (its K/V and its state, each at its index)
        self.rotates, self.window = True, None
        self.input_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.attn = Attention(s)
        self.mamba = Mamba2Mixer(s.hidden_size, s.mamba)
        self.post_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = SwiGLU(s.hidden_size, s.intermediate_size)

    def forward(self, x, cos, sin, kv_cache, step, masks, runs):
        h = self.input_norm(x)
        x = x + self.attn(h, cos, sin, kv_cache, self.pool_layer, step, masks) + self.mamba(
            h, kv_cache.state_layer(self.pool_layer), runs)
        return x + self.mlp(self.post_norm(x))


class FalconH1(GraniteHybrid):
    """Granite 4's hybrid model (its forward: the embeddings' and the logits' multipliers, the layers over the
    pool and the state slots) with Falcon-H1's layers, each attending and mixing."""

    BLOCK = Block

    @staticmethod
    def convert(hf: dict[str, torch.Tensor], s: FalconH1Spec) -> dict[str, torch.Tensor]:
        """Transformers' parameter names (or a GGUF file's, as gguf.py names them: -exp(A_log) as ssm_a, the
        MLP's and norms' by Llama's names) -> this module's, the config's multipliers folded into the weights."""
        hf = {k.removeprefix("model.").replace(".feed_forward.", ".mlp.").replace(".pre_ff_layernorm.",
                                                                             ".post_attention_layernorm."): v
              for k, v in hf.items()}
        final = hf.pop("final_layernorm.weight", None)
        out = {"embed.weight": hf["embed_tokens.weight"], "norm.weight": hf["norm.weight"] if final is None else final}
        out["lm_head.weight"] = hf["embed_tokens.weight"] if s.tie_word_embeddings else hf["lm_head.weight"]
        for i in range(s.num_layers):
            p = o = f"layers.{i}."
            for product, scale in s.scales:
                factor = torch.tensor(scale, dtype=torch.float64)
                if product == "mamba.in_proj":
                    factor = factor * _ssm_rows(s)[:, None]
                if not torch.all(factor == 1.0):
                    hf[f"{p}{product}.weight"] = _scaled(hf[f"{p}{product}.weight"], factor)
            out[o + "input_norm.weight"] = hf[p + "input_layernorm.weight"]
            out[o + "post_norm.weight"] = hf[p + "post_attention_layernorm.weight"]
            out[o + "attn.qkv.weight"] = fused(hf, p, QKV)
            out[o + "attn.out.weight"] = hf[p + "self_attn.o_proj.weight"]
            out.update(Mamba2Mixer.convert(hf, p + "mamba.", o + "mamba.", s.mamba))
            out[o + "mlp.gate_up.weight"] = fused(hf, p, GATE_UP)
            out[o + "mlp.down.weight"] = hf[p + "mlp.down_proj.weight"]
        return out


def _scaled(weight: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``weight`` times ``factor`` rounded once, in float32 at least (a bfloat16 checkpoint's weights scaled in
    bfloat16 would round twice, and the factor too): the model's dtype is taken after."""
    work = torch.promote_types(weight.dtype, torch.float32)
    return weight.to(work) * factor.to(work)


def _ssm_rows(s: FalconH1Spec) -> torch.Tensor:
    """Each row of Mamba2's input product's multiplier (transformers' mup_vector): z's, x's, B's, C's, dt's."""
    m = s.mamba
    widths = [m.inner, m.inner, m.groups * m.state_size, m.groups * m.state_size, m.heads]
    return torch.cat([torch.full((w,), v, dtype=torch.float64) for w, v in zip(widths, s.ssm_multipliers)])
