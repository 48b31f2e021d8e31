"""A GGUF file's metadata as a transformers-style config: its architecture (checked before any
tensor is read), sizes, norms and rope, with the rope's scaling as llama.cpp's converter writes it:
linear or yarn in the metadata, or in tensors (Llama 3.1's divisor per frequency, Phi-3's longrope
factors); and the tokens that end a turn, as llama.cpp picks them."""

from __future__ import annotations

import numpy as np

from .gguf_file import TensorInfo
from ..families.olmo import EXAONE4_GLOBAL_EVERY
from ..families.recurrent import UNBOUNDED_CONTEXT
from ..families.rope import rope_type
from ..kernels.block_formats import widened

# gguf architecture -> transformers model_type
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "smollm3": "smollm3",
                 "granite": "granite", "gemma": "gemma", "gemma2": "gemma2", "gemma3": "gemma3_text",
                 "gemma4": "gemma4_text", "gemma3n": "gemma3n_text",
                 "qwen3moe": "qwen3_moe", "granitemoe": "granitemoe", "mistral3": "ministral3", "ernie4_5": "llama",
                 "olmo2": "olmo2", "olmoe": "olmoe", "gpt-oss": "gpt_oss", "qwen2moe": "qwen2_moe",
                 "ernie4_5-moe": "ernie4_5_moe", "lfm2": "lfm2", "lfm2moe": "lfm2_moe", "exaone4": "exaone4",
                 "qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text", "qwen3next": "qwen3_next",
                 "granitehybrid": "granitemoehybrid",
                 # (Granite's with window layers and a sink a head; with experts: MIXTURES)
                 "granite_swa": "granite_swa",
                 # vision-language models' text (vision_language.py says why they are their text families')
                 "qwen2vl": "qwen2", "qwen3vl": "qwen3", "qwen3vlmoe": "qwen3_moe", "nemotron_h": "nemotron_h",
                 "nemotron_h_moe": "nemotron_h",  # (Nemotron 3's mixtures: its experts' layers told by their widths)
                 "glm4": "glm4", "glm4moe": "glm4_moe",  # (GLM-4.5 and 4.6, GLM-4.5-Air)
                 "chatglm": "glm",  # (ChatGLM2 and 3, GLM-4-9B: GLM-4's layers without its output norms)
                 "falcon-h1": "falcon_h1", "mamba2": "mamba2", "mamba": "mamba",  # (Falcon-Mamba's too: _mamba_model)
                 # DeepSeek-V2 and V3, Kimi K2, Moonlight, GLM-4.7-Flash (V2's softmax, V3's sigmoid: _deepseek2)
                 "deepseek2": "deepseek_v3",
                 "mistral4": "mistral4",  # (Mistral 4's: DeepSeek-V3's latent attention, softmax routing)
                 # (MiniCPM3's: DeepSeek's latent attention, its rotary in halves, a dense MLP, MiniCPM's scales)
                 "minicpm3": "minicpm3",
                 # Llama's math under names of their own: EXAONE 3.5, Arcee's AFM (an MLP without a gate), Seed-OSS;
                 # InternLM2 and MiniCPM (Granite's multipliers: _minicpm_scales) as their files hold them, Llama's
                 "exaone": "exaone", "arcee": "arcee", "seed_oss": "seed_oss", "internlm2": "llama", "minicpm": "llama",
                 # and XVERSE's, Baichuan 7B's (Baichuan 13B's ALiBi refused: _baichuan), Qwen 1's (Qwen2's math: q/k/v
                 # one product with biases, every head its own K/V) and Orion's (StableLM's: LayerNorms, SwiGLU)
                 "xverse": "llama", "baichuan": "llama", "qwen": "qwen2", "orion": "stablelm",
                 # HunYuan's dense models (q/k norms after the rotation; the converter folds its alpha into the base)
                 "hunyuan-dense": "hunyuan_v1_dense",
                 # LayerNorms: StarCoder2 (an MLP of gelu(up)), StableLM, Phi-2 and Cohere's Command R and R7B (the
                 # attention and the MLP beside each other: _layer_norm_layers)
                 "starcoder2": "starcoder2", "stablelm": "stablelm", "phi2": "phi", "command-r": "cohere",
                 "cohere2": "cohere2", "olmo": "olmo",  # (OLMo 1's: weightless LayerNorms)
                 "nemotron": "nemotron",  # (Nemotron-4's and Minitron's: of 1 + their weights, an MLP of relu(up)^2)
                 "jais2": "jais2",  # (Jais-2's: LayerNorms, an MLP of relu(up)^2, biases everywhere)
                 "bloom": "bloom",  # (BLOOM's: ALiBi in the rotary's place, its embeddings LayerNormed)
                 "mpt": "mpt",  # (MPT's: ALiBi, LayerNorms, its q/k/v clamped where the file says)
                 # GPT-NeoX's (Pythia's) and Falcon's (their MLPs' GELU by tanh, as llama.cpp runs them)
                 "gptneox": "gpt_neox", "falcon": "falcon",
                 "gpt2": "gpt2", "starcoder": "gpt_bigcode",  # (GPT-2's module: learned positions; _gpt2_model)
                 # mixtures on Llama's attention: dots.llm1 (Qwen3's, DeepSeek-V3's routing), Hunyuan-A13B (HunYuan's,
                 # a shared MLP beside softmax-routed experts), MiniMax-M2 (q/k norms across heads, sigmoid routing)
                 "dots1": "dots1", "hunyuan-moe": "hunyuan_v1_moe", "minimax-m2": "minimax_m2",
                 "afmoe": "afmoe",  # (Arcee's Trinity: gated attention, norms about each part, global layers unrotated)
                 "apertus": "apertus",  # (Qwen3's q/k norms, an MLP of xIELU(up), its numbers a layer in the metadata)
                 "dbrx": "dbrx",  # (LayerNorms without biases, q/k/v clamped and one product, softmax-routed experts)
                 # (K-EXAONE's: Qwen3's attention, three window layers in four, those alone rotating, DeepSeek-V3's
                 # routing beside a shared expert)
                 "exaone-moe": "exaone_moe",
                 # (Llama 4's: experts every interleave_moe_layer_step-th layer, weighing their inputs, beside a
                 # shared one; its rotating layers in chunks, q/k-normed without weights; the others' temperature)
                 "llama4": "llama4_text",
                 # (Cohere's Command A mixture: Cohere2's parallel layers, RMSNorms or LayerNorms, a dense prefix, then
                 # experts averaged with shared ones)
                 "cohere2moe": "cohere2_moe",
                 # (AI21's Jamba: Mamba layers and attention layers without positions, experts every other layer)
                 "jamba": "jamba"}
# the architectures whose files may route to experts, and the model_type of such a file (Mixtral's
# files say "llama"): llama.cpp renormalises the chosen experts' softmax weights in all but OLMoE's,
# Qwen2-MoE's and Jamba's (gpt-oss's softmax over the chosen logits: the same weights)
MIXTURES = {"llama": "mixtral", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "granitemoe": "granitemoe",
            "olmoe": "olmoe", "ernie4_5-moe": "ernie4_5_moe", "gpt-oss": "gpt_oss", "lfm2moe": "lfm2_moe",
            "granitehybrid": "granitemoehybrid", "qwen3vlmoe": "qwen3_moe", "qwen35moe": "qwen3_5_moe_text",
            "deepseek2": "deepseek_v3", "mistral4": "mistral4", "nemotron_h_moe": "nemotron_h", "glm4moe": "glm4_moe",
            "granite_swa": "granitemoe_swa",
            "qwen3next": "qwen3_next", "gemma4": "gemma4_text", "dots1": "dots1", "hunyuan-moe": "hunyuan_v1_moe",
            "minimax-m2": "minimax_m2", "afmoe": "afmoe", "dbrx": "dbrx", "exaone-moe": "exaone_moe",
            "llama4": "llama4_text", "cohere2moe": "cohere2_moe", "jamba": "jamba"}
# llama.cpp's expert_gating_func: how an architecture's experts are scored where the file says (LFM2-MoE's
# sigmoid, Nemotron 3's; DeepSeek's either, V2's softmax, V3's sigmoid; the others' softmax, which their files need
# not say)
GATING = {1: "softmax", 2: "sigmoid"}
EXPERT_SCORES = {"lfm2moe": ("sigmoid",), "deepseek2": ("softmax", "sigmoid"), "mistral4": ("softmax",),
                 "nemotron_h_moe": ("sigmoid",), "glm4moe": ("sigmoid",), "dots1": ("sigmoid",),
                 "minimax-m2": ("sigmoid",), "afmoe": ("sigmoid",), "exaone-moe": ("sigmoid",),
                 "llama4": ("sigmoid",), "cohere2moe": ("sigmoid", "softmax")}
# the mixtures whose files may scale their chosen experts' weights (expert_weights_scale)
SCALED_MIXTURES = frozenset({"lfm2moe", "deepseek2", "mistral4", "nemotron_h_moe", "glm4moe", "dots1", "afmoe",
                             "exaone-moe", "cohere2moe"})
# the mixtures whose files may add a shared expert every token takes (Qwen2-MoE's always, weighted by a
# router of its own; Granite MoE Shared's, a granitemoe file with expert_shared_feed_forward_length; ERNIE 4.5's)
SHARED_EXPERTS = frozenset({"qwen2moe", "granitemoe", "ernie4_5-moe", "granitehybrid", "qwen35moe", "deepseek2",
                            "mistral4", "nemotron_h_moe", "glm4moe", "qwen3next", "dots1", "hunyuan-moe", "afmoe",
                            "exaone-moe", "granite_swa", "llama4", "cohere2moe"})
