"""A GGUF file's metadata as a transformers-style config: its architecture (checked before any
tensor is read), sizes, norms and rope, with the rope's scaling as llama.cpp's converter writes it:
linear or yarn in the metadata, or in tensors (Llama 3.1's divisor per frequency, Phi-3's longrope
factors)."""

from __future__ import annotations

from .gguf_file import TensorInfo
from ..kernels.block_formats import widened

# gguf architecture -> transformers model_type
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma3": "gemma3_text"}
# Rotary frequencies a file keeps as tensors, which become the config's rope scaling: a divisor per
# frequency (Llama 3.1's scaling, as llama.cpp's converter writes it), or longrope's short and long
# factors (Phi-3's long-context models)
ROPE_FREQS, ROPE_LONG, ROPE_SHORT = "rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"
ROPE_TENSORS = (ROPE_FREQS, ROPE_LONG, ROPE_SHORT)


def check_architecture(meta: dict, file_name: str) -> str:
    """The file's architecture, or a ValueError naming the supported ones (or, for a mixture of
    experts, what runs one)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {file_name}; supported: {', '.join(ARCHITECTURES)}")
    if meta.get(f"{arch}.expert_count"):  # Mixtral's files say "llama", with routed experts
        raise ValueError(f"{file_name} is a mixture-of-experts model ({meta[f'{arch}.expert_count']} experts), which "
                         "Loom does not read from GGUF files; it runs Mixtral and Qwen3-MoE from Hugging Face directories")
    return arch


def gguf_config(arch: str, meta: dict, names: dict) -> dict:
    """The transformers-style config of an ``arch`` file's metadata and its tensors (by llama.cpp's
    names: whether there is an output layer, rotary factors kept as tensors)."""
    key = lambda k, default=None: meta.get(f"{arch}.{k}", default)
    heads = key("attention.head_count")
    config = {
        "model_type": ARCHITECTURES[arch],
        "vocab_size": key("vocab_size") or names["token_embd.weight"].shape[0],
        "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": key("attention.key_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": key("rope.freq_base", 10000.0),
        "max_position_embeddings": key("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names and arch == "llama",
    }
    if arch == "gemma3":  # what llama.cpp assumes and the file does not say (as transformers reads it)
        config |= {"sliding_window": key("attention.sliding_window"), "query_pre_attn_scalar": config["head_dim"],
                   "rope_local_base_freq": 10000.0, "rope_theta": key("rope.freq_base", 1_000_000.0)}
    if arch == "phi3":
        config["sliding_window"] = key("attention.sliding_window") or None  # 0: none (Phi-4 is a "phi3" too)
    rotary = key("rope.dimension_count")
    if rotary and heads:
        head_dim = config["head_dim"] or config["hidden_size"] // heads
        if rotary != head_dim:  # a rotary over the first part of each head (Phi-3 may)
            config["partial_rotary_factor"] = rotary / head_dim
    config |= _rope_scaling(key, names)
    return config


def _rope_scaling(key, names: dict) -> dict:
    """The config's rope scaling (transformers' rope_scaling) from the file's metadata and rotary
    tensors, as llama.cpp's converter writes them: linear; yarn (Qwen's long-context files); a
    divisor per frequency (rope_freqs, no scaling type: Llama 3.1's llama3 scaling as the converter
    computes it, which llama.cpp divides each frequency by); longrope (Phi-3's short and long
    factors, the type written by converters since 2024, absent before); {} for none."""
    scaling = key("rope.scaling.type") or "none"
    kept = [name for name in ROPE_TENSORS if name in names]
    factors = {name: _values(names[name]) for name in kept}
    if ROPE_FREQS in factors:
        if scaling != "none" or len(factors) > 1:
            raise ValueError(f"a GGUF file with rope_freqs and rope scaling {scaling!r} or longrope factors: Loom "
                             "reads rope_freqs alone")
        return {"rope_scaling": {"rope_type": "frequency_factors", "factors": factors[ROPE_FREQS]}}
    if scaling == "longrope" or factors:
        if set(factors) != {ROPE_LONG, ROPE_SHORT} or scaling not in ("longrope", "none"):
            raise ValueError(f"a GGUF file with rope scaling {scaling!r} and {', '.join(kept) or 'no factors'}: "
                             "longrope needs rope_factors_long and rope_factors_short")
        longrope = {"rope_type": "longrope", "long_factor": factors[ROPE_LONG], "short_factor": factors[ROPE_SHORT],
                    "original_max_position_embeddings": key("rope.scaling.original_context_length",
                                                            key("context_length", 2048))}
        if key("rope.scaling.attn_factor") is not None:
            longrope["attention_factor"] = key("rope.scaling.attn_factor")
        return {"rope_scaling": longrope}
    if scaling == "linear":
        return {"rope_scaling": {"rope_type": "linear", "factor": key("rope.scaling.factor")}}
    if scaling == "yarn":
        yarn = {"rope_type": "yarn", "factor": key("rope.scaling.factor"),
                "original_max_position_embeddings": key("rope.scaling.original_context_length",
                                                        key("context_length", 2048))}
        for field, name in (("yarn_attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                            ("yarn_beta_slow", "beta_slow")):  # what the converter copies from transformers'
            if key(f"rope.scaling.{field}") is not None:
                yarn[name] = key(f"rope.scaling.{field}")
        return {"rope_scaling": yarn}
    if scaling != "none":
        raise ValueError(f"unsupported GGUF rope scaling {scaling!r}; supported: none, linear, yarn, longrope, and "
                         "rope_freqs' factors")
    return {}


def _values(info: TensorInfo) -> list[float]:
    """A small tensor's values (rotary factors) as Python floats."""
    return widened(info.data, info.type, info.shape[-1]).flatten().tolist()
