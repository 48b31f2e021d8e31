"""Model implementations and ``load(source)``, which picks one by the checkpoint's model_type.

A model is an ``nn.Module`` whose ``forward(step, kv_cache)`` returns the logits of the step's
sampled positions, and which tells the engine its cache geometry: ``num_layers``,
``num_kv_heads``, ``head_dim``, ``vocab_size``, ``max_position`` (and ``conv_rows``, where some layers
keep a row a token instead of K/V, or ``state_shapes``, where some carry a state a sequence: models/step.py).
"""

from __future__ import annotations

import ctypes
import gc
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .checkpoints import gguf, huggingface
from .checkpoints.vision_language import TEXT_MODELS
from .families.deepseek import FAMILIES as DEEPSEEK_FAMILIES, DeepSeek, DeepSeekSpec
from .families.falcon_h1 import FAMILIES as FALCON_H1_FAMILIES, FalconH1, FalconH1Spec
from .families.gemma import Gemma, GemmaSpec
from .families.gemma3n import FAMILIES as GEMMA3N_FAMILIES, Gemma3n, Gemma3nSpec
from .families.gemma4 import FAMILIES as GEMMA4_FAMILIES, Gemma4, Gemma4Spec
from .families.gpt2 import GPT2, GPT2Spec
from .families.granite_hybrid import FAMILIES as GRANITE_HYBRID_FAMILIES, GraniteHybrid, GraniteHybridSpec
from .families.jamba import FAMILIES as JAMBA_FAMILIES, Jamba, JambaSpec
from .families.lfm2 import FAMILIES as LFM2_FAMILIES, Lfm2, Lfm2Spec
from .families.llama import Llama
from .families.llama_spec import FAMILIES as LLAMA_FAMILIES, LlamaSpec
from .families.mamba import FAMILIES as MAMBA_FAMILIES, Mamba, MambaSpec
from .families.nemotron_h import FAMILIES as NEMOTRON_H_FAMILIES, NemotronH, NemotronHSpec
from .families.olmo import FAMILIES as OLMO_FAMILIES, Olmo, OlmoSpec
from .families.qwen35 import FAMILIES as QWEN35_FAMILIES, Qwen35, Qwen35Spec
from .kernels import native
from .kernels.block_experts import use_stored_experts
from .kernels.block_heads import use_stored_heads
from .kernels.block_linear import use_block_linears, use_stored_blocks
from .kernels.cpu_linear import use_cpu_linears
from .kernels.decoder_layer import use_decoder_layers
from .kernels.quantized import BLOCK_WEIGHTS, check_weights, reduce_linears, runs_blocks

ARCHITECTURES = {"gpt2": (GPT2Spec, GPT2), "gpt_bigcode": (GPT2Spec, GPT2), "gemma": (GemmaSpec, Gemma),
                 "gemma2": (GemmaSpec, Gemma),
                 "gemma3_text": (GemmaSpec, Gemma),
                 **{family: (Gemma4Spec, Gemma4) for family in GEMMA4_FAMILIES},
                 **{family: (Gemma3nSpec, Gemma3n) for family in GEMMA3N_FAMILIES},
                 **{family: (LlamaSpec, Llama) for family in LLAMA_FAMILIES},
                 **{family: (OlmoSpec, Olmo) for family in OLMO_FAMILIES},
                 **{family: (Lfm2Spec, Lfm2) for family in LFM2_FAMILIES},
                 **{family: (Qwen35Spec, Qwen35) for family in QWEN35_FAMILIES},
                 **{family: (GraniteHybridSpec, GraniteHybrid) for family in GRANITE_HYBRID_FAMILIES},
                 **{family: (JambaSpec, Jamba) for family in JAMBA_FAMILIES},
                 **{family: (NemotronHSpec, NemotronH) for family in NEMOTRON_H_FAMILIES},
                 **{family: (FalconH1Spec, FalconH1) for family in FALCON_H1_FAMILIES},
                 **{family: (MambaSpec, Mamba) for family in MAMBA_FAMILIES},
                 **{family: (DeepSeekSpec, DeepSeek) for family in DEEPSEEK_FAMILIES}}


