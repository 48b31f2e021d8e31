"""Rotary position embeddings with the checkpoint's rope settings: default, linear, llama3, yarn,
longrope and dynamic (NTK), over the whole head or its first ``partial_rotary_factor`` of it; proportional
(Gemma 4's global layers: the first share of each head's frequency pairs, over the whole head's width,
the others' frequencies zero); and a
GGUF file's own divisor per frequency (frequency_factors: its rope_freqs tensor, which is how
llama.cpp keeps Llama 3.1's llama3 scaling). Also the queries' scale by position some families add
past the original context (query_temperature). The frequencies are computed in float32 as transformers
computes them, so that float64 runs match it exactly."""

from __future__ import annotations

import math

import torch
from torch import nn

SUPPORTED = ("default", "linear", "llama3", "yarn", "longrope", "dynamic", "frequency_factors", "proportional")


def rope_type(parameters: dict | None) -> str:
    parameters = parameters or {}
    return parameters.get("rope_type", parameters.get("type", "default"))


class Rotary(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None, partial_factor: float = 1.0,
                 max_position: int | None = None):
        super().__init__()
        with torch.device("cpu"):  # real numbers even while the model is built on the meta device
            self._frequencies(head_dim, theta, scaling or {}, partial_factor, max_position)

    def _frequencies(self, head_dim, theta, scaling, partial_factor, max_position):
        kind = rope_type(scaling)
        self.dim = int(head_dim * partial_factor)
        exponents = torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim
        inv_freq = 1.0 / theta ** exponents
        self.attention_factor = 1.0
        self.long_from = None  # longrope: sequences holding more tokens than this rotate with the long factors
        self.dynamic = None    # dynamic NTK: (theta, factor, trained context, exponents)
        long_freq = inv_freq
        if kind == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif kind == "llama3":
            inv_freq = _llama3_frequencies(inv_freq, scaling)
        elif kind == "frequency_factors":
            factors = torch.tensor(scaling["factors"], dtype=torch.float32)
            if factors.shape != inv_freq.shape:
                raise ValueError(f"{len(factors)} rope frequency factors for a rotary of {len(inv_freq)} frequencies")
            inv_freq = inv_freq / factors
        elif kind == "proportional":  # (transformers' rotates the whole head so: the rest turn by 0)
            rotated = int(scaling.get("partial_rotary_factor", 1.0) * head_dim // 2)
            inv_freq = torch.cat([inv_freq[:rotated], torch.zeros(len(inv_freq) - rotated)]) / scaling.get("factor", 1.0)
        elif kind == "yarn":
            inv_freq, self.attention_factor = _yarn(theta, self.dim, scaling, max_position)
        elif kind == "longrope":
            original = scaling["original_max_position_embeddings"]
            factor = scaling.get("factor") or (max_position or original) / original
            self.attention_factor = scaling.get("attention_factor") or (
                1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original)))
            shape = theta ** exponents
            inv_freq = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * shape)
            long_freq = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * shape)
            self.long_from = original
        elif kind == "dynamic":
            self.dynamic = (theta, scaling["factor"], max_position, exponents)
        elif kind != "default":
            raise ValueError(f"unsupported rope scaling {kind!r}; supported: {', '.join(SUPPORTED)}")
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("long_freq", long_freq, persistent=False)

    @property
    def per_sequence(self) -> bool:
        """Whether the frequencies depend on how far each sequence reaches (forward's sequence_ends)."""
        return self.long_from is not None or self.dynamic is not None

    def forward(self, positions, dtype, sequence_ends=None):
        """cos and sin for each position, [T, 1, rotary dim], computed once per step.
        ``sequence_ends``: for each token, the last position of its sequence (longrope and
        dynamic only; see sequence_ends below)."""
        inv_freq = self.inv_freq.float()[None, :]
        if self.dynamic is not None:
            # transformers recomputes the base for a forward whose sequence passes the trained
            # context: base * (factor * length / trained - (factor - 1)) ** (dim / (dim - 2)).
            theta, factor, trained, exponents = self.dynamic
            length = (sequence_ends + 1).clamp_min(trained).float()
            base = theta * ((factor * length / trained) - (factor - 1)) ** (self.dim / (self.dim - 2))
            inv_freq = 1.0 / base[:, None] ** exponents.to(base.device)[None, :]
        if self.long_from is not None:
            # transformers rotates a whole forward with the long factors once its sequence passes the
            # original context, and recomputes the cache with them when a sequence first does (Loom's
            # runtime does, asked by the model's recompute_past: Llama's, DeepSeek's). So every position
            # of a sequence holding more tokens than the original context rotates long, in whatever
            # chunks it is computed.
            long = (sequence_ends >= self.long_from)[:, None]
            inv_freq = torch.where(long, self.long_freq.float()[None, :], inv_freq)
        freqs = positions[:, None].float() * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return (angles.cos() * self.attention_factor).to(dtype), (angles.sin() * self.attention_factor).to(dtype)