# architectures whose files keep Llama's layout: Q/K rows in the interleaved rotary's order (llama.cpp's
# converter permutes Llama's; ERNIE 4.5's and GLM-4's checkpoints hold them so: their files are Llama's from
# there, GLM-4's over the rotary's half of each head), attention biases where the model has them; gguf.py puts
# the rows in halves as it reads them
LLAMA_LAYOUT = frozenset({"llama", "smollm3", "granite", "granitemoe", "granitehybrid", "granite_swa", "mistral3",
                          "ernie4_5", "ernie4_5-moe", "glm4", "chatglm", "arcee", "internlm2", "minicpm", "command-r",
                          "cohere2", "olmo", "xverse", "baichuan", "llama4", "cohere2moe"})
# the architectures whose norms are LayerNorms (their epsilon attention.layer_norm_epsilon), their biases and
# which of their layers' products add one told by the file's tensors (_layer_norm_layers)
LAYER_NORM_ARCHITECTURES = frozenset({"starcoder2", "stablelm", "phi2", "command-r", "cohere2", "olmo", "nemotron",
                                      "gptneox", "falcon", "dbrx", "jais2", "orion", "bloom", "mpt"})
# SmolLM3: every fourth layer attends without rotary, as llama.cpp fixes it (the files do not say); AFMoE's too
SMOLLM3_NO_ROPE_STEP = AFMOE_NO_ROPE_STEP = 4
# EXAONE 4: llama.cpp gives only the 32B's 64 layers a window (three layers in four, 4096 tokens where the file
# names none), whatever other files say
EXAONE4_WINDOWED_LAYERS, EXAONE4_WINDOW = 64, 4096
# the architectures whose attention is DeepSeek's latent attention (deepseek.py's)
LATENT_ATTENTION = ("deepseek2", "mistral4")
# llama.cpp's Baichuan of 40 layers (13B) attends by ALiBi, its 7B by rotary
BAICHUAN_13B_LAYERS = 40
EXAONE_MOE_WINDOW = 128  # (EXAONE-MoE's window where a file names none, as llama.cpp fixes it)
# Llama 4: llama.cpp's fixed numbers, which its files do not say: chunks of 8192 positions in three layers of four
# (those rotating), the fourth's temperature 0.1 from 8192 positions; no q/k norms in files of 128 experts (Maverick's)
LLAMA4_CHUNK, LLAMA4_NO_ROPE_STEP, LLAMA4_TEMPERATURE, LLAMA4_UNNORMED_EXPERTS = 8192, 4, (0.1, 8192), 128
# the architectures whose layers may be short convolutions (LFM2's) or Mamba2 layers (Granite 4's hybrids), told
# apart by having no K/V heads
CONVOLVING = frozenset({"lfm2", "lfm2moe"})
MAMBA_HYBRIDS = frozenset({"granitehybrid", "nemotron_h", "nemotron_h_moe", "jamba"})
# the architectures whose layers are gated delta-rule layers where they are not attention layers (qwen35.py's)
DELTA_RULE_HYBRIDS = frozenset({"qwen35", "qwen35moe", "qwen3next"})
# Nemotron-H's layers are a Mamba2 layer, an attention layer or an MLP (in a Nemotron 3 file, a mixture of
# experts), told apart by their K/V heads and MLP widths (neither: Mamba2), listed a layer at a time
SINGLE_PURPOSE_LAYERS = frozenset({"nemotron_h", "nemotron_h_moe"})
# the sizes a file's Mamba2 layers (Granite 4's, Nemotron-H's, Falcon-H1's, Mamba2's own) and Mamba's list (ssm.*)
MAMBA2_SIZES = ("conv_kernel", "state_size", "group_count", "time_step_rank", "inner_size")
MAMBA_SIZES = ("conv_kernel", "state_size", "time_step_rank", "inner_size")
# Granite's multipliers: the file's keys (under the architecture's prefix) -> transformers' names
GRANITE_SCALES = {"embedding_scale": "embedding_multiplier", "residual_scale": "residual_multiplier",
                  "attention.scale": "attention_multiplier", "logit_scale": "logits_scaling"}
