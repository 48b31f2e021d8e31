"""Small random-weight models of each supported architecture, in float64 so that greedy
comparisons with transformers are exact rather than at the mercy of float32 ties."""

import contextlib
import random
import signal
import threading
import time

import pytest
import torch
import transformers

VOCAB = 256
EOS = 3


def _delta_rule_in_float64(query, key, value, g, beta, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, **_):
    """transformers' Qwen3.5 delta rule (its recurrent and chunked forms alike) token by token in the
    inputs' dtype: transformers' own runs in float32 whatever the model's, too coarse a reference for
    float64 comparisons (log-probabilities 1e-5 apart)."""
    dtype = query.dtype
    heads, key_heads = value.shape[2], key.shape[2]
    query, key = (x.repeat_interleave(heads // key_heads, dim=2) for x in (query, key))
    if use_qk_l2norm_in_kernel:
        query, key = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (query, key))
    query = query * query.shape[-1] ** -0.5
    state = torch.zeros(value.shape[0], heads, key.shape[-1], value.shape[-1], dtype=dtype) \
        if initial_state is None else initial_state.to(dtype)
    out = torch.empty_like(value)
    for t in range(value.shape[1]):
        state = state * g[:, t].to(dtype).exp()[..., None, None]
        delta = (value[:, t] - torch.einsum("bhk,bhkv->bhv", key[:, t], state)) * beta[:, t, :, None].to(dtype)
        state = state + key[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = torch.einsum("bhk,bhkv->bhv", query[:, t], state)
    return out, state if output_final_state else None


for _module in (transformers.models.qwen3_5.modeling_qwen3_5, transformers.models.qwen3_5_moe.modeling_qwen3_5_moe,
                transformers.models.qwen3_next.modeling_qwen3_next):
    _module.torch_chunk_gated_delta_rule = _module.torch_recurrent_gated_delta_rule = _delta_rule_in_float64

def _mamba2_scan_in_float64(module, hidden_states, B, C, dt, cache, **_):
    """transformers' Granite 4 Mamba2 scan (its recurrent and chunked forms alike) token by token in the
    inputs' dtype: transformers' own runs in float32 whatever the model's (A too), too coarse a reference for
    float64 comparisons."""
    state = cache.get_recurrent_state(module.layer_idx, state_idx=0) if cache is not None else None
    batch, length, _ = hidden_states.shape
    heads, per_group = module.num_heads, module.num_heads // module.n_groups
    x = hidden_states.view(batch, length, heads, module.head_dim)
    B, C = (t.view(batch, length, module.n_groups, -1).repeat_interleave(per_group, dim=2) for t in (B, C))
    dt = torch.nn.functional.softplus(dt + module.dt_bias)
    A = -torch.exp(module.A_log)
    state = torch.zeros(batch, heads, module.head_dim, module.ssm_state_size, dtype=x.dtype) \
        if state is None else state.to(x.dtype)
    out = torch.empty_like(x)
    for t in range(length):
        state = state * torch.exp(dt[:, t] * A)[..., None, None] + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None]
        out[:, t] = torch.einsum("bhpn,bhn->bhp", state, C[:, t]) + x[:, t] * module.D[:, None]
    if cache is not None:
        cache.update_recurrent_state(state, module.layer_idx)
    return out.view(batch, length, -1)


def _mamba_scan_in_float64(module, hidden_states, time_step, B, C, gate, cache, **_):
    """transformers' Mamba (and Falcon-Mamba) selective scan token by token in the inputs' dtype: transformers' own
    runs in float32 whatever the model's, too coarse a reference for float64 comparisons."""
    state = cache.get_recurrent_state(module.layer_idx, state_idx=0) if cache is not None else None
    batch, inner, length = hidden_states.shape
    A = -torch.exp(module.A_log)
    dt = torch.nn.functional.softplus(time_step + module.dt_proj.bias[:, None])
    state = torch.zeros(batch, inner, A.shape[1], dtype=hidden_states.dtype) if state is None else \
        state.to(hidden_states.dtype)
    out = torch.empty_like(hidden_states)
    for t in range(length):
        state = state * torch.exp(dt[:, :, t, None] * A) + (dt[:, :, t] * hidden_states[:, :, t])[..., None] * B[:, t, None]
        out[:, :, t] = torch.einsum("bcn,bn->bc", state, C[:, t]) + hidden_states[:, :, t] * module.D
    if cache is not None:
        cache.update_recurrent_state(state, module.layer_idx)
    return out * torch.nn.functional.silu(gate)


transformers.models.mamba.modeling_mamba.mamba_scan_forward = _mamba_scan_in_float64
transformers.models.falcon_mamba.modeling_falcon_mamba.mamba_scan_forward = _mamba_scan_in_float64
transformers.models.jamba.modeling_jamba.mamba_scan_forward = _mamba_scan_in_float64  # (Jamba's Mamba layers too)


def _gemma4_norm_in_dtype(self, hidden_states):
    """transformers' Gemma 4 norm in its input's dtype: its own widens to float32 only (a float64
    model's norms then round to float32), too coarse a reference for float64 comparisons."""
    normed = self._norm(hidden_states)
    return normed * self.weight.to(normed.dtype) if self.with_scale else normed


transformers.models.gemma4.modeling_gemma4.Gemma4RMSNorm.forward = _gemma4_norm_in_dtype
transformers.models.gemma3n.modeling_gemma3n.Gemma3nRMSNorm.forward = _gemma4_norm_in_dtype  # (Gemma 3n's the same)
TRANSFORMERS_MAMBA2_SCAN = transformers.models.granitemoehybrid.modeling_granitemoehybrid.mamba2_scan_forward
transformers.models.granitemoehybrid.modeling_granitemoehybrid.mamba2_scan_forward = _mamba2_scan_in_float64
transformers.models.nemotron_h.modeling_nemotron_h.mamba2_scan_forward = _mamba2_scan_in_float64  # (Nemotron-H's too)
transformers.models.falcon_h1.modeling_falcon_h1.mamba2_scan_forward = _mamba2_scan_in_float64  # (and Falcon-H1's)
transformers.models.mamba2.modeling_mamba2.mamba2_scan_forward = _mamba2_scan_in_float64  # (and Mamba2's own)

CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, eos_token_id=EOS, bos_token_id=1),
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}),
    "qwen2": lambda: transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
        tie_word_embeddings=True),
    "mistral": lambda: transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1, sliding_window=24),
    "qwen3": lambda: transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64}),
    "qwen2_sliding": lambda: transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
        use_sliding_window=True, sliding_window=20, max_window_layers=1),
    # its queries' temperature and yarn from a short original context, so that test prompts pass it
    "ministral3": lambda: transformers.Ministral3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
        pad_token_id=0, rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                                         "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.4}),
    "ernie4_5": lambda: transformers.Ernie4_5Config(  # its rotary pairs side by side in q/k's rows
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
        pad_token_id=0),
    "olmoe": lambda: transformers.OlmoeConfig(  # its q/k norms across heads; the top-k weights as they come
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1, pad_token_id=0,
        num_experts=6, num_experts_per_tok=2, experts_implementation="eager"),
    # every other layer through a window the test prompts pass, the clamp low enough to bind, sinks and
    # biases set (transformers starts its biases at 0: tiny_model draws them)
    "gpt_oss": lambda: transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
        pad_token_id=0, num_local_experts=6, num_experts_per_tok=2, sliding_window=12, swiglu_limit=0.3,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
        attn_implementation="eager", experts_implementation="eager"),
    "olmo2": lambda: transformers.Olmo2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1, pad_token_id=0),
    # three layers in four through a window the test prompts pass; the global layers' rope a yarn
    "olmo3": lambda: transformers.Olmo3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1, pad_token_id=0,
        sliding_window=12, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
            "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                               "original_max_position_embeddings": 64}}),
    "phi3": lambda: transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, original_max_position_embeddings=64,
        eos_token_id=EOS, bos_token_id=1, pad_token_id=0, partial_rotary_factor=0.5, sliding_window=48,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.1, 1.3, 1.6],
                         "long_factor": [1.0, 2.0, 4.0, 8.0], "original_max_position_embeddings": 64}),
    "mixtral": lambda: transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
        num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager"),  # grouped_mm lacks float64
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256, eos_token_id=EOS,
        bos_token_id=1, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
        experts_implementation="eager"),
    # a shared expert beside the routed ones, weighted by its own router (tiny_model draws its weights
    # large, for the weight to matter); the top-k weights as they come; a dense layer
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=80, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1, num_experts=6, num_experts_per_tok=2,
        mlp_only_layers=[1], experts_implementation="eager"),
    # ERNIE 4.5's rotary pairs side by side, a dense first layer, two experts' width shared, a bias to choose
    # experts by (tiny_model draws it large: the choice then differs from the probabilities' top-k), weights
    # large enough for the choice to change greedy tokens (at 0.02 a zero bias answered alike)
    "ernie4_5_moe": lambda: transformers.Ernie4_5_MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, moe_num_shared_experts=2,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        eos_token_id=EOS, bos_token_id=1, pad_token_id=0, moe_num_experts=6, moe_k=2, moe_layer_start_index=1,
        initializer_range=0.1, experts_implementation="eager"),
    "smollm3": lambda: transformers.SmolLM3Config(  # its fourth layer without rotary
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "granite": lambda: transformers.GraniteConfig(  # Granite 3's multipliers (its 2B's)
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1, pad_token_id=0,
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=8.0),
    "granitemoe": lambda: transformers.GraniteMoeConfig(  # Granite 3 1B-A400M's multipliers
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1, pad_token_id=0,
        num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=12.0, residual_multiplier=0.22,
        attention_multiplier=0.015625, logits_scaling=6.0, experts_implementation="eager"),
    # Granite SWA: Granite's multipliers, three window layers in four (the first global, unrotated: its theta 0), a
    # sink a head; dense, and with Granite MoE Shared's experts
    "granite_swa": lambda: transformers.GraniteSWAConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1, pad_token_id=0,
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=8.0,
        sliding_window=12, layer_rope_theta=[0, 10000.0, 10000.0, 10000.0], tie_word_embeddings=False),
    "granitemoe_swa": lambda: transformers.GraniteMoeSWAConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, shared_intermediate_size=80, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
        pad_token_id=0, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=12.0,
        residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=6.0, sliding_window=12,
        layer_rope_theta=[0, 10000.0, 10000.0, 10000.0], experts_implementation="eager"),
    "granitemoeshared": lambda: transformers.GraniteMoeSharedConfig(  # Granite MoE's, and a shared expert
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, shared_intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
        pad_token_id=0, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=12.0,
        residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=6.0, experts_implementation="eager"),
    # scores and logits large enough that both soft caps bend them (initializer_range: scores up to ~3)
    "gemma2": lambda: transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
        pad_token_id=0, sliding_window=12, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0, initializer_range=0.1, attn_implementation="eager"),  # SDPA has no soft cap
    # short convolutions around one attention layer, the weights drawn wide enough that the convolutions
    # move greedy tokens (at transformers' 0.02 their B x rows are ~1e-3)
    "lfm2": lambda: transformers.Lfm2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=192, block_multiple_of=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
        pad_token_id=0, layer_types=["conv", "full_attention", "conv", "conv"], initializer_range=0.15),
    # a dense leading layer, then experts chosen by sigmoid plus a bias each (tiny_model draws the bias)
    "lfm2_moe": lambda: transformers.Lfm2MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
        pad_token_id=0, layer_types=["conv", "full_attention", "conv", "conv"], num_dense_layers=1, num_experts=6,
        num_experts_per_tok=2, routed_scaling_factor=1.5, initializer_range=0.15, experts_implementation="eager"),
    "gemma": lambda: transformers.GemmaConfig(  # (one key head, as Gemma 2B's)
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
        pad_token_id=0),
    # a window the test prompts pass on three layers in four, the fourth attending without rotary
    "exaone4": lambda: transformers.Exaone4Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
        pad_token_id=0, sliding_window=12, sliding_window_pattern=4, initializer_range=0.15),
    # three delta-rule layers (two key heads read by four value heads) around an attention layer, the
    # weights drawn wide enough that the delta-rule layers move greedy tokens
    "qwen3_5": lambda: transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
        pad_token_id=0, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, initializer_range=0.15,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
    # Qwen3-Next: Qwen3.5's layers (its value heads of a key head side by side), four experts, two a token,
    # renormalised, beside a shared expert with a router of its own
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
        pad_token_id=0, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=32, initializer_range=0.15, experts_implementation="eager",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
    # Falcon-H1: each layer attending and mixing through Mamba2 (eight heads of 8 in two groups, gated without a
    # norm, as Falcon-H1's are) at once, every μP multiplier of its own
    "falcon_h1": lambda: transformers.FalconH1Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
        pad_token_id=0, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=16, mamba_n_groups=2,
        mamba_d_conv=4, mamba_rms_norm=False, embedding_multiplier=2.0, lm_head_multiplier=0.5,
        key_multiplier=0.7, attention_in_multiplier=1.3, attention_out_multiplier=0.8, ssm_in_multiplier=1.2,
        ssm_out_multiplier=0.9, mlp_multipliers=[1.1, 0.9], ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3],
        initializer_range=0.15, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # Granite 4 H: Mamba2 layers (eight heads of 16 in two groups) around an attention layer without rotary,
    # routed experts beside a shared one, Granite's multipliers
    "granitemoehybrid": lambda: transformers.GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, shared_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
        pad_token_id=0, layer_types=["mamba", "attention", "mamba", "mamba"], num_local_experts=4,
        num_experts_per_tok=2, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4,
        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=3.0,
        position_embedding_type="nope", initializer_range=0.15, experts_implementation="eager"),
    # GLM-4: rotary pairs side by side over half of each head, biases on q/k/v (drawn: tiny_model), its outputs'
    # norms, gate and up one product
    "glm4": lambda: transformers.Glm4Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
        pad_token_id=0, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    # GLM (GLM-4-9B's, ChatGLM's): GLM-4's layers without its outputs' norms
    "glm": lambda: transformers.GlmConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
        pad_token_id=0, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    # Nemotron-H: a Mamba2 layer and an attention layer each followed by a squared-ReLU MLP layer, then two
    # Mamba2 layers, the first with no MLP after it
    "nemotron_h": lambda: transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1, pad_token_id=0,
        layers_block_type=["linear_attention", "mlp", "full_attention", "mlp", "linear_attention", "linear_attention",
                           "mlp"], mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4,
        initializer_range=0.15, layer_norm_epsilon=1e-2),  # (an epsilon large enough that a wrong one shows)
    # Mamba2's own language models: Mamba2 layers alone, B and C a group's of two heads
    "mamba2": lambda: transformers.Mamba2Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_heads=8, head_dim=16, state_size=16, n_groups=4,
        expand=2, conv_kernel=4, eos_token_id=EOS, bos_token_id=1, pad_token_id=0, initializer_range=0.15,
        layer_norm_epsilon=1e-2, tie_word_embeddings=False),
    # Mamba: selective-scan layers alone, each channel's state decaying at a rate for each of its values; Falcon-Mamba
    # the same with its time steps, B and C RMS-normed (an epsilon large enough that a wrong one shows)
    "mamba": lambda: transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, state_size=8, expand=2, conv_kernel=4,
        time_step_rank=8, eos_token_id=EOS, bos_token_id=1, pad_token_id=0, initializer_range=0.15,
        layer_norm_epsilon=1e-2, tie_word_embeddings=False),
    "falcon_mamba": lambda: transformers.FalconMambaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, state_size=8, expand=2, conv_kernel=4,
        time_step_rank=8, eos_token_id=EOS, bos_token_id=1, pad_token_id=0, initializer_range=0.15,
        layer_norm_epsilon=1e-2, mixer_rms_eps=1e-3, tie_word_embeddings=True),
    # MiniCPM3: DeepSeek's latent attention (low-rank queries, a value narrower than the hidden size over the heads),
    # its rotary in halves over the last part of each head, a dense SwiGLU MLP, MiniCPM's scales of the embeddings,
    # the residual branches and the logits (each far from 1, so that a scale left out shows)
    "minicpm3": lambda: transformers.MiniCPM3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
        max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1, pad_token_id=0, scale_emb=3.0,
        scale_depth=2.5, dim_model_base=16, tie_word_embeddings=False),
    # Jamba: Mamba layers (their time step, B and C RMS-normed with weights; an epsilon large enough that a wrong one
    # shows) and an attention layer in three without positions, experts every other layer (the top two's softmax
    # probabilities as they are), SwiGLU MLPs between
    "jamba": lambda: transformers.JambaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1, pad_token_id=0,
        attn_layer_period=3, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=4,
        num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, rms_norm_eps=1e-2,
        use_mamba_kernels=False, initializer_range=0.15, experts_implementation="eager"),
    # Nemotron 3 (Nano's layout): Mamba2 and attention layers each followed by a mixture of squared-ReLU experts
    # beside a shared one, chosen by sigmoid and bias, renormalised and scaled
    "nemotron_h_moe": lambda: transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1, pad_token_id=0,
        layers_block_type=["linear_attention", "moe", "full_attention", "moe", "linear_attention", "moe",
                           "linear_attention"], mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
        conv_kernel=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=64, n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, initializer_range=0.15, layer_norm_epsilon=1e-2, experts_implementation="eager"),
    # GLM-4.5 (Air's layout, with 4.5's q/k norms): GQA over half of each head rotated (rotate-half), q/k/v biases, a
    # dense first layer, then DeepSeek-V3's routing (sigmoid and bias, renormalised and scaled) beside a shared expert
    "glm4_moe": lambda: transformers.Glm4MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=1.8, n_group=1,
        topk_group=1, attention_bias=True, use_qk_norm=True, max_position_embeddings=256, eos_token_id=EOS,
        bos_token_id=1, pad_token_id=0, initializer_range=0.15, experts_implementation="eager",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    # dots.llm1: Qwen3's attention (each head's q/k norms; its K/V heads its query heads, as llama.cpp runs it), a
    # dense first layer, then DeepSeek-V3's routing (sigmoid and bias, renormalised and scaled) beside two shared experts
    "dots1": lambda: transformers.Dots1Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=2, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5, n_group=1,
        topk_group=1, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1, pad_token_id=0,
        initializer_range=0.15, experts_implementation="eager"),
    # EXAONE-MoE (K-EXAONE): each head's q/k norms, three window layers in four, those alone rotating; a dense first
    # layer, then DeepSeek-V3's routing (sigmoid and bias, renormalised and scaled) beside a shared expert
    "exaone_moe": lambda: transformers.ExaoneMoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        num_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        sliding_window=12, sliding_window_pattern=4, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
        pad_token_id=0, initializer_range=0.15, experts_implementation="eager",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # Hunyuan-A13B: HunYuan's attention (each head's q/k norms after the rotation, NTK by a fixed alpha), every layer's
    # experts (softmax, renormalised) beside a shared MLP as wide as they are
    "hunyuan_v1_moe": lambda: transformers.HunYuanMoEV1Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, moe_topk=2, max_position_embeddings=256,
        eos_token_id=EOS, bos_token_id=1, pad_token_id=0, initializer_range=0.15, experts_implementation="eager",
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0}),
    # MiniMax-M2: q/k norms across all heads, half of each head rotated, experts chosen by sigmoid and bias, renormalised
    # DBRX: LayerNorms without biases, q/k/v one product clamped at 0.2 (about one value in eight reaches past it),
    # four experts of 32 rows, two a token by softmax, renormalised
    # Llama 4: three layers in four rotating, in chunks of 8 positions, each head's q/k RMS-normed after the rotation
    # without weights; the fourth unrotated, its queries scaled by temperature from position 3 (floor_scale 4); every
    # other layer's experts (sigmoid of the top two logits weighing their inputs) beside a shared one, the others' MLPs
    # twice as wide (its temperature 2.0, not 0.1, for it to tell in a few tokens)
    "llama4_text": lambda: transformers.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, intermediate_size_mlp=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        interleave_moe_layer_step=2, attention_chunk_size=8, floor_scale=4, attn_scale=2.0,
        max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1, pad_token_id=0, initializer_range=0.15,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # Cohere2-MoE (Command A's mixture): Cohere2's layers (LayerNorms without biases, the MLP beside the attention,
    # rotary pairs side by side, three window layers in four, those alone rotating, logits scaled); a dense first layer
    # (rotating, its MLP 96 wide), then four experts of 32 rows, two a token by the softmax of their logits, averaged
    # with a shared expert
    "cohere2_moe": lambda: transformers.Cohere2MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, prefix_dense_intermediate_size=96, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        num_shared_experts=1, sliding_window=12, sliding_window_pattern=4, first_k_dense_replace=1, logit_scale=0.25,
        max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1, pad_token_id=0, initializer_range=0.15,
        experts_implementation="eager"),
    "dbrx": lambda: transformers.DbrxConfig(
        vocab_size=VOCAB, d_model=64, n_heads=4, n_layers=2, max_seq_len=256, eos_token_id=EOS, bos_token_id=1,
        pad_token_id=0, attn_config={"kv_n_heads": 2, "clip_qkv": 0.2, "rope_theta": 10000.0},
        ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}),
    "minimax_m2": lambda: transformers.MiniMaxM2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, rotary_dim=8,
        max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1, pad_token_id=0, initializer_range=0.15,
        experts_implementation="eager"),
    # Arcee's Trinity (AFMoE): each head's q/k norms, its attention gated, norms before and after the attention and
    # the MLP, three window layers in four and the fourth global and unrotated, a dense first layer, then experts by
    # sigmoid and bias, renormalised and scaled, beside a shared one; its embeddings times sqrt(hidden) (muP)
    "afmoe": lambda: transformers.AfmoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_dense_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, num_shared_experts=1, route_scale=2.5, global_attn_every_n_layers=4, sliding_window=12,
        mup_enabled=True, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1, pad_token_id=0,
        initializer_range=0.15, experts_implementation="eager"),
    # DeepSeek-V2 (V2-Lite's layout): latent attention with full-rank queries, YaRN with DeepSeek's mscales, a dense
    # first layer, softmax routing limited to the groups whose best expert scores highest, a shared expert
    "deepseek_v2": lambda: transformers.DeepseekV2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        topk_method="group_limited_greedy", n_group=4, topk_group=1, routed_scaling_factor=1.5,
        max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1, pad_token_id=0, initializer_range=0.15,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "mscale": 0.707, "mscale_all_dim": 0.707,
                         "beta_fast": 32, "beta_slow": 1}, experts_implementation="eager"),
    # DeepSeek-V3: low-rank queries, sigmoid routing with selection biases over the groups whose best two score
    # highest, renormalised and scaled
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=32,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
        max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1, pad_token_id=0, initializer_range=0.15,
        experts_implementation="eager"),
    # Mistral 4: DeepSeek-V3's latent attention (low-rank queries), every layer's experts by softmax, renormalised and
    # scaled, beside a shared one; YaRN, and Llama 4's attention temperature past a 16-token original context
    "mistral4": lambda: transformers.Mistral4Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=32,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        norm_topk_prob=True, routed_scaling_factor=1.5, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
        pad_token_id=0, initializer_range=0.15, experts_implementation="eager",
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}),
    # GLM-4.7-Flash: DeepSeek-V3's attention and routing in one group, its dense layers by mlp_layer_types
    "glm4_moe_lite": lambda: transformers.Glm4MoeLiteConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        mlp_layer_types=["sparse", "dense", "sparse"], norm_topk_prob=True, routed_scaling_factor=1.8,
        max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1, pad_token_id=0, initializer_range=0.15,
        experts_implementation="eager"),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
        pad_token_id=0, sliding_window=12, query_pre_attn_scalar=24, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}),
    # Gemma 4's E-sizes in small: wider global heads (one, its values its keys), the last two layers reading
    # the K/V of the last earlier layer of their kind with MLPs twice as wide, per-layer embeddings
    "gemma4": lambda: transformers.Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
        pad_token_id=0, sliding_window=12, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                     "full_attention"]),
    # Gemma 3n's E-sizes in small: four AltUp streams, Laurel, the first two layers' gates sparse, the last two
    # layers reading the K/V of the last earlier layer of their kind, a per-layer table shorter than the vocabulary
    "gemma3n": lambda: transformers.Gemma3nTextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_kv_shared_layers=2, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB - 40, laurel_rank=8, altup_num_inputs=4,
        activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0, 0.0], max_position_embeddings=256, eos_token_id=EOS,
        bos_token_id=1, pad_token_id=0, sliding_window=12, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                     "full_attention"]),
    # the 26B-A4B's in small: experts beside every layer's MLP, global layers' values their keys, no per-layer inputs
    "gemma4_moe": lambda: transformers.Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
        moe_intermediate_size=32, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1, pad_token_id=0,
        sliding_window=12, final_logit_softcapping=30.0, experts_implementation="eager",
        layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
}
MODEL_CLASSES = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM,
                 "qwen2": transformers.Qwen2ForCausalLM, "mistral": transformers.MistralForCausalLM,
                 "qwen3": transformers.Qwen3ForCausalLM, "qwen2_sliding": transformers.Qwen2ForCausalLM,
                 "ministral3": transformers.Ministral3ForCausalLM, "ernie4_5": transformers.Ernie4_5ForCausalLM,
                 "olmo2": transformers.Olmo2ForCausalLM, "olmo3": transformers.Olmo3ForCausalLM,
                 "olmoe": transformers.OlmoeForCausalLM, "gpt_oss": transformers.GptOssForCausalLM,
                 "phi3": transformers.Phi3ForCausalLM, "mixtral": transformers.MixtralForCausalLM,
                 "qwen2_moe": transformers.Qwen2MoeForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM,
                 "ernie4_5_moe": transformers.Ernie4_5_MoeForCausalLM,
                 "smollm3": transformers.SmolLM3ForCausalLM, "granite": transformers.GraniteForCausalLM,
                 "granitemoe": transformers.GraniteMoeForCausalLM,
                 "granitemoeshared": transformers.GraniteMoeSharedForCausalLM,
                 "exaone4": transformers.Exaone4ForCausalLM, "gemma": transformers.GemmaForCausalLM,
                 "gemma2": transformers.Gemma2ForCausalLM, "lfm2": transformers.Lfm2ForCausalLM,
                 "lfm2_moe": transformers.Lfm2MoeForCausalLM, "qwen3_5": transformers.Qwen3_5ForCausalLM,
                 "qwen3_next": transformers.Qwen3NextForCausalLM, "falcon_h1": transformers.FalconH1ForCausalLM,
                 "granitemoehybrid": transformers.GraniteMoeHybridForCausalLM, "gemma3": transformers.Gemma3ForCausalLM,
                 "nemotron_h": transformers.NemotronHForCausalLM, "nemotron_h_moe": transformers.NemotronHForCausalLM,
                 "mamba2": transformers.Mamba2ForCausalLM, "mamba": transformers.MambaForCausalLM,
                 "falcon_mamba": transformers.FalconMambaForCausalLM, "jamba": transformers.JambaForCausalLM,
                 "minicpm3": transformers.MiniCPM3ForCausalLM, "gemma4": transformers.Gemma4ForCausalLM,
                 "gemma3n": transformers.Gemma3nForCausalLM,
                 "gemma4_moe": transformers.Gemma4ForCausalLM,
                 "glm4": transformers.Glm4ForCausalLM, "glm": transformers.GlmForCausalLM,
                 "deepseek_v2": transformers.DeepseekV2ForCausalLM, "deepseek_v3": transformers.DeepseekV3ForCausalLM,
                 "glm4_moe_lite": transformers.Glm4MoeLiteForCausalLM, "glm4_moe": transformers.Glm4MoeForCausalLM,
                 "dots1": transformers.Dots1ForCausalLM, "hunyuan_v1_moe": transformers.HunYuanMoEV1ForCausalLM,
                 "minimax_m2": transformers.MiniMaxM2ForCausalLM, "afmoe": transformers.AfmoeForCausalLM,
                 "dbrx": transformers.DbrxForCausalLM, "llama4_text": transformers.Llama4ForCausalLM,
                 "cohere2_moe": transformers.Cohere2MoeForCausalLM,
                 "exaone_moe": transformers.ExaoneMoeForCausalLM,
                 "mistral4": transformers.Mistral4ForCausalLM, "granite_swa": transformers.GraniteSWAForCausalLM,
                 "granitemoe_swa": transformers.GraniteMoeSWAForCausalLM}


