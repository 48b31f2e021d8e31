"""The Llama module's kin in Llama's terms: how other families' configs (the hub's names, transformers', a GGUF file's,
which come in Llama's already) read as Llama's config fields (in_llama_terms: GPT-NeoX's, Falcon's, DBRX's, MPT's,
BLOOM's, Llama 4's, Cohere2-MoE's), and the names their checkpoints give Llama's parameters (HUB_NAMES, AFMOE_NAMES,
LLAMA4_NAMES). llama_spec.py reads the result as LlamaSpec."""

from __future__ import annotations

# AFMoE's checkpoint names by Llama's, in this order: its norm of the attention's output is GLM-4's (post_norm's
# name in Llama's checkpoints), the norm before its MLP Llama's post_norm, its router's gate the router
AFMOE_NAMES = ((".post_attention_layernorm.", ".post_self_attn_layernorm."),
               (".pre_mlp_layernorm.", ".post_attention_layernorm."), (".mlp.router.gate.", ".mlp.gate."))
# Llama 4's checkpoint names by Llama's: its feed_forward the MLP (its experts' stacks keep their names: moe.py reads
# them as they are), its router the gate
LLAMA4_NAMES = ((".feed_forward.router.", ".mlp.gate."), (".feed_forward.shared_expert.", ".mlp.shared_expert."),
                (".feed_forward.gate_proj.", ".mlp.gate_proj."), (".feed_forward.up_proj.", ".mlp.up_proj."),
                (".feed_forward.down_proj.", ".mlp.down_proj."))
# checkpoint names of Llama's parameters in other families, in this order of replacement: EXAONE 3.5's (the hub's,
# and transformers' saved ones) after GPT-2's (its output product before the other attention products), StarCoder2's
# MLP's, Phi-2's, HunYuan's q/k norms, Hunyuan-A13B's router and shared MLP (by DeepSeek's names)
HUB_NAMES = (("transformer.wte.", "model.embed_tokens."), ("transformer.ln_f.", "model.norm."),
             ("transformer.h.", "model.layers."), (".attn.attention.out_proj.", ".self_attn.o_proj."),
             (".attn.attention.", ".self_attn."), (".ln_1.", ".input_layernorm."),
             (".ln_2.", ".post_attention_layernorm."), (".mlp.c_fc_0.", ".mlp.gate_proj."),
             (".mlp.c_fc_1.", ".mlp.up_proj."), (".mlp.c_fc.", ".mlp.up_proj."), (".mlp.c_proj.", ".mlp.down_proj."),
             (".mlp.fc1.", ".mlp.up_proj."), (".mlp.fc2.", ".mlp.down_proj."),
             (".self_attn.dense.", ".self_attn.o_proj."), ("model.final_layernorm.", "model.norm."),
             (".self_attn.query_layernorm.", ".self_attn.q_norm."), (".self_attn.key_layernorm.", ".self_attn.k_norm."),
             (".mlp.gate.wg.", ".mlp.gate."), (".mlp.shared_mlp.", ".mlp.shared_experts."),
             # GPT-NeoX's (its output layer the hub's embed_out), Falcon's (its two norms the attention's and the MLP's)
             ("gpt_neox.embed_in.", "model.embed_tokens."), ("gpt_neox.layers.", "model.layers."),
             ("gpt_neox.final_layer_norm.", "model.norm."), ("embed_out.", "lm_head."),
             (".attention.query_key_value.", ".self_attn.qkv_proj."), (".attention.dense.", ".self_attn.o_proj."),
             (".mlp.dense_h_to_4h.", ".mlp.up_proj."), (".mlp.dense_4h_to_h.", ".mlp.down_proj."),
             ("transformer.word_embeddings.", "model.embed_tokens."),
             (".self_attention.query_key_value.", ".self_attn.qkv_proj."),
             (".self_attention.dense.", ".self_attn.o_proj."),
             (".ln_attn.", ".input_layernorm."), (".ln_mlp.", ".post_attention_layernorm."),
             # BLOOM's (its embeddings' norm), Apertus's
             ("transformer.word_embeddings_layernorm.", "model.embedding_norm."),
             (".attention_layernorm.", ".input_layernorm."), (".feedforward_layernorm.", ".post_attention_layernorm."),
             # DBRX's (its experts' three stacks, a matrix of every expert's rows each: moe.py's _routed_experts)
             ("transformer.blocks.", "model.layers."), ("transformer.norm_f.", "model.norm."),
             (".norm_attn_norm.norm_1.", ".input_layernorm."),
             (".norm_attn_norm.norm_2.", ".post_attention_layernorm."),
             (".norm_attn_norm.attn.Wqkv.", ".self_attn.qkv_proj."),
             (".norm_attn_norm.attn.out_proj.", ".self_attn.o_proj."),
             (".ffn.router.layer.", ".mlp.gate."), (".ffn.experts.mlp.", ".mlp.experts."),
             # MPT's (after DBRX's, whose names hold some of them)
             (".norm_1.", ".input_layernorm."), (".norm_2.", ".post_attention_layernorm."),
             (".attn.Wqkv.", ".self_attn.qkv_proj."), (".attn.out_proj.", ".self_attn.o_proj."),
             (".ffn.up_proj.", ".mlp.up_proj."), (".ffn.down_proj.", ".mlp.down_proj."))


