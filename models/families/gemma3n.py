"""Gemma 3n (text) over the paged KV cache. Gemma 4's E-sizes grew from it, and it shares their attention (norms of
their own weight, queries and keys normalised per head, values without a weight, unscaled), their last layers
reading an earlier layer's K/V, their per-layer embeddings and final soft cap (gemma4.py). Its own:

- AltUp: the hidden state is ``altup_inputs`` streams (4). The embedded input is the first; the others are its
  projections, each rescaled to the input's root mean square. A layer predicts every stream as a mix of all of
  them (the mix's coefficients from the active stream through a small router), runs its attention and MLP on
  the active stream's prediction, then corrects each stream's prediction by the layer's innovation (its output
  less the active prediction) times a coefficient of its own; the per-layer input, gated by the corrected active
  stream, is added to the other streams. After the last layer the other streams are projected back, rescaled to
  the active stream's root mean square, and the streams averaged;
- Laurel: beside the attention, a low-rank product of the layer's normed input (rank laurel_rank), normed and
  added to that input; its sum with the attention's residual scaled by 1 / sqrt(2);
- activation sparsity: in the first layers (activation_sparsity_pattern), the MLP's gate keeps only what lies above
  its mean plus a multiple of its standard deviation (the normal quantile of the layer's sparsity), less that cutoff.

Images and audio are not read (their towers' tensors are left out, as for the other VLMs)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .gemma import gemma_tensors
from .gemma4 import (BLOCK_NAMES, PER_LAYER_NAMES, Attention, Gemma4, Gemma4Spec, per_layer_table, renamed,
                     shared_queries)
from .layers import GATE_UP, QKV, RMSNorm, fused

FAMILIES = ("gemma3n_text",)


@dataclass
class Gemma3nSpec(Gemma4Spec):
    altup_inputs: int = 4
    layer_widths: tuple[int, ...] = ()           # each layer's MLP width
    sparsity_stds: tuple[float | None, ...] = ()  # each layer's gate cutoff in standard deviations (None: dense)
    laurel_rank: int = 64
    altup_correct_scale: bool = True

    @classmethod
    def from_hf(cls, c: dict) -> "Gemma3nSpec":
        activation = c.get("hidden_activation") or "gelu_pytorch_tanh"
        if activation != "gelu_pytorch_tanh":
            raise ValueError(f"unsupported hidden_activation {activation!r} for gemma3n; supported: gelu_pytorch_tanh")
        if c.get("attention_bias"):
            raise ValueError("gemma3n with attention biases is not supported")
        if c.get("altup_active_idx", 0) != 0:
            raise ValueError(f"gemma3n with altup_active_idx {c['altup_active_idx']} is not supported; Loom runs "
                             "the first stream as the active one, as every Gemma 3n does")
        layers = c["num_hidden_layers"]
        types = list(c.get("layer_types") or ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention"
                                              for i in range(layers)])
        widths = c["intermediate_size"]
        widths = tuple(widths) if isinstance(widths, (list, tuple)) else (widths,) * layers
        stds = c.get("activation_sparsity_stds")  # (a GGUF file's, as its converter writes them: gguf_config)
        if stds is None:  # (transformers' default pattern: the first ten layers of a model of more)
            sparse = 10 if layers > 10 else 0
            pattern = c.get("activation_sparsity_pattern") or [0.95] * sparse + [0.0] * (layers - sparse)
            stds = [gate_cutoff_stds(p) for p in pattern]
        if len(widths) != layers or len(stds) != layers:
            raise ValueError(f"a gemma3n config's intermediate_size and activation_sparsity_pattern list one value "
                             f"a layer ({layers}); got {len(widths)} and {len(stds)}")
        rope = c.get("rope_parameters") or {}
        if "full_attention" in rope:
            global_rope, local_theta = dict(rope["full_attention"]), rope["sliding_attention"].get("rope_theta")
        else:
            global_rope = {"rope_type": "default", "rope_theta": c.get("rope_theta", 1_000_000.0)}
            local_theta = c.get("rope_local_base_freq")
        for kind, parameters in (("global", global_rope), ("sliding-window", rope.get("sliding_attention", {}))):
            if parameters.get("rope_type", "default") != "default":
                raise ValueError(f"unsupported rope {parameters['rope_type']!r} for gemma3n's {kind} layers; "
                                 "supported: default")
        global_rope.setdefault("rope_theta", 1_000_000.0)
        per_layer_width = c.get("hidden_size_per_layer_input", 256)
        if not per_layer_width:
            raise ValueError("a gemma3n config names no hidden_size_per_layer_input; every Gemma 3n has per-layer inputs")
        heads = c["num_attention_heads"]
        kv_heads = c.get("num_key_value_heads") or heads
        head_dim = c.get("head_dim") or 256
        shared = c.get("num_kv_shared_layers") or 0
        if shared and set(types[layers - shared:]) - set(types[:layers - shared]):
            raise ValueError("gemma3n's layers sharing K/V need an earlier layer of their kind to read")
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=max(widths),
            num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6), global_kv_heads=kv_heads, global_head_dim=head_dim,
            layer_windows=tuple(c.get("sliding_window", 512) if t == "sliding_attention" else None for t in types),
            values_are_keys=False, first_shared=layers - shared, double_wide_mlp=False,
            sliding_theta=float(local_theta or 10_000.0), global_rope=global_rope,
            per_layer_width=per_layer_width,
            per_layer_vocab=c.get("vocab_size_per_layer_input") or c["vocab_size"],
            final_softcap=c.get("final_logit_softcapping"), max_position=c.get("max_position_embeddings", 32_768),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", True)),
            altup_inputs=c.get("altup_num_inputs", 4), layer_widths=widths,
            sparsity_stds=tuple(float(v) if math.isfinite(v) else None for v in stds),
            laurel_rank=c.get("laurel_rank", 64),
            altup_correct_scale=bool(c.get("altup_correct_scale", True)))


def gate_cutoff_stds(sparsity: float) -> float:
    """The MLP gate's cutoff, in standard deviations above its mean, that keeps a layer's ``sparsity`` share of a
    normal gate at zero (-inf: a dense layer): the normal quantile, in float32 as transformers computes it (and a
    GGUF file keeps it, activation_sparsity_scale)."""
    return float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(sparsity, dtype=torch.float32)))


def rescaled(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """x rescaled to the root mean square ``target`` (its own taken as 1e-5 at least, squared, as transformers)."""
    return x * target / x.pow(2).mean(-1, keepdim=True).clamp(min=1e-5).sqrt()


class AltUp(nn.Module):
    """A layer's prediction of its streams before it runs and their correction after (the module docstring)."""

    def __init__(self, s: Gemma3nSpec):
        super().__init__()
        streams = s.altup_inputs
        self.router = nn.Linear(s.hidden_size, streams, bias=False)
        self.router_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.predict_coefs = nn.Parameter(torch.zeros(streams * streams, streams))
        self.correct_coefs = nn.Parameter(torch.zeros(streams, streams))
        self.correct_scale = nn.Parameter(torch.ones(s.hidden_size))
        self.router_scale = 1.0 / s.hidden_size

    def modalities(self, x: torch.Tensor) -> torch.Tensor:
        """[T, streams]: tanh of the router over the stream normed and scaled by 1 / hidden."""
        scale = torch.tensor(self.router_scale, dtype=torch.float32).to(x.dtype)
        return torch.tanh(self.router(self.router_norm(x) * scale))

    def predict(self, streams: torch.Tensor) -> torch.Tensor:
        """[T, A, H]: each stream plus a mix of all of them, the mix's coefficients from the active stream."""
        tokens, count = streams.shape[:2]
        mix = F.linear(self.modalities(streams[:, 0]), self.predict_coefs).view(tokens, count, count)
        return streams + mix @ streams

    def correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        """[T, A, H]: each prediction plus the layer's innovation times its stream's coefficient (+ 1)."""
        coefs = F.linear(self.modalities(activated), self.correct_coefs) + 1.0
        return predictions + coefs.unsqueeze(-1) * (activated - predictions[:, 0]).unsqueeze(1)