def interruptible() -> None:
    """A child process's ``preexec_fn`` where a test sends it Ctrl-C: SIGINT's default, as a terminal
    gives it. A suite run as a shell's background job (``&``) starts with SIGINT ignored, which Python
    keeps, so the child would never see the signal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def pytest_addoption(parser):
    parser.addoption("--stress", action="store_true", help="run the large threaded stress sizes")
    parser.addoption("--timing", action="store_true",
                     help="run the tests whose outcome depends on how busy the machine is")
    parser.addoption("--all-families", action="store_true",
                     help="run the engine-wide and native-layer matrices for every family, not MATRIX_FAMILIES alone")


def pytest_collection_modifyitems(config, items):
    for marker, why in (("stress", "large stress size: run with --stress"),
                        ("timing", "depends on an idle machine: run with --timing")):
        if not config.getoption(f"--{marker}"):
            for item in items:
                if marker in item.keywords:
                    item.add_marker(pytest.mark.skip(reason=why))


# Families the Llama module runs with a difference or two from a family the family-wide tests run: their files
# and checkpoints are tested alone (test_gguf's Llama kin). EXAONE 3.5 (Llama's math); Arcee's AFM (an MLP of
# relu(up)^2, no gate); Seed-OSS (q/k/v biases, none on the output); HunYuan's dense models (each head's q/k norm
# after the rotation, NTK by a fixed alpha); StarCoder2 (LayerNorms, biases everywhere, an MLP of gelu(up)); StableLM (LayerNorms, q/k/v biases, a quarter of each head rotated); Phi-2 (LayerNorms, the
# attention and the MLP beside each other, biases everywhere, the output layer's too, an MLP of gelu(up)); Cohere's
# Command R (LayerNorms without biases, beside each other, rotary pairs side by side, logits scaled) and R7B (its
# fourth layers global and unrotated); OLMo 1 (LayerNorms without weights or biases); Nemotron-4 (LayerNorms of
# 1 + their weights, an MLP of relu(up)^2, half of each head rotated)
# (the sizes they share: two layers of 64, four query heads over two K/V heads)
KIN_SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1, pad_token_id=0)
LLAMA_KIN = {
    "exaone": lambda: transformers.ExaoneConfig(**KIN_SIZES, head_dim=16),
    "arcee": lambda: transformers.ArceeConfig(**KIN_SIZES, head_dim=16),
    "seed_oss": lambda: transformers.SeedOssConfig(**KIN_SIZES, head_dim=16, attention_bias=True, attention_out_bias=False,
                                                   attention_dropout=0.0, residual_dropout=0.0),
    "hunyuan_v1_dense": lambda: transformers.HunYuanDenseV1Config(
        **KIN_SIZES, head_dim=16, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0,
                                                   "factor": 1.0}),
    "starcoder2": lambda: transformers.Starcoder2Config(**KIN_SIZES, use_bias=True, residual_dropout=0.0,
                                                       embedding_dropout=0.0, attention_dropout=0.0),
    "stablelm": lambda: transformers.StableLmConfig(
        **KIN_SIZES, use_qkv_bias=True, hidden_dropout=0.0, attention_dropout=0.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
    "phi": lambda: transformers.PhiConfig(
        **KIN_SIZES | {"num_key_value_heads": 4}, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    "cohere": lambda: transformers.CohereConfig(**KIN_SIZES, logit_scale=0.25),
    "olmo": lambda: transformers.OlmoConfig(**KIN_SIZES),
    "cohere2": lambda: transformers.Cohere2Config(**KIN_SIZES | {"num_hidden_layers": 4}, logit_scale=0.25,
                                                  sliding_window=24),
    "nemotron": lambda: transformers.NemotronConfig(**KIN_SIZES, head_dim=16, attention_bias=True, mlp_bias=True),
    # BLOOM: ALiBi in the rotary's place, its embeddings LayerNormed, a head's q/k/v rows together, gelu_tanh(up)
    "bloom": lambda: transformers.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4,
                                              eos_token_id=EOS, bos_token_id=1, pad_token_id=0),
    # MPT: ALiBi, LayerNorms without biases (but the final one's), q/k/v one product clamped, an MLP of gelu(up)
    "mpt": lambda: transformers.MptConfig(vocab_size=VOCAB, d_model=64, n_heads=4, n_layers=2, max_seq_len=256,
                                          eos_token_id=EOS, bos_token_id=1, pad_token_id=0,
                                          attn_config={"clip_qkv": 0.3, "alibi_bias_max": 8}),
    # Jais-2: LayerNorms, an MLP of relu(up)^2, biases on every product
    "jais2": lambda: transformers.Jais2Config(**KIN_SIZES, head_dim=16),
    # GPT-NeoX (Pythia's: the MLP beside the attention on a norm of its own, biases everywhere, a quarter of each head
    # rotated, an exact GELU) and Falcon (40B's layout: a norm for the attention, one for the MLP, beside each other;
    # two K/V groups, no biases, an exact GELU, its table tied)
    # Apertus: each head's q/k norms, an MLP of xIELU(up) with each layer's own numbers, its norms by names of its own
    "apertus": lambda: transformers.ApertusConfig(**KIN_SIZES, head_dim=16, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0}),
    # StarCoder (gpt_bigcode): GPT-2's layers with one K/V head, its matrices as nn.Linear keeps them
    "gpt_bigcode": lambda: transformers.GPTBigCodeConfig(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, eos_token_id=EOS, bos_token_id=1,
        pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1, pad_token_id=0, hidden_dropout=0.0,
        attention_dropout=0.0),
    "falcon": lambda: transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
        new_decoder_architecture=True, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1, pad_token_id=0),
}


def tiny_model(arch: str, seed: int = 0, **config):
    """``arch``'s tiny random model in float64; ``config``: its config's fields set otherwise."""
    torch.manual_seed(seed)
    settings = (CONFIGS | LLAMA_KIN)[arch]()
    for name, value in config.items():
        setattr(settings, name, value)
    model = (MODEL_CLASSES[arch](settings) if arch in MODEL_CLASSES else
             transformers.AutoModelForCausalLM.from_config(settings)).to(torch.float64).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            # (transformers starts gpt-oss's biases at 0, Qwen2-MoE's shared expert's router near it, Mamba2's D at 1,
            # Gemma 3n's scale of the corrected stream at 0)
            if name.endswith(("sinks", "_bias", "router.bias", "shared_expert_gate.weight", "mamba.D", "mixer.D",
                              "e_score_correction_bias", "router.scale", "per_expert_scale",
                              "correct_output_scale")) or (
                    arch in ("glm", "glm4", "glm4_moe") and name.endswith("proj.bias")):
                tensor.normal_(0.0, 0.5)
            # (at 1 and 0; Jamba's norms of its time steps, B and C too)
            if (arch in LLAMA_KIN or arch == "jamba") and ("norm" in name or ".ln_" in name or name.endswith("bias")):
                tensor.normal_(0.0 if name.endswith("bias") else 1.0, 0.3)
            if name.endswith(("act_fn.alpha_p", "act_fn.alpha_n")):  # (Apertus's xIELU: each layer its own)
                tensor.normal_(0.0, 0.5)
        for name, tensor in model.named_buffers():  # (LFM2-MoE's selection bias, a buffer starting at 0)
            if name.endswith(("expert_bias", "e_score_correction_bias")):
                tensor.normal_(0.0, 0.5)
            if name.endswith("layer_scalar"):  # (Gemma 4's, starting at 1)
                tensor.uniform_(0.6, 1.4)
    return model


# The families the engine-wide tests (threaded streams with preemption, prefix caching: hf_model) and the
# native-layer matrices (pools x row counts) take by default: one of each kind of layer and pool. Plain GQA with a
# scaled rope; GPT-2's learned positions and LayerNorms; windows on some layers; longrope's recomputed past;
# queries scaled by position; soft caps and alternating windows; Gemma 3's local rotation; per-layer K/V shapes
# and shared K/V; AltUp's streams; sinks beside experts; latent attention; delta rules; Mamba2 in the attention's
# place and beside it; short convolutions; a pool without K/V. Every family's own numerics are tested in full
# alone (test_model_families' saved checkpoint of each, tests/models/test_<family>.py, the native layers' first
# cases of each); with --all-families every family runs every matrix (about twice the suite's time).
MATRIX_FAMILIES = ("llama", "gpt2", "qwen2_sliding", "phi3", "ministral3", "gemma2", "gemma3", "gemma4", "gemma3n",
                   "gpt_oss", "deepseek_v3", "qwen3_5", "granitemoehybrid", "falcon_h1", "lfm2", "mamba")


def family_cases(config, families, cases: list[tuple]) -> list[tuple]:
    """(family, *case) for each of ``families``: every one of ``cases`` for MATRIX_FAMILIES' (every family's with
    --all-families), the first alone for the others'."""
    every = config.getoption("--all-families")
    return [(family, *case) for family in families
            for case in (cases if every or family in MATRIX_FAMILIES else cases[:1])]