# Gemma 2 27B's layers: llama.cpp scales its queries by the hidden size over the heads, the other
# Gemma 2 sizes' by the head size (their query_pre_attn_scalar, which the files do not keep)
GEMMA2_27B_LAYERS = 46
# What llama.cpp fixes for Gemma 3n where a file does not say: the layers that keep K/V (the later ones read
# theirs), and the first ten layers' MLP gates cut at the normal 0.95 quantile (as its converter computes it)
GEMMA3N_KV_LAYERS, GEMMA3N_SPARSE_LAYERS, GEMMA3N_SPARSE_STDS = 20, 10, 1.6448533535003662
# Rotary frequencies a file keeps as tensors, which become the config's rope scaling: a divisor per
# frequency (Llama 3.1's scaling, as llama.cpp's converter writes it), or longrope's short and long
# factors (Phi-3's long-context models)
ROPE_FREQS, ROPE_LONG, ROPE_SHORT = "rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"
ROPE_TENSORS = (ROPE_FREQS, ROPE_LONG, ROPE_SHORT)
END_TOKEN_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
# Tokens llama.cpp ends generation at by their text, whatever the file names as EOS: most files name
# one end token, while a chat turn ends at another (Phi-3's EOS is <|endoftext|>, its turns end at
# <|end|>; Llama 3 base files name <|end_of_text|>, their chats end at <|eot_id|>).
END_TOKEN_TEXTS = frozenset({"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                             "<|end_of_text|>", "<EOT>"})


def check_architecture(meta: dict, file_name: str) -> str:
    """The file's architecture, or a ValueError naming the supported ones (or, for a mixture of
    experts Loom does not run, the ones it does)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {file_name}; supported: {', '.join(ARCHITECTURES)}")
    key = lambda k: meta.get(f"{arch}.{k}")
    if key("expert_count"):
        if arch not in MIXTURES:
            raise ValueError(f"{file_name} is a {arch} model with {key('expert_count')} experts; Loom runs experts "
                             f"in {', '.join(MIXTURES)} files (Mixtral's, Qwen2-MoE's, Qwen3-MoE's, Granite MoE's, "
                             "OLMoE's, ERNIE 4.5's, gpt-oss's, LFM2-MoE's, Granite 4's, Qwen3-VL's, Qwen3.5's, "
                             "Qwen3-Next's, DeepSeek's, Nemotron 3's, GLM-4.5's, Gemma 4's, dots.llm1's, Hunyuan-A13B's, "
                             "MiniMax-M2's, Arcee's Trinity's, DBRX's, EXAONE-MoE's, Mistral 4's, Granite SWA's, "
                             "Llama 4's, Cohere2-MoE's and Jamba's)")
        if key("expert_shared_feed_forward_length") and arch not in SHARED_EXPERTS:
            raise ValueError(f"{file_name} is a {arch} model with a shared expert, which Loom runs in "
                             f"{', '.join(sorted(SHARED_EXPERTS))} files only")
        if key("expert_weights_scale") not in (None, 0.0, 1.0) and arch not in SCALED_MIXTURES:
            # (llama.cpp: 0 and 1 scale nothing; LFM2-MoE's and DeepSeek's routed_scaling_factor is read)
            raise ValueError(f"{file_name} scales its experts' weights by {key('expert_weights_scale')}, which Loom "
                             f"runs in {', '.join(sorted(SCALED_MIXTURES))} files only")
        gating = GATING.get(key("expert_gating_func"), key("expert_gating_func"))
        if gating is not None and gating not in EXPERT_SCORES.get(arch, ("softmax",)):
            raise ValueError(f"{file_name} scores its experts by {gating}, which Loom does not run for {arch}")
    return arch


def end_tokens(meta: dict) -> frozenset[int]:
    """The ids that end a stream: the file's EOS, EOT and EOM, and the tokens llama.cpp ends at by
    their text (END_TOKEN_TEXTS)."""
    named = {meta[key] for key in END_TOKEN_KEYS if key in meta}
    tokens = meta.get("tokenizer.ggml.tokens", ())
    if hasattr(tokens, "indices_of"):  # a file's StringArray: found in its bytes, nothing else decoded
        return frozenset(named.union(*(tokens.indices_of(text) for text in END_TOKEN_TEXTS)))
    return frozenset(named | {i for i, text in enumerate(tokens) if text in END_TOKEN_TEXTS})


def gguf_config(arch: str, meta: dict, tensors: dict[str, TensorInfo], file_name: str) -> dict:
    """The transformers-style config of an ``arch`` file's metadata and its ``tensors`` (by
    llama.cpp's names: whether there is an output layer, rotary factors kept as tensors). Raises
    ValueError for a rope Loom does not run."""
    key = lambda k, default=None: meta.get(f"{arch}.{k}", default)
    shared = lambda k, default=None: _shared_by_layers(key(k, default), f"{arch}.{k}", file_name)
    heads = shared("attention.head_count")
    config = {
        "model_type": ARCHITECTURES[arch],
        "vocab_size": key("vocab_size") or tensors["token_embd.weight"].shape[0],
        "hidden_size": key("embedding_length"),
        # (Nemotron-H's a layer at a time, none for a Mamba2 or attention layer: _nemotron_h_layers)
        # (Gemma 4's a layer at a time where some are twice as wide, its heads too: _gemma4_layers; Gemma 3n's a
        # layer at a time: _gemma3n_layers)
        "intermediate_size": None if arch in SINGLE_PURPOSE_LAYERS | {"gemma4", "gemma3n"} else
        shared("feed_forward_length"),
        # (llama.cpp runs the layers before a file's next-token prediction layers, which it keeps for speculation)
        "num_hidden_layers": key("block_count") - (key("nextn_predict_layers") or 0),
        "num_attention_heads": heads,
        # (LFM2's and Granite 4's files list them a layer at a time, none for a convolution or Mamba2 layer:
        # _kv_heads_by_layer)
        "num_key_value_heads": None if arch in CONVOLVING | MAMBA_HYBRIDS | {"gemma4"} else
        shared("attention.head_count_kv", heads),
        "head_dim": key("attention.key_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": key("rope.freq_base", 10000.0),
        "max_position_embeddings": key("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors and (arch in LLAMA_LAYOUT or arch in ("gpt-oss", "glm4moe")),
        "rotary_rows_in_halves": arch in LLAMA_LAYOUT,  # (as read: ERNIE 4.5's and GLM-4's need no reordering after)
    }
    if key("expert_count"):
        config |= _experts(arch, key, config)
    if arch in CONVOLVING:
        config |= _lfm2_layers(key, heads, config["num_hidden_layers"], file_name)
    if arch == "granitehybrid":  # (a convolution's bias a file may leave out: llama.cpp's loader does not require it)
        config |= _granite_hybrid_layers(arch, key, heads, config, file_name)
        config["mamba_conv_bias"] = any(name.endswith(".ssm_conv1d.bias") for name in tensors)
    if arch in SINGLE_PURPOSE_LAYERS:
        config |= _nemotron_h_layers(arch, key, heads, config, file_name)
        config |= {"use_conv_bias": any(name.endswith(".ssm_conv1d.bias") for name in tensors),
                   "attention_biases_in_file": any(name.endswith(".attn_q.bias") for name in tensors),
                   "mlp_bias": any(name.endswith(".ffn_up.bias") for name in tensors)}
    if arch in LATENT_ATTENTION:
        config |= _deepseek2(key, config)
    if arch == "minicpm3":
        config |= _minicpm3(key, config)
    if arch == "falcon-h1":
        config |= _falcon_h1_layers(arch, key, tensors, file_name)
    if arch == "mamba2":
        config |= _mamba2_model(arch, key, tensors, config, file_name)
    if arch == "mamba":
        config |= _mamba_model(arch, key, tensors, config, file_name)
    if arch == "jamba":
        config |= _jamba_layers(arch, key, tensors, heads, config, file_name)
    if arch == "glm4moe":  # (its q/k norms where the file has them: GLM-4.5's, not Air's)
        config["use_qk_norm"] = "blk.0.attn_q_norm.weight" in tensors
    if arch == "qwen2moe":  # (llama.cpp's adds the biases a file has)
        config["qkv_bias"] = "blk.0.attn_q.bias" in tensors
    if arch == "gemma":  # (llama.cpp's Gemma reads token_embd as its output layer)
        config["tie_word_embeddings"] = True
    if arch == "gemma3":  # what llama.cpp assumes and the file does not say (as transformers reads it)
        config |= {"sliding_window": key("attention.sliding_window"), "query_pre_attn_scalar": config["head_dim"],
                   "rope_local_base_freq": 10000.0, "rope_theta": key("rope.freq_base", 1_000_000.0)}
    if arch in ("gemma2", "gemma3") and (types := _sliding_layers(key, config["num_hidden_layers"], file_name)):
        config["layer_types"] = types
    if arch == "gemma2":  # what llama.cpp assumes where the file does not say
        heads_width = config["hidden_size"] // heads
        config |= {"sliding_window": key("attention.sliding_window", 4096),
                   "tie_word_embeddings": True,  # (llama.cpp's Gemma 2 reads token_embd as its output layer)
                   "query_pre_attn_scalar": heads_width if config["num_hidden_layers"] == GEMMA2_27B_LAYERS
                   else config["head_dim"] or heads_width,
                   "attn_logit_softcapping": key("attn_logit_softcapping", 50.0),
                   "final_logit_softcapping": key("final_logit_softcapping", 30.0)}
        if key("rope.freq_base_swa") is not None:
            config["rope_local_base_freq"] = key("rope.freq_base_swa")
    if arch == "smollm3":
        layers = config["num_hidden_layers"]
        config["no_rope_layers"] = [int((i + 1) % SMOLLM3_NO_ROPE_STEP != 0) for i in range(layers)]
    # Granite's scales: a scale of 0 or none is 1, or the head size's for the attention, as llama.cpp reads it
    if arch in ("granite", "granitemoe", "granitehybrid", "granite_swa"):
        config |= {name: key(field) for field, name in GRANITE_SCALES.items() if key(field)}
        config.setdefault("attention_multiplier", (config["head_dim"] or config["hidden_size"] // heads) ** -0.5)
        if key("rope.scaling.finetuned") is False:  # llama.cpp's switch for Granite's rotary: off, every layer
            config["no_rope_layers"] = [0] * config["num_hidden_layers"]
    if arch == "granite_swa":  # (its window layers as the file lists them, its rotating layers where it says: no
        # rope_pattern, every layer)
        layers, rotating = config["num_hidden_layers"], key("attention.rope_pattern")
        config |= {"sliding_window": key("attention.sliding_window"),
                   "layer_types": _sliding_layers(key, layers, file_name),
                   "layer_rope_theta": [config["rope_theta"] if rotates else 0
                                        for rotates in ([True] * layers if rotating is None else rotating)]}
    if arch == "minicpm":
        config |= _minicpm_scales(key, config)
    if arch == "qwen":  # (its converter writes Qwen 1's intermediate_size, twice its MLP's width, as llama.cpp
        # reads it)
        config["intermediate_size"] //= 2
    if arch == "baichuan" and config["num_hidden_layers"] == BAICHUAN_13B_LAYERS:
        raise ValueError(f"{file_name} is a baichuan model of {BAICHUAN_13B_LAYERS} layers (Baichuan 13B's), which "
                         "llama.cpp runs with ALiBi's positions over Llama's layers: Loom runs ALiBi in BLOOM's and "
                         "MPT's layers alone")
    if arch in LAYER_NORM_ARCHITECTURES:
        config |= _layer_norm_layers(arch, key, tensors, config, file_name)
    if arch in ("exaone", "seed_oss"):  # q/k/v biases where the file has them, none after (as llama.cpp loads them)
        config |= {"attention_bias": "blk.0.attn_q.bias" in tensors, "attention_out_bias": False}
    if arch == "phi3":
        config["sliding_window"] = key("attention.sliding_window") or None  # 0: none (Phi-4 is a "phi3" too)
    if arch == "gpt-oss":  # every other layer through its window where the file lists none, as llama.cpp reads it
        config |= {"sliding_window": key("attention.sliding_window"),
                   "layer_types": _sliding_layers(key, config["num_hidden_layers"], file_name, default_pattern=2)}
    # An OLMo 3: three local layers in four where the file lists none, rotating by the global layers' base
    # without their scaling, as llama.cpp's graph does (its rope.freq_base_swa serves only its cache shifts)
    if arch == "olmo2" and key("attention.sliding_window"):
        config |= {"model_type": "olmo3", "sliding_window": key("attention.sliding_window")}
        if types := _sliding_layers(key, config["num_hidden_layers"], file_name):
            config["layer_types"] = types
    if arch in ("exaone4", "exaone-moe"):
        config |= _exaone_windows(arch, key, config["num_hidden_layers"], file_name)
    if arch == "afmoe":  # (llama.cpp's: three window layers in four where the file names a window, every fourth layer
        # unrotated, the embeddings times sqrt(hidden) whatever the file)
        layers = config["num_hidden_layers"]
        window = key("attention.sliding_window") or None
        config |= {"sliding_window": window, "mup_enabled": True,
                   "layer_types": _sliding_layers(key, layers, file_name, default_pattern=4) if window else
                   ["full_attention"] * layers,
                   "no_rope_layers": [int((i + 1) % AFMOE_NO_ROPE_STEP != 0) for i in range(layers)]}
    if arch in DELTA_RULE_HYBRIDS:  # (a head's width the hidden size's share where the file says none, as llama.cpp's)
        config |= _qwen35_layers(arch, key, config["num_hidden_layers"], file_name)
        config["head_dim"] = config["head_dim"] or config["hidden_size"] // heads
    if arch == "cohere2moe":
        config |= _cohere2moe_layers(key, config, file_name)
    if arch == "llama4":
        if not key("expert_count"):
            raise ValueError(f"{file_name} is a llama4 model without experts (MobileLLM-R1's file), which llama.cpp "
                             "does not run either; load its Hugging Face checkpoint")
        config |= _llama4_attention(key, config["num_hidden_layers"], file_name)
    if arch in ("gpt2", "starcoder"):
        return _gpt2_model(key, tensors, config)
    if arch == "gemma4":  # (its rotary and rope_freqs are its global layers': _gemma4_layers reads them)
        return config | _gemma4_layers(key, tensors, config, file_name)
    if arch == "gemma3n":
        return config | _gemma3n_layers(key, tensors, config, file_name)
    rotary = key("rope.dimension_count")
    if rotary and heads:
        head_dim = config["head_dim"] or config["hidden_size"] // heads
        if rotary > head_dim:
            raise ValueError(f"{file_name} rotates {rotary} values of heads of {head_dim}")
        # a rotary over the first part of each head (Phi-3 may); Qwen3.5's and Qwen3-Next's share said always (their
        # configs' default, a quarter, is not the file's where it rotates whole heads)
        if rotary < head_dim or arch in DELTA_RULE_HYBRIDS:
            config["partial_rotary_factor"] = rotary / head_dim
    try:
        config |= _rope_scaling(key, tensors)
        if arch in LATENT_ATTENTION:
            config |= _deepseek2_mscales(key, config)
    except ValueError as error:
        raise ValueError(f"{file_name}: {error}") from None
    if arch == "mistral3":
        config |= _mistral3_scales(key, config)
    return config


def _gemma4_layers(key, tensors: dict[str, TensorInfo], config: dict, file_name: str) -> dict:
    """A Gemma 4 file's layers as transformers names them, read as llama.cpp reads them: which slide (the
    pattern), the sliding-window layers' heads and size (key_length_swa) and the global layers' (key_length, their
    heads a layer at a time in head_count_kv), values that are keys where a global layer has no attn_v, the last
    shared_kv_layers layers reading earlier ones' K/V with MLPs twice as wide where feed_forward_length says so,
    the per-layer inputs' width, and the global layers' rope (their rope_freqs: a divisor per frequency pair, 1e30
    for those that do not turn), the sliding-window layers' (rope.freq_base_swa, whole heads)."""
    layers = config["num_hidden_layers"]
    types = _sliding_layers(key, layers, file_name)
    if types is None:
        raise ValueError(f"{file_name} names no attention.sliding_window_pattern, which Gemma 4's files carry")
    kv_heads, widths = (per_layer(key(k), layers) for k in ("attention.head_count_kv", "feed_forward_length"))
    first_shared = layers - (key("attention.shared_kv_layers") or 0)
    local, wide = key("attention.key_length_swa"), key("attention.key_length")
    if key("rope.dimension_count_swa") not in (None, local):
        raise ValueError(f"{file_name}'s sliding-window layers rotate {key('rope.dimension_count_swa')} values of "
                         f"heads of {local}; Loom's Gemma 4 rotates them whole")
    heads_of = {t: {kv_heads[i] for i in range(first_shared) if types[i] == t} for t in set(types)}
    inner, shared_widths = set(widths[:first_shared]), set(widths[first_shared:])
    if any(len(h) != 1 for h in heads_of.values()) or len(inner) != 1 or len(shared_widths) > 1 or not (
            shared_widths <= {min(inner), 2 * min(inner)}):
        raise ValueError(f"{file_name}'s Gemma 4 layers differ in K/V heads within a kind or in MLP width "
                         f"({kv_heads}, {widths}); Loom runs files whose layers of a kind share their heads, and "
                         "whose MLPs are one width (twice it in the layers sharing K/V)")
    (inner,), (local_kv,) = inner, heads_of["sliding_attention"]
    (global_kv,) = heads_of.get("full_attention", {local_kv})
    first_global = types.index("full_attention")
    global_rope = {"rope_type": "default", **_rope_scaling(key, tensors).get("rope_scaling", {}),
                   "rope_theta": key("rope.freq_base")}
    return {"num_key_value_heads": local_kv, "head_dim": local, "intermediate_size": inner, "layer_types": types,
            "per_layer_config": {i: {"head_dim": wide, "num_key_value_heads": global_kv}
                                 for i, t in enumerate(types) if t == "full_attention"},
            "attention_k_eq_v": f"blk.{first_global}.attn_v.weight" not in tensors,
            "num_kv_shared_layers": layers - first_shared,
            "use_double_wide_mlp": shared_widths == {2 * inner},
            "hidden_size_per_layer_input": key("embedding_length_per_layer_input") or 0,
            "vocab_size_per_layer_input": (tensors["per_layer_token_embd.weight"].shape[0]
                                           if "per_layer_token_embd.weight" in tensors else config["vocab_size"]),
            "sliding_window": key("attention.sliding_window"), "final_logit_softcapping": key("final_logit_softcapping"),
            "rope_parameters": {"full_attention": global_rope, "sliding_attention": {
                "rope_type": "default", "rope_theta": key("rope.freq_base_swa", 10_000.0)}}}


def _gemma3n_layers(key, tensors: dict[str, TensorInfo], config: dict, file_name: str) -> dict:
    """A Gemma 3n file's layers as llama.cpp reads them: which slide (the pattern, four in five where the file names
    none), the MLPs' widths a layer, the last shared_kv_layers layers reading earlier ones' K/V (those past the
    twentieth where the file does not say, as llama.cpp fixes it), each layer's gate cutoff in standard deviations
    (activation_sparsity_scale, as the converter writes it: -inf for a dense layer; llama.cpp's 0.95 quantile for the
    first ten where the file names none), the AltUp streams, Laurel's rank and the per-layer inputs' width by
    their tensors' shapes, the sliding-window layers' rope base (rope.freq_base_swa, 10000 where the file names
    none)."""
    layers = config["num_hidden_layers"]
    stds = key("activation_sparsity_scale")
    if stds is None:
        stds = [GEMMA3N_SPARSE_STDS] * min(GEMMA3N_SPARSE_LAYERS, layers) + [float("-inf")] * max(
            0, layers - GEMMA3N_SPARSE_LAYERS)
    required = ("altup_proj.weight", "blk.0.laurel_l.weight", "per_layer_token_embd.weight")
    if missing := [name for name in required if name not in tensors]:
        raise ValueError(f"{file_name} is a gemma3n file without {', '.join(missing)}")
    return {"intermediate_size": per_layer(key("feed_forward_length"), layers),
            "layer_types": _sliding_layers(key, layers, file_name, default_pattern=5),
            "num_kv_shared_layers": key("attention.shared_kv_layers", max(0, layers - GEMMA3N_KV_LAYERS)),
            "activation_sparsity_stds": [float(v) for v in stds],
            "altup_num_inputs": tensors["altup_proj.weight"].shape[0] + 1,
            "laurel_rank": tensors["blk.0.laurel_l.weight"].shape[0],
            "hidden_size_per_layer_input": key("embedding_length_per_layer_input",
                                               tensors["per_layer_token_embd.weight"].shape[1] // layers),
            "vocab_size_per_layer_input": tensors["per_layer_token_embd.weight"].shape[0],
            "sliding_window": key("attention.sliding_window"), "final_logit_softcapping": key("final_logit_softcapping"),
            "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": key("rope.freq_base")},
                                "sliding_attention": {"rope_type": "default",
                                                      "rope_theta": key("rope.freq_base_swa", 10_000.0)}}}