def sequence_ends(step) -> torch.Tensor:
    """For each token of a step, the last position its sequence holds (StepInput.lengths), as
    transformers sees a prompt it prefills in one forward even where Loom splits it in chunks.
    A step that does not say: the last position the sequence reaches in the step."""
    ends = step.positions.clone()
    lengths = step.lengths
    decodes = step.decode_groups[-1].end if step.decode_groups else 0  # one row per sequence, first
    if lengths is not None and decodes:
        ends[:decodes] = torch.tensor(lengths[:decodes]).to(ends.device) - 1
    for i, chunk in enumerate(step.prefills):
        length = lengths[decodes + i] if lengths is not None else chunk.first_position + chunk.end - chunk.start
        ends[chunk.start:chunk.end] = length - 1
    return ends


def query_temperature(positions: torch.Tensor, beta: float, original_context: int, offset: int = 0) -> torch.Tensor:
    """Llama 4's attention temperature, which Ministral 3 keeps: each position's query scale,
    1 + beta ln(1 + floor((position + offset) / original_context)), exactly 1 within the original context,
    growing by steps past it so that long contexts do not flatten the scores (Llama 4's positions counted from 1:
    ``offset`` 1). In float32, as transformers computes it."""
    return 1 + beta * torch.log(1 + torch.floor((positions + offset) / original_context))


def query_scales_at(positions: torch.Tensor, temperature: tuple[float, int, int] | None,
                    dtype: torch.dtype) -> torch.Tensor | None:
    """Each position's query scale in ``dtype`` for a spec's ``temperature`` (temperature_of's; None: none)."""
    return None if temperature is None else query_temperature(positions, *temperature).to(dtype)


def temperature_of(rope: dict) -> tuple[float, int, int] | None:
    """(beta, the original context, 0: query_temperature's arguments) of a rope that scales the queries by position
    (Ministral 3's llama_4_scaling_beta), or None."""
    beta = rope.get("llama_4_scaling_beta")
    if not beta:
        return None
    if not rope.get("original_max_position_embeddings"):
        raise ValueError("llama_4_scaling_beta needs the rope's original_max_position_embeddings, from which the "
                         "queries' scale grows")
    return float(beta), int(rope["original_max_position_embeddings"]), 0


def halves_from_pairs(rows: int, heads: int, rotary: int | None = None, start: int = 0) -> torch.Tensor:
    """The reordering of a query or key projection's ``rows`` (``heads`` heads) from rotary pairs side
    by side (the interleaved rotation: llama.cpp's files of Llama's layout, ERNIE 4.5's, GLM-4's and
    DeepSeek's checkpoints) to the rotate-half layout apply_rotary takes (a pair's values rotary / 2 apart),
    over ``rotary`` rows of each head from its row ``start`` (None: all; GLM-4 rotates the first half,
    DeepSeek the last rows), the others as they are: new row i is old row order[i]."""
    head = rows // heads
    rotary = rotary or head - start
    pairs = torch.arange(start, start + rotary).reshape(rotary // 2, 2).t().reshape(-1)
    within = torch.cat([torch.arange(start), pairs, torch.arange(start + rotary, head)])
    return (torch.arange(heads)[:, None] * head + within).reshape(rows)


def apply_rotary(x, cos, sin):
    """Rotate the first cos.shape[-1] features of each head (all of them, unless partial)."""
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _llama3_frequencies(inv_freq, scaling):
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    middle = (wavelen <= old_context / low) & (wavelen >= old_context / high)
    return torch.where(middle, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's magnitude scale for a context stretched ``factor`` times: 0.1 m ln(factor) + 1 (1 where not
    stretched), transformers' yarn_get_mscale."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _yarn(theta: float, dim: int, scaling: dict, max_position: int | None):
    """YaRN (arXiv 2309.00071): low frequencies interpolated by ``factor``, high ones kept, a linear
    ramp between; cos and sin scaled by the attention factor."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position / original
    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = float(yarn_mscale(factor, m) / yarn_mscale(factor, m_all)) if m and m_all else yarn_mscale(factor)
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction(fast), correction(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    positions = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = 1.0 / (factor * positions) * (1 - extrapolation) + 1.0 / positions * extrapolation
    return inv_freq, attention
