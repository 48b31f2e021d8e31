"""Decoder layers for steps of decode rows and short prefill chunks on the CPU, all of them and the
output layer in one native call (decoder_layer.cpp): what the Blocks of families/llama.py and
gpt2.py, the final norm and lm_head compute, without the per-layer dispatch of ~16 torch operators
and 6 ctypes calls, which was a quarter of a one-stream step (docs/benchmarks-history.md,
"Small-batch products").

``use_decoder_layers(model)`` attaches them where the model qualifies: GPT-2, Gemma 1, 2 and 3 in
float32, Gemma 4 and Gemma 3n (its AltUp streams around the layer), OLMo 2 and 3, LFM2 (its short convolutions in
the attention's place, and LFM2-MoE's experts), Qwen3.5 and Qwen3-Next in float32 (their gated delta rule in the
attention's place, their other layers' attention gated), Granite 4's hybrids (Mamba2 in the attention's place),
Jamba (Mamba's selective scan there, an MLP or experts after), Falcon-H1 (Mamba2 beside the attention), Mamba and
Falcon-Mamba (the selective scan in the attention's place, no MLP), DeepSeek's latent attention (MiniCPM3's scaled),
or a Llama-family model (Qwen3's per-head q/k norms and OLMoE's across heads, Ministral 3's queries scaled by position, SmolLM3's layers without rotary, Granite's scaled residuals,
gpt-oss's sinks and the mixtures' routed and shared experts, biases and clamped SwiGLU included) whose linear layers,
the output layer's too, are CpuLinear or BlockLinear. A prefill chunk within PREFILL_KEYS (a prompt of up to
1024 tokens) is rows of its sequence here too, each attending to its prefix on the decode kernel,
and 64 prompts of 21 tokens (a 1344-row step) run as one call. On the torch
layers that step took 4.5-5.1 s against 4.3-4.5 over the 360M F32 file, 10.1-11.2 against
8.1-10.0 over the 1.7B Q4_K_M, 16 such prompts 2.6 s against 2.25 (their elementwise operators,
fresh tensors and page faults between the products; two Zen 4 threads, `docs/bench/decode_forward.py
--prefill 21`). Steps with a longer chunk, and every other model, run the torch path, which stays
the reference the tests compare with.
"""

from __future__ import annotations

import bisect
import ctypes

import torch
from torch import nn

from . import native
from .block_linear import FLOAT32, FLOAT32_PADDED, BlockLinear
from .cpu_linear import CpuLinear, default_panel_rows
from ..families.deepseek import DeepSeek
from ..families.gemma import Gemma
from ..families.gemma3n import Gemma3n
from ..families.gemma4 import Gemma4, MixtureBeside
from ..families.gpt2 import GPT2
from ..families.falcon_h1 import FalconH1
from ..families.granite_hybrid import GraniteHybrid
from ..families.layers import (ExactGeluMLP, GeluMLP, HeadLayerNorm, NativeDecoding, RMSNorm, SquaredReLU,
                               UngatedMLP, XieluMLP, chunk_rows, kernel_window, prefill_keys)
from ..families.lfm2 import Lfm2
from ..families.mamba import Mamba, MambaMixer
from ..families.llama import Llama
from ..families.olmo import Olmo
from ..families.qwen35 import Qwen35
from ..families.moe import Experts, SparseMoE
from .block_experts import BlockExperts
from .block_heads import BlockHeadProducts, HeadProducts

_pointer, _int64, _double = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double

# From this many rows per thread, each thread carries its own rows through every layer (one barrier
# per step rather than ten per layer; decoder_layer.cpp). Below it, each thread reading every weight
# cost more than the barriers: quiet on Zen 5, 16 rows split took 30 ms against 23 shared, 32 rows
# were level and 64 rows split took 74 against 81 (docs/benchmarks-history.md, "Threads that carry their
# own rows").
SPLIT_ROWS_PER_THREAD = 12
# A model with routed experts: each thread carrying its own rows would read every expert its rows
# route to, where the team reads each once.
EXPERT_SPLIT_ROWS_PER_THREAD = 1 << 30
# Where a model's products read float32 weights and the build's vectors are AVX2's, the threads
# carry their own rows only where those compute at most PANEL_SLACK times the panel rows (zero rows
# included, cpu_linear.h's panel_computed_rows) of an even share of the team's: 48 rows split are
# two shares of 24, each a 16-row panel and a whole one for the 8 left, where the team's 48 fill
# three. On a Zen 3 (two threads, three decode steps twice; docs/benchmarks-history.md, "Float32
# rows split on AVX2, not taken", then "Threads that take each other's rows") the 1.7B F32 file's
# step at 24 / 32 / 48 / 64 rows took 725-812 / 755-793 / 1309-1611 / 1437-1807 ms split against
# 701-1063 / 756-817 / 1053-1229 / 1485-1666 on the team, the 360M F32's at 32 / 48 / 64 190-207 /
# 327-502 / 372-506 against 200-347 / 279-302 / 401-640; beside one busy process every count ran
# faster split (1.7B 64 rows 2204-2720 against 2539-2867), 48 rows level. The slack lets a prefill
# step split whose shares end where its prompts start: one of 1378 rows (63 prompts) computed ~2%
# more split, and left to the team, which the load's sample had cut to one thread for Loom's
# server's own event loop, took 11.9 s against 6.2 split.
PANEL_SLACK = 1.125

# A prefill chunk whose tokens read at most this many keys in all (layers.prefill_keys: a prompt of up
# to 1024 tokens from its start) goes through the native layers, each token a row attending to its
# prefix on the decode kernel; longer ones attend through SDPA on the torch layers, which reads each
# key once for all of a chunk's queries. A prompt of 128 / 512 / 1024 tokens over the 360M F32 file:
# 427-433 / 1825-1843 / 4091-4330 ms as rows against 464-473 / 2092-2138 / 4367-4935 on the torch
# layers; 2000 tokens 10.2 s against 9.3-9.6; over the 1.7B Q4_K_M 512 tokens 3.6-3.9 s against
# 4.4-5.5, 1024 level (8.9-9.1 against 8.9-9.4; two Zen 4 threads). The torch layers keep their own,
# smaller bound for attention as rows (layers.SHORT_PREFILL_KEYS).
PREFILL_KEYS = 1 << 20

# A step's rows go through the layers in passes of at most this many (a thread's own, where threads
# carry their own rows; decoder_layer.cpp's decoder_layers), which bounds the intermediates kept
# (~150 KB a row for a 1.7B model). decode_forward.py's step of 64 prompts of 21 tokens over the 360M
# F32 file took 4.36-4.82 s at 128 rows a thread, 4.47 at 64, 4.46-4.64 at 256 and all rows at once
# (runs apart, noise ~10%; two Zen 4 threads), 4.9-5.0 s with the team sharing each pass.
PASS_ROWS = 128