def pytest_generate_tests(metafunc):
    """hf_model: each of MATRIX_FAMILIES' tiny models (every family's with --all-families)."""
    if "hf_model" in metafunc.fixturenames:
        families = sorted(CONFIGS) if metafunc.config.getoption("--all-families") else MATRIX_FAMILIES
        metafunc.parametrize("hf_model", families, indirect=True, scope="session")


@pytest.fixture(scope="session")
def hf_model(request):
    return tiny_model(request.param)


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama")


def reference(hf, prompt, max_new_tokens, **kwargs):
    """transformers' greedy generate() of one request alone: what every engine stream must equal."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                          pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


def greedy_with_logprobs(hf, prompt, max_new_tokens):
    """transformers' greedy generate() of one request alone: its tokens and their log-probabilities
    (transformers hands generate's logits over in float32)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [torch.log_softmax(row[0].double(), -1)[t].item() for row, t in zip(out.logits, tokens)]


def random_prompt(rng: random.Random, low: int, high: int) -> list[int]:
    return [rng.randrange(4, VOCAB) for _ in range(rng.randint(low, high))]


@pytest.fixture(scope="session")
def smollm():
    """The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) in float64."""
    from runtime import Engine
    with Engine.from_pretrained(dtype=torch.float64, max_batch_size=16) as engine:
        yield engine


def run_threaded(engine, prompts, new_tokens, threads=8, in_order=False):
    """Launch and fetch every prompt from ``threads`` worker threads; {index: tokens}.

    ``in_order``: the workers launch in the prompts' order, one after another, inside
    ``engine.paused()``, so that nothing runs until all are launched and the run's schedule no longer
    depends on how fast the workers start. Without it a busy machine can start them so far apart
    that each request ends before the next arrives, and a test that counts on preemption sees none."""
    from runtime import GenerationConfig
    results = {}
    turn = threading.Condition()
    launched = []

    def launch(i):
        config = GenerationConfig(max_new_tokens=new_tokens[i])
        if not in_order:
            return engine.launch_response_tokens(prompts[i], config)
        with turn:
            assert turn.wait_for(lambda: len(launched) == i, timeout=60), "an earlier launch never came"
            launched.append(engine.launch_response_tokens(prompts[i], config))
            turn.notify_all()
            return launched[-1]

    def worker(indices):
        handles = [(i, launch(i)) for i in indices]
        for i, h in handles:
            results[i] = list(engine.stream_response_tokens(h, timeout=60))

    pool = [threading.Thread(target=worker, args=(range(t, len(prompts), threads),)) for t in range(threads)]
    with engine.paused() if in_order else contextlib.nullcontext():
        for t in pool:
            t.start()
        if in_order:
            with turn:
                assert turn.wait_for(lambda: len(launched) == len(prompts), timeout=60), "a launch never came"
    for t in pool:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in pool), "a worker thread hung"
    return results