def in_llama_terms(kind: str, c: dict) -> dict:
    """``kind``'s config in Llama's names where its family names them otherwise (GPT-NeoX's, Falcon's, DBRX's, MPT's,
    BLOOM's: CONFIGS_OF_KIN), refused there where llama.cpp and transformers do not run it; other families' as they
    are."""
    return CONFIGS_OF_KIN[kind](c) if kind in CONFIGS_OF_KIN else c


def _gpt_neox_config(c: dict) -> dict:
    """GPT-NeoX's config (the hub's names, transformers', a GGUF file's) in Llama's names: biases, the MLP's norm
    beside the attention's, a head's query, key and value rows together, every head its own K/V, the rotary's base
    and share."""
    extra = {"mlp_bias": c.get("mlp_bias", True), "parallel_mlp_norm": c.get("use_parallel_residual", True),
             "qkv_layout": c.get("qkv_layout", "heads"), "num_key_value_heads": c["num_attention_heads"]}
    if c.get("rotary_emb_base"):  # (the hub's names; transformers 5's rope_parameters)
        extra["rope_theta"] = c["rotary_emb_base"]
    if c.get("rotary_pct"):
        extra["partial_rotary_factor"] = c["rotary_pct"]
    return {"use_parallel_residual": True} | c | extra


def _falcon_config(c: dict) -> dict:
    """Falcon's config in Llama's names: biases, the MLP's width and activation, K/V heads (one where it is
    multi-query), the MLP's norm beside the attention's (40B's), the fused q/k/v rows' layout. A ValueError for a
    Falcon with ALiBi or its MLP after the attention (Falcon-RW's), which llama.cpp does not run either."""
    if c.get("alibi"):
        raise ValueError("falcon with alibi (ALiBi's positions, Falcon-RW's) is not supported")
    if not c.get("parallel_attn", True):
        raise ValueError("falcon with its MLP after the attention (parallel_attn false, Falcon-RW's) is not supported")
    heads = c.get("num_attention_heads") or c["n_head"]
    new = bool(c.get("new_decoder_architecture"))
    # (as transformers' attention counts them, whatever num_key_value_heads a saved config says)
    kv = c.get("num_kv_heads") or c.get("n_head_kv") or heads if new or not c.get("multi_query", True) else 1
    return c | {"num_attention_heads": heads, "num_key_value_heads": kv,
                "intermediate_size": c.get("intermediate_size") or c.get("ffn_hidden_size") or 4 * c["hidden_size"],
                "hidden_act": c.get("hidden_act") or c.get("activation", "gelu"),
                "attention_bias": c.get("attention_bias", c.get("bias", False)),
                "mlp_bias": c.get("mlp_bias", c.get("bias", False)),
                "parallel_mlp_norm": c.get("parallel_mlp_norm", (c.get("num_ln_in_parallel_attn") or (2 if new else 1))
                                           == 2),
                "qkv_layout": c.get("qkv_layout", "groups" if new else None if c.get("multi_query", True) else "heads")}