# Threads carry their own rows only where no share is more than this times an even one: a share
# ends where a sequence starts, and a 1000-token prompt beside a few decode rows would be one
# thread's work alone.
SPLIT_SHARE_SLACK = 1.5

# Where threads carry their own rows, one whose share is done takes half the rows another still
# carries, for the layers after the one in flight (decoder_layer.cpp), where each half holds at
# least this many. Fewer rows would stream a layer's weights for too little arithmetic (a 1.7B F32
# layer's weights take ~30 ms to stream on one Zen 3 core, 16 of its rows ~27 ms to compute): the
# taker would finish after the thread it helped.
TAKE_ROWS = 16


MAX_PARTS = 4  # decoder_layer.cpp's: the parts a product's weights may have (AFMoE's q, gates, k, v)


class _Part(ctypes.Structure):  # decoder_layer.cpp's Weights::Part
    _fields_ = [("data", _pointer), ("format", _int64), ("rows", _int64)]


class _Weights(ctypes.Structure):  # decoder_layer.cpp's Weights
    _fields_ = [("parts", _int64), ("part", _Part * MAX_PARTS)]


class _Experts(ctypes.Structure):  # decoder_layer.cpp's Experts
    _fields_ = [(name, _pointer) for name in ("router", "gate_up", "down", "router_bias", "gate_up_bias", "down_bias",
                                              "selection_bias", "shared_gate_up", "shared_down", "shared_gate",
                                              "expert_scales", "route_norm", "pre_norm", "post_norm", "dense_norm",
                                              "latent_down", "latent_up")]
    _fields_ += [(name, _int64) for name in ("count", "top_k", "normalize", "activation", "shared_intermediate",
                                              "sigmoid", "beside", "intermediate", "latent")]
    _fields_ += [(name, _double) for name in ("alpha", "limit", "routed_scale")]
    _fields_ += [("weights_inputs", _int64), ("shared_scale", _double)]


class _Layer(ctypes.Structure):  # decoder_layer.cpp's Layer<T, C>
    _fields_ = [(name, _pointer) for name in (
        "input_norm", "input_norm_bias", "post_norm", "post_norm_bias", "qkv", "qkv_bias", "out", "out_bias", "up",
        "up_bias", "down", "down_bias", "q_norm", "k_norm", "attn_out_norm", "mlp_out_norm", "k_cache", "v_cache",
        "experts", "sinks", "conv", "conv_bias", "conv_cache", "delta", "mamba", "mamba_beside", "latent", "selective",
        "per_layer_gate", "per_layer_out", "per_layer_norm", "altup")]
    _fields_ += [(name, _int64) for name in (
        "hidden", "intermediate", "heads", "kv_heads", "dim", "window", "layer_norm", "activation", "window_angles",
        "rotates", "norms_across_heads", "conv_taps", "gated", "values_are_keys", "value_norm", "reads_kv",
        "per_layer_offset", "per_layer_width", "parallel", "norms_after_rotation")]
    _fields_ += [(name, _double) for name in ("eps", "scale", "softcap", "residual_scale", "layer_scale")]
    _fields_ += [("xielu", _double * 4), ("clip_qkv", _double), ("head_layer_norms", _int64), ("slopes", _pointer),
                 ("unscaled_queries", _int64)]


class _AltUpLayer(ctypes.Structure):  # decoder_layer.cpp's AltUpLayer
    _fields_ = [(name, _pointer) for name in (
        "router", "laurel_left", "laurel_right", "router_norm", "predict_coefs", "correct_coefs", "correct_scale",
        "laurel_norm")]
    _fields_ += [(name, _int64) for name in ("streams", "laurel_rank", "sparse")]
    _fields_ += [("cutoff_stds", _double)]


# Gemma 3n's AltUp streams the native layers take at most (decoder_layer.cpp's MOST_STREAMS)
MOST_STREAMS = 8


class _DeltaLayer(ctypes.Structure):  # decoder_layer.cpp's DeltaLayer
    _fields_ = [(name, _pointer) for name in (
        "z", "beta", "alpha", "conv", "dt_bias", "decay_rate", "norm", "conv_states", "states")]
    _fields_ += [(name, _int64) for name in ("key_heads", "heads", "key_dim", "value_dim", "taps", "grouped")]
    _fields_ += [("eps", _double)]


class _MambaLayer(ctypes.Structure):  # decoder_layer.cpp's MambaLayer
    _fields_ = [(name, _pointer) for name in (
        "conv", "conv_bias", "dt_bias", "decay", "skip", "norm", "conv_states", "states", "in_", "out")]
    _fields_ += [(name, _int64) for name in ("heads", "head_dim", "state_size", "groups", "taps")]
    _fields_ += [("eps", _double)]


class _SelectiveLayer(ctypes.Structure):  # decoder_layer.cpp's SelectiveLayer
    _fields_ = [(name, _pointer) for name in (
        "x_proj", "dt_proj", "conv", "conv_bias", "dt_bias", "decay", "skip", "dt_norm", "b_norm", "c_norm",
        "conv_states", "states")]
    _fields_ += [(name, _int64) for name in ("inner", "state_size", "rank", "taps", "normed")]
    _fields_ += [("eps", _double)]


class _LatentLayer(ctypes.Structure):  # decoder_layer.cpp's LatentLayer
    _fields_ = [(name, _pointer) for name in ("q_up", "kv_down", "k_up", "v_up", "q_norm", "kv_norm")]
    _fields_ += [(name, _int64) for name in ("q_rank", "kv_rank", "nope", "rope", "value")]
    _fields_ += [("eps", _double)]


class _Step(ctypes.Structure):  # decoder_layer.cpp's Step<T>
    _fields_ = [(name, _pointer) for name in (
        "cos", "sin", "window_cos", "window_sin", "query_scales", "per_layer_inputs", "slots", "tables", "lens",
        "samples", "shares", "starts", "state_slots")]
    _fields_ += [(name, _int64) for name in (
        "rows", "rotary_dim", "max_blocks", "block_size", "sampled", "parts", "panel_from", "pass_rows",
        "start_count", "take_rows", "taken", "window_rotary_dim", "per_layer_stride")]


class _Head(ctypes.Structure):  # decoder_layer.cpp's Head<T>
    _fields_ = [(name, _pointer) for name in ("norm", "norm_bias", "weight", "bias", "unembed")]
    _fields_ += [(name, _int64) for name in ("vocab", "layer_norm", "streams")]
    _fields_ += [("eps", _double)]