def new_threads(before: set, name: str = "loom-engine-loop") -> list[threading.Thread]:
    """The threads called ``name`` running now that were not in ``before`` (a threading.enumerate())."""
    return [t for t in threading.enumerate() if t not in before and t.name == name]


def wait_until(condition, seconds=10.0):
    """Poll ``condition`` until it holds; fails the test after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


# transformers' parameter names -> llama.cpp's (Phi-3's fused products keep theirs: attn_qkv, and its
# gate and up rows in ffn_up)
GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.router": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "shared_mlp.output_linear": "ffn_down_shexp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
    "mlp.fc1_latent_proj": "ffn_latent_down", "mlp.fc2_latent_proj": "ffn_latent_up",  # (Nemotron 3 Super's)
    # StarCoder2's and Phi-2's MLPs (up and down), Phi-2's attention output
    "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down",
    "self_attn.dense": "attn_output",
    "self_attn.query_layernorm": "attn_q_norm", "self_attn.key_layernorm": "attn_k_norm",  # (HunYuan's)
    # (Hunyuan-A13B's router and shared MLP)
    "mlp.gate.wg": "ffn_gate_inp", "mlp.shared_mlp.gate_proj": "ffn_gate_shexp",
    "mlp.shared_mlp.up_proj": "ffn_up_shexp", "mlp.shared_mlp.down_proj": "ffn_down_shexp",
    # GPT-NeoX's and Falcon's (Falcon 40B's norms: ln_mlp as attn_norm, ln_attn as attn_norm_2, as its converter's)
    "attention.query_key_value": "attn_qkv", "attention.dense": "attn_output", "mlp.dense_h_to_4h": "ffn_up",
    "mlp.dense_4h_to_h": "ffn_down", "self_attention.query_key_value": "attn_qkv",
    "self_attention.dense": "attn_output",
    "ln_attn": "attn_norm_2", "ln_mlp": "attn_norm",
    # GPT-2's (its MLP's c_fc and c_proj StarCoder2's above)
    "ln_1": "attn_norm", "ln_2": "ffn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output",
    "attention_layernorm": "attn_norm", "feedforward_layernorm": "ffn_norm",  # (Apertus's)
    "norm_1": "attn_norm", "attn.Wqkv": "attn_qkv", "attn.out_proj": "attn_output", "norm_2": "ffn_norm",  # (MPT's)
    "ffn.up_proj": "ffn_up", "ffn.down_proj": "ffn_down"}
GGUF_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight", "model.embedding_norm.weight": "token_embd_norm.weight",
                     # (LayerNorm models' biases: StarCoder2's, StableLM's, Phi-2's, and Phi-2's output layer's)
                     "model.norm.bias": "output_norm.bias", "model.final_layernorm.weight": "output_norm.weight",
                     "model.final_layernorm.bias": "output_norm.bias", "lm_head.bias": "output.bias",
                     # GPT-NeoX's and Falcon's
                     "gpt_neox.embed_in.weight": "token_embd.weight",
                     "gpt_neox.final_layer_norm.weight": "output_norm.weight",
                     "gpt_neox.final_layer_norm.bias": "output_norm.bias",
                     "transformer.word_embeddings.weight": "token_embd.weight",
                     "transformer.ln_f.weight": "output_norm.weight",
                     "transformer.ln_f.bias": "output_norm.bias",
                     "transformer.wte.weight": "token_embd.weight", "transformer.wpe.weight": "position_embd.weight",
                     "transformer.norm_f.weight": "output_norm.weight",  # (DBRX's, MPT's)
                     "transformer.norm_f.bias": "output_norm.bias",
                     "transformer.word_embeddings_layernorm.weight": "token_embd_norm.weight",  # (BLOOM's)
                     "transformer.word_embeddings_layernorm.bias": "token_embd_norm.bias"}
GGUF_LFM2_NAMES = {"operator_norm": "attn_norm", "ffn_norm": "ffn_norm", "self_attn.out_proj": "attn_output",
                   "self_attn.q_layernorm": "attn_q_norm", "self_attn.k_layernorm": "attn_k_norm",
                   "feed_forward.w1": "ffn_gate", "feed_forward.w3": "ffn_up", "feed_forward.w2": "ffn_down",
                   "conv.in_proj": "shortconv.in_proj", "conv.conv": "shortconv.conv", "conv.out_proj": "shortconv.out_proj"}
# Gemma's four norms a block (its "ffn_norm" the pre-feed-forward one), stored as 1 + weight
GGUF_GEMMA_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                    "post_feedforward_layernorm": "post_ffw_norm"}


# Qwen3.5's: its delta-rule layers' products and parameters, its norm after the attention
GGUF_QWEN35_NAMES = {"post_attention_layernorm": "post_attention_norm", "linear_attn.in_proj_qkv": "attn_qkv",
                     "linear_attn.in_proj_z": "attn_gate", "linear_attn.in_proj_b": "ssm_beta",
                     "linear_attn.in_proj_a": "ssm_alpha", "linear_attn.conv1d": "ssm_conv1d",
                     "linear_attn.norm": "ssm_norm", "linear_attn.out_proj": "ssm_out"}


def _qwen35_tensor(rest: str, values, c, tile: bool = True):
    """A Qwen3.5 delta-rule parameter as llama.cpp's converter writes it: (name within the block, values),
    its value heads from the checkpoint's grouped order to the tiled one (value head h reading key head h
    mod the key heads; ``tile`` False: left in the checkpoint's, as Qwen3-Next's files keep them), A_log as
    -exp(A_log), dt_bias as ssm_dt's bias, the convolution's taps [channels, length]; None for the others."""
    import numpy as np
    groups, repeat, key_width = c.linear_num_key_heads, c.linear_num_value_heads // c.linear_num_key_heads, \
        2 * c.linear_num_key_heads * c.linear_key_head_dim

    def tiled(x, width, axis=0):
        if not tile:
            return x
        x = np.moveaxis(x, axis, 0)
        x = x.reshape(groups, repeat, width, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)
        return np.ascontiguousarray(np.moveaxis(x, 0, axis))

    width = c.linear_value_head_dim
    if rest == "linear_attn.A_log":
        return "ssm_a", -np.exp(tiled(values, 1))
    if rest == "linear_attn.dt_bias":
        return "ssm_dt.bias", tiled(values, 1)
    if rest in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
        values = values.reshape(values.shape[0], -1)
        values = np.concatenate([values[:key_width], tiled(values[key_width:], width)])
    elif rest in ("linear_attn.in_proj_z.weight", "linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"):
        values = tiled(values, 1 if rest != "linear_attn.in_proj_z.weight" else width)
    elif rest == "linear_attn.out_proj.weight":
        values = tiled(values, width, axis=1)
    else:
        return None
    part, kind = rest.rsplit(".", 1)
    return f"{GGUF_QWEN35_NAMES[part]}.{kind}", values


def _qwen3next_tensors(rest: str, values, c, fused_qkvz: bool):
    """A Qwen3-Next delta-rule parameter as llama.cpp's converter writes it: [(name within the block, values)], its
    value heads in the checkpoint's order; q/k/v/z split into attn_qkv (every query, key and value) and attn_gate
    (or, ``fused_qkvz``, one ssm_in a key head at a time, as the first converter wrote it); beta and alpha one
    ssm_ba, a key head at a time; the others as Qwen3.5's (_qwen35_tensor); None for the others."""
    import numpy as np
    if rest == "linear_attn.in_proj_qkvz.weight" and not fused_qkvz:
        repeat = c.linear_num_value_heads // c.linear_num_key_heads
        widths = np.cumsum([c.linear_key_head_dim, c.linear_key_head_dim, repeat * c.linear_value_head_dim])
        q, k, v, z = np.split(values.reshape(c.linear_num_key_heads, -1, values.shape[1]), widths, axis=1)
        flat = lambda x: x.reshape(-1, values.shape[1])
        return [("attn_qkv.weight", np.concatenate([flat(q), flat(k), flat(v)])), ("attn_gate.weight", flat(z))]
    if rest in ("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight"):
        return [("ssm_in.weight" if "qkvz" in rest else "ssm_ba.weight", values)]
    written = _qwen35_tensor(rest, values, c, tile=False)
    return None if written is None else [written]


