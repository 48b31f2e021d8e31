"""Building blocks shared by the models: attention over the paged KV cache, RMSNorm, and the frame of
the Llama-family and Gemma models (DecoderShape, DecoderModel; rotary embeddings are in rope.py, CPU
linear layers in cpu_linear.py). They read a StepInput and know nothing of requests,
threads or scheduling."""

from __future__ import annotations

import math

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import native, paged_decode
from .rope import apply_rotary
from ..step import DecodeGroup, PrefillChunk

# A prefill chunk whose queries read at most this many keys in all (each token its own prefix)
# attends on the decode kernel, a row per token: a prompt of a dozen tokens took a gather of its
# blocks, SDPA and some views in every layer, which for 64 such prompts was ~100 ms of a 500-600 ms
# prefill (docs/benchmarks-history.md, "Short prompts on the decode kernel"). Longer chunks keep SDPA,
# which reads each key once for all of the chunk's queries.
SHORT_PREFILL_KEYS = 4096


@dataclass(frozen=True)
class Chunked:
    """A layer's window that is Llama 4's chunks rather than a sliding window: a query reads the keys from the start
    of its own chunk of ``size`` positions (the last multiple of size at or before it) up to itself."""
    size: int


def first_keys(window: "int | Chunked", ends):
    """The first key each query reads under ``window`` (a sliding window's width, or Chunked), for queries that read
    ``ends`` keys (their positions + 1); ints or tensors alike."""
    if isinstance(window, Chunked):
        return (ends - 1) // window.size * window.size
    return ends - window


def kernel_window(window: "int | Chunked | None") -> int:
    """A layer's window as the kernels take it (paged_decode.h's decode_attention_rows): 0 for none, a sliding
    window's width, or minus a chunk's size."""
    return 0 if window is None else -window.size if isinstance(window, Chunked) else window


class AttentionMasks:
    """The masks of one step, built once per forward and shared by every layer.

    Decode tokens attend to their whole context (or its last ``window`` keys, or their chunk's where the window is
    Chunked); a prefill chunk attends causally to everything before it, including earlier chunks and cached
    prefixes. On the CPU kernels, short chunks go with the decode groups, as more of them (``prefill_rows``).
    """

    def __init__(self, step, dtype: torch.dtype, kv_cache, window: int | Chunked | None = None):
        self.window = window
        # The CPU kernels bound each context themselves; the torch path needs padded masks.
        self.on_kernel = native.supports(step.positions.device, dtype, kv_cache.dtype)
        self.decode = []  # one mask per decode group on the torch path (the kernel needs none)
        for group in step.decode_groups if not self.on_kernel else ():
            width = group.block_tables.shape[1] * step.block_size
            keys = torch.arange(width, device=step.positions.device)
            lens = group.context_lens[:, None]
            mask = keys < lens
            if window is not None:
                mask &= keys >= first_keys(window, lens)
            self.decode.append(mask[:, None, None, :])
        self.prefill = []  # (chunk, its mask) for SDPA
        self.prefill_rows: list[DecodeGroup] = []  # runs of short chunks, a row per token (kernel only)
        short = []
        for chunk in step.prefills:
            n = chunk.end - chunk.start
            if self.on_kernel and prefill_keys(chunk) <= SHORT_PREFILL_KEYS:
                short.append(chunk)
                continue
            if short:
                self.prefill_rows.append(chunk_rows(short))
            short = []
            if chunk.first_position == 0 and window is None:
                self.prefill.append((chunk, None))  # plain causal: lets SDPA take its fastest path
                continue
            queries = torch.arange(chunk.first_position, chunk.first_position + n, device=step.positions.device)
            keys = torch.arange(chunk.first_position + n, device=step.positions.device)
            mask = keys[None, :] <= queries[:, None]
            if window is not None:
                mask &= keys[None, :] >= first_keys(window, queries[:, None] + 1)
            self.prefill.append((chunk, mask))
        if short:
            self.prefill_rows.append(chunk_rows(short))


def prefill_keys(chunk: PrefillChunk) -> int:
    """The keys a chunk's queries would read a row per token, at most (each token its whole prefix)."""
    n = chunk.end - chunk.start
    return n * (chunk.first_position + n)


def chunk_rows(chunks: list[PrefillChunk]) -> DecodeGroup:
    """Consecutive chunks as one decode group: token i of a chunk attends to the first
    first_position + i + 1 keys (its window's share) through the chunk's block table."""
    tokens = chunks[-1].end - chunks[0].start
    tables = np.zeros((tokens, max(len(c.block_table) for c in chunks)), dtype=np.int64)
    lens = np.empty(tokens, dtype=np.int64)
    for chunk in chunks:
        rows = slice(chunk.start - chunks[0].start, chunk.end - chunks[0].start)
        tables[rows, :len(chunk.block_table)] = chunk.block_table.numpy()
        lens[rows] = np.arange(chunk.first_position + 1, chunk.first_position + 1 + chunk.end - chunk.start)
    return DecodeGroup(chunks[0].start, chunks[-1].end, torch.from_numpy(tables), torch.from_numpy(lens))