@dataclass
class Checkpoint:
    model: nn.Module
    eos_token_ids: frozenset[int]
    tokenizer: object | None = None
    name: str = "model"
    config: dict = field(default_factory=dict, repr=False)


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    """None picks float32 on CPU (half precision is slow there) and bfloat16 on CUDA."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        aliases = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
                   "fp64": "float64", "double": "float64"}
        resolved = getattr(torch, aliases.get(dtype, dtype), None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}; use float32, float16, bfloat16 or float64")
        dtype = resolved
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch dtype, got {dtype!r}")
    return dtype


def architecture(config: dict):
    """(spec type, module type) for a config's model_type, or a ValueError naming the supported ones."""
    kind = config.get("model_type")
    if kind not in ARCHITECTURES:
        raise ValueError(f"unsupported model_type {kind!r}; supported: {', '.join(sorted(ARCHITECTURES))} "
                         f"(and, for their text, {', '.join(TEXT_MODELS)})")
    return ARCHITECTURES[kind]


def build(config: dict, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
          weights: str = "float32", float_rows: bool = False, owned: bool = False) -> nn.Module:
    """Our module for a transformers-style config and state dict, its weights cast to ``dtype``
    (``weights`` other than "float32": its linear layers' weights in fewer bits, see kernels/quantized.py).
    With ``float_rows``, float matrices are kept as they are (a GGUF file's F32, F16 and BF16, read to
    keep its formats: views of the mapped file, or padded copies of it, gguf._pad_float32_rows). Takes
    the tensors: ``tensors`` is left empty, so that each part of a fused product is freed as soon as
    the fused copy exists (a model's worth of copies at once, otherwise). ``owned``: the tensors are
    copies made for this load (Contents.owned), kept as they are where in ``dtype`` on ``device``."""
    spec_type, model_type = architecture(config)
    _check_not_float8(config, tensors)
    spec = spec_type.from_hf(config)
    with torch.device("meta"):  # no time spent initialising weights that are about to be replaced
        model = model_type(spec)
    try:
        state = model_type.convert(_taken(tensors), spec)
    except KeyError as missing:
        raise ValueError(f"the {config['model_type']} checkpoint is missing tensor {missing.args[0]}") from None
    use_stored_blocks(model, state, float_rows)  # weights a checkpoint keeps in blocks run on them as they are
    use_stored_experts(model, state)  # and a GGUF mixture's expert stacks
    use_stored_heads(model, state, float_rows)  # and its stacks of a matrix a head (DeepSeek's)
    model.load_state_dict(_owned(state, device, dtype, copy=not owned), assign=True)
    if isinstance(getattr(model, "lm_head", None), nn.Linear):
        model.tie_embeddings()  # assign=True loaded the tied names as two tensors (blocks stay one)
    model = model.to(device).eval().requires_grad_(False)
    if weights in BLOCK_WEIGHTS:
        use_block_linears(model, BLOCK_WEIGHTS[weights])
    elif weights not in ("float32", "stored"):
        reduce_linears(model, weights)
    elif native.supports(device, dtype):  # builds the CPU kernels now (once per machine), not in the first step
        use_cpu_linears(model)
    use_decoder_layers(model)
    return model


