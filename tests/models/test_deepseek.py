"""DeepSeek's family (multi-head latent attention over one latent a token, DeepSeek's mixtures): DeepSeek-V2
(V2-Lite's full-rank queries, YaRN with DeepSeek's mscales, softmax routing), V3 (low-rank queries, sigmoid
routing with selection biases over groups) and GLM-4.7-Flash, as GGUF files the way llama.cpp's converter writes
them (kv_b_proj split, its legacy whole one, a next-token prediction layer Loom leaves) against transformers'
model in float64, and their 8-bit products a head at a time; the pool's geometry; the group-limited routing; what
Loom refuses. (The engine's threaded, preemption,
prefix-cache and saved-directory tests run the three among the other families.)"""

import random

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from models.families.deepseek import DeepSeekSpec
from models.families.moe import within_chosen_groups
from runtime import Engine

from ..conftest import EOS, greedy_with_logprobs, random_prompt, tiny_model, write_gguf_of
from .test_gguf import assert_same_answers, greedy
from .test_qwen35 import float32_weights

# each kind as a GGUF file can hold it: V2's routing over every expert (llama.cpp scores V2's groups as V3's,
# by their best two, where transformers takes V2's best one), GLM-4.7-Flash's dense layers leading
FILE_KINDS = {"deepseek_v2": {"topk_method": "greedy"}, "deepseek_v3": {},
              "glm4_moe_lite": {"mlp_layer_types": ["dense", "sparse", "sparse"]}}


def as_in_a_file(kind: str, seed: int, **config):
    """``kind``'s tiny model as llama.cpp runs its file: its weights and selection biases rounded to float32, as
    a file of F32 tensors holds them, and the latent's norms by the model's one epsilon (transformers fixes 1e-6
    there; GLM-4.7-Flash's rms_norm_eps is 1e-5)."""
    hf = float32_weights(tiny_model(kind, seed=seed, **config))
    with torch.no_grad():
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(buffer.float().double())
    for layer in hf.model.layers:
        for norm in (getattr(layer.self_attn, "q_a_layernorm", None), layer.self_attn.kv_a_layernorm):
            if norm is not None:
                norm.variance_epsilon = hf.config.rms_norm_eps
    return hf


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_prompt(rng, 1, 4), random_prompt(rng, 30, 60)]


@pytest.mark.parametrize("kind", sorted(FILE_KINDS))
def test_a_deepseek2_file_equals_its_transformers_model(kind, tmp_path):
    """In float64, transformers' answers: the rotary pairs put in halves as they are read, the keys' and values'
    up-projections from k_b and v_b, the routing as the file says. (Quantized, a tiny random mixture's routes flip
    on 8-bit rounding, a logit apart from transformers' after one token: the products are tested one at a time.)"""
    hf = as_in_a_file(kind, 3, **FILE_KINDS[kind])
    asked = prompts(11)
    path = write_gguf_of(hf, tmp_path / "deepseek2.gguf", "deepseek2", {"tokenizer.ggml.eos_token_id": EOS})
    assert_same_answers(greedy(path, asked), [greedy_with_logprobs(hf, p, 16) for p in asked])


def test_a_mistral4_file_and_checkpoint_equal_their_transformers_model(tmp_path):
    """Mistral 4 (DeepSeek-V3's latent attention, every layer's experts by softmax, renormalised and scaled, no
    selection bias; its queries' temperature past the original context, Llama 4's): its file (architecture mistral4,
    the temperature as llama.cpp's deepseek2 reads it, attention.temperature_scale and temperature_length) on the
    native and torch layers, and its checkpoint, equal transformers' model in float64. The prompts reach past the
    16-token original context, where the temperature changes the answers."""
    hf = as_in_a_file("mistral4", 3)
    asked = prompts(12)
    expected = [greedy_with_logprobs(hf, p, 16) for p in asked]
    rope = hf.config.rope_parameters
    beta, rope["llama_4_scaling_beta"] = rope["llama_4_scaling_beta"], 0.0  # (transformers reads it each forward)
    assert greedy_with_logprobs(hf, asked[1], 16) != expected[1]
    rope["llama_4_scaling_beta"] = beta
    metadata = {"tokenizer.ggml.eos_token_id": EOS, "attention.temperature_scale": beta,
                "attention.temperature_length": rope["original_max_position_embeddings"]}
    path = write_gguf_of(hf, tmp_path / "mistral4.gguf", "mistral4", metadata)
    assert_same_answers(greedy(path, asked), expected)
    assert_same_answers(greedy(path, asked, native_layers=False), expected)
    hf.save_pretrained(tmp_path / "checkpoint")
    assert_same_answers(greedy(tmp_path / "checkpoint", asked), expected)


