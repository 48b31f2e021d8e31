"""AI21's Jamba (Mamba layers with normed time steps, B and C beside attention layers without positions, experts
every other layer): checkpoints and GGUF files against transformers' models (its 8-bit files: test_mamba.py), its
Mamba layers on the kernels and on torch operators, a pool holding both states and K/V; the configs and files Loom
refuses. (The engine's threaded, preemption and native-layer tests run it among the other families.)"""

import random

import pytest
import torch

from models.families.jamba import JambaSpec
from models.families.mamba import MambaMixer
from models.kernels import selective_scan
from runtime import Engine

from ..conftest import CONFIGS, greedy_with_logprobs, random_prompt, tiny_model, write_gguf_of
from .test_falcon_h1 import answers, tensor_kinds
from .test_gguf import assert_same_answers, greedy
from .test_qwen35 import assert_mixing_alike, float32_weights


@pytest.mark.parametrize("settings", [{}, {"num_experts": 1}], ids=["experts", "dense"])
def test_a_jamba_model_answers_as_transformers_does(settings):
    """Jamba in memory, in float64, prompts long and short, chunked and decoded beside each other: transformers'
    greedy tokens and their log-probabilities. The pool holds a state for each Mamba layer and K/V for each
    attention layer."""
    hf = tiny_model("jamba", seed=3, **settings)
    prompts = [random_prompt(random.Random(14), 1, 4), random_prompt(random.Random(15), 30, 60)]
    with Engine.from_pretrained(hf, dtype=torch.float64, max_batch_size=4, max_batch_tokens=16) as engine:
        got = answers(engine, prompts)
        kinds = hf.config.layers_block_type
        assert engine.model.num_layers == kinds.count("attention")
        assert len(engine.kv_cache.states[1]) == kinds.count("mamba")
    assert_same_answers(got, [greedy_with_logprobs(hf, p, 16) for p in prompts])


def test_the_tiny_model_tells_jambas_parts_apart(monkeypatch):
    """The tests' model would show a runtime that left out the time step's norm weights, B's and C's, or that
    renormalised the chosen experts' weights: transformers' own last logits move by more than 0.01 with either."""
    import copy

    import transformers
    hf = tiny_model("jamba", seed=3)
    prompt = torch.tensor([random_prompt(random.Random(15), 30, 40)])
    last = lambda model: model(prompt).logits[0, -1]
    with torch.no_grad():
        expected = last(hf)
        unweighted = copy.deepcopy(hf)
        for layer in unweighted.model.layers:
            if hasattr(layer, "mamba"):
                for norm in (layer.mamba.dt_layernorm, layer.mamba.b_layernorm, layer.mamba.c_layernorm):
                    norm.weight.fill_(1.0)
        assert (last(unweighted) - expected).abs().max() > 1e-2
        router = transformers.models.jamba.modeling_jamba.JambaTopKRouter
        chosen = router.forward
        monkeypatch.setattr(router, "forward", lambda self, x: (lambda logits, weights, index: (
            logits, weights / weights.sum(-1, keepdim=True), index))(*chosen(self, x)))
        assert (last(hf) - expected).abs().max() > 1e-2
    spec = JambaSpec.from_hf(hf.config.to_dict())
    assert not spec.moe.normalize and spec.mamba.dt_b_c_weights and not any(spec.layer_rotates)


@pytest.mark.parametrize("settings", [{}, {"num_experts": 1}], ids=["experts", "dense"])
def test_a_jamba_file_equals_its_transformers_model(tmp_path, settings):
    """A jamba file as llama.cpp's converter writes it (no K/V heads for a Mamba layer, the time step's, B's and C's
    norms as ssm_dt_norm, ssm_b_norm, ssm_c_norm, -exp(A_log) as ssm_a, three expert stacks in the routing layers, no
    rotary), in float64: transformers' answers; its tensors all among those llama.cpp's jamba reads."""
    from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES
    hf = float32_weights(tiny_model("jamba", seed=5, **settings))
    path = write_gguf_of(hf, tmp_path / "jamba.gguf", "jamba", {"tokenizer.ggml.eos_token_id": hf.config.eos_token_id}
                         | ({"expert_count": None, "expert_used_count": None} if settings else {}))
    known = {TENSOR_NAMES[t] for t in MODEL_TENSORS[MODEL_ARCH.JAMBA]}
    names = tensor_kinds(path)
    assert names <= known and "blk.{bid}.ssm_dt_norm" in names
    assert ("blk.{bid}.ffn_gate_exps" in names) != bool(settings)
    prompts = [random_prompt(random.Random(16), 1, 4), random_prompt(random.Random(17), 30, 60)]
    assert_same_answers(greedy(path, prompts), [greedy_with_logprobs(hf, p, 16) for p in prompts])


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_the_jamba_mamba_layers_answer_alike_on_the_kernels_and_on_torch_operators(kernel, monkeypatch):
    """The convolution and the scan on selective_scan.h or on torch operators, over prompts, chunked prefills and
    decode steps of several requests at once: transformers' tokens and log-probabilities."""
    assert_mixing_alike("jamba", selective_scan, MambaMixer, kernel, monkeypatch)


def test_jamba_configs_and_files_loom_does_not_run_are_refused(tmp_path):
    config = CONFIGS["jamba"]().to_dict()
    with pytest.raises(ValueError, match="Jamba with hidden_act 'gelu' is not supported; supported: silu"):
        JambaSpec.from_hf(config | {"hidden_act": "gelu"})
    with pytest.raises(ValueError, match=r"lists 6 layer kinds and 2 expert counts for 6 layers"):
        JambaSpec.from_hf(config | {"layers_num_experts": [1, 4]})
    with pytest.raises(ValueError, match=r"Jamba layer kinds \['conv'\] are not supported"):
        JambaSpec.from_hf(config | {"layers_block_type": ["mamba", "conv"] * 3})
    with pytest.raises(ValueError, match="attn_layer_period is 0; it is the layers a period, 1 or more"):
        JambaSpec.from_hf(config | {"attn_layer_period": 0})
    hf = tiny_model("jamba")
    path = write_gguf_of(hf, tmp_path / "bare.gguf", "jamba", {"ssm.time_step_rank": None})
    with pytest.raises(ValueError, match=r"leaves out the Mamba layers' sizes \(jamba.ssm.time_step_rank\)"):
        Engine.from_pretrained(path)
    path = write_gguf_of(hf, tmp_path / "unsized.gguf", "jamba", {"expert_count": None, "expert_used_count": None})
    with pytest.raises(ValueError, match="has routers but no jamba.expert_count, which llama.cpp requires"):
        Engine.from_pretrained(path)
    path = write_gguf_of(hf, tmp_path / "wide.gguf", "jamba", {"ssm.inner_size": 3 * hf.config.hidden_size})
    with pytest.raises(ValueError, match="Mamba layers are 192 wide, not twice its hidden size"):
        Engine.from_pretrained(path)