def _mpt_config(c: dict) -> dict:
    """MPT's config in Llama's names: its MLP expansion_ratio times the hidden size, no biases but its final norm's,
    every head its own K/V, its q/k/v clamped where clip_qkv says, no rotary but ALiBi (alibi_bias_max), an exact
    GELU. A ValueError for what transformers' MPT and llama.cpp do not run: q/k LayerNorms (qk_ln), another softmax
    scale, no ALiBi, grouped K/V heads."""
    attention = c.get("attn_config") or {}
    named = {MOSAIC_NAMES.get(name, name): value for name, value in c.items()}
    if not attention:  # (a GGUF file's: Llama's names already)
        return named
    for field, refused in (("qk_ln", True), ("prefix_lm", True), ("alibi", False)):
        if bool(attention.get(field, not refused)) == refused:
            raise ValueError(f"mpt with attn_config.{field} {refused} is not supported")
    if attention.get("softmax_scale") is not None or attention.get("attn_type", "multihead_attention") != \
            "multihead_attention":
        raise ValueError("mpt with a softmax_scale of its own or grouped K/V heads (attn_type) is not supported")
    hidden, layers = named["hidden_size"], named["num_hidden_layers"]
    return named | {"num_key_value_heads": named["num_attention_heads"],
                    "intermediate_size": int(c.get("expansion_ratio", 4) * hidden), "clip_qkv": attention.get(
                        "clip_qkv"), "alibi_max_bias": float(attention.get("alibi_bias_max", 8)),
                    "no_rope_layers": [0] * layers, "final_norm_bias": True, "hidden_act": "gelu",
                    "logit_scale": 1.0,  # (transformers' MPT scales no logits, whatever logit_scale says)
                    "layer_norm_epsilon": c.get("layer_norm_epsilon", 1e-5),
                    "tie_word_embeddings": c.get("tie_word_embeddings", True)}


def _bloom_config(c: dict) -> dict:
    """BLOOM's config in Llama's names: its MLP four times the hidden size, biases everywhere, every head its own
    K/V, a head's query, key and value rows together (its fused q/k/v's layout), no rotary but ALiBi (its slopes' 8),
    its embeddings LayerNormed. A ValueError for the residual taken after the norms
    (apply_residual_connection_post_layernorm), which llama.cpp does not run either."""
    if c.get("apply_residual_connection_post_layernorm"):
        raise ValueError("bloom with its residual taken after the norms (apply_residual_connection_post_layernorm) "
                         "is not supported")
    hidden = c.get("hidden_size") or c["n_embed"]
    heads, layers = c.get("num_attention_heads") or c["n_head"], c.get("num_hidden_layers") or c["n_layer"]
    return c | {"hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": heads,
                "num_hidden_layers": layers, "intermediate_size": c.get("intermediate_size") or 4 * hidden,
                "attention_bias": True, "mlp_bias": True, "qkv_layout": c.get("qkv_layout", "heads"),
                "no_rope_layers": [0] * layers, "alibi_max_bias": c.get("alibi_max_bias", 8.0),
                "embedding_norm": True, "tie_word_embeddings": c.get("tie_word_embeddings", True)}


# MosaicML's config names (DBRX's, MPT's) by Llama's (a GGUF file's config has Llama's already)
MOSAIC_NAMES = {"d_model": "hidden_size", "n_heads": "num_attention_heads", "n_layers": "num_hidden_layers",
              "max_seq_len": "max_position_embeddings"}


def _dbrx_config(c: dict) -> dict:
    """DBRX's config in Llama's and Mixtral's names: its attention's (K/V heads, the clamp of q/k/v, the rotary's
    base) and its experts' (their count, width, top-k), the chosen weights renormalised (their L1 norm, its
    moe_normalize_expert_weights of 1) or not (None). A ValueError for another norm, which llama.cpp does not run."""
    attention, experts = c.get("attn_config") or {}, c.get("ffn_config") or {}
    norm = experts.get("moe_normalize_expert_weights", 1.0)
    if norm not in (None, 1, 1.0):
        raise ValueError(f"dbrx with its experts' weights normalised by their L{norm} norm (moe_normalize_expert_"
                         "weights) is not supported: 1 (their sum) or None")
    named = {MOSAIC_NAMES.get(name, name): value for name, value in c.items()}
    if not experts:  # (a GGUF file's: Mixtral's names already)
        return named
    return named | {"num_key_value_heads": attention.get("kv_n_heads", 1), "clip_qkv": attention.get("clip_qkv"),
                    "rope_theta": attention.get("rope_theta", 10000.0),
                    "intermediate_size": experts["ffn_hidden_size"], "num_local_experts": experts["moe_num_experts"],
                    "num_experts_per_tok": experts["moe_top_k"], "norm_topk_prob": norm is not None,
                    "hidden_act": (experts.get("ffn_act_fn") or {}).get("name", "silu")}