def _mistral3_scales(key, config: dict) -> dict:
    """What llama.cpp reads of a Ministral 3 file alone (other architectures' files may carry these
    keys, which it ignores there): its yarn's log multiplier (transformers' mscale_all_dim, mscale taken
    as 1), and its queries' temperature past the original context (the yarn's, or the trained one)."""
    rope = dict(config.get("rope_scaling") or {"rope_type": "default"})
    if rope_type(rope) == "yarn" and key("rope.scaling.yarn_log_multiplier"):
        rope |= {"mscale": 1.0, "mscale_all_dim": key("rope.scaling.yarn_log_multiplier")}
    if key("attention.temperature_scale"):
        rope["llama_4_scaling_beta"] = key("attention.temperature_scale")
        rope.setdefault("original_max_position_embeddings",
                        key("rope.scaling.original_context_length", config["max_position_embeddings"]))
    return {"rope_scaling": rope}


def _experts(arch: str, key, config: dict) -> dict:
    """A mixture of experts' config fields as transformers names them for Mixtral, Qwen2-MoE, Qwen3-MoE,
    Granite MoE (Shared), OLMoE, gpt-oss, ERNIE 4.5 or LFM2-MoE: every layer routes (but ERNIE's and
    LFM2-MoE's dense leading ones), the chosen experts' weights renormalised (but OLMoE's and Qwen2-MoE's),
    as llama.cpp runs them; a shared expert as wide as the file says (Qwen2-MoE's feed_forward_length where
    it does not)."""
    experts, used, inner = key("expert_count"), key("expert_used_count"), key("expert_feed_forward_length")
    shared = key("expert_shared_feed_forward_length")
    if arch == "gemma4":  # (its experts beside each layer's MLP, their scales tensors: gemma4.py reads them)
        if not inner:
            raise ValueError("a gemma4 file with experts names no expert_feed_forward_length")
        return {"enable_moe_block": True, "num_experts": experts, "top_k_experts": used, "moe_intermediate_size": inner}
    if arch == "ernie4_5-moe":
        return _ernie_experts(key, config, experts, used, inner, shared)
    if arch == "cohere2moe":  # (its dense prefix's MLPs feed_forward_length wide, its experts' and shared ones'
        # expert_feed_forward_length; llama.cpp averages the two)
        if shared and shared != inner * (key("expert_shared_count") or 0):
            raise ValueError(f"a cohere2moe file's shared experts are {key('expert_shared_count') or 0} experts wide "
                             f"({inner} each), as Cohere2-MoE's; its expert_shared_feed_forward_length is {shared}")
        return {"prefix_dense_intermediate_size": config["intermediate_size"], "num_experts": experts,
                "num_experts_per_tok": used, "intermediate_size": inner or config["intermediate_size"],
                "num_shared_experts": key("expert_shared_count") or 0, "shared_expert_combination_strategy": "average",
                "routed_scaling_factor": key("expert_weights_scale") or 1.0}
    if arch == "jamba":  # (its experts as wide as its MLPs: feed_forward_length, as llama.cpp reads them)
        return {"num_experts": experts, "num_experts_per_tok": used}
    if arch == "llama4":  # (every interleave_moe_layer_step-th layer's, beside a shared one as wide; the other layers'
        # MLPs feed_forward_length wide)
        if not inner:
            raise ValueError("a llama4 file needs expert_feed_forward_length, as llama.cpp does")
        return {"intermediate_size_mlp": config["intermediate_size"], "intermediate_size": inner,
                "num_local_experts": experts, "num_experts_per_tok": used,
                "interleave_moe_layer_step": key("interleave_moe_layer_step") or 1,
                "use_qk_norm": experts != LLAMA4_UNNORMED_EXPERTS}
    if arch == "lfm2moe":  # (llama.cpp requires its bias, renormalises; its dense layers feed_forward_length wide)
        return {"num_experts": experts, "num_experts_per_tok": used, "moe_intermediate_size": inner,
                "num_dense_layers": key("leading_dense_block_count") or 0, "use_expert_bias": True,
                "norm_topk_prob": True, "routed_scaling_factor": key("expert_weights_scale") or 1.0}
    if arch == "granitehybrid":  # (its experts feed_forward_length wide, as llama.cpp reads them)
        return {"num_local_experts": experts, "num_experts_per_tok": used,
                "intermediate_size": inner or config["intermediate_size"], "shared_intermediate_size": shared or 0}
    if MIXTURES[arch] == "granitemoe" and shared:
        return {"model_type": "granitemoeshared", "num_local_experts": experts, "num_experts_per_tok": used,
                "intermediate_size": inner or config["intermediate_size"], "shared_intermediate_size": shared}
    if MIXTURES[arch] == "granitemoe_swa":  # (its experts feed_forward_length wide, as llama.cpp reads them)
        return {"model_type": "granitemoe_swa", "num_local_experts": experts, "num_experts_per_tok": used,
                "intermediate_size": config["intermediate_size"], "shared_intermediate_size": shared or 0}
    if MIXTURES[arch] in ("mixtral", "granitemoe", "dbrx"):  # (llama.cpp's experts there feed_forward_length wide)
        return {"model_type": MIXTURES[arch], "num_local_experts": experts, "num_experts_per_tok": used,
                "intermediate_size": inner or config["intermediate_size"]}
    if arch == "gpt-oss":
        return {"num_local_experts": experts, "num_experts_per_tok": used,
                "intermediate_size": inner or config["intermediate_size"]}
    if arch == "nemotron_h_moe":
        return _nemotron_h_experts(key, used, inner, shared)
    # (DeepSeek-V3's routing: moe.py's _deepseek; dots.llm1's by sigmoid always)
    if arch in ("glm4moe", "dots1", "exaone-moe"):
        return _v3_routing(key) | {"moe_intermediate_size": inner or config["intermediate_size"] // used,
                                   "first_k_dense_replace": key("leading_dense_block_count") or 0}
    if arch == "hunyuan-moe":  # (its experts feed_forward_length wide, as llama.cpp reads them, its shared MLP too
        # where the file does not say)
        return {"num_experts": experts, "moe_topk": used,
                "shared_expert_intermediate_size": shared or config["intermediate_size"]}
    if arch == "minimax-m2":
        return {"num_local_experts": experts, "num_experts_per_tok": used,
                "intermediate_size": inner or config["intermediate_size"]}
    if arch == "afmoe":  # (renormalised where the file says, as llama.cpp's; scaled by expert_weights_scale)
        return {"num_experts": experts, "num_experts_per_tok": used, "moe_intermediate_size": inner,
                "num_dense_layers": key("leading_dense_block_count") or 0,
                "num_shared_experts": key("expert_shared_count") or 0,
                "norm_topk_prob": bool(key("expert_weights_norm")), "route_scale": key("expert_weights_scale") or 1.0}
    if arch == "olmoe":  # (feed_forward_length wide too)
        return {"num_experts": experts, "num_experts_per_tok": used, "norm_topk_prob": False,
                "intermediate_size": inner or config["intermediate_size"]}
    inner = inner or config["intermediate_size"] // used  # (llama.cpp's Qwen2-MoE and Qwen3-MoE fallback)
    fields = {"num_experts": experts, "num_experts_per_tok": used, "moe_intermediate_size": inner,
              "intermediate_size": config["intermediate_size"] or inner,
              "norm_topk_prob": arch in ("qwen3moe", "qwen3vlmoe", "qwen3next")}
    if arch == "qwen2moe":
        fields["shared_expert_intermediate_size"] = shared or config["intermediate_size"]
    if arch in ("qwen35moe", "qwen3next"):  # (a shared expert gated by its own router, as Qwen2-MoE's; renormalised)
        fields["shared_expert_intermediate_size"] = shared or config["intermediate_size"] or 0  # (llama.cpp's fallback)
    return fields