# decoder_layer.cpp's Activation: GPT-2's, Llama's, Gemma's, gpt-oss's experts', Nemotron-H's
GELU_TANH, SILU_GATED, GELU_TANH_GATED, CLAMPED_SWIGLU, RELU_SQUARED, GELU_ERF, XIELU = 0, 1, 2, 3, 4, 5, 6

KERNEL_ARGTYPES = [_pointer, ctypes.POINTER(_Layer), _int64, ctypes.POINTER(_Step), ctypes.POINTER(_Head), _pointer]


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _final_norm(model: Llama | Gemma | Olmo | Lfm2 | Qwen35 | GPT2) -> nn.Module:
    """The final norm (RMSNorm or LayerNorm): its weight is on the activations' device, in their
    dtype (the output layer's weight may be blocks)."""
    return model.ln_f if isinstance(model, GPT2) else model.norm


def _products(model: Llama | Gemma | Olmo | Lfm2 | GPT2) -> list:
    """Every linear layer a decode step runs: the layers' four products each (a router, and a shared
    expert's products, where a layer routes to experts, whose products moe.Experts or BlockExperts
    hold; LFM2's convolution's two in its attention's place), then the output layer."""
    if isinstance(model, Lfm2):
        layers = [m for b in model.layers for m in (
            (b.conv.in_proj, b.conv.out) if b.convolves else (b.attn.qkv, b.attn.out)) + _mlp_products(b.mlp)]
    elif isinstance(model, Qwen35):
        layers = [m for b in model.layers for m in (
            (b.mixer.qkv, b.mixer.z, b.mixer.beta, b.mixer.alpha, b.mixer.out) if b.recurrent
            else (b.mixer.qkv, b.mixer.out)) + _mlp_products(b.mlp)]
    elif isinstance(model, FalconH1):
        layers = [m for b in model.layers for m in (b.attn.qkv, b.attn.out, *_mixer_products(b.mamba),
                                                    *_mlp_products(b.mlp))]
    elif isinstance(model, GraniteHybrid):
        layers = [m for b in model.layers for m in (
            _mixer_products(b.mamba) if b.recurrent else (b.attn.qkv, b.attn.out)) + _mlp_products(b.mlp)]
    elif isinstance(model, (Llama, Olmo)):
        layers = [m for b in model.layers for m in (b.attn.qkv, b.attn.out, *_mlp_products(b.mlp))]
    elif isinstance(model, DeepSeek):  # (its heads' own matrices beside: HeadProducts or BlockHeadProducts)
        layers = [m for b in model.layers for m in (
            *(p for p in (b.attn.q, b.attn.q_down, b.attn.q_up) if p is not None), b.attn.kv_down, b.attn.out,
            *_mlp_products(b.mlp))]
    elif isinstance(model, Gemma):
        layers = [m for b in model.layers for m in (b.attn.qkv, b.attn.out, b.gate_up, b.down)]
    elif isinstance(model, Mamba):
        layers = [m for b in model.layers for m in _mixer_products(b.mixer)]
    elif isinstance(model, Gemma3n):
        layers = [m for b in model.layers for m in (b.attn.qkv, b.attn.out, b.gate_up, b.down, b.per_layer_gate,
                                                    b.per_layer_out, b.altup.router, b.laurel_left, b.laurel_right)]
        layers += list(model.altup_unembed)
    elif isinstance(model, Gemma4):
        layers = [m for b in model.layers for m in (b.attn.qkv, b.attn.out, b.gate_up, b.down,
                                                    *((b.per_layer_gate, b.per_layer_out)
                                                      if model.spec.per_layer_width else ()),
                                                    *((b.moe.router,) if b.moe is not None else ()))]
    else:
        layers = [m for b in model.layers for m in (b.qkv, b.attn_out, b.fc, b.proj)]
    return layers + [model.lm_head]


def _mixer_products(mixer: nn.Module) -> tuple:
    """A Mamba2 or Mamba mixer's linear layers: its input and output products, and Mamba's x and dt products."""
    return (mixer.in_proj, mixer.out) + ((mixer.x_proj, mixer.dt_proj) if isinstance(mixer, MambaMixer) else ())


def _mlp_products(mlp: nn.Module | None) -> tuple:
    """An MLP's linear layers: a SwiGLU's two, a squared ReLU's two, a mixture's (_moe_products), or none
    (a Nemotron-H block without an MLP)."""
    if mlp is None:
        return ()
    return _moe_products(mlp) if isinstance(mlp, SparseMoE) else (_up_product(mlp), mlp.down)


def _mlp_fields(mlp: nn.Module | None, spec) -> tuple:
    """A layer's MLP as the native layer takes it: (up product, down product, width, activation); a mixture's
    products are its experts' (DecoderLayers._route), a block without an MLP has none (width 0)."""
    if isinstance(mlp, SparseMoE):
        return None, None, mlp.spec.intermediate_size, SILU_GATED
    if mlp is None:
        return None, None, 0, SILU_GATED
    activation = (RELU_SQUARED if isinstance(mlp, SquaredReLU) else GELU_ERF if isinstance(mlp, ExactGeluMLP) else
                  XIELU if isinstance(mlp, XieluMLP) else GELU_TANH if isinstance(mlp, GeluMLP) else SILU_GATED)
    return _up_product(mlp), mlp.down, spec.intermediate_size, activation


def _up_product(mlp: nn.Module) -> nn.Module:
    """An MLP's first product: a SwiGLU's gate and up rows, an ungated MLP's up."""
    return mlp.up if isinstance(mlp, UngatedMLP) else mlp.gate_up


def _moe_products(moe: SparseMoE) -> tuple:
    """A mixture's linear layers besides its experts' stacks: its router, its shared expert's, and a latent
    mixture's projections."""
    latent = () if moe.latent_down is None else (moe.latent_down, moe.latent_up)
    return (moe.router, *(() if moe.shared is None else _shared_products(moe.shared)), *latent)


def _shared_products(shared: nn.Module) -> tuple:
    """A shared expert's products: its up (a SwiGLU's gate and up rows), down, and its one-row router where it
    has one (Qwen2-MoE's)."""
    gate = getattr(shared, "gate", None)
    return (_up_product(shared), shared.down, *(() if gate is None else (gate,)))


def _reads_float32(model: Llama | GPT2) -> bool:
    """Whether every product of ``model`` reads float32 weights (a Hugging Face model in float32, a
    GGUF file's F32 matrices)."""
    floats = (FLOAT32, FLOAT32_PADDED)
    return all(all(f in floats for f in m.formats) if isinstance(m, BlockLinear) else m.weight.dtype == torch.float32
               for m in _products(model))