def paged_attention(q, k, v, kv_cache, layer: int, step, masks: AttentionMasks, scale: float,
                    cos=None, sin=None, softcap: float | None = None, sinks: torch.Tensor | None = None,
                    slopes: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, heads, dim]; k, v: [T, kv_heads, dim]. Rotates q and k by the step's angles (if
    given, from rope.Rotary), writes the step's K/V into the pool (rounded to its dtype, where that
    is not q's), then attends through block tables, each score soft-capped to softcap tanh(score /
    softcap) where ``softcap`` is given (Gemma 2), each head's softmax taking its sink's logit
    (``sinks`` [heads], gpt-oss's) in its denominator where given, each score plus its head's ALiBi slope
    (``slopes`` [heads], BLOOM's and MPT's) times the key's position less the query's where given. With ``k`` and
    ``v`` None (a layer reading another's K/V: Gemma 4's last layers) only q is rotated and nothing stored. Returns
    [T, heads, dim]."""
    k_cache, v_cache = kv_cache.layer(layer)
    kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    if k is None:
        q = q if cos is None else apply_rotary(q, cos, sin)
    elif masks.on_kernel:
        q = paged_decode.rotate_and_store(q, k, v, cos, sin, step.slot_mapping, k_cache, v_cache)
    else:
        if cos is not None:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k_cache.view(-1, kv_heads, dim).index_copy_(0, step.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, kv_heads, dim).index_copy_(0, step.slot_mapping, v.to(v_cache.dtype))
    out = torch.empty_like(q)
    if masks.on_kernel:  # one read of each key and value, straight from the pool
        for group in step.decode_groups + masks.prefill_rows:
            rows = slice(group.start, group.end)
            paged_decode.decode_attention(q[rows], k_cache, v_cache, group.block_tables, group.context_lens,
                                          out[rows], scale, kernel_window(masks.window), softcap, sinks,
                                          slopes)
    for group, mask in zip(step.decode_groups, masks.decode):  # the torch path
        rows = slice(group.start, group.end)
        # index_select copies whole blocks; advanced indexing (cache[tables]) measured 8x slower.
        blocks = group.block_tables.flatten()
        shape = (group.end - group.start, -1, kv_heads, dim)
        keys = kv_cache.gather(k_cache, blocks, 0, q.dtype).view(shape).transpose(1, 2)  # [n, kv_heads, L, dim]
        values = kv_cache.gather(v_cache, blocks, 1, q.dtype).view(shape).transpose(1, 2)
        bias = None if slopes is None else slopes[:, None, None] * (  # (each row's query its last key)
            torch.arange(keys.shape[2], device=q.device) - (group.context_lens[:, None] - 1))[:, None, None, :]
        out[rows] = attend(q[rows, :, None, :], keys, values, mask, scale, softcap, sinks, bias)[:, :, 0, :]
    for chunk, mask in masks.prefill:
        length = chunk.first_position + chunk.end - chunk.start
        keys = kv_cache.gather(k_cache, chunk.block_table, 0, q.dtype).flatten(0, 1)[:length].transpose(0, 1)[None]
        values = kv_cache.gather(v_cache, chunk.block_table, 1, q.dtype).flatten(0, 1)[:length].transpose(0, 1)[None]
        queries = q[chunk.start:chunk.end].transpose(0, 1)[None]
        bias = None
        if slopes is not None:  # (the chunk's queries from first_position, its keys from 0)
            positions = torch.arange(length, device=q.device)
            bias = slopes[:, None, None] * (positions - positions[chunk.first_position:, None])
        out[chunk.start:chunk.end] = attend(queries, keys, values, mask, scale, softcap, sinks,
                                            bias)[0].transpose(0, 1)
    return out


def attend(q, k, v, mask, scale: float, softcap: float | None, sinks: torch.Tensor | None = None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [..., heads, n, dim] over k, v [..., kv_heads, L, dim] (kv_heads dividing heads)
    under a boolean ``mask`` ([n, L] or broadcast to it; None: causal, n == L): SDPA, or, with a
    ``softcap`` or ``sinks`` ([heads]), which SDPA cannot apply, the scores soft-capped and softmaxed
    here, each head's sink a logit in its softmax that weighs no value. ``bias``: added to the scores (ALiBi's,
    broadcast to [..., heads, n, L]), where the mask lets them be."""
    gqa = q.shape[-3] != k.shape[-3]
    if bias is not None:  # (a float mask: the bias where the boolean one is true)
        if mask is None:
            mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        mask = bias.to(q.dtype).masked_fill(~mask, float("-inf"))
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=gqa)
    if gqa:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if sinks is None:
        return torch.softmax(scores, dim=-1) @ v
    sink = sinks.to(scores.dtype)[:, None, None].expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1] @ v