def _cohere2moe_layers(key, config: dict, file_name: str) -> dict:
    """A Cohere2-MoE file's layers as llama.cpp runs them, in transformers' names (llama_kin's _cohere2_moe_config
    reads them): RMSNorms where the file names their epsilon, else LayerNorms; its window layers (a flag a layer) and
    its dense prefix (leading_dense_block_count) rotating; its experts scored by sigmoid unless the file says softmax,
    renormalised where it says (a softmax not renormalised, which transformers' model does not run, refused)."""
    layers, lead = config["num_hidden_layers"], key("leading_dense_block_count") or 0
    softmax = GATING.get(key("expert_gating_func")) == "softmax"
    if softmax and not key("expert_weights_norm"):
        raise ValueError(f"{file_name} scores its experts by a softmax over all of them and does not renormalise the "
                         "chosen ones (expert_weights_norm), which transformers' Cohere2-MoE does not run: Loom runs "
                         "cohere2moe files by sigmoid, or by softmax renormalised")
    return {"rms_norm_eps": key("attention.layer_norm_rms_epsilon"), "layer_norm_eps": key(
                "attention.layer_norm_epsilon", 1e-5), "logit_scale": key("logit_scale", 1.0),
            "sliding_window": key("attention.sliding_window"),
            "layer_types": _sliding_layers(key, layers, file_name, default_pattern=4),
            "mlp_layer_types": ["dense" if i < lead else "sparse" for i in range(layers)],
            "prefix_dense_sliding_window_pattern": 1, "expert_selection_fn": "softmax" if softmax else "sigmoid",
            "norm_topk_prob": bool(key("expert_weights_norm"))}


def _llama4_attention(key, layers: int, file_name: str) -> dict:
    """A Llama 4 file's attention as llama.cpp runs it, in transformers' names (llama_kin's _llama4_config reads
    them): every fourth layer unrotated, its queries scaled by temperature, the others attending in chunks (as
    attention.sliding_window_pattern says where the file has one); unless the file names a sliding window of 0 (its
    converter's for a model of global layers alone: then every layer rotates but the last, as llama.cpp's pattern has
    it, none in chunks, no temperature)."""
    if key("attention.sliding_window") == 0:
        return {"no_rope_layer_interval": layers, "attention_chunk_size": None, "attn_temperature_tuning": False}
    types = _sliding_layers(key, layers, file_name, default_pattern=LLAMA4_NO_ROPE_STEP)
    scale, floor = LLAMA4_TEMPERATURE
    return {"no_rope_layer_interval": LLAMA4_NO_ROPE_STEP, "attention_chunk_size": LLAMA4_CHUNK,
            "layer_types": ["chunked_attention" if t == "sliding_attention" else t for t in types],
            "attn_temperature_tuning": True, "attn_scale": scale, "floor_scale": floor}


def _deepseek2(key, config: dict) -> dict:
    """A DeepSeek file's latent attention and mixture as transformers names them (deepseek.py, moe.py's _deepseek),
    as llama.cpp reads them: the experts scored as the file says (llama.cpp takes a 47- or 48-layer file of
    154880 tokens that does not say for GLM-4.7-Flash's sigmoid, the others for V2's softmax), a group's score
    the sum of its best two, the chosen weights renormalised and scaled where the file says; the rotary rows
    put in halves as they are read (the file keeps DeepSeek's pairs); the latent's norms by the file's one epsilon.
    A legacy file (kv_b_proj unsplit) gives a head's query and value
    widths as its key and value lengths."""
    rotary = key("rope.dimension_count")
    query = key("attention.key_length_mla") or key("attention.key_length")
    gating = GATING.get(key("expert_gating_func"))
    if gating is None:
        glm_flash = config["num_hidden_layers"] in (47, 48) and config["vocab_size"] == 154880
        gating = "sigmoid" if glm_flash else "softmax"
    fields = {"kv_lora_rank": key("attention.kv_lora_rank"), "q_lora_rank": key("attention.q_lora_rank") or None,
              "qk_rope_head_dim": rotary, "qk_nope_head_dim": query - rotary,
              "v_head_dim": key("attention.value_length_mla") or key("attention.value_length"),
              "first_k_dense_replace": key("leading_dense_block_count") or 0, "scoring_func": gating,
              "rotary_rows_in_halves": True, "head_dim": None, "latent_norm_eps": config["rms_norm_eps"]}
    if key("expert_count"):
        fields |= _v3_routing(key) | {"moe_intermediate_size": key("expert_feed_forward_length")}
    return fields