def computed_rows(rows: int) -> int:
    """The rows float32 products compute for ``rows`` rows that go through the layers in passes of
    PASS_ROWS (cpu_linear.h's panel_computed_rows for each pass: a panel's zero rows included)."""
    panel_rows = native.library().loom_float_panel_rows
    if panel_rows.argtypes is None:  # the same object on every getattr: set once
        panel_rows.argtypes, panel_rows.restype = [_int64], _int64
    whole, left = divmod(rows, PASS_ROWS)
    return whole * panel_rows(PASS_ROWS) + (panel_rows(left) if left else 0)


def _weights(linear: CpuLinear | BlockLinear) -> _Weights:
    """What a product reads: the float weight (format 0), or each part's blocks."""
    if isinstance(linear, BlockLinear):
        parts = [_Part(blocks.data_ptr(), format, rows) for blocks, format, rows in linear.parts()]
    else:
        parts = [_Part(linear.weight.data_ptr(), 0, linear.out_features)]
    return _Weights(len(parts), (_Part * MAX_PARTS)(*parts))


def _head_weights(products: HeadProducts | BlockHeadProducts) -> _Weights:
    """What a stack of a matrix a head reads: one part, every head's rows, in the file's blocks or float (format 0)."""
    if isinstance(products, BlockHeadProducts):
        part = _Part(products.blocks.data_ptr(), products.format, products.heads * products.out_features)
    else:
        part = _Part(products.weight.data_ptr(), 0, products.weight.shape[0] * products.weight.shape[1])
    return _Weights(1, (_Part * MAX_PARTS)(part))


def _expert_weights(experts: Experts | BlockExperts, index: int) -> tuple[_Weights, _Weights]:
    """What expert ``index``'s gate/up and down products read: its rows of a file's stacks (two
    parts, gate and up, or its up alone where it has no gate, then one), or its float matrices (one part
    each, format 0)."""
    if isinstance(experts, BlockExperts):
        names = ("up",) if experts.squared_relu else ("gate", "up")
        first = [_Part(*experts.expert_rows(name, index)) for name in names]
        down = _Part(*experts.expert_rows("down", index))
        return _Weights(len(first), (_Part * MAX_PARTS)(*first)), _Weights(1, (_Part * MAX_PARTS)(down))
    gate_up, down = experts.gate_up[index], experts.down[index]
    return (_Weights(1, (_Part * MAX_PARTS)(_Part(gate_up.data_ptr(), 0, gate_up.shape[0]))),
            _Weights(1, (_Part * MAX_PARTS)(_Part(down.data_ptr(), 0, down.shape[0]))))