def test_a_latent_attentions_temperature_is_read_as_llama_cpp_reads_it():
    """A DeepSeek or Mistral 4 file's queries' temperature (attention.temperature_scale, past every
    attention.temperature_length tokens) is the config's llama_4_scaling_beta from that context; a file without the
    length, or whose length is not its yarn's original context (one key in transformers' configs), is refused
    saying so."""
    from models.checkpoints.gguf_config import gguf_config
    sizes = {"attention.head_count": 4, "embedding_length": 64, "feed_forward_length": 128, "vocab_size": 256,
             "block_count": 2, "attention.kv_lora_rank": 32, "attention.key_length_mla": 40,
             "attention.value_length_mla": 16, "rope.dimension_count": 8, "rope.scaling.type": "yarn",
             "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 16}
    of = lambda **more: gguf_config("mistral4", {f"mistral4.{k}": v for k, v in (sizes | more).items()}, {}, "m.gguf")
    rope = of(**{"attention.temperature_scale": 0.1, "attention.temperature_length": 16})["rope_scaling"]
    assert rope["llama_4_scaling_beta"] == pytest.approx(0.1) and rope["original_max_position_embeddings"] == 16
    assert DeepSeekSpec.from_hf(of(**{"attention.temperature_scale": 0.1, "attention.temperature_length": 16}) | {
        "model_type": "mistral4"}).query_temperature == (pytest.approx(0.1), 16, 0)
    with pytest.raises(ValueError, match="m.gguf: attention.temperature_scale without attention.temperature_length"):
        of(**{"attention.temperature_scale": 0.1})
    with pytest.raises(ValueError, match="m.gguf: attention.temperature_length 32 differs from the yarn's original "
                                         "context 16"):
        of(**{"attention.temperature_scale": 0.1, "attention.temperature_length": 32})


def eight_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` through Q8_0 and back along its rows (as it is where no block divides them)."""
    import gguf
    if t.shape[-1] % 32:
        return t
    codes = gguf.quants.quantize(t.float().numpy(), Q.Q8_0)
    return torch.from_numpy(gguf.quants.dequantize(codes, Q.Q8_0)).to(t.dtype)


def through_eight_bits(hf):
    """``hf`` with each matrix as its Q8_0 file holds it (kv_b_proj's as k_b, each head's key rows transposed, and
    v_b; the router left)."""
    c = hf.config
    with torch.no_grad():
        for name, tensor in hf.named_parameters():
            if name.endswith("kv_b_proj.weight"):
                key_rows, values = tensor.view(c.num_attention_heads, -1, c.kv_lora_rank).split(
                    [c.qk_nope_head_dim, c.v_head_dim], 1)
                key_rows = eight_bits(key_rows.transpose(1, 2)).transpose(1, 2)
                tensor.copy_(torch.cat([key_rows, eight_bits(values)], 1).view_as(tensor))
            elif tensor.ndim >= 2 and not name.endswith(("norm.weight", "mlp.gate.weight", "kv_b_proj.weight")):
                tensor.copy_(eight_bits(tensor))
    return hf


def test_a_files_head_stacks_run_in_their_blocks(tmp_path):
    """k_b and v_b, Q8_0 in the file, stay in their blocks, a matrix a head (V3's 32-wide key heads; V2's 16-wide
    ones, which no block divides, stay float): each head's product is the float64 product over the file's values
    of its input rounded to 8 bits (as llama.cpp's products round theirs), within 1e-3 of the largest value; the
    native layers' step over them is the torch layers'."""
    from models.kernels.block_experts import BlockExperts
    from models.kernels.block_heads import BlockHeadProducts, HeadProducts
    from models.kernels.block_linear import BlockLinear

    import models

    from .test_kernels import decode_both_ways

    hf = tiny_model("deepseek_v3", seed=2, n_group=1, topk_group=1)  # (one group: the native layers route it)
    c = hf.config
    model = models.load(write_gguf_of(hf, tmp_path / "v3-q8.gguf", "deepseek2", matrices=Q.Q8_0)).model
    layer = model.layers[1]
    attention = layer.attn
    assert isinstance(attention.k_up, BlockHeadProducts) and isinstance(attention.v_up, BlockHeadProducts)
    assert all(isinstance(product, BlockLinear) for product in (
        attention.q_down, attention.q_up, attention.kv_down, attention.out, layer.mlp.shared.gate_up))
    assert isinstance(layer.mlp.experts, BlockExperts)
    assert model.decoder_layers is not None
    native_logits, native_pool, torch_logits, torch_pool = decode_both_ways(model, 5, torch.float32)
    torch.testing.assert_close(native_logits, torch_logits, atol=1e-4, rtol=1e-4)  # (the native layers' products
    torch.testing.assert_close(native_pool, torch_pool, atol=1e-4, rtol=1e-4)      # over the same blocks)
    through_eight_bits(hf)
    key_rows, values = hf.model.layers[1].self_attn.kv_b_proj.weight.detach().view(
        c.num_attention_heads, -1, c.kv_lora_rank).split([c.qk_nope_head_dim, c.v_head_dim], 1)
    queries = torch.randn(5, c.num_attention_heads, 64)[..., :c.qk_nope_head_dim]  # (a view's heads, as the model's)
    latents = torch.randn(5, c.num_attention_heads, c.kv_lora_rank)
    for products, x, expected in ((attention.k_up, queries, lambda x: torch.einsum("thn,hnl->thl", x, key_rows)),
                                  (attention.v_up, latents, lambda x: torch.einsum("thl,hvl->thv", x, values))):
        want = expected(eight_bits(x.contiguous()).double())
        assert (products(x).double() - want).abs().max() <= 1e-3 * want.abs().max()
    small = tiny_model("deepseek_v2", seed=2, topk_method="greedy")
    with Engine.from_pretrained(write_gguf_of(small, tmp_path / "v2-q8.gguf", "deepseek2", matrices=Q.Q8_0)) as engine:
        attention = engine.model.layers[1].attn
    assert isinstance(attention.k_up, HeadProducts) and isinstance(attention.v_up, BlockHeadProducts)


def test_a_legacy_file_with_kv_b_whole_and_a_prediction_layer_loads_as_llama_cpp_reads_it(tmp_path):
    """A file from before llama.cpp split kv_b_proj (attn_kv_b, its key and value lengths a head's query and
    value widths) whose last block is a next-token prediction layer (nextn_predict_layers, its eh_proj beside a
    layer's tensors, as GLM-4.7-Flash's files carry one): the layers before it alone, transformers' answers
    without it."""
    hf = as_in_a_file("deepseek_v3", 4, num_hidden_layers=4)
    c = hf.config
    kv_b = {f"blk.{i}.attn_kv_b.weight": layer.self_attn.kv_b_proj.weight.detach().float().numpy()
            for i, layer in enumerate(hf.model.layers)}
    eh_proj = {"blk.3.nextn.eh_proj.weight": np.random.default_rng(0).standard_normal((c.hidden_size, 2 * c.hidden_size))}
    metadata = {"tokenizer.ggml.eos_token_id": EOS, "nextn_predict_layers": 1,
                "attention.key_length": c.qk_nope_head_dim + c.qk_rope_head_dim, "attention.value_length": c.v_head_dim,
                "attention.key_length_mla": None, "attention.value_length_mla": None}
    path = write_gguf_of(hf, tmp_path / "legacy.gguf", "deepseek2", metadata, tensors=kv_b | eh_proj,
                         leave_out=("attn_k_b.weight", "attn_v_b.weight"))
    without = tiny_model("deepseek_v3")
    without.load_state_dict({k: v for k, v in hf.state_dict().items() if not k.startswith("model.layers.3.")})
    asked = prompts(12)
    assert_same_answers(greedy(path, asked), [greedy_with_logprobs(without, p, 16) for p in asked])


def test_the_pool_keeps_one_latent_a_token():
    """One key head a layer, the rotary part and the latent (rope_dim + kv_lora_rank values), not keys and values
    a head: a DeepSeek-V3 of 4 heads of 24-value keys would take 4 x (24 + 16) values a token."""
    hf = tiny_model("deepseek_v3")
    c = hf.config
    with Engine.from_pretrained(hf, dtype=torch.float64, block_size=16) as engine:
        assert engine.kv_cache.data.shape[-2:] == (1, c.qk_rope_head_dim + c.kv_lora_rank)


def test_group_limited_routing_keeps_the_best_groups_experts():
    """Experts in consecutive groups; a token's experts outside its chosen groups at -inf: the groups ranked by
    their best expert (V2) or the sum of their best two (V3), which can differ."""
    scores = torch.tensor([[0.75, 0.0, 0.5, 0.5, 0.125, 0.25]])  # three groups of two (exact in binary)
    by_best = within_chosen_groups(scores, 3, 1, 1)
    by_two = within_chosen_groups(scores, 3, 1, 2)
    inf = float("-inf")
    assert by_best.tolist() == [[0.75, 0.0, inf, inf, inf, inf]]
    assert by_two.tolist() == [[inf, inf, 0.5, 0.5, inf, inf]]
    assert within_chosen_groups(scores, 3, 2, 2).tolist() == [[0.75, 0.0, 0.5, 0.5, inf, inf]]


def test_configs_loom_does_not_run_are_refused(tmp_path):
    config = tiny_model("deepseek_v3").config.to_dict()
    with pytest.raises(ValueError, match="deepseek_v3 with attention_bias"):
        DeepSeekSpec.from_hf(config | {"attention_bias": True})
    with pytest.raises(ValueError, match="unsupported hidden_act 'gelu' for deepseek_v3"):
        DeepSeekSpec.from_hf(config | {"hidden_act": "gelu"})
    hf = tiny_model("deepseek_v3", seed=1)
    path = write_gguf_of(hf, tmp_path / "softplus.gguf", "deepseek2", {"expert_gating_func": 3})
    with pytest.raises(ValueError, match="scores its experts by 3, which Loom does not run for deepseek2"):
        Engine.from_pretrained(path)


def test_a_minicpm3_model_answers_as_transformers_does():
    """MiniCPM3 in memory, in float64 (its norms in float32, as transformers computes them), prompts long and short:
    transformers' greedy tokens and log-probabilities; its rotary in halves, no pair reordered. The scales matter
    here: with any one of them left at 1, Loom's first logits move away from transformers'."""
    hf = tiny_model("minicpm3", seed=4)
    asked = prompts(12)
    with Engine.from_pretrained(hf, dtype=torch.float64) as engine:
        spec = engine.model.spec
        assert not spec.interleaved_rotary and spec.moe is None and spec.value_dim == 12
        assert (spec.embedding_scale, spec.logits_divisor) == (3.0, 4.0)
        assert spec.residual_scale == pytest.approx(2.5 / 3 ** 0.5)
    assert_same_answers(greedy(hf, asked), [greedy_with_logprobs(hf, p, 16) for p in asked])
    prompt = torch.tensor([asked[1]])
    with torch.no_grad():
        expected = hf(prompt).logits[0, -1]
        for name in ("scale_emb", "scale_depth", "dim_model_base"):
            changed = tiny_model("minicpm3", seed=4, **{name: {"scale_emb": 1.0, "scale_depth": 3 ** 0.5,
                                                                "dim_model_base": 64}[name]})
            assert (changed(prompt).logits[0, -1] - expected).abs().max() > 1e-2, name


def test_a_minicpm3_with_longrope_recomputes_a_sequence_past_its_original_context():
    """MiniCPM3-4B's rope is longrope's: its short factors within the original context, its long ones past it, where
    transformers rotates the whole sequence anew. Prompts on either side of 32 positions, and one that decodes across
    them: transformers' tokens and log-probabilities."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
            "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 4.0, 6.0, 9.0]}
    hf = tiny_model("minicpm3", seed=6, rope_parameters=rope, max_position_embeddings=128)
    rng = random.Random(14)
    asked = [random_prompt(rng, 5, 10), random_prompt(rng, 24, 26), random_prompt(rng, 40, 60)]
    with Engine.from_pretrained(hf, dtype=torch.float64) as engine:
        assert engine.model.recompute_past == 32
    assert_same_answers(greedy(hf, asked, new_tokens=12), [greedy_with_logprobs(hf, p, 12) for p in asked])


def test_a_minicpm3_file_equals_its_transformers_model(tmp_path):
    """A minicpm3 file as llama.cpp's converter writes it (DeepSeek's tensor names, kv_b whole, its key length a query
    head's, no value length), in float64: transformers' answers, with the scales llama.cpp fixes (MiniCPM3-4B's,
    which the file does not keep) set in the model."""
    hf = float32_weights(tiny_model("minicpm3", seed=5, scale_emb=12.0, scale_depth=1.4, dim_model_base=256,
                                    v_head_dim=16))
    for layer in hf.model.layers:  # (llama.cpp norms the latent and the queries' low rank by the file's one epsilon)
        for norm in (layer.self_attn.q_a_layernorm, layer.self_attn.kv_a_layernorm):
            norm.variance_epsilon = hf.config.rms_norm_eps
    path = write_gguf_of(hf, tmp_path / "minicpm3.gguf", "minicpm3", {"tokenizer.ggml.eos_token_id": EOS})
    asked = prompts(13)
    assert_same_answers(greedy(path, asked), [greedy_with_logprobs(hf, p, 16) for p in asked])