def _minicpm3(key, config: dict) -> dict:
    """A MiniCPM3 file's latent attention as transformers' MiniCPM3Config names it (DeepSeek's fields, a head's value
    the hidden size over the heads where the file does not say, as llama.cpp reads it), and the scales llama.cpp
    fixes, which the files do not keep: MiniCPM3-4B's embeddings times 12, residual branches times 1.4 over the root
    of the layers, logits over the hidden size in 256s."""
    fields = _deepseek2(key, config)
    return {name: fields[name] for name in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                            "head_dim", "latent_norm_eps")} | {
        "v_head_dim": fields["v_head_dim"] or config["hidden_size"] // config["num_attention_heads"],
        "scale_emb": 12.0, "scale_depth": 1.4, "dim_model_base": 256}


def _v3_routing(key) -> dict:
    """DeepSeek-V3's routing as a file gives it (DeepSeek's, GLM-4.5's and Nemotron 3's files), by transformers'
    names: the experts, those a token takes and the shared ones, the chosen weights' scale and whether they are
    renormalised, the groups and those chosen."""
    return {"n_routed_experts": key("expert_count"), "num_experts_per_tok": key("expert_used_count"),
            "n_shared_experts": key("expert_shared_count") or 0,
            "routed_scaling_factor": key("expert_weights_scale") or 1.0,
            "norm_topk_prob": bool(key("expert_weights_norm")),
            "n_group": key("expert_group_count") or 1, "topk_group": key("expert_group_used_count") or 1}


def _deepseek2_mscales(key, config: dict) -> dict:
    """YaRN's log multiplier in a DeepSeek (or Mistral 4) file, 0.1 mscale_all_dim as its converter writes it, as both
    mscales (transformers' reading of DeepSeek's configs: the rotation unscaled, every score by mscale_all_dim's
    factor squared, deepseek.py's _attention_scale); and the queries' temperature where the file has one (Mistral
    Large 3's, Llama 4's: attention.temperature_scale past every attention.temperature_length tokens), as llama.cpp
    reads it."""
    rope = dict(config.get("rope_scaling") or {"rope_type": "default"})
    if rope_type(rope) == "yarn" and key("rope.scaling.yarn_log_multiplier"):
        every = key("rope.scaling.yarn_log_multiplier") / 0.1
        rope |= {"mscale": every, "mscale_all_dim": every}
    if key("attention.temperature_scale"):
        length = key("attention.temperature_length")
        if not length:
            raise ValueError("attention.temperature_scale without attention.temperature_length, the context past "
                             "which the queries' temperature grows")
        if rope.setdefault("original_max_position_embeddings", length) != length:
            raise ValueError(f"attention.temperature_length {length} differs from the yarn's original context "
                             f"{rope['original_max_position_embeddings']}, from which Loom also scales the queries")
        rope["llama_4_scaling_beta"] = key("attention.temperature_scale")
    return {"rope_scaling": rope} if rope_type(rope) != "default" or "llama_4_scaling_beta" in rope else {}


def _nemotron_h_experts(key, used: int, inner: int | None, shared: int | None) -> dict:
    """A Nemotron 3 file's experts as transformers names them, as llama.cpp runs them: sigmoid scores, renormalised
    and scaled where the file says, within the best groups where it has several (scored by their best two, as
    llama.cpp scores any mixture's groups); an expert's width a layer's feed_forward_length over the experts it
    takes where the file does not say (llama.cpp's fallback); a latent mixture's width (Nemotron 3 Super's)."""
    if not isinstance(used, int) or not isinstance(inner, (int, type(None))):
        raise ValueError("a Nemotron-H file whose layers take different numbers of experts, or experts of different "
                         "widths (NVIDIA's Puzzle models), is not supported; Loom runs mixtures whose layers share "
                         "them")
    return _v3_routing(key) | {"moe_intermediate_size": inner or max(per_layer(key("feed_forward_length"), 1)) // used,
                               "moe_shared_expert_intermediate_size": shared or 0,
                               "moe_latent_size": key("moe_latent_size") or None}


def _ernie_experts(key, config: dict, experts: int, used: int, inner: int | None, shared: int | None) -> dict:
    """ERNIE 4.5's mixture as transformers names it: the layers from leading_dense_block_count on route
    (every interleave_moe_layer_step-th), its shared expert a whole number of experts wide; its q/k
    rows put in rotate-half order as they are read (the file keeps the checkpoint's pairs)."""
    if not inner:
        raise ValueError("an ernie4_5-moe file needs expert_feed_forward_length, as llama.cpp does")
    if (shared or 0) % inner:
        raise ValueError(f"ERNIE 4.5's shared expert is a whole number of experts wide; the file's is {shared} "
                         f"wide, its experts {inner}")
    return {"moe_num_experts": experts, "moe_k": used, "moe_intermediate_size": inner,
            "moe_num_shared_experts": (shared or 0) // inner,
            "moe_layer_start_index": key("leading_dense_block_count") or 0,
            "moe_layer_end_index": config["num_hidden_layers"] - 1,
            "moe_layer_interval": key("interleave_moe_layer_step") or 1}


def _lfm2_layers(key, heads: int, layers: int, file_name: str) -> dict:
    """An LFM2 file's layers as transformers names them: a layer without K/V heads is a short
    convolution (llama.cpp's reading), the others attend with one count of them; the MLP's width as
    the file keeps it (transformers would derive it again from intermediate_size)."""
    counts, kv_heads = _kv_heads_by_layer(key, heads, layers, file_name, "LFM2")
    return {"num_key_value_heads": kv_heads,
            "layer_types": ["full_attention" if n else "conv" for n in counts],
            "conv_L_cache": key("shortconv.l_cache", 3), "block_auto_adjust_ff_dim": False,
            "sliding_window": key("attention.sliding_window")}


def _kv_heads_by_layer(key, heads: int, layers: int, file_name: str, family: str) -> tuple[list[int], int]:
    """Each layer's K/V heads as a hybrid's file lists them (none: a layer that does not attend, as llama.cpp
    reads LFM2's and Granite 4's), and the one count its attention layers share (``heads`` where none
    attends), or a ValueError where they differ."""
    counts = per_layer(key("attention.head_count_kv", heads), layers, key("nextn_predict_layers") or 0)
    if len(counts) != layers:
        raise ValueError(f"{file_name} lists K/V heads for {len(counts)} layers of {layers}")
    kv_heads = {n for n in counts if n}
    if len(kv_heads) > 1:
        raise ValueError(f"{file_name}'s attention layers have different K/V head counts ({sorted(kv_heads)}); Loom "
                         f"runs {family} models whose attention layers share one")
    return counts, kv_heads.pop() if kv_heads else heads


def _ssm_sizes(arch: str, key, file_name: str, names: tuple[str, ...] = MAMBA2_SIZES, layers: str = "Mamba2") -> dict:
    """A file's Mamba2 (or Mamba's: MAMBA_SIZES) sizes by their llama.cpp names (ssm.*), or a ValueError naming
    those it leaves out."""
    sizes = {name: key(f"ssm.{name}") for name in names}
    if missing := [f"{arch}.ssm.{name}" for name, value in sizes.items() if not value]:
        raise ValueError(f"{file_name} leaves out the {layers} layers' sizes ({', '.join(missing)}), which llama.cpp "
                         "requires")
    return sizes


def _mamba2_fields(arch: str, key, file_name: str) -> dict:
    """A file's Mamba2 sizes by Granite 4's (and Falcon-H1's) transformers names: mamba2.py's Mamba2Shape.from_hf."""
    sizes = _ssm_sizes(arch, key, file_name)
    heads, inner = sizes["time_step_rank"], sizes["inner_size"]
    return {"mamba_d_conv": sizes["conv_kernel"], "mamba_d_state": sizes["state_size"],
            "mamba_n_groups": sizes["group_count"], "mamba_n_heads": heads, "mamba_d_head": inner // heads,
            "mamba_d_ssm": inner}


def _mamba2_model(arch: str, key, tensors: dict, config: dict, file_name: str) -> dict:
    """A Mamba2 language model's file (Mamba2 layers alone) as transformers' Mamba2Config names its sizes
    (nemotron_h.py's from_mamba2 reads them); its context UNBOUNDED_CONTEXT where the file says none."""
    sizes = _ssm_sizes(arch, key, file_name)
    heads, inner = sizes["time_step_rank"], sizes["inner_size"]
    return {"num_heads": heads, "head_dim": inner // heads, "state_size": sizes["state_size"],
            "n_groups": sizes["group_count"], "conv_kernel": sizes["conv_kernel"], "expand": inner / config["hidden_size"],
            "layer_norm_epsilon": config["rms_norm_eps"], "max_position_embeddings": key("context_length", UNBOUNDED_CONTEXT),
            "use_conv_bias": any(name.endswith(".ssm_conv1d.bias") for name in tensors)}


def _mamba_model(arch: str, key, tensors: dict, config: dict, file_name: str) -> dict:
    """A Mamba file's sizes as transformers' MambaConfig names them (mamba.py's MambaSpec reads them); a file that
    says ssm.dt_b_c_rms is a Falcon-Mamba's, whose time steps, B and C are normed with the file's epsilon (as
    llama.cpp reads it); its context UNBOUNDED_CONTEXT where the file says none."""
    sizes = _ssm_sizes(arch, key, file_name, MAMBA_SIZES, "Mamba")
    falcon = bool(key("ssm.dt_b_c_rms"))
    return {"model_type": "falcon_mamba" if falcon else "mamba", "intermediate_size": sizes["inner_size"],
            "state_size": sizes["state_size"], "conv_kernel": sizes["conv_kernel"],
            "time_step_rank": sizes["time_step_rank"], "layer_norm_epsilon": config["rms_norm_eps"],
            **({"dt_b_c_eps": config["rms_norm_eps"]} if falcon else {}),
            "max_position_embeddings": key("context_length", UNBOUNDED_CONTEXT),
            "use_conv_bias": any(name.endswith(".ssm_conv1d.bias") for name in tensors)}