class DecoderLayers:
    def __init__(self, model: Llama | Gemma | Olmo | Lfm2 | GPT2):
        self.dtype = _final_norm(model).weight.dtype
        self.weights = []  # the modules, tensors and structures whose addresses the layers hold, kept alive
        layer = (self._gpt2_layer if isinstance(model, GPT2) else self._gemma_layer if isinstance(model, Gemma)
                 else self._gemma3n_layer if isinstance(model, Gemma3n)
                 else self._mamba_layer if isinstance(model, Mamba)
                 else self._gemma4_layer if isinstance(model, Gemma4)
                 else self._olmo_layer if isinstance(model, Olmo) else self._lfm2_layer if isinstance(model, Lfm2)
                 else self._qwen35_layer if isinstance(model, Qwen35)
                 else self._deepseek_layer if isinstance(model, DeepSeek)
                 else self._falcon_h1_layer if isinstance(model, FalconH1)
                 else self._granite_hybrid_layer if isinstance(model, GraniteHybrid) else self._llama_layer)
        layers = [layer(block, model.spec) for block in model.layers]
        # each layer's place in the pool: its K/V (kv_cache.layer), a convolution's rows (kv_cache.conv_layer)
        # or a recurrent layer's states (kv_cache.state_layer: a delta rule's or a Mamba2's)
        self.pool_places = [(_pool_kind(block), getattr(block, "pool_layer", i)) for i, block in enumerate(model.layers)]
        self.layers = (_Layer * len(layers))(*layers)
        # whether some layer rotates by the step's window angles (Gemma 3's local ones): forward() needs them
        self.needs_window_angles = any(layer.window_angles for layer in layers)
        self.head = self._head(model)
        self._pool = None  # the KV pool whose addresses the layers hold (kept: its id is not reused)
        # the model's panel threshold (cpu_linear.measure_panel_rows), for its float products
        self.panel_rows = next((m.panel_rows for m in _products(model) if isinstance(m, CpuLinear)),
                               default_panel_rows())
        # from how many rows each thread carries its own through the layers
        avx2 = native.library().loom_vector_bytes() == 32
        routes = any(isinstance(getattr(block, "mlp", None), SparseMoE) or getattr(block, "moe", None) is not None
                     for block in model.layers)
        self.split_rows = EXPERT_SPLIT_ROWS_PER_THREAD if routes else SPLIT_ROWS_PER_THREAD
        # whether the threads' own rows may compute no more panel rows than the team's (PANEL_SLACK)
        self.weighs_panels = avx2 and _reads_float32(model)
        self.taken_rows = 0  # rows that threads took from each other, over every step so far

    def _llama_layer(self, block, spec, mixer: tuple | None = None) -> _Layer:
        """``mixer``: the two products in the attention's place (LFM2's convolution's, a Mamba2's; None: the
        attention's)."""
        attn = block.attn
        qkv, out = mixer or (attn.qkv, attn.out)
        up, down, inner, activation = _mlp_fields(block.mlp, spec)
        layer = self._layer((block.input_norm, block.post_norm), qkv, out, up, down,
                            (None, None, None, None) if mixer else (attn.q_norm, attn.k_norm,
                                                                    getattr(block, "attn_out_norm", None),
                                                                    getattr(block, "mlp_out_norm", None)),
                            hidden=spec.hidden_size, intermediate=inner, heads=spec.num_heads,
                            kv_heads=spec.num_kv_heads, dim=spec.head_dim, window=kernel_window(block.window),
                            activation=activation, rotates=block.rotates,
                            norms_across_heads=not mixer and attn.norms_across_heads, eps=spec.rms_norm_eps,
                            scale=1.0 if mixer else attn.scale, residual_scale=spec.residual_scale,
                            layer_norm=isinstance(block.input_norm, nn.LayerNorm),
                            parallel=getattr(block, "parallel", False),  # (Llama's blocks': LFM2's have none)
                            norms_after_rotation=not mixer and attn.norms_after_rotation,
                            gated=not mixer and attn.gated,  # (AFMoE's gates between its queries and keys)
                            clip_qkv=0.0 if mixer else attn.clip or 0.0,  # (OLMo 1.7's)
                            # (StableLM 2 12B's, Command R+'s)
                            head_layer_norms=not mixer and isinstance(attn.q_norm, HeadLayerNorm))
        if isinstance(block.mlp, XieluMLP):  # (Apertus's: its layer's own four numbers)
            layer.xielu = (ctypes.c_double * 4)(*block.mlp.factors())
        self._route(layer, block.mlp)
        layer.sinks = None if mixer else self._in_dtype(attn.sinks)
        layer.slopes = None if mixer else self._in_dtype(getattr(attn, "slopes", None))  # (BLOOM's, MPT's ALiBi)
        layer.unscaled_queries = not getattr(block, "scales_queries", True)  # (Llama 4's rotating layers)
        return layer

    def _lfm2_layer(self, block, spec) -> _Layer:
        """An attention layer as Qwen3's; a convolution layer with its input and output products in
        the q/k/v's and the output's places, its taps (and their bias) in the layers' dtype."""
        if not block.convolves:
            return self._llama_layer(block, spec)
        conv = block.conv
        layer = self._llama_layer(block, spec, mixer=(conv.in_proj, conv.out))
        layer.conv, layer.conv_bias, layer.conv_taps = self._in_dtype(conv.weight), self._in_dtype(conv.bias), spec.conv_size
        return layer

    def _qwen35_layer(self, block, spec) -> _Layer:
        """A delta-rule layer: its qkv and output products in the attention's, its other products,
        parameters (in the layers' dtype) and states in a DeltaLayer; an attention layer: Qwen3's, gated."""
        mixer, d = block.mixer, spec.delta
        up, down, inner, activation = _mlp_fields(block.mlp, spec)
        layer = self._layer((block.input_norm, block.post_norm), mixer.qkv, mixer.out, up, down,
                            (None, None, None, None) if block.recurrent else (mixer.q_norm, mixer.k_norm, None, None),
                            hidden=spec.hidden_size, intermediate=inner, heads=spec.num_heads,
                            kv_heads=spec.num_kv_heads, dim=spec.head_dim, activation=activation,
                            eps=spec.rms_norm_eps, scale=1.0 if block.recurrent else mixer.scale,
                            gated=not block.recurrent)
        self._route(layer, block.mlp)
        if block.recurrent:
            products = [_weights(m) for m in (mixer.z, mixer.beta, mixer.alpha)]
            delta = _DeltaLayer(*(ctypes.addressof(w) for w in products),
                                *(self._in_dtype(t) for t in (mixer.conv, mixer.dt_bias, mixer.decay, mixer.norm.weight)),
                                None, None, d.key_heads, d.value_heads, d.key_dim, d.value_dim, d.conv_size,
                                d.grouped, mixer.norm.eps)
            self.weights.append((mixer, products, delta))
            layer.delta = ctypes.addressof(delta)
        return layer

    def _granite_hybrid_layer(self, block, spec) -> _Layer:
        """An attention layer as Granite's; a Mamba2 layer with its input and output products in the q/k/v's
        and the output's places, its parameters (in the layers' dtype) and states in a MambaLayer (Jamba's Mamba
        layer: in a SelectiveLayer)."""
        if not block.recurrent:
            return self._llama_layer(block, spec)
        layer = self._llama_layer(block, spec, mixer=(block.mamba.in_proj, block.mamba.out))
        if isinstance(block.mamba, MambaMixer):
            layer.selective = self._selective(block.mamba)
        else:
            layer.mamba = self._mamba(block.mamba, spec.mamba)
        return layer

    def _falcon_h1_layer(self, block, spec) -> _Layer:
        """Llama's layer with a Mamba2 beside its attention: the Mamba2's own products, parameters and states in a
        MambaLayer."""
        layer = self._llama_layer(block, spec)
        layer.mamba_beside = self._mamba(block.mamba, spec.mamba, (block.mamba.in_proj, block.mamba.out))
        return layer

    def _mamba_layer(self, block, spec) -> _Layer:
        """Mamba's layer: its norm, its mixer's input and output products in the q/k/v's and the output's places, its
        other products, parameters (in the layers' dtype) and states (set where the pool is bound) in a
        SelectiveLayer; no MLP."""
        mixer = block.mixer
        layer = self._layer((block.norm, None), mixer.in_proj, mixer.out, None, None, (None, None, None, None),
                            hidden=spec.hidden_size, eps=spec.rms_norm_eps)
        layer.selective = self._selective(mixer)
        return layer

    def _selective(self, mixer: MambaMixer) -> int:
        """The address of a Mamba mixer's SelectiveLayer: its x and dt products, its parameters (and its time step's,
        B's and C's norm weights: Jamba's) in the layers' dtype; its states set where the pool is bound."""
        m = mixer.spec
        products = [_weights(p) for p in (mixer.x_proj, mixer.dt_proj)]
        norms = [n.weight for n in mixer.step_norms] if mixer.step_norms is not None else [None] * 3
        selective = _SelectiveLayer(*(ctypes.addressof(w) for w in products),
                                    *(self._in_dtype(t) for t in (mixer.conv, mixer.conv_bias, mixer.dt_proj.bias,
                                                                  mixer.decay, mixer.skip, *norms)),
                                    None, None, m.intermediate_size, m.state_size, m.time_step_rank, m.conv_size,
                                    m.dt_b_c_eps is not None, m.dt_b_c_eps or 0.0)
        self.weights.append((mixer, products, selective))
        return ctypes.addressof(selective)

    def _mamba(self, mixer, m, products: tuple = ()) -> int:
        """The address of a Mamba2 mixer's MambaLayer: its parameters in the layers' dtype, its ``products`` (input,
        output) where it has its own beside an attention; its states set where the pool is bound."""
        weights = [_weights(p) for p in products]
        own = [ctypes.addressof(w) for w in weights] or [None, None]
        mamba = _MambaLayer(*(self._in_dtype(t) for t in (mixer.conv, mixer.conv_bias, mixer.dt_bias, mixer.decay,
                                                           mixer.skip, mixer.norm)),
                            None, None, *own, m.heads, m.head_dim, m.state_size, m.groups, m.conv_size, m.eps)
        self.weights.append((mamba, weights))
        return ctypes.addressof(mamba)

    def _deepseek_layer(self, block, spec) -> _Layer:
        """DeepSeek's latent attention: its queries' product (or their low rank's) and its output product in the
        attention's places, one key head of the pool's width (spec.head_dim), its other products, norms and
        widths in a LatentLayer; its MLP as Llama's."""
        attn = block.attn
        up, down, inner, activation = _mlp_fields(block.mlp, spec)
        layer = self._layer((block.input_norm, block.post_norm), attn.q if attn.q is not None else attn.q_down,
                            attn.out, up, down, (None, None, None, None), hidden=spec.hidden_size,
                            intermediate=inner, heads=spec.num_heads, kv_heads=1, dim=spec.head_dim,
                            activation=activation, eps=spec.rms_norm_eps, scale=attn.scale,
                            residual_scale=spec.residual_scale)  # (MiniCPM3's)
        self._route(layer, block.mlp)
        products = [None if m is None else _weights(m) for m in (attn.q_up, attn.kv_down)]
        products += [_head_weights(attn.k_up), _head_weights(attn.v_up)]
        latent = _LatentLayer(*(None if w is None else ctypes.addressof(w) for w in products),
                              self._factors(attn.q_norm), self._factors(attn.kv_norm), spec.q_lora_rank or 0,
                              spec.kv_lora_rank, spec.nope_dim, spec.rope_dim, spec.value_dim, spec.latent_norm_eps)
        self.weights.append((attn, products, latent))
        layer.latent = ctypes.addressof(latent)
        return layer

    def _route(self, layer: _Layer, mlp: nn.Module | None) -> None:
        """A layer whose MLP routes to experts (or that has experts beside it: Gemma 4's) reads them from an Experts
        description (_experts)."""
        if isinstance(mlp, (SparseMoE, MixtureBeside)):
            layer.experts = ctypes.addressof(self._experts(mlp))

    def _in_dtype(self, tensor: torch.Tensor | None) -> int | None:
        """The address of ``tensor`` in the layers' dtype (a copy kept alive here where it is not), or None."""
        if tensor is None:
            return None
        tensor = tensor.detach().to(self.dtype).contiguous()
        self.weights.append(tensor)
        return tensor.data_ptr()

    def _experts(self, moe: SparseMoE | MixtureBeside) -> _Experts:
        """The native description of a layer's router and experts, kept alive here (their width is
        the layer's intermediate size; Gemma 4's beside its MLP, theirs: moe.spec's)."""
        s = moe.spec
        router = _weights(moe.router)
        each = [_expert_weights(moe.experts, i) for i in range(s.num_experts)]
        gate_up = (_Weights * s.num_experts)(*(g for g, _ in each))
        down = (_Weights * s.num_experts)(*(d for _, d in each))
        shared_expert = getattr(moe, "shared", None)
        shared = [_weights(m) for m in (() if shared_expert is None else _shared_products(shared_expert))]
        shared += [None] * (3 - len(shared))
        alpha, limit = s.clamped_swiglu or (0.0, 0.0)
        activation = (RELU_SQUARED if s.squared_relu else GELU_TANH_GATED if s.gelu else
                      SILU_GATED if s.clamped_swiglu is None else CLAMPED_SWIGLU)
        beside = isinstance(moe, MixtureBeside)  # (its norms and scales; its route norm the scale over sqrt(hidden))
        norms = [self._in_dtype(moe.expert_scales), self._in_dtype(moe.router_scale * moe.root),
                 *(self._factors(n) for n in (moe.pre_norm, moe.post_norm, moe.dense_norm))] if beside else [None] * 5
        # a latent mixture's projections into its space and back (MoESpec.latent_size)
        latent = [None if m is None else _weights(m) for m in (getattr(moe, "latent_down", None),
                                                                getattr(moe, "latent_up", None))]
        address = lambda w: None if w is None else ctypes.addressof(w)
        experts = _Experts(ctypes.addressof(router), ctypes.addressof(gate_up), ctypes.addressof(down),
                           self._in_dtype(moe.router.bias), self._in_dtype(moe.experts.gate_up_bias),
                           self._in_dtype(moe.experts.down_bias), self._in_dtype(getattr(moe, "selection_bias", None)),
                           *map(address, shared), *norms, *map(address, latent), s.num_experts,
                           s.top_k, s.normalize, activation, s.shared_intermediate_size, s.sigmoid, beside,
                           s.intermediate_size if beside else 0, s.latent_size, alpha, limit, s.routed_scale,
                           s.weights_inputs, s.shared_scale)
        self.weights.append((moe, router, gate_up, down, shared, latent, experts))
        return experts

    def _gemma_layer(self, block, spec) -> _Layer:
        """Its pre-MLP norm where Llama's post-attention norm is; Gemma 3's layers with a window rotate
        by the local angles (the step's window angles)."""
        attn = block.attn
        return self._layer((block.input_norm, block.pre_mlp_norm), attn.qkv, attn.out, block.gate_up, block.down,
                           (attn.q_norm, attn.k_norm, block.post_attn_norm, block.post_mlp_norm),
                           hidden=spec.hidden_size, intermediate=spec.intermediate_size, heads=spec.num_heads,
                           kv_heads=spec.num_kv_heads, dim=spec.head_dim, window=kernel_window(block.window),
                           activation=GELU_TANH_GATED,
                           window_angles=block.window is not None and spec.local_theta is not None,
                           eps=spec.rms_norm_eps, scale=attn.scale, softcap=attn.softcap or 0.0)

    def _gemma4_layer(self, block, spec) -> _Layer:
        """Gemma's layer with norms of their own weight, unscaled attention over the layer's own heads (a global
        layer's wider), values normed without a weight (a global layer's its keys, where the model says), a layer
        reading another's K/V storing none; the sliding-window layers rotate by the step's window angles (their
        narrower heads'); its per-layer input's products and norm, and its output's scale."""
        attn = block.attn
        layer = self._layer((block.input_norm, block.pre_mlp_norm), attn.qkv, attn.out, block.gate_up, block.down,
                            (attn.q_norm, attn.k_norm, block.post_attn_norm, block.post_mlp_norm),
                            hidden=spec.hidden_size, intermediate=block.down.in_features, heads=spec.num_heads,
                            kv_heads=attn.kv_heads, dim=attn.head_dim, window=kernel_window(block.window),
                            activation=GELU_TANH_GATED, window_angles=block.window is not None,
                            values_are_keys=attn.values_are_keys, value_norm=True, reads_kv=attn.shares,
                            eps=spec.rms_norm_eps, scale=1.0, layer_scale=float(getattr(block, "scalar", 1.0)))
        if spec.per_layer_width:
            products = [_weights(m) for m in (block.per_layer_gate, block.per_layer_out)]
            self.weights.append((block.per_layer_gate, block.per_layer_out, products))
            layer.per_layer_gate, layer.per_layer_out = (ctypes.addressof(w) for w in products)
            layer.per_layer_norm = self._factors(block.per_layer_norm)
            layer.per_layer_offset, layer.per_layer_width = block.index * spec.per_layer_width, spec.per_layer_width
        self._route(layer, getattr(block, "moe", None))
        return layer

    def _gemma3n_layer(self, block, spec) -> _Layer:
        """Gemma 4's layer (its E-sizes' kind: Gemma 3n's block has no scalar, no experts) on AltUp's active stream,
        with Laurel beside its attention and its MLP's gate cut where the layer is sparse (an AltUpLayer)."""
        layer = self._gemma4_layer(block, spec)
        altup = block.altup
        products = [_weights(m) for m in (altup.router, block.laurel_left, block.laurel_right)]
        described = _AltUpLayer(*(ctypes.addressof(w) for w in products), self._factors(altup.router_norm),
                                *(self._in_dtype(t) for t in (altup.predict_coefs, altup.correct_coefs)),
                                self._in_dtype(altup.correct_scale) if block.scales_correction else None,
                                self._factors(block.laurel_norm), spec.altup_inputs, spec.laurel_rank,
                                block.cutoff_stds is not None, block.cutoff_stds or 0.0)
        self.weights.append((products, described))
        layer.altup = ctypes.addressof(described)
        return layer

    def _olmo_layer(self, block, spec) -> _Layer:
        """No norm before the attention or the MLP, their outputs' norms where Gemma's are; the
        queries' and keys' norms across all heads (EXAONE 4's a head at a time); the layers with a
        window rotate by the window angles where those differ (OLMo 3's long-context global rope);
        EXAONE 4's global layers, where some slide, without rotary."""
        attn = block.attn
        return self._layer((None, None), attn.qkv, attn.out, block.mlp.gate_up, block.mlp.down,
                           (attn.q_norm, attn.k_norm, block.post_attn_norm, block.post_mlp_norm),
                           hidden=spec.hidden_size, intermediate=spec.intermediate_size, heads=spec.num_heads,
                           kv_heads=spec.num_kv_heads, dim=spec.head_dim, window=kernel_window(block.window),
                           activation=SILU_GATED, window_angles=block.window is not None and spec.local_rotation,
                           rotates=block.rotates, norms_across_heads=attn.norms_across_heads, eps=spec.rms_norm_eps,
                           scale=attn.scale)

    def _gpt2_layer(self, block, spec) -> _Layer:
        return self._layer((block.ln1, block.ln2), block.qkv, block.attn_out, block.fc, block.proj,
                           (None, None, None, None), hidden=spec.hidden_size, intermediate=spec.inner_size,
                           heads=block.heads, kv_heads=block.kv_heads, dim=block.dim, layer_norm=True,
                           activation=GELU_TANH, eps=spec.eps, scale=block.dim ** -0.5)

    def _factors(self, norm: nn.Module | None) -> int | None:
        """The address of what a norm multiplies by: its weight, or Gemma's 1 + weight (a float32
        copy made now, kept alive here: a Gemma norm's weight changed after load would need the
        layers made again)."""
        if norm is None:
            return None
        if isinstance(norm, RMSNorm) and norm.offset:
            factors = norm.offset + norm.weight.float()
            self.weights.append(factors)
            return factors.data_ptr()
        return norm.weight.data_ptr()

    def _head(self, model: Llama | Gemma | Olmo | GPT2) -> _Head:
        """The final norm and output layer (Gemma 3n's streams merged first, through its unembed products)."""
        norm, output = _final_norm(model), model.lm_head
        weights = _weights(output)
        unembed = list(getattr(model, "altup_unembed", ()))
        unembed_weights = (_Weights * max(1, len(unembed)))(*(_weights(m) for m in unembed))
        self.weights.append((output, weights, unembed_weights))
        return _Head(self._factors(norm), _address(getattr(norm, "bias", None)), ctypes.addressof(weights),
                     _address(output.bias), ctypes.addressof(unembed_weights) if unembed else None,
                     output.out_features, isinstance(norm, nn.LayerNorm), len(unembed) + 1, norm.eps)

    def _layer(self, norms, qkv, out, up, down, other_norms, rotates=True, residual_scale=1.0, layer_scale=1.0,
               **shape) -> _Layer:
        """``norms``: the input norm and the one before the MLP (their biases, LayerNorm's, too; None
        where the layer has none: OLMo's); ``other_norms``: the query and key norms (a head's, or all
        heads' with norms_across_heads), and the attention's and MLP's output norms (None where the
        model has none); ``shape``: the layer's other fields by name (those not
        given 0: no window, RMSNorm, no window angles, no soft cap)."""
        products = (qkv, out, up, down)  # (up and down None where the layer routes to experts)
        weights = [None if m is None else _weights(m) for m in products]
        self.weights.append((products, weights))  # the modules hold the tensors, the structures their addresses
        pointers = (*(a for n in norms for a in (self._factors(n), _address(getattr(n, "bias", None)))),
                    *(a for m, w in zip(products, weights)
                      for a in ((None, None) if m is None else (ctypes.addressof(w), _address(m.bias)))),
                    *map(self._factors, other_norms))
        return _Layer(*pointers, None, None, None, None, None, None, None, rotates=rotates,
                      residual_scale=residual_scale, layer_scale=layer_scale, **shape)

    @classmethod
    def of(cls, model) -> "DecoderLayers | None":
        """The native layers for ``model``, or None where it does not qualify (see the module's doc)."""
        if not isinstance(model, (Llama, Gemma, Gemma4, Olmo, Lfm2, Qwen35, GraniteHybrid, DeepSeek, GPT2, Mamba)):
            return None
        if isinstance(model, Gemma3n) and model.spec.altup_inputs > MOST_STREAMS:
            return None
        moe = getattr(model.spec, "moe", None)
        if moe is not None and moe.groups is not None:
            return None  # (group-limited routing, DeepSeek's and Nemotron 3's: the torch layers')
        weight = _final_norm(model).weight
        if not native.supports(weight.device, weight.dtype):
            return None
        if isinstance(model, (Gemma, Qwen35)) and weight.dtype != torch.float32:  # their norms round to float32 whatever
            return None                                                           # the dtype
        return cls(model) if all(isinstance(m, (CpuLinear, BlockLinear)) for m in _products(model)) else None

    def serves(self, step, kv_cache) -> bool:
        """Decode rows and prefill chunks that attend a row per token within PREFILL_KEYS, and a KV
        pool of a dtype the kernels read. Longer chunks attend through SDPA on the torch layers."""
        return (len(step.input_ids) > 0 and all(prefill_keys(chunk) <= PREFILL_KEYS for chunk in step.prefills)
                and native.supports(step.input_ids.device, self.dtype, kv_cache.dtype))

    def splits(self, step, threads: int, kv_cache) -> bool:
        """Whether ``threads`` threads would each carry their own rows of ``step`` through the layers."""
        return self.serves(step, kv_cache) and self._shares(step, threads) is not None

    def _shares(self, step, threads: int) -> list[int] | None:
        """Where each of ``threads`` threads' own rows of ``step`` (a step the layers serve) begin,
        then the step's end, if they would carry them through the layers alone: enough rows a thread,
        and shares about even. A share ends where a sequence starts (its rows read each other's K/V),
        the first from an even cut on, so a long chunk beside a few decode rows (one thread's alone)
        runs on the team."""
        rows = len(step.input_ids)
        if threads < 2 or rows < self.split_rows * threads:
            return None
        starts = step.sequence_starts()

        def share_start(row: int) -> int:
            i = bisect.bisect_left(starts, row)
            return starts[i] if i < len(starts) else rows

        cuts = [0]
        for t in range(1, threads):
            cuts.append(max(cuts[-1], share_start(rows * t // threads)))
        cuts.append(rows)
        widest = max(end - first for first, end in zip(cuts, cuts[1:]))
        if widest > SPLIT_SHARE_SLACK * rows / threads:
            return None
        if self.weighs_panels and computed_rows(widest) * threads > PANEL_SLACK * computed_rows(rows):
            return None
        return cuts

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, kv_cache,
                step, window_angles: tuple[torch.Tensor, torch.Tensor] | None = None,
                query_scales: torch.Tensor | None = None, per_layer_inputs: torch.Tensor | None = None) -> torch.Tensor:
        """The logits of a step's sampled rows (a step serves() takes): every layer, the final norm
        and the output layer. x is the embedded input (overwritten); cos and sin the rotary angles
        (None for GPT-2); ``window_angles`` those of the layers with a sliding window, where they
        differ (Gemma 3's local layers; Gemma 4's, of narrower heads); ``query_scales`` each row's query
        scale, in x's dtype (Ministral 3's temperature; None: 1); ``per_layer_inputs`` Gemma 4's, [rows,
        layers, width]. One forward at a time (the engine's loop thread): the layers hold the pool's
        addresses."""
        rows = x.shape[0]
        groups = step.decode_groups + ([chunk_rows(step.prefills)] if step.prefills else [])
        tables, lens = _padded_tables(groups)
        samples = step.sample_indices.contiguous()
        # where the threads' own rows begin, at this thread's OpenMP count (the kernel's team)
        cuts = self._shares(step, torch.get_num_threads())
        shares = None if cuts is None else torch.tensor(cuts, dtype=torch.int64)
        starts = None if cuts is None else torch.tensor(step.sequence_starts(), dtype=torch.int64)
        state_slots = None if step.state_slots is None else step.row_state_slots().contiguous()
        if cos is not None:
            cos, sin = cos.reshape(rows, -1).contiguous(), sin.reshape(rows, -1).contiguous()
        if self.needs_window_angles and (window_angles is None or window_angles[0].shape[0] != rows):
            raise ValueError("this model's sliding-window layers rotate by angles of their own: pass "
                             "window_angles of the step's rows")
        window_cos, window_sin = (None, None) if window_angles is None else (
            a.reshape(rows, -1).contiguous() for a in window_angles)
        # A step that verifies proposed tokens orders its rows by context length, a sequence's
        # last first: its rows go through the layers in one pass.
        pass_rows = rows if step.verifies else PASS_ROWS
        if query_scales is not None:
            query_scales = query_scales.to(x.dtype).contiguous()
        if per_layer_inputs is not None:
            per_layer_inputs = per_layer_inputs.to(x.dtype).reshape(rows, -1).contiguous()
        plan = _Step(_address(cos), _address(sin), _address(window_cos), _address(window_sin), _address(query_scales),
                     _address(per_layer_inputs), step.slot_mapping.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                     samples.data_ptr(), _address(shares), _address(starts), _address(state_slots), rows,
                     0 if cos is None else cos.shape[1], tables.shape[1], step.block_size, len(samples),
                     0 if cuts is None else len(cuts) - 1, self.panel_rows, pass_rows,
                     0 if starts is None else len(starts), TAKE_ROWS, 0,
                     0 if window_cos is None else window_cos.shape[1],
                     0 if per_layer_inputs is None else per_layer_inputs.shape[1])
        x = x.contiguous()
        if kv_cache is not self._pool:
            for layer, (kind, place) in zip(self.layers, self.pool_places):
                if kind == "conv":
                    layer.conv_cache = kv_cache.conv_layer(place).data_ptr()
                if kind in ("state", "both"):  # (a delta rule's or a Mamba2's, in the attention's place or beside it)
                    mixer = (_DeltaLayer.from_address(layer.delta) if layer.delta else
                             _SelectiveLayer.from_address(layer.selective) if layer.selective else
                             _MambaLayer.from_address(layer.mamba or layer.mamba_beside))
                    mixer.conv_states, mixer.states = (t.data_ptr() for t in kv_cache.state_layer(place))
                if kind in ("kv", "both"):
                    k_cache, v_cache = kv_cache.layer(place)
                    layer.k_cache, layer.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            self._pool = kv_cache
        logits = torch.empty(len(samples), self.head.vocab, dtype=x.dtype)
        kernel = native.function("loom_decoder_layers", self.dtype, KERNEL_ARGTYPES, kv_cache.dtype)
        kernel(x.data_ptr(), self.layers, len(self.layers), ctypes.byref(plan), ctypes.byref(self.head),
               logits.data_ptr())
        self.taken_rows += plan.taken
        return logits


def _pool_kind(block) -> str:
    """Where a block keeps its past in the pool: "kv", "conv" (LFM2's convolution rows), "state" (Qwen3.5's
    delta-rule states, Granite 4's Mamba2 states) or "both" (Falcon-H1's K/V and Mamba2 states, at one index)."""
    if getattr(block, "convolves", False):
        return "conv"
    if isinstance(getattr(block, "mixer", None), MambaMixer):  # (Mamba's: its states alone)
        return "state"
    if getattr(block, "attn", None) is not None and getattr(block, "mamba", None) is not None:
        return "both"
    return "state" if getattr(block, "recurrent", False) else "kv"


def _padded_tables(groups: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The block tables of a step's row groups (DecodeGroups, in the batch's order) as one, padded to the
    widest, and their lengths."""
    if len(groups) == 1:
        return groups[0].block_tables.contiguous(), groups[0].context_lens.contiguous()
    width = max(g.block_tables.shape[1] for g in groups)
    tables = torch.zeros(groups[-1].end, width, dtype=torch.int64)
    for g in groups:
        tables[g.start:g.end, :g.block_tables.shape[1]] = g.block_tables
    return tables, torch.cat([g.context_lens for g in groups])


def use_decoder_layers(model) -> None:
    """Give ``model`` its native layers (``model.decoder_layers``, which its forward asks first for
    decode-only steps) where it qualifies; None otherwise."""
    if isinstance(model, NativeDecoding):
        model.decoder_layers = DecoderLayers.of(model)