def _llama4_config(c: dict) -> dict:
    """Llama 4's text config (transformers', or a GGUF file's made like it) in Llama's and the mixtures' names: its
    dense MLPs intermediate_size_mlp wide, its experts intermediate_size; the layers that route (moe_layers, else every
    interleave_moe_layer_step-th), that rotate (no_rope_layers, 1 where a layer does; else all but every
    no_rope_layer_interval-th) and that attend in chunks (layer_types' chunked_attention: the rotating ones, of
    attention_chunk_size, where it names one); its unrotated layers' attention temperature (attn_scale, floor_scale,
    positions from 1: rope.query_temperature's) where attn_temperature_tuning says."""
    if "moe_intermediate_size" in c:  # (read already)
        return c
    c = _with_defaults(c, ("intermediate_size_mlp",))
    mlp, inner = c.pop("intermediate_size_mlp"), c["intermediate_size"]
    layers, step = c["num_hidden_layers"], c.get("interleave_moe_layer_step") or 1
    interval = c.get("no_rope_layer_interval") or 4
    rotates = c.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    chunk = c.get("attention_chunk_size")
    types = c.get("layer_types") or ["chunked_attention" if r and chunk else "full_attention" for r in rotates]
    return c | {"intermediate_size": mlp, "moe_intermediate_size": inner,
                "moe_layers": list(range(step - 1, layers, step)) if c.get("moe_layers") is None else c["moe_layers"],
                "no_rope_layers": rotates,
                "layer_types": types,
                "query_temperature": (float(c.get("attn_scale", 0.1)), int(c.get("floor_scale", 8192)), 1)
                if c.get("attn_temperature_tuning", True) else None}


def _cohere2_moe_config(c: dict) -> dict:
    """Cohere2-MoE's config (transformers', or a GGUF file's made like it) in Llama's and the mixtures' names: its
    dense prefix's MLPs prefix_dense_intermediate_size wide (its experts intermediate_size); its window layers
    rotating, and its dense prefix's too where prefix_dense_sliding_window_pattern is 1 (transformers'; a file's
    always, as llama.cpp runs them)."""
    if "moe_intermediate_size" in c:  # (read already)
        return c
    c = _with_defaults(c, ("layer_types", "mlp_layer_types"))
    inner, dense = c["intermediate_size"], c.pop("prefix_dense_intermediate_size") or c["intermediate_size"]
    types, mlps = c["layer_types"], c["mlp_layer_types"]
    prefix_rotates = (c.get("prefix_dense_sliding_window_pattern") or 1) == 1
    rotates = [int(t == "sliding_attention" or (m == "dense" and prefix_rotates)) for t, m in zip(types, mlps)]
    return c | {"intermediate_size": dense, "moe_intermediate_size": inner, "no_rope_layers": rotates}


def _with_defaults(c: dict, needed: tuple[str, ...]) -> dict:
    """A copy of ``c``, completed as transformers' config class completes it (its defaults; the lists it derives, as
    Cohere2-MoE's layer types from first_k_dense_replace) where a hub config.json leaves out one of ``needed``."""
    if all(c.get(name) is not None for name in needed):
        return dict(c)
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[c["model_type"]](**{k: v for k, v in c.items() if k != "model_type"}).to_dict()


CONFIGS_OF_KIN = {"gpt_neox": _gpt_neox_config, "falcon": _falcon_config, "dbrx": _dbrx_config, "mpt": _mpt_config,
                  "bloom": _bloom_config, "llama4_text": _llama4_config, "cohere2_moe": _cohere2_moe_config}