def _jamba_layers(arch: str, key, tensors: dict, heads: int, config: dict, file_name: str) -> dict:
    """A Jamba file's layers as transformers' JambaConfig lists them, read as llama.cpp reads them: a layer without
    K/V heads is a Mamba layer, one with a router routes to the file's experts (the others' MLPs as wide); its Mamba
    sizes (inner_size twice the hidden size, as llama.cpp requires: mamba_expand)."""
    layers = config["num_hidden_layers"]
    counts, kv_heads = _kv_heads_by_layer(key, heads, layers, file_name, "Jamba")
    sizes = _ssm_sizes(arch, key, file_name, MAMBA_SIZES, "Mamba")
    if sizes["inner_size"] != 2 * config["hidden_size"]:
        raise ValueError(f"{file_name}'s Mamba layers are {sizes['inner_size']} wide, not twice its hidden size "
                         f"({config['hidden_size']}), as llama.cpp runs Jamba")
    routes = [f"blk.{i}.ffn_gate_inp.weight" in tensors for i in range(layers)]
    if any(routes) and not key("expert_count"):
        raise ValueError(f"{file_name} has routers but no {arch}.expert_count, which llama.cpp requires")
    return {"layers_block_type": ["attention" if n else "mamba" for n in counts], "num_key_value_heads": kv_heads,
            "layers_num_experts": [key("expert_count") if routed else 1 for routed in routes],
            "mamba_d_conv": sizes["conv_kernel"], "mamba_d_state": sizes["state_size"],
            "mamba_dt_rank": sizes["time_step_rank"], "mamba_expand": 2,
            "mamba_conv_bias": any(name.endswith(".ssm_conv1d.bias") for name in tensors), "mamba_proj_bias": False}


def _granite_hybrid_layers(arch: str, key, heads: int, config: dict, file_name: str) -> dict:
    """A Granite 4 hybrid file's layers as transformers names them, read as llama.cpp reads them: a layer
    without K/V heads is a Mamba2 layer, the others attend with one count of them (rotating only where
    rope.scaling.finetuned says so: Granite 4.0 H's files say not); the Mamba2 layers' sizes; a dense file's
    MLP as its shared one (experts: _experts)."""
    counts, kv_heads = _kv_heads_by_layer(key, heads, config["num_hidden_layers"], file_name, "Granite 4")
    fields = _mamba2_fields(arch, key, file_name) | {
        "num_key_value_heads": kv_heads, "layer_types": ["attention" if n else "mamba" for n in counts],
        "position_embedding_type": None if key("rope.scaling.finetuned") is False else "rope"}
    if not config.get("num_local_experts"):
        fields |= {"shared_intermediate_size": config["intermediate_size"], "num_local_experts": 0}
    return fields


def _falcon_h1_layers(arch: str, key, tensors: dict, file_name: str) -> dict:
    """A Falcon-H1 file's Mamba2 sizes as transformers names them; its gated answers normed where the file has the
    norm (llama.cpp's reading: gated, then normed); no multipliers, which its converter folded into the weights;
    the biases it has (which falcon_h1.py refuses)."""
    has = lambda name: f"blk.0.{name}" in tensors
    return _mamba2_fields(arch, key, file_name) | {
        "mamba_rms_norm": has("ssm_norm.weight"), "mamba_norm_before_gate": False,
        "mamba_conv_bias": has("ssm_conv1d.bias"), "attention_bias": has("attn_output.bias"),
        "mlp_bias": has("ffn_gate.bias") or has("ffn_up.bias") or has("ffn_down.bias")}


def _nemotron_h_layers(arch: str, key, heads: int, config: dict, file_name: str) -> dict:
    """A Nemotron-H file's layers as transformers names them, read as llama.cpp reads them: a layer with K/V
    heads attends, one with an MLP width is an MLP (in a file with experts, a mixture of them), one with neither
    is a Mamba2 layer; the Mamba2 sizes. The lists may go on for the file's next-token prediction layers
    (Nemotron 3's), which are not read."""
    layers = config["num_hidden_layers"]
    counts, kv_heads = _kv_heads_by_layer(key, heads, layers, file_name, "Nemotron-H")
    if key("feed_forward_length") is None:
        raise ValueError(f"{file_name} leaves out {arch}.feed_forward_length, which tells its MLP layers apart")
    widths = per_layer(key("feed_forward_length"), layers, key("nextn_predict_layers") or 0)
    if len(widths) != layers:
        raise ValueError(f"{file_name} lists MLP widths for {len(widths)} layers of {layers}")
    experts = bool(key("expert_count"))
    if len({w for w in widths if w}) > 1 and not experts:
        raise ValueError(f"{file_name}'s MLP layers have different widths ({sorted({w for w in widths if w})}); Loom "
                         "runs Nemotron-H models whose MLP layers share one")
    sizes = _ssm_sizes(arch, key, file_name)
    feed_forward = "moe" if experts else "mlp"
    # (in llama.cpp's order: a layer with both an MLP width and K/V heads is an MLP)
    return {"layers_block_type": [feed_forward if w else "full_attention" if n else "linear_attention"
                                  for n, w in zip(counts, widths)], "intermediate_size": max(widths),
            "num_key_value_heads": kv_heads, "head_dim": config["head_dim"] or config["hidden_size"] // heads,
            "mamba_num_heads": sizes["time_step_rank"], "mamba_head_dim": sizes["inner_size"] // sizes["time_step_rank"],
            "ssm_state_size": sizes["state_size"], "n_groups": sizes["group_count"], "conv_kernel": sizes["conv_kernel"],
            # (llama.cpp requires layer_norm_epsilon, and reads an RMS one where the file has it)
            "layer_norm_epsilon": key("attention.layer_norm_rms_epsilon", key("attention.layer_norm_epsilon", 1e-5))}


def _minicpm_scales(key, config: dict) -> dict:
    """A MiniCPM file's multipliers as Granite's (transformers' names): its embeddings' scale_emb, its residuals'
    scale_depth / sqrt(layers), the logits divided by hidden / dim_model_base, as its converter writes them (its
    defaults where a file leaves one out: 12, 1.4 / sqrt(layers) and MiniCPM's dim_model_base of 256); the
    attention's scale a head's, as Llama's."""
    return {"embedding_multiplier": key("embedding_scale") or 12.0,
            "residual_multiplier": key("residual_scale") or 1.4 / config["num_hidden_layers"] ** 0.5,
            "logits_scaling": key("logit_scale") or config["hidden_size"] / 256}


def _layer_norm_layers(arch: str, key, tensors: dict[str, TensorInfo], config: dict, file_name: str) -> dict:
    """A file's LayerNorm layers as transformers names them, as llama.cpp reads them: the norms' epsilon; the
    products' biases where the file has them (StarCoder2's and Phi-2's every product's; StableLM's q/k/v's); a
    StableLM file without norms before its MLPs runs them beside the attention, and one with q/k norms LayerNorms a
    head at a time (StableLM 2 12B's; Command R+'s too); Phi-2's rotary
    over rope.dimension_count of a head; Cohere's logits times logit_scale, Command R7B's window layers (three in
    four where the file names no pattern) rotating alone; OLMo 1's queries, keys and values clamped where the file
    says (clamp_kqv: transformers' clip_qkv); GPT-NeoX's and Falcon's MLPs' GELU by tanh (as
    llama.cpp runs it, where their checkpoints' is erf's), GPT-NeoX's MLP beside the attention where the file says
    (use_parallel_residual), Falcon 40B's two norms where the file has attn_norm_2."""
    has = lambda name: f"blk.0.{name}" in tensors
    heads = config["num_attention_heads"]
    head = config["head_dim"] or config["hidden_size"] // heads
    # (the norms' epsilon under the name LlamaSpec reads first, whatever the norm)
    out = {"rms_norm_eps": key("attention.layer_norm_epsilon", 1e-5), "attention_out_bias": has("attn_output.bias"),
           "attention_bias": has("attn_q.bias") or has("attn_qkv.bias"), "mlp_bias": has("ffn_up.bias"),
           "partial_rotary_factor": (key("rope.dimension_count") or head) / head}
    if key("attention.clamp_kqv"):
        out["clip_qkv"] = key("attention.clamp_kqv")
    if arch in ("stablelm", "orion"):  # (StableLM 2 12B's: each head's q/k LayerNorm, its MLP beside the attention)
        out |= {"use_qkv_bias": out.pop("attention_bias"), "use_parallel_residual": not has("ffn_norm.weight"),
                "qk_layernorm": has("attn_q_norm.weight")}
    if arch in ("gptneox", "falcon", "bloom", "mpt"):  # (llama.cpp's GELU is tanh's; the rows come as queries',
        # keys', values')
        out |= {"hidden_act": "gelu_pytorch_tanh", "qkv_layout": None}
    if arch == "mpt":  # (ALiBi by the file's maximum bias, no rotary; its final norm's bias where it has one)
        if "position_embd.weight" in tensors or not key("attention.max_alibi_bias"):
            raise ValueError(f"{file_name} is an mpt model with learned positions (position_embd) or without "
                             "attention.max_alibi_bias: Loom runs MPT's ALiBi alone")
        out |= {"alibi_max_bias": key("attention.max_alibi_bias"), "final_norm_bias": "output_norm.bias" in tensors,
                "no_rope_layers": [0] * config["num_hidden_layers"]}
    if arch == "gptneox":  # (its MLP beside the attention on a norm of its own where the file says, as llama.cpp's)
        out |= {"use_parallel_residual": bool(key("use_parallel_residual", True)), "mlp_bias": has("ffn_up.bias")}
    if arch == "falcon":  # (a norm for the attention and one for the MLP where the file has two, attn_norm_2 the first;
        # its K/V heads as the file says, which Falcon's configs tell by their layout)
        out |= {"num_ln_in_parallel_attn": 2 if has("attn_norm_2.weight") else 1, "new_decoder_architecture": True,
                "num_kv_heads": config["num_key_value_heads"]}
    if arch in ("command-r", "cohere2"):  # (Command R+'s: each head's q/k LayerNorm)
        out |= {"logit_scale": key("logit_scale", 1.0), "use_qk_norm": has("attn_q_norm.weight")}
    if arch == "cohere2":
        out |= {"sliding_window": key("attention.sliding_window"),
                "layer_types": _sliding_layers(key, config["num_hidden_layers"], file_name, default_pattern=4)}
    return out