# Granite 4's hybrids': their Mamba2 layers' products and parameters
GGUF_GRANITE_HYBRID_NAMES = {"mamba.in_proj": "ssm_in", "mamba.out_proj": "ssm_out", "mamba.conv1d": "ssm_conv1d"}


def _granite_hybrid_tensor(rest: str, values, c):
    """A Granite 4 hybrid parameter as llama.cpp's converter writes it: (name within the block, values): the
    Mamba2 layers' A_log as -exp(A_log) and D as [heads, 1], dt_bias as ssm_dt's bias, the convolution's taps
    [channels, length], the gated norm's weight a row a group; a dense model's shared MLP as Llama's; None for
    the others."""
    import numpy as np
    if rest == "mamba.A_log":
        return [("ssm_a", -np.exp(values)[:, None])]
    if rest == "mamba.D":
        return [("ssm_d", values[:, None])]
    if rest == "mamba.dt_bias":
        return [("ssm_dt.bias", values)]
    if rest == "mamba.norm.weight":
        return [("ssm_norm.weight", values.reshape(getattr(c, "mamba_n_groups", None) or c.n_groups, -1))]
    if rest.startswith(("mamba.in_proj.", "mamba.out_proj.", "mamba.conv1d.")):
        part, kind = rest.rsplit(".", 1)
        return [(f"{GGUF_GRANITE_HYBRID_NAMES[part]}.{kind}", values.reshape(values.shape[0], -1) if kind == "weight"
                 else values)]
    if getattr(c, "num_local_experts", 0):
        return None
    if rest == "shared_mlp.input_linear.weight":
        gate, up = np.split(values, 2, axis=0)
        return [("ffn_gate.weight", np.ascontiguousarray(gate)), ("ffn_up.weight", np.ascontiguousarray(up))]
    if rest == "shared_mlp.output_linear.weight":
        return [("ffn_down.weight", values)]
    return None


def _granite_hybrid_metadata(c) -> dict:
    """The metadata llama.cpp's converter writes for a Granite 4 hybrid: its Mamba2 sizes, no K/V heads in a
    Mamba2 layer, Granite's multipliers, the rotary off (Granite 4.0 H's), its experts."""
    experts = {"expert_count": c.num_local_experts, "expert_used_count": c.num_experts_per_tok,
               "expert_shared_feed_forward_length": c.shared_intermediate_size} if c.num_local_experts else {}
    return {"ssm.conv_kernel": c.mamba_d_conv, "ssm.state_size": c.mamba_d_state, "ssm.group_count": c.mamba_n_groups,
            "ssm.time_step_rank": c.mamba_n_heads, "ssm.inner_size": c.mamba_n_heads * c.mamba_d_head,
            "embedding_scale": c.embedding_multiplier, "residual_scale": c.residual_multiplier,
            "attention.scale": c.attention_multiplier, "logit_scale": c.logits_scaling,
            "rope.scaling.finetuned": c.position_embedding_type == "rope", **experts}


# a Nemotron-H layer's type -> the prefix of its mixer's parameters in Granite 4's names (and llama.cpp's converter's)
NEMOTRON_H_KINDS = {"linear_attention": "mamba", "full_attention": "self_attn", "mlp": "mlp", "moe": "mlp"}


def _nemotron_h_name(name: str, types: list[str]) -> str:
    """A Nemotron-H parameter's name as Granite 4's (whose writing it then takes): each layer's norm as its
    input_layernorm, its mixer's products under its kind's prefix, the embeddings and final norm as Llama's."""
    name = {"model.embeddings.weight": "model.embed_tokens.weight", "model.norm_f.weight": "model.norm.weight"}.get(
        name, name)
    parts = name.split(".", 4)
    if parts[1] == "layers" and parts[3] == "norm":
        return f"model.layers.{parts[2]}.input_layernorm.{parts[4]}"
    if parts[1] == "layers" and parts[3] == "mixer":
        return f"model.layers.{parts[2]}.{NEMOTRON_H_KINDS[types[int(parts[2])]]}.{parts[4]}"
    return name