# 8-bit float weights: a checkpoint's FP8 blocks (GLM-4.5-FP8's, DeepSeek-V3's, Nemotron 3's FP8 release), each
# matrix beside scales of its own (weight_scale_inv, weight_scale) that a cast to the model's dtype would leave out
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _check_not_float8(config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """A ValueError for a checkpoint whose weights are 8-bit floats, before any is read as if it were its values."""
    name = next((n for n, t in tensors.items() if getattr(t, "dtype", None) in FLOAT8), None)  # (a list: parts)
    if name is not None:
        method = (config.get("quantization_config") or {}).get("quant_method", "none named")
        raise ValueError(f"the {config['model_type']} checkpoint keeps its weights in 8-bit floats with scales of "
                         f"their own ({name}; quantization_config's quant_method: {method}), which Loom does not "
                         "read: load the model's BF16 checkpoint or a GGUF file of it")


def _owned(state: dict, device: torch.device, dtype: torch.dtype, copy: bool = True) -> dict:
    """``state``'s float tensors copied in ``dtype`` (never views: a view into a memory-mapped file
    would keep the file mapped, and its pages read while converting resident, as long as the model
    lives), one at a time, each original let go of as its copy is made; ``state`` is emptied. Without
    ``copy`` (tensors made for this load) one already in ``dtype`` on ``device`` is kept: the default
    model's float32 weights were copied once more, 0.19 s of its 0.8 s load."""
    owned = {}
    for name in list(state):
        tensor = state.pop(name)
        owned[name] = tensor.to(device=device, dtype=dtype, copy=copy) if tensor.is_floating_point() else tensor
    return owned


def _taken(tensors: dict) -> dict:
    """The tensors in a dict no one else holds (``tensors`` emptied): a converter that pops them
    then lets each go as it uses it."""
    taken = dict(tensors)
    tensors.clear()
    return taken


def load(source=None, *, device="cpu", dtype=None, weights=None) -> Checkpoint:
    """Load a checkpoint: None (the embedded default model), a Hugging Face directory, a .gguf
    file, or an in-memory transformers causal LM. ``weights``: "stored" (as the checkpoint holds
    them: a GGUF file's blocks where Loom's CPU kernels run them, float in ``dtype`` otherwise),
    "float32" (everything in ``dtype``), "int4", "int8", "float16" or "int8-dynamic" (linear layers
    in fewer bits on the CPU; see kernels/quantized.py). None: "stored", the embedded model's Q4_1
    blocks included (DEFAULT_WEIGHTS says why)."""
    checkpoint = _load(source, torch.device(device), dtype, weights)
    return_freed_memory()
    return checkpoint


def return_freed_memory() -> None:
    """Give the heap's free pages back to the system. Loading frees the file's tensors and their
    conversions; glibc keeps those pages, so without this the resident memory after a load with
    smaller weights stayed near float32's (997 against 502 MB for the default model in int4)."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator returns memory its own way
        pass


# The weights when none are asked for, the embedded model's included: its file's Q4_1 blocks decode
# 3.3-4.2x as fast as float32 at one stream on a Zen 4 (163-230 against 48-55 tok/s) and 1.6-2x at 16
# and 64, on the AVX2 paths too, and were never slower (a Zen 5: level, 143 against 145, before Q4_1
# was laid out side by side). Their products round the input to 8 bits, as llama.cpp's do, so greedy
# text parts from float32's (transformers') within 2-40 tokens on 7 of 10 chat prompts, with answers
# alike; a request's text no longer depends on its batch-mates. weights="float32" gives transformers'
# numbers (docs/benchmarks.md, the Zen 4's "2026-12-05, evening").
DEFAULT_WEIGHTS = "stored"


def _load(source, device: torch.device, dtype, weights) -> Checkpoint:
    kept = False  # a GGUF file read to keep its formats, its F16/BF16 matrices too
    weights = DEFAULT_WEIGHTS if weights is None else weights
    if isinstance(source, nn.Module):
        contents = huggingface.read_module(source)
        dtype = resolve_dtype(dtype if dtype is not None else source.dtype, device)
        weights = check_weights(weights, device, dtype)
    else:
        path = Path(source).expanduser() if source is not None else gguf.default_model_path()
        if path.is_dir() and not (path / "config.json").exists() and len(list(path.glob("*.gguf"))) == 1:
            path = next(path.glob("*.gguf"))
        dtype = resolve_dtype(dtype, device)
        weights = check_weights(weights, device, dtype)  # before any tensor is read or dequantized
        if path.suffix == ".gguf":
            kept = weights == "stored" and runs_blocks(device, dtype)
            contents = gguf.read(path, keep_blocks=kept)
        elif not path.exists():
            raise FileNotFoundError(f"no checkpoint at {path}: expected a directory with config.json or a .gguf file")
        else:
            config = huggingface.read_config(path)
            architecture(config)  # an unsupported type fails before any tensor is read
            contents = huggingface.read(path, config)
    model = build(contents.config, contents.tensors, dtype, device, weights, float_rows=kept, owned=contents.owned)
    return Checkpoint(model, contents.eos_token_ids, contents.tokenizer, contents.name, contents.config)