class Block(nn.Module):
    def __init__(self, s: Gemma3nSpec, index: int):
        super().__init__()
        self.index, self.window = index, s.layer_windows[index]
        self.pool_layer = s.pool_layer(index)
        self.cutoff_stds = s.sparsity_stds[index]
        inner = s.layer_widths[index]
        norm = lambda: RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.input_norm, self.post_attn_norm, self.pre_mlp_norm, self.post_mlp_norm = norm(), norm(), norm(), norm()
        self.altup = AltUp(s)
        self.attn = Attention(s, index)
        self.laurel_left = nn.Linear(s.hidden_size, s.laurel_rank, bias=False)
        self.laurel_right = nn.Linear(s.laurel_rank, s.hidden_size, bias=False)
        self.laurel_norm = norm()
        self.gate_up = nn.Linear(s.hidden_size, 2 * inner, bias=False)
        self.down = nn.Linear(inner, s.hidden_size, bias=False)
        self.per_layer_gate = nn.Linear(s.hidden_size, s.per_layer_width, bias=False)
        self.per_layer_out = nn.Linear(s.per_layer_width, s.hidden_size, bias=False)
        self.per_layer_norm = norm()
        self.scales_correction = s.altup_correct_scale

    def sparse(self, gate: torch.Tensor) -> torch.Tensor:
        """The gate less its cutoff (mean + cutoff_stds x its standard deviation), at least 0."""
        if self.cutoff_stds is None:
            return gate
        mean, std = gate.mean(-1, keepdim=True), gate.std(-1, keepdim=True, unbiased=False)
        return F.relu(gate - (mean + std * torch.tensor(self.cutoff_stds, dtype=torch.float32).to(gate.dtype)))

    def forward(self, streams, per_layer_input, rotations, kv_cache, step, masks):
        cos, sin = rotations[self.window is None]
        predictions = self.altup.predict(streams)
        active = predictions[:, 0]
        normed = self.input_norm(active)
        laurel = normed + self.laurel_norm(self.laurel_right(self.laurel_left(normed)))
        attended = self.post_attn_norm(self.attn(normed, cos, sin, kv_cache, self.pool_layer, step, masks[self.window]))
        x = (active + attended + laurel) / math.sqrt(2)
        gate, up = self.gate_up(self.pre_mlp_norm(x)).chunk(2, dim=-1)
        x = x + self.post_mlp_norm(self.down(F.gelu(self.sparse(gate), approximate="tanh") * up))
        corrected = self.altup.correct(predictions, x)
        first = corrected[:, 0] * self.altup.correct_scale if self.scales_correction else corrected[:, 0]
        gated = F.gelu(self.per_layer_gate(first), approximate="tanh") * per_layer_input
        corrected[:, 1:] += self.per_layer_norm(self.per_layer_out(gated)).unsqueeze(1)
        return corrected