def _nemotron_h_metadata(c) -> dict:
    """The metadata llama.cpp's converter writes for a Nemotron-H: its Mamba2 sizes (K/V heads and an MLP's
    width a layer: write_gguf_of), Nemotron 3's experts."""
    experts = {"expert_count": c.n_routed_experts, "expert_used_count": c.num_experts_per_tok,
               "expert_feed_forward_length": c.moe_intermediate_size,
               "expert_shared_feed_forward_length": c.moe_shared_expert_intermediate_size,
               "expert_shared_count": c.n_shared_experts, "expert_weights_norm": c.norm_topk_prob,
               "expert_weights_scale": float(c.routed_scaling_factor), "expert_group_count": c.n_group,
               "moe_latent_size": c.moe_latent_size}
    return {"ssm.conv_kernel": c.conv_kernel, "ssm.state_size": c.ssm_state_size, "ssm.group_count": c.n_groups,
            "ssm.time_step_rank": c.mamba_num_heads, "ssm.inner_size": c.mamba_num_heads * c.mamba_head_dim,
            **(experts if "moe" in c.layers_block_type else {})}


# Mamba's mixer's parameters by llama.cpp's names (A_log written as -exp(A_log))
GGUF_MAMBA_NAMES = {"in_proj": "ssm_in", "conv1d": "ssm_conv1d", "x_proj": "ssm_x", "dt_proj": "ssm_dt",
                    "A_log": "ssm_a", "D": "ssm_d", "out_proj": "ssm_out",
                    # (Jamba's norms of the time step, B and C)
                    "dt_layernorm": "ssm_dt_norm", "b_layernorm": "ssm_b_norm", "c_layernorm": "ssm_c_norm"}


def _mamba_tensor_name(rest: str) -> str:
    """A Mamba mixer's parameter (``mamba.<name>[.<kind>]``) by llama.cpp's name within its block."""
    _, name, *kind = rest.split(".")
    return ".".join([GGUF_MAMBA_NAMES[name], *kind])


def _mamba_metadata(c) -> dict:
    """The metadata llama.cpp's converter writes for a Mamba (a Falcon-Mamba: its time steps, B and C normed)."""
    return {"ssm.conv_kernel": c.conv_kernel, "ssm.state_size": c.state_size, "ssm.time_step_rank": c.time_step_rank,
            "ssm.inner_size": c.intermediate_size, "ssm.dt_b_c_rms": c.model_type == "falcon_mamba"}


def _jamba_metadata(c) -> dict:
    """The metadata llama.cpp's converter writes for a Jamba: its Mamba sizes, its experts (a layer routes where it
    has a router)."""
    return {"ssm.conv_kernel": c.mamba_d_conv, "ssm.state_size": c.mamba_d_state, "ssm.time_step_rank": c.mamba_dt_rank,
            "ssm.inner_size": c.mamba_expand * c.hidden_size, "expert_count": c.num_experts,
            "expert_used_count": c.num_experts_per_tok}


def _mamba2_metadata(c) -> dict:
    """The metadata llama.cpp's converter writes for a Mamba2 language model: its Mamba2 sizes."""
    return {"ssm.conv_kernel": c.conv_kernel, "ssm.state_size": c.state_size, "ssm.group_count": c.n_groups,
            "ssm.time_step_rank": c.num_heads, "ssm.inner_size": c.num_heads * c.head_dim}


def _falcon_h1_state(hf) -> dict:
    """A Falcon-H1 model's weights as llama.cpp's converter writes them, under the Llama names write_gguf_of knows:
    every μP multiplier folded into the weights (the attention's input into q, k and v, the keys' into k, Mamba2's
    input and its input product's five parts into in_proj, the outputs' into o_proj and out_proj, the MLP's into
    its gate and down products, the embeddings' and the logits' into theirs)."""
    c = hf.config
    rows = torch.cat([torch.full((w,), m, dtype=torch.float64) for w, m in zip(
        [c.mamba_d_ssm, c.mamba_d_ssm, c.mamba_n_groups * c.mamba_d_state, c.mamba_n_groups * c.mamba_d_state,
         c.mamba_n_heads], c.ssm_multipliers)])
    scales = {"q_proj": c.attention_in_multiplier, "k_proj": c.attention_in_multiplier * c.key_multiplier,
              "v_proj": c.attention_in_multiplier, "o_proj": c.attention_out_multiplier,
              "out_proj": c.ssm_out_multiplier, "gate_proj": c.mlp_multipliers[0], "down_proj": c.mlp_multipliers[1],
              "lm_head": c.lm_head_multiplier, "embed_tokens": c.embedding_multiplier}
    state = {}
    for name, tensor in hf.state_dict().items():
        if name.endswith("mup_vector"):
            continue
        product = name.split(".")[-2]
        tensor = tensor * scales.get(product, 1.0)
        if product == "in_proj":
            tensor = tensor * c.ssm_in_multiplier * rows.to(tensor.dtype)[:, None]
        name = name.replace("model.final_layernorm", "model.norm").replace(".feed_forward.", ".mlp.")
        state[name.replace(".pre_ff_layernorm.", ".post_attention_layernorm.")] = tensor
    return state


def _kv_heads(c) -> int:
    """A config's K/V heads: Llama's name; GPT-NeoX's its query heads; Falcon's num_kv_heads, or one where it is
    multi-query in the old layout."""
    if c.model_type in ("gpt_neox", "gpt2", "bloom", "mpt"):
        return c.num_attention_heads
    if c.model_type == "gpt_bigcode":
        return 1 if c.multi_query else c.num_attention_heads
    if c.model_type == "falcon":
        return c.num_kv_heads if c.new_decoder_architecture or not c.multi_query else 1
    return c.num_key_value_heads


def _qkv_in_thirds(values, c, arch: str):
    """GPT-NeoX's fused q/k/v rows (a head's query, key and value together) and Falcon's (a K/V group's queries, key
    and value in its new layout; every query's, then the key's and the value's in its multi-query one) as every
    query's, every key's, every value's, as their converters write them."""
    import numpy as np
    dim = c.hidden_size // c.num_attention_heads
    if arch in ("gptneox", "bloom"):  # (BLOOM's as GPT-NeoX's)
        return values.reshape(c.num_attention_heads, 3, dim, *values.shape[1:]).swapaxes(0, 1).reshape(values.shape)
    kv = _kv_heads(c)
    if not c.new_decoder_architecture:
        return values
    grouped = values.reshape(kv, c.num_attention_heads // kv + 2, dim, *values.shape[1:])
    rows = lambda part: part.reshape(-1, *values.shape[1:])
    return np.concatenate([rows(grouped[:, :-2]), rows(grouped[:, -2]), rows(grouped[:, -1])])


def _glm4_moe_metadata(c) -> dict:
    """A GLM-4.5 config's metadata as llama.cpp's converter writes it: its rotary's share of a head, its experts
    (DeepSeek-V3's routing: sigmoid scores, the chosen renormalised and scaled), its dense leading layers."""
    return {"rope.dimension_count": int(c.head_dim * c.rope_parameters["partial_rotary_factor"]),
            "expert_count": c.n_routed_experts, "expert_used_count": c.num_experts_per_tok,
            "expert_feed_forward_length": c.moe_intermediate_size, "expert_shared_count": c.n_shared_experts,
            "leading_dense_block_count": c.first_k_dense_replace,
            "expert_weights_scale": float(c.routed_scaling_factor), "expert_weights_norm": c.norm_topk_prob,
            "expert_gating_func": 2, "expert_group_count": c.n_group,
            "expert_group_used_count": c.topk_group}


# AFMoE's norms of the attention's output, before and after the MLP, its attention's gate and its router
GGUF_AFMOE_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_mlp_layernorm": "ffn_norm",
                    "post_mlp_layernorm": "post_ffw_norm", "self_attn.gate_proj": "attn_gate",
                    "mlp.router.gate": "ffn_gate_inp"}
# DeepSeek's latent attention (kv_b_proj split as llama.cpp's converter splits it: _deepseek2_tensors)
GGUF_DEEPSEEK2_NAMES = {"self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
                        "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
                        "self_attn.kv_a_layernorm": "attn_kv_a_norm"}


def _deepseek2_metadata(c) -> dict:
    """A DeepSeek (or GLM-4.7-Flash) config's metadata as llama.cpp's converter writes it: the latent attention's
    widths (its MLA key and value lengths), the mixture's, YaRN's with its log multiplier (0.1 mscale_all_dim)."""
    dense = c.first_k_dense_replace if hasattr(c, "first_k_dense_replace") else \
        next(i for i, t in enumerate(c.mlp_layer_types + ["sparse"]) if t == "sparse")
    v2, sigmoid = c.model_type == "deepseek_v2", c.model_type not in ("deepseek_v2", "mistral4")  # (Mistral 4's softmax)
    rope = c.rope_parameters
    metadata = {"attention.kv_lora_rank": c.kv_lora_rank, "attention.q_lora_rank": c.q_lora_rank,
                "attention.key_length": c.kv_lora_rank + c.qk_rope_head_dim, "attention.value_length": c.kv_lora_rank,
                "attention.key_length_mla": c.qk_nope_head_dim + c.qk_rope_head_dim,
                "attention.value_length_mla": c.v_head_dim, "rope.dimension_count": c.qk_rope_head_dim,
                "leading_dense_block_count": dense, "expert_feed_forward_length": c.moe_intermediate_size,
                "expert_count": c.n_routed_experts, "expert_used_count": c.num_experts_per_tok,
                "expert_shared_count": c.n_shared_experts, "expert_weights_scale": float(c.routed_scaling_factor),
                "expert_weights_norm": None if v2 else bool(c.norm_topk_prob), "expert_gating_func": 2 if sigmoid else 1,
                "expert_group_count": None if v2 else c.n_group, "expert_group_used_count": None if v2 else c.topk_group}
    if rope.get("rope_type") == "yarn":
        metadata |= {"rope.scaling.type": "yarn", "rope.scaling.factor": float(rope["factor"]),
                     "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
                     "rope.scaling.yarn_log_multiplier": 0.1 * rope["mscale_all_dim"]}
    return metadata