def alibi_slopes(heads: int, max_bias: float = 8.0) -> torch.Tensor:
    """ALiBi's slope a head (BLOOM's and MPT's; llama.cpp's for any head count): 2^(-max_bias / n) to the powers
    1..n for the first n heads, n the largest power of two not above ``heads``, and the others 2^(-max_bias / 2n)
    to the odd powers."""
    n = 2 ** int(math.floor(math.log2(heads)))
    first = (2.0 ** (-max_bias / n)) ** torch.arange(1, n + 1, dtype=torch.float64)
    rest = (2.0 ** (-max_bias / 2 / n)) ** torch.arange(1, 2 * (heads - n) + 1, 2, dtype=torch.float64)
    return torch.cat([first, rest]).float()


class NativeDecoding:
    """A family whose steps of decode rows and short prefill chunks may run on native layers:
    kernels/decoder_layer.py attaches them as ``decoder_layers`` where they serve; the forward asks
    ``native_decode`` first."""

    decoder_layers = None

    def native_decode(self, x, cos, sin, step, kv_cache, window_angles=None, query_scales=None,
                      per_layer_inputs=None) -> torch.Tensor | None:
        """The step's logits from the native layers; None where they do not serve this step.
        ``window_angles``: (cos, sin) of the layers with a sliding window, where they differ;
        ``query_scales``: each row's query scale, where the model scales them (rope.query_temperature);
        ``per_layer_inputs``: Gemma 4's, [rows, layers, width]."""
        layers = self.decoder_layers
        if layers is None or not layers.serves(step, kv_cache):
            return None
        if step.verifies and layers.splits(step, torch.get_num_threads(), kv_cache):
            return None  # rows of one sequence on two threads: one could attend before the other wrote its K/V
        return layers.forward(x, cos, sin, kv_cache, step, window_angles, query_scales, per_layer_inputs)

    def splits_rows(self, step, threads: int, kv_cache) -> bool:
        """Whether the forward gives each of ``threads`` threads rows of its own (models/step.py:
        the thread count the runtime chooses depends on it). Never for a step that verifies
        proposed tokens (StepInput.verifies)."""
        return (self.decoder_layers is not None and not step.verifies
                and self.decoder_layers.splits(step, threads, kv_cache))


@dataclass
class DecoderShape:
    """The sizes a Llama-family or Gemma spec holds first, from which DecoderModel builds."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float


class DecoderModel(NativeDecoding, nn.Module):
    """What a Llama-family or Gemma model holds and tells the engine: its spec, the cache geometry,
    the token embeddings, its blocks (``block(spec, index)``), the final norm (``norm(width, eps)``)
    and the output layer, tied to the embeddings where the spec says."""

    def __init__(self, s, block, norm):
        super().__init__()
        self.spec = s
        self.num_layers, self.num_kv_heads, self.head_dim = s.num_layers, s.num_kv_heads, s.head_dim
        self.vocab_size, self.max_position = s.vocab_size, s.max_position
        self.embed = embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(block(s, i) for i in range(s.num_layers))
        self.norm = norm(s.hidden_size, s.rms_norm_eps)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        self.tie_embeddings()

    def tie_embeddings(self):
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight


# a layer's products that the models fuse: their checkpoint names, and their parts' (the rows in order)
QKV = ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"))
GATE_UP = ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"))


def renamed(hf: dict[str, torch.Tensor], renames: tuple[tuple[str, str], ...]) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors with each (theirs, ours) of ``renames`` replaced in their names, in that order."""
    named = {}
    for name, tensor in hf.items():
        for theirs, ours in renames:
            name = name.replace(theirs, ours)
        named[name] = tensor
    return named


def fused(hf: dict, prefix: str, product: tuple[str, tuple[str, ...]], kind: str = "weight") -> torch.Tensor:
    """A fused product's ``kind`` tensor under ``prefix`` (QKV, GATE_UP): the checkpoint's own (Phi-3's;
    a GGUF file's blocks, which gguf.py fuses), or its parts' rows one after another, popped from ``hf``
    so that they go now."""
    name, parts = product
    whole = hf.get(f"{prefix}{name}.{kind}")
    return whole if whole is not None else torch.cat([hf.pop(f"{prefix}{part}.{kind}") for part in parts])


def decoder_tensors(hf: dict, s) -> tuple[dict, dict]:
    """A Llama-style checkpoint's tensors without their "model." prefix, and DecoderModel's own from them: the
    embeddings, the final norm and the output layer (the embeddings where the spec ties them)."""
    hf = {k.removeprefix("model."): v for k, v in hf.items()}
    out = {"embed.weight": hf["embed_tokens.weight"], "norm.weight": hf["norm.weight"],
           "lm_head.weight": hf["embed_tokens.weight"] if s.tie_word_embeddings else hf["lm_head.weight"]}
    return hf, out