def _gpt2_model(key, tensors: dict[str, TensorInfo], config: dict) -> dict:
    """A GPT-2 file's config by GPT-2's names (a StarCoder file's too: multi-query where it has one K/V head): its
    positions' table as long as the file's (n_ctx, its context_length), its matrices as nn.Linear keeps them
    (linear_layout: gpt2.py's), its own output layer where it has one (Llama's names kept beside, which the reader's
    own steps read)."""
    return config | {"n_embd": config["hidden_size"],
            "n_layer": config["num_hidden_layers"], "n_head": config["num_attention_heads"],
            "n_inner": config["intermediate_size"], "n_positions": tensors["position_embd.weight"].shape[0],
            "layer_norm_epsilon": key("attention.layer_norm_epsilon", 1e-5),
            "tie_word_embeddings": config["tie_word_embeddings"], "linear_layout": True,
            "multi_query": config["num_key_value_heads"] == 1}


def per_layer(value, layers: int, predicting: int = 0, kind: type = int) -> list:
    """A size (or another number: ``kind``) a file may give once or a layer at a time, as a list a layer (a list's
    last ``predicting`` entries left out where it goes on for the file's next-token prediction layers)."""
    if np.ndim(value) == 0:
        return [kind(value)] * layers
    values = [kind(v) for v in value]
    return values[:layers] if predicting and len(values) == layers + predicting else values


def _exaone_windows(arch: str, key, layers: int, file_name: str) -> dict:
    """An EXAONE 4 or EXAONE-MoE file's layer types as llama.cpp reads them: EXAONE 4's window for the 32B's 64 layers
    alone (none for the others), EXAONE-MoE's always (128 tokens where the file names none); three window layers
    in four where the file lists none, its global layers then without rotary. A ValueError for window layers that
    rotate by a base of their own."""
    if arch == "exaone4" and layers != EXAONE4_WINDOWED_LAYERS:
        return {"sliding_window": None, "layer_types": ["full_attention"] * layers}
    if key("rope.freq_base_swa") not in (None, key("rope.freq_base")):
        raise ValueError(f"{file_name}'s window layers rotate by a base of their own, which Loom does not run for "
                         f"{arch}")
    return {"sliding_window": key("attention.sliding_window", EXAONE4_WINDOW if arch == "exaone4" else
                                  EXAONE_MOE_WINDOW),
            "layer_types": _sliding_layers(key, layers, file_name, default_pattern=EXAONE4_GLOBAL_EVERY)}


def _qwen35_layers(arch: str, key, layers: int, file_name: str) -> dict:
    """A Qwen3.5 or Qwen3-Next file's delta-rule layers as transformers names them, read as llama.cpp reads them:
    the layers the file lists as recurrent, else all but every full_attention_interval-th (its next-token
    prediction layers, MTP, which its converter keeps after them, are not run); the file's layout (qwen35.py's
    llama_cpp_layout: -exp(A_log) stored, query rows beside the gates'; Qwen3.5's value heads tiled)."""
    recurrent = key("attention.recurrent_layers")
    if recurrent is None:
        every = key("full_attention_interval", 4)
        recurrent = [(i + 1) % every != 0 for i in range(layers)]
    predicting = key("nextn_predict_layers") or 0
    if predicting and len(recurrent) == layers + predicting:  # (the prediction layers listed too, last)
        recurrent = recurrent[:layers]
    if len(recurrent) != layers:
        raise ValueError(f"{file_name} lists {len(recurrent)} recurrent layers of {layers}")
    value_heads = key("ssm.time_step_rank")
    fields = {"linear_conv_kernel_dim": key("ssm.conv_kernel"), "linear_key_head_dim": key("ssm.state_size"),
              "linear_num_key_heads": key("ssm.group_count"), "linear_num_value_heads": value_heads,
              "linear_value_head_dim": (key("ssm.inner_size") or 0) // (value_heads or 1)}
    if missing := [name for name, value in fields.items() if not value]:
        raise ValueError(f"{file_name} leaves out the delta-rule layers' sizes ({', '.join(missing)}), which "
                         "llama.cpp requires")
    return fields | {"layer_types": ["linear_attention" if r else "full_attention" for r in recurrent],
                     "llama_cpp_layout": True, "llama_cpp_tiled_value_heads": arch != "qwen3next"}


def _shared_by_layers(value, name: str, file_name: str):
    """A size every layer shares, which a file may list a layer at a time (Granite 4's converter
    writes its heads so): the one value, or a ValueError where the layers differ."""
    if value is None or isinstance(value, (int, float)):
        return value
    values = sorted(set(int(v) for v in value))
    if len(values) != 1:
        raise ValueError(f"{file_name} gives its layers different {name} ({values}); Loom runs models whose layers "
                         "share one")
    return values[0]


def _sliding_layers(key, layers: int, file_name: str, default_pattern: int | None = None) -> list[str] | None:
    """Each layer's type where the file says which slide (attention.sliding_window_pattern: a flag a
    layer, or n: n - 1 local layers, then a global one, as llama.cpp reads it), else by
    ``default_pattern`` (the architecture's, llama.cpp's); None where neither says."""
    pattern = key("attention.sliding_window_pattern", default_pattern)
    if pattern is None:
        return None
    if isinstance(pattern, int):
        slides = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    else:
        slides = [bool(flag) for flag in pattern]
        if len(slides) == layers + (key("nextn_predict_layers") or 0):  # (its next-token prediction layers' too)
            slides = slides[:layers]
        if len(slides) != layers:
            raise ValueError(f"{file_name}'s sliding_window_pattern names {len(slides)} layers of {layers}")
    return ["sliding_attention" if slide else "full_attention" for slide in slides]


def _rope_scaling(key, tensors: dict[str, TensorInfo]) -> dict:
    """The config's rope scaling (transformers' rope_scaling) from the file's metadata and rotary
    tensors, as llama.cpp's converter writes them: linear; yarn (Qwen's long-context files); a
    divisor per frequency (rope_freqs, no scaling type: Llama 3.1's llama3 scaling as the converter
    computes it, which llama.cpp divides each frequency by); longrope (Phi-3's short and long
    factors, with the scaling type "longrope" or, as llama.cpp's Phi-3 converter writes them,
    without one); {} for none."""
    scaling = key("rope.scaling.type") or "none"
    if scaling == "linear" and key("rope.scaling.factor") in (None, 0.0, 1.0):
        scaling = "none"  # as llama.cpp reads it (its own model saver writes linear and 0 for none)
    kept = [name for name in ROPE_TENSORS if name in tensors]
    factors = {name: _values(tensors[name]) for name in kept}
    if ROPE_FREQS in factors:
        if scaling != "none":
            raise ValueError(f"rope_freqs beside a {scaling} rope scaling: Loom reads rope_freqs alone")
        if len(factors) > 1:
            raise ValueError("rope_freqs beside longrope's factors: Loom reads one or the other")
        return {"rope_scaling": {"rope_type": "frequency_factors", "factors": factors[ROPE_FREQS]}}
    if scaling == "longrope" or factors:
        if scaling not in ("longrope", "none"):
            raise ValueError(f"longrope's factors beside a {scaling} rope scaling: Loom reads one or the other")
        if set(factors) != {ROPE_LONG, ROPE_SHORT}:
            raise ValueError(f"longrope needs rope_factors_long and rope_factors_short; the file has "
                             f"{', '.join(kept) or 'neither'}")
        longrope = {"rope_type": "longrope", "long_factor": factors[ROPE_LONG], "short_factor": factors[ROPE_SHORT],
                    "original_max_position_embeddings": key("rope.scaling.original_context_length",
                                                            key("context_length", 2048))}
        if key("rope.scaling.attn_factor") is not None:
            longrope["attention_factor"] = key("rope.scaling.attn_factor")
        return {"rope_scaling": longrope}
    if scaling == "linear":
        return {"rope_scaling": {"rope_type": "linear", "factor": key("rope.scaling.factor")}}
    if scaling == "yarn":
        # The attention factor stays transformers' default for the factor (0.1 ln(factor) + 1), as
        # llama.cpp computes it for these families whatever yarn_attn_factor says (its model saver
        # writes 1.0 there, meaning nothing more).
        yarn = {"rope_type": "yarn", "factor": key("rope.scaling.factor"),
                "original_max_position_embeddings": key("rope.scaling.original_context_length",
                                                        key("context_length", 2048))}
        for field, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
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