def _deepseek2_tensors(rest: str, values, c):
    """kv_b_proj's rows as k_b ([heads, kv_lora_rank, nope], each head's key rows transposed) and v_b, and the
    V3 router's selection bias, as llama.cpp's converter writes them; None for the other tensors."""
    import numpy as np
    if rest == "self_attn.kv_b_proj.weight":
        heads = values.reshape(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
        return [("attn_k_b.weight", np.ascontiguousarray(heads[:, :c.qk_nope_head_dim].swapaxes(1, 2))),
                ("attn_v_b.weight", np.ascontiguousarray(heads[:, c.qk_nope_head_dim:]))]
    if rest == "mlp.gate.e_score_correction_bias":
        return [("exp_probs_b.bias", values)]
    return None


# DBRX's by llama.cpp's names (its experts' stacks: _dbrx_tensors)
GGUF_DBRX_NAMES = {"norm_attn_norm.norm_1.weight": "attn_norm.weight",
                   "norm_attn_norm.attn.Wqkv.weight": "attn_qkv.weight",
                   "norm_attn_norm.attn.out_proj.weight": "attn_output.weight",
                   "norm_attn_norm.norm_2.weight": "attn_output_norm.weight",
                   "ffn.router.layer.weight": "ffn_gate_inp.weight"}


def _dbrx_tensors(rest: str, values, c):
    """A DBRX layer's tensor as its converter writes it: by llama.cpp's name; its experts' w1, v1 and w2 as stacks
    [experts, inner, hidden], w2's transposed to [experts, hidden, inner]."""
    if rest in GGUF_DBRX_NAMES:
        return GGUF_DBRX_NAMES[rest], values
    experts = values.reshape(c.ffn_config.moe_num_experts, c.ffn_config.ffn_hidden_size, c.d_model)
    name = {"ffn.experts.mlp.w1": "ffn_gate_exps", "ffn.experts.mlp.v1": "ffn_up_exps",
            "ffn.experts.mlp.w2": "ffn_down_exps"}[rest]
    return f"{name}.weight", experts.transpose(0, 2, 1).copy() if name == "ffn_down_exps" else experts


def _gpt_oss_tensors(rest: str, values):
    """A gpt-oss parameter as llama.cpp's converter writes it: (name within the block, values) pairs.
    Its experts' interleaved gate and up columns [experts, hidden, 2 x inner] split into two stacks
    [experts, inner, hidden], their biases likewise; down_proj transposed; the router's weight and bias."""
    if rest == "self_attn.sinks":
        return [("attn_sinks.weight", values)]
    if rest.startswith("mlp.router."):
        return [(f"ffn_gate_inp.{rest.rsplit('.', 1)[1]}", values)]
    if rest.endswith("gate_up_proj"):
        values = values.swapaxes(1, 2)
        return [("ffn_gate_exps.weight", values[:, 0::2]), ("ffn_up_exps.weight", values[:, 1::2])]
    if rest.endswith("gate_up_proj_bias"):
        return [("ffn_gate_exps.bias", values[:, 0::2]), ("ffn_up_exps.bias", values[:, 1::2])]
    if rest.endswith("down_proj"):
        return [("ffn_down_exps.weight", values.swapaxes(1, 2))]
    return [("ffn_down_exps.bias", values)]


def write_gguf_of(hf, path, arch: str, metadata: dict | None = None, tensors: dict | None = None,
                  matrices=None, leave_out: tuple[str, ...] = (), fused_experts: bool = False, fused_qkvz: bool = False):
    """``hf``'s weights in a GGUF file as llama.cpp's converter writes them for ``arch``: llama.cpp's
    names, a Llama's (SmolLM3's, Granite's) query and key rows permuted for llama.cpp's rotary, the sizes in the metadata
    (a head's size only where it is not the hidden size over the heads); ``metadata`` (key -> a
    uint32, float32, str or list value, under the arch's prefix unless it starts with "tokenizer.")
    and ``tensors`` (name -> float32 array) added (a None value leaves a key out). Matrices in float32, or in ``matrices``' type
    (a GGMLQuantizationType gguf-py quantizes to). Gemma's norms are stored as 1 + weight, as its
    converter stores them (OLMo's output norms are named as Gemma's); a mixture's experts as three stacks (ffn_gate_exps, ffn_up_exps,
    ffn_down_exps), its router in float32 (gpt-oss's: _gpt_oss_tensors), a shared expert's three
    products (*_shexp) and its router's one row (a vector). Tensors whose llama.cpp names end in one of
    ``leave_out`` are left out (those a file may go without). ``fused_experts``: a mixture's gate and up stacks
    as one, ffn_gate_up_exps (llama.cpp's --fuse-gate-up-exps); ``fused_qkvz``: a Qwen3-Next file's q/k/v/z
    product as one, ssm_in (_qwen3next_tensors). A vision-language model's language model alone,
    as llama.cpp's converter writes its text GGUF. The file carries no tokenizer."""
    import gguf
    import numpy as np
    c = hf.config.get_text_config()
    # Mamba's and Mamba2's: their layers alone, no heads, no MLP, a context of 2^20, as their converters write
    mamba2, state_only = arch == "mamba2", arch in ("mamba2", "mamba")
    heads, kv_heads = (0, 0) if state_only else (c.num_attention_heads, _kv_heads(c))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(1 << 20 if state_only else getattr(c, "max_position_embeddings", 2048))  # (BLOOM: none)
    writer.add_embedding_length(c.hidden_size)
    # LFM2's: its MLP's width as derived, no K/V heads in a convolution layer, the convolution's length
    # Granite 4's hybrids' and Nemotron-H's: Mamba2 layers, no K/V heads in them; Nemotron-H's an MLP's width a
    # layer (none in a mixer layer)
    lfm2, nemotron = arch in ("lfm2", "lfm2moe"), arch in ("nemotron_h", "nemotron_h_moe") or state_only
    hybrid, jamba = arch == "granitehybrid" or nemotron, arch == "jamba"
    types = c.layers_block_type if nemotron and not state_only else getattr(c, "layer_types", None)
    writer.add_feed_forward_length(0 if state_only else hf.model.layers[0].feed_forward.w1.out_features if lfm2 else
                                   [c.intermediate_size if t == "mlp" else c.moe_intermediate_size if t == "moe" else 0
                                    for t in types] if nemotron else
                                   c.shared_intermediate_size if hybrid and not c.num_local_experts else
                                   (c.n_inner or 4 * c.n_embd) if arch in ("gpt2", "starcoder") else
                                   c.ffn_config.ffn_hidden_size if arch == "dbrx" else
                                   2 * c.intermediate_size if arch == "qwen" else  # (Qwen 1's config's, as written)
                                   4 * c.hidden_size if arch == "bloom" else
                                   c.expansion_ratio * c.d_model if arch == "mpt" else
                                   c.intermediate_size_mlp if arch == "llama4" else
                                   c.prefix_dense_intermediate_size if arch == "cohere2moe" else
                                   c.to_dict().get("intermediate_size") or getattr(c, "ffn_hidden_size", None) or
                                   c.moe_intermediate_size)
    writer.add_head_count(heads)
    deepseek = arch in ("deepseek2", "mistral4")  # (Mistral 4's files are DeepSeek's under a name of their own)
    minicpm3 = arch == "minicpm3"  # (DeepSeek's latent attention, its kv_b whole, its key length a query head's)
    if not state_only:
        writer.add_head_count_kv([kv_heads if t in ("attention", "full_attention") else 0 for t in types]
                                 if lfm2 or hybrid or jamba else 1 if deepseek else kv_heads)
    if deepseek:
        metadata = _deepseek2_metadata(c) | (metadata or {})
    if arch == "glm4moe":
        metadata = _glm4_moe_metadata(c) | (metadata or {})
    if minicpm3:
        metadata = {"attention.kv_lora_rank": c.kv_lora_rank, "attention.q_lora_rank": c.q_lora_rank,
                    "attention.key_length": c.qk_nope_head_dim + c.qk_rope_head_dim,
                    "rope.dimension_count": c.qk_rope_head_dim} | (metadata or {})
    if hybrid:
        metadata = (_mamba_metadata(c) if arch == "mamba" else _mamba2_metadata(c) if mamba2 else
                    _nemotron_h_metadata(c) if nemotron else _granite_hybrid_metadata(c)) | (metadata or {})
    if jamba:
        metadata = _jamba_metadata(c) | (metadata or {})
    if lfm2:
        writer.add_uint32(f"{arch}.shortconv.l_cache", c.conv_L_cache)
    falcon = arch == "falcon-h1"
    if falcon:  # its Mamba2 sizes (Granite 4's keys)
        metadata = {"ssm.conv_kernel": c.mamba_d_conv, "ssm.state_size": c.mamba_d_state,
                    "ssm.group_count": c.mamba_n_groups, "ssm.time_step_rank": c.mamba_n_heads,
                    "ssm.inner_size": c.mamba_d_ssm, **(metadata or {})}
    qwen35 = arch in ("qwen35", "qwen35moe", "qwen3next")
    if qwen35:  # its delta-rule layers' sizes and places, its rotary's share of a head
        metadata = {"ssm.conv_kernel": c.linear_conv_kernel_dim, "ssm.state_size": c.linear_key_head_dim,
                    "ssm.group_count": c.linear_num_key_heads, "ssm.time_step_rank": c.linear_num_value_heads,
                    "ssm.inner_size": c.linear_value_head_dim * c.linear_num_value_heads,
                    "attention.recurrent_layers": [t == "linear_attention" for t in c.layer_types],
                    "rope.dimension_count": int(c.head_dim * c.rope_parameters["partial_rotary_factor"]),
                    **(metadata or {})}
    if not (deepseek or minicpm3 or state_only) and getattr(c, "head_dim", None) not in (None, c.hidden_size // heads):
        writer.add_key_length(c.head_dim)
    layer_norms = arch in ("starcoder2", "stablelm", "phi2", "command-r", "cohere2", "olmo", "nemotron", "gptneox",
                           "falcon", "gpt2", "starcoder", "dbrx", "jais2", "orion", "bloom", "mpt") or (
        arch == "cohere2moe" and c.rms_norm_eps is None)  # (Cohere2-MoE's RMSNorms where its config names their eps)
    if layer_norms:  # (LayerNorms' epsilon; OLMo 1's fixed, as its converter writes it)
        writer.add_layer_norm_eps(getattr(c, "norm_epsilon", None) or getattr(c, "layer_norm_eps", None) or
                                  getattr(c, "norm_eps", None) or getattr(c, "layer_norm_epsilon", None) or 1e-5)
        if arch == "gptneox":
            writer.add_bool("gptneox.use_parallel_residual", c.use_parallel_residual)
        rotary = (getattr(c, "rope_parameters", None) or {}).get("partial_rotary_factor")  # (none: GPT-2's)
        if rotary:  # (StableLM's and Phi-2's share of a head)
            writer.add_rope_dimension_count(int(rotary * c.hidden_size // c.num_attention_heads))
    else:
        writer.add_layer_norm_rms_eps(c.norm_eps if lfm2 else c.layer_norm_epsilon if nemotron else c.rms_norm_eps)
    # (no positions: Nemotron's, Jamba's; learned ones; ALiBi)
    if not nemotron and arch not in ("gpt2", "starcoder", "bloom", "mpt", "jamba"):
        rope = c.rope_parameters
        base = (rope.get("full_attention") or rope)["rope_theta"]  # (OLMo 3's: its global layers')
        if arch in ("hunyuan-dense", "hunyuan-moe") and rope.get("alpha"):  # (its converter folds the alpha into the base)
            base *= rope["alpha"] ** (c.head_dim / (c.head_dim - 2))
        writer.add_rope_freq_base(base)
    writer.add_vocab_size(c.vocab_size)
    for key, value in (metadata or {}).items():
        if value is None:  # (a key the architecture's files carry, left out)
            continue
        adds = {int: writer.add_uint32, float: writer.add_float32, str: writer.add_string, list: writer.add_array,
                bool: writer.add_bool}
        adds[type(value)](key if key.startswith("tokenizer.") else f"{arch}.{key}", value)

    def add(name, values):
        if name.endswith(leave_out):
            return None
        if falcon and name.endswith(".ffn_norm.weight"):  # (its converter names Falcon-H1's without a kind)
            name = name.removesuffix(".weight")
        if matrices is None or values.ndim < 2 or values.shape[-1] % 32 or name.endswith((
                "ffn_gate_inp.weight", ".bias", "shortconv.conv.weight", "ssm_conv1d.weight", "ssm_norm.weight",
                "ssm_a", "ssm_d")):
            # (routers, convolutions' taps and norms stay F32; rows no block divides too, as llama-quantize leaves
            # them: DeepSeek's k_b of narrow heads)
            return writer.add_tensor(name, values)
        writer.add_tensor(name, gguf.quants.quantize(values, matrices), raw_dtype=matrices)

    gemma = arch.startswith("gemma")
    names = {**GGUF_LAYER_NAMES,
             **(GGUF_GEMMA_NAMES if arch in ("gemma2", "gemma3", "olmo2", "gpt-oss", "exaone4") else {}),
             **(GGUF_LFM2_NAMES if lfm2 else {}), **(GGUF_QWEN35_NAMES if qwen35 else {}),
             **({"post_self_attn_layernorm": "post_attention_norm", "post_mlp_layernorm": "post_ffw_norm"}
                if arch == "glm4" else {}), **(GGUF_DEEPSEEK2_NAMES if deepseek or minicpm3 else {}),
             **({"self_attn.kv_b_proj": "attn_kv_b"} if minicpm3 else {}),
             **({"post_attention_layernorm": "post_attention_norm"} if arch in ("glm4moe", "seed_oss") else {}),
             **(GGUF_AFMOE_NAMES if arch == "afmoe" else {})}
    for name, tensor in (_falcon_h1_state(hf) if falcon else hf.state_dict()).items():
        if name.startswith("model.visual."):
            continue
        name = name.replace("model.language_model.", "model.", 1).replace("backbone.", "model.", 1)
        converters_leave_out = state_only or arch in ("falcon", "gpt2", "starcoder", "bloom", "mpt")
        if name == "lm_head.weight" and converters_leave_out and c.tie_word_embeddings:
            continue  # (their converters leave it out)
        if ".act_fn." in name:  # (Apertus's xIELU numbers: the metadata's, a value a layer, as its converter writes)
            continue
        if name.endswith("query_key_value.weight") or name.endswith("query_key_value.bias"):
            values = _qkv_in_thirds(tensor.float().numpy(), c, arch)  # (GPT-NeoX's and Falcon's, as their converters)
        if nemotron:
            name = _nemotron_h_name(name, types)
        values = values if name.endswith(("query_key_value.weight", "query_key_value.bias")) else tensor.float().numpy()
        if arch == "gpt2" and name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            values = np.ascontiguousarray(values.T)  # (its Conv1D's [in, out] as nn.Linear's, as its converter)
        if name.endswith("conv.conv.weight"):  # LFM2's taps [hidden, 1, length], kept [hidden, length]
            values = values.reshape(values.shape[0], -1)
        if (gemma or qwen35 or arch == "nemotron") and name.endswith("norm.weight") and "linear_attn" not in name:
            values = values + 1
        if name in GGUF_GLOBAL_NAMES:
            add(GGUF_GLOBAL_NAMES[name], values)
            continue
        _, _, layer, rest = name.split(".", 3)
        if arch == "qwen3next" and (written := _qwen3next_tensors(rest, values, c, fused_qkvz)) is not None:
            for part, part_values in written:
                add(f"blk.{layer}.{part}", np.ascontiguousarray(part_values))
            continue
        if qwen35 and (written := _qwen35_tensor(rest, values, c)) is not None:
            add(f"blk.{layer}.{written[0]}", written[1])
            continue
        if jamba:  # (its MLPs, router and experts by Llama's and Mixtral's names, as its converter writes them)
            rest = rest.replace("pre_ff_layernorm", "post_attention_layernorm").replace(
                "feed_forward.router.", "mlp.gate.").replace("feed_forward.", "mlp.")
        if arch in ("mamba", "jamba") and rest.startswith("mamba."):
            add(f"blk.{layer}.{_mamba_tensor_name(rest)}", -np.exp(values) if rest == "mamba.A_log" else
                values.reshape(values.shape[0], -1) if rest == "mamba.conv1d.weight" else values)
            continue
        if (hybrid or falcon) and (written := _granite_hybrid_tensor(rest, values, c)) is not None:
            for part, part_values in written:
                add(f"blk.{layer}.{part}", np.ascontiguousarray(part_values))
            continue
        if deepseek and (written := _deepseek2_tensors(rest, values, c)) is not None:
            for part, part_values in written:
                add(f"blk.{layer}.{part}", part_values)
            continue
        if arch == "qwen" and rest.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
            continue  # (Qwen 1's q/k/v one product, c_attn: written with the queries')
        if arch == "qwen" and rest.startswith("self_attn.q_proj."):
            kind = rest.rsplit(".", 1)[1]
            layer_state = {n: t.float().numpy() for n, t in hf.model.layers[int(layer)].self_attn.state_dict().items()}
            add(f"blk.{layer}.attn_qkv.{kind}", np.concatenate([layer_state[f"{p}_proj.{kind}"] for p in "qkv"]))
            continue
        if "_layernorm.norms." in rest:  # StableLM 2 12B's q/k norms, a LayerNorm a head: stacked, as its converter
            if rest.endswith(".norms.0.weight"):
                which = rest.split("_layernorm.")[0].rsplit(".", 1)[-1]
                norms = getattr(hf.model.layers[int(layer)].self_attn, f"{which}_layernorm").norms
                add(f"blk.{layer}.attn_{which}_norm.weight", np.stack([n.weight.detach().float().numpy() for n in norms]))
            continue
        if arch == "dbrx":
            part, part_values = _dbrx_tensors(rest, values, c)
            add(f"blk.{layer}.{part}", part_values)
            continue
        if arch == "gpt-oss" and rest.startswith(("mlp.experts.", "mlp.router.", "self_attn.sinks")):
            for part, part_values in _gpt_oss_tensors(rest, values):
                add(f"blk.{layer}.{part}", np.ascontiguousarray(part_values))
            continue
        if rest == "mlp.shared_expert_gate.weight":  # (one vector in the file)
            add(f"blk.{layer}.ffn_gate_inp_shexp.weight", values.reshape(-1))
            continue
        if rest in ("mlp.gate.moe_statics.e_score_correction_bias", "feed_forward.expert_bias",  # ERNIE's, LFM2-MoE's,
                    "mlp.gate.e_score_correction_bias", "mlp.e_score_correction_bias",  # Nemotron 3's, MiniMax-M2's,
                    "mlp.expert_bias"):  # AFMoE's
            add(f"blk.{layer}.exp_probs_b.bias", values.reshape(-1))
            continue
        if arch == "llama4" and rest.startswith("feed_forward."):  # (its experts' stacks bmm's, [experts, in, out])
            rest = rest.replace("feed_forward.", "mlp.", 1).replace("mlp.router.", "mlp.gate.")
            if rest.startswith("mlp.experts."):
                values = np.ascontiguousarray(values.swapaxes(1, 2))
        if rest.startswith("feed_forward.experts.") or rest == "feed_forward.gate.weight":  # LFM2-MoE's: as a mixture's
            rest = rest.replace("feed_forward.", "mlp.", 1)
        if rest == "self_attn.sinks":  # (Granite SWA's, gpt-oss's name)
            add(f"blk.{layer}.attn_sinks.weight", values)
            continue
        if rest == "shared_mlp.input_linear.weight" and arch == "granite_swa":  # (kept one, gate and up rows)
            add(f"blk.{layer}.ffn_up_shexp.weight", values)
            continue
        if rest == "shared_mlp.input_linear.weight":  # Granite MoE Shared's gate and up rows together
            gate, up = np.split(values, 2, axis=0)
            add(f"blk.{layer}.ffn_gate_shexp.weight", np.ascontiguousarray(gate))
            add(f"blk.{layer}.ffn_up_shexp.weight", np.ascontiguousarray(up))
            continue
        if rest.startswith(("mlp.experts.", "block_sparse_moe.experts.")):  # stacks: gate and up rows together
            if rest.endswith("gate_up_proj") and fused_experts:
                add(f"blk.{layer}.ffn_gate_up_exps.weight", values)
            elif rest.endswith("gate_up_proj"):
                gate, up = np.split(values, 2, axis=1)
                add(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
                add(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(up))
            elif rest.endswith("up_proj"):  # (Nemotron 3's experts have no gate)
                add(f"blk.{layer}.ffn_up_exps.weight", values)
            else:
                add(f"blk.{layer}.ffn_down_exps.weight", values)
            continue
        part, kind = rest.rsplit(".", 1)
        if arch in ("llama", "smollm3", "granite", "granitemoe", "granitehybrid", "granite_swa", "mistral3", "arcee",
                    "internlm2", "minicpm", "olmo", "xverse", "baichuan") and part in ("self_attn.q_proj",
                                                                                   "self_attn.k_proj"):
            count = heads if part == "self_attn.q_proj" else kv_heads
            values = values.reshape(count, 2, values.shape[0] // count // 2, *values.shape[1:]).swapaxes(1, 2)
            values = values.reshape(tensor.shape)
        add(f"blk.{layer}.{names[part]}.{kind}", np.ascontiguousarray(values))
    if arch == "apertus":
        for name in ("alpha_p", "alpha_n", "beta", "eps"):
            writer.add_array(f"xielu.{name}", [float(layer.mlp.act_fn.state_dict()[name]) for layer in hf.model.layers])
    for name, values in (tensors or {}).items():
        writer.add_tensor(name, np.asarray(values, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