def block_norms(hf: dict, prefix: str) -> dict:
    """A Llama-style layer's two norms under ``prefix``, before the attention and before the MLP, by a Block's names."""
    return {prefix + "input_norm.weight": hf[prefix + "input_layernorm.weight"],
            prefix + "post_norm.weight": hf[prefix + "post_attention_layernorm.weight"]}


def embedding(rows: int, dim: int) -> nn.Embedding:
    """An nn.Embedding whose table is left uninitialised, for loading to replace: its own init (a
    normal_ that, even on the meta device, imports torch's compiler) took 1.5 s of a 2.5 s load."""
    return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))


class SwiGLU(nn.Module):
    """silu(gate) x up, then the down product: the Llama family's MLP (its gate and up rows one product),
    OLMo's, and a mixture's shared expert's."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_up = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class UngatedMLP(nn.Module):
    """An activation of the up product, then the down product, no gate: SquaredReLU's or GeluMLP's."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.up = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x):
        return self.down(self.activate(self.up(x)))


class SquaredReLU(UngatedMLP):
    """relu(up)^2: Nemotron-H's MLP, Arcee's."""

    @staticmethod
    def activate(up: torch.Tensor) -> torch.Tensor:
        return F.relu(up).square()


class GeluMLP(UngatedMLP):
    """gelu_tanh(up): StarCoder2's MLP, Phi-2's (and GPT-NeoX's and Falcon's in llama.cpp's files)."""

    @staticmethod
    def activate(up: torch.Tensor) -> torch.Tensor:
        return F.gelu(up, approximate="tanh")


class ExactGeluMLP(UngatedMLP):
    """gelu(up) by erf: GPT-NeoX's MLP (Pythia's), Falcon's."""

    @staticmethod
    def activate(up: torch.Tensor) -> torch.Tensor:
        return F.gelu(up)


class XieluMLP(UngatedMLP):
    """xIELU(up): Apertus's MLP. x > 0: softplus(alpha_p) x^2 + beta x; else (expm1(min(x, eps)) - x) (beta +
    softplus(alpha_n)) + beta x, with each layer's own alpha_p, alpha_n (as its checkpoint keeps them), beta and eps."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__(hidden_size, intermediate_size, bias)
        for name in ("alpha_p", "alpha_n", "beta", "eps"):
            self.register_buffer(name, torch.zeros(1))

    def factors(self) -> tuple[float, float, float, float]:
        """Its positive side's factor, its negative side's, beta and eps, as the activation uses them."""
        beta = float(self.beta)
        return float(F.softplus(self.alpha_p.double())), beta + float(F.softplus(self.alpha_n.double())), beta, float(
            self.eps)

    def activate(self, up: torch.Tensor) -> torch.Tensor:
        positive, negative, beta, eps = self.factors()
        return torch.where(up > 0, positive * up * up + beta * up,
                           (torch.expm1(up.clamp(max=eps)) - up) * negative + beta * up)


class HeadLayerNorm(nn.Module):
    """A LayerNorm of each head's values [..., heads, dim] with weights of its own a head and no bias (StableLM 2
    12B's and Command R+'s q/k norms), in float32 at least, as transformers' are."""

    def __init__(self, heads: int, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(heads, dim))
        self.eps = eps

    def forward(self, x):
        work = x.to(torch.promote_types(x.dtype, torch.float32))
        return (F.layer_norm(work, work.shape[-1:], None, None, self.eps) * self.weight).to(x.dtype)


def weightless_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x), in float32 at least, as transformers' norms without a weight (Falcon-Mamba's time steps, B
    and C; Gemma 4's values and its experts' router)."""
    work = x.to(torch.promote_types(x.dtype, torch.float32))
    return F.rms_norm(work, work.shape[-1:], None, eps).to(x.dtype)


class RMSNorm(nn.Module):
    """x / rms(x) * (offset + weight). Gemma's norms (offset 1: its checkpoints store weight - 1)
    normalise in float32 whatever the model's dtype, as transformers' do; the others in the model's
    dtype, float32 at least."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))
        self.eps, self.offset = eps, offset

    def forward(self, x):
        if self.offset and x.dtype == torch.float32:  # one operator (Qwen3.5's 72 norms a step: 12% of a decode's)
            return F.rms_norm(x, self.weight.shape, self.offset + self.weight, self.eps)
        if self.offset:
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            return (h * (self.offset + self.weight.float())).type_as(x)
        if x.dtype in (torch.float32, torch.float64):  # one operator, bit-identical to the steps below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32 at least, as transformers does, then return to the model's dtype.
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