class Gemma3n(Gemma4):
    block = Block

    def __init__(self, s: Gemma3nSpec):
        super().__init__(s)
        others = s.altup_inputs - 1
        self.altup_spread = nn.Linear(s.hidden_size, others * s.hidden_size, bias=False)  # (the streams' stacked)
        self.altup_unembed = nn.ModuleList(nn.Linear(s.hidden_size, s.hidden_size, bias=False) for _ in range(others))

    def spread(self, x: torch.Tensor) -> torch.Tensor:
        """[T, A, H]: the embedded input, then its projections each rescaled to its root mean square."""
        target = x.pow(2).mean(-1, keepdim=True).sqrt().unsqueeze(1)
        others = self.altup_spread(x).view(len(x), self.spec.altup_inputs - 1, -1)
        return torch.cat([x.unsqueeze(1), rescaled(others, target)], dim=1)

    def merge(self, streams: torch.Tensor) -> torch.Tensor:
        """[T, H]: the first stream and the others projected back (each rescaled to the first's root mean
        square), averaged."""
        first = streams[:, 0]
        target = first.pow(2).mean(-1, keepdim=True).sqrt()
        back = [rescaled(unembed(streams[:, i + 1]), target) for i, unembed in enumerate(self.altup_unembed)]
        return torch.stack([first, *back]).mean(0)

    @staticmethod
    def convert(hf: dict[str, torch.Tensor], s: Gemma3nSpec) -> dict[str, torch.Tensor]:
        """Transformers' parameter names (or a GGUF file's stacked AltUp projections, gguf.py's names) -> this
        module's, fusing q/k/v and gate/up."""
        hf, out = gemma_tensors(hf, s)
        out |= per_layer_table(hf)
        # the AltUp projections a matrix a stream (transformers'), or a file's stack of them (gguf.py: a matrix of
        # their rows, in the file's blocks; a [streams, hidden, hidden] float32 copy where none are kept)
        others, width = range(s.altup_inputs - 1), s.hidden_size
        spread, unembed = (hf[f"{n}.weight"].flatten(0, -2) if f"{n}.weight" in hf else
                           torch.cat([hf[f"{n}.{i}.weight"] for i in others])
                           for n in ("altup_projections", "altup_unembed_projections"))
        out["altup_spread.weight"] = spread
        out |= {f"altup_unembed.{i}.weight": unembed[i * width:(i + 1) * width] for i in others}
        own = {"laurel_left": "laurel.linear_left", "laurel_right": "laurel.linear_right",
               "laurel_norm": "laurel.post_laurel_norm", "altup.router": "altup.modality_router",
               "altup.router_norm": "altup.router_norm"}
        coefs = {"altup.predict_coefs": "altup.prediction_coefs", "altup.correct_coefs": "altup.correction_coefs"}
        for i in range(s.num_layers):
            p = o = f"layers.{i}."
            shares = i >= s.first_shared
            out |= renamed(hf, p, o, BLOCK_NAMES | PER_LAYER_NAMES | own | (
                {} if shares else {"attn.k_norm": "self_attn.k_norm"}))
            out |= {o + ours: hf[p + theirs + ".weight"] for ours, theirs in coefs.items()}
            scale = p + "altup.correct_output_scale"  # (a GGUF file's with a kind: gguf.py's names)
            out[o + "altup.correct_scale"] = hf[scale] if scale in hf else hf[scale + ".weight"]
            out[o + "attn.qkv.weight"] = shared_queries(hf, p) if shares else fused(hf, p, QKV)
            out[o + "gate_up.weight"] = fused(hf, p, GATE_UP)
        return out
