"""Mamba and Falcon-Mamba (selective-scan layers alone, a decay rate for each value of a channel's state):
checkpoints and GGUF files against transformers' models, a pool holding states and no K/V; the configs and files
Loom refuses. (The engine's threaded, preemption and saved-directory tests run them among the other families.)"""

import random

import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from models.families.mamba import MambaMixer, MambaSpec
from models.families.recurrent import UNBOUNDED_CONTEXT
from models.kernels import selective_scan
from runtime import Engine

from ..conftest import CONFIGS, greedy_with_logprobs, random_prompt, tiny_model, write_gguf_of
from .test_falcon_h1 import alone_and_together, answers, tensor_kinds
from .test_gguf import assert_same_answers, greedy
from .test_granite_hybrid import needs_kernels
from .test_qwen35 import assert_mixing_alike, float32_weights

ARCHS = ["mamba", "falcon_mamba"]


@pytest.mark.parametrize("arch", ARCHS)
def test_a_mamba_model_answers_as_transformers_does(arch):
    """Mamba and Falcon-Mamba in memory, in float64, prompts long and short, chunked and decoded beside each other:
    transformers' greedy tokens and their log-probabilities. The pool holds a state a layer and no K/V."""
    hf = tiny_model(arch, seed=3)
    prompts = [random_prompt(random.Random(14), 1, 4), random_prompt(random.Random(15), 30, 60)]
    with Engine.from_pretrained(hf, dtype=torch.float64, max_batch_size=4, max_batch_tokens=16) as engine:
        got = answers(engine, prompts)
        pool = engine.kv_cache
        assert pool.data.numel() == 0 and pool.block_bytes == 0
        assert len(pool.states[1]) == hf.config.num_hidden_layers
        assert pool.states[1].shape[2:] == (hf.config.state_size, hf.config.intermediate_size)
        assert engine.model.max_position == UNBOUNDED_CONTEXT
    assert_same_answers(got, [greedy_with_logprobs(hf, p, 16) for p in prompts])


@pytest.mark.parametrize("arch", ARCHS)
def test_a_mamba_file_equals_its_transformers_model(tmp_path, arch):
    """A mamba file as llama.cpp's converter writes it (no heads, -exp(A_log) as ssm_a, the time step's product as
    ssm_dt with its bias; a Falcon-Mamba's saying ssm.dt_b_c_rms), in float64: transformers' answers; its tensors
    all among those llama.cpp's mamba reads. (A file's time steps, B and C are normed with its norms' epsilon, as
    llama.cpp reads them: the checkpoint's mixer_rms_eps is set to it here.)"""
    from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES
    hf = float32_weights(tiny_model(arch, seed=5))
    if arch == "falcon_mamba":
        hf.config.mixer_rms_eps = hf.config.layer_norm_epsilon
        for layer in hf.backbone.layers:
            for norm in (layer.mixer.dt_layernorm, layer.mixer.b_layernorm, layer.mixer.c_layernorm):
                norm.variance_epsilon = hf.config.layer_norm_epsilon
    path = write_gguf_of(hf, tmp_path / "mamba.gguf", "mamba",  # (an answer here reaches its end token)
                         {"tokenizer.ggml.eos_token_id": hf.config.eos_token_id})
    known = {TENSOR_NAMES[t] for t in MODEL_TENSORS[MODEL_ARCH.MAMBA]}
    names = tensor_kinds(path)
    assert names <= known and "blk.{bid}.ssm_x" in names
    assert ("output" in names) != hf.config.tie_word_embeddings
    prompts = [random_prompt(random.Random(16), 1, 4), random_prompt(random.Random(17), 30, 60)]
    assert_same_answers(greedy(path, prompts), [greedy_with_logprobs(hf, p, 16) for p in prompts])


@pytest.mark.parametrize("arch, mixer", [("mamba", "mixer"), ("jamba", "mamba")])
def test_a_quantized_mamba_file_runs_in_its_blocks(tmp_path, arch, mixer):
    """A file of 8-bit blocks (Mamba's; Jamba's, Mamba's mixers beside attention and experts): its mixers' products
    run in them, and every request's greedy answer equals the one it gets alone (the state slots, and Jamba's K/V,
    kept apart across requests, more requests than slots waiting their turn)."""
    from models.kernels.block_linear import BlockLinear
    hf = tiny_model(arch, seed=6)
    path = write_gguf_of(hf, tmp_path / f"{arch}-q8.gguf", arch, matrices=Q.Q8_0)
    prompts = [random_prompt(random.Random(i), 3, 30) for i in range(7)]
    with Engine.from_pretrained(path, max_batch_size=4) as engine:
        mixer = getattr(engine.model.layers[0], mixer)
        assert all(isinstance(m, BlockLinear) for m in (mixer.in_proj, mixer.x_proj, mixer.out))
        alone, together = alone_and_together(engine, prompts)
    assert together == alone


def test_mamba_configs_and_files_loom_does_not_run_are_refused(tmp_path):
    with pytest.raises(ValueError, match="Mamba with hidden_act 'gelu' is not supported; supported: silu"):
        MambaSpec.from_hf(CONFIGS["mamba"]().to_dict() | {"hidden_act": "gelu"})
    path = write_gguf_of(tiny_model("mamba"), tmp_path / "bare.gguf", "mamba", {"ssm.time_step_rank": None})
    with pytest.raises(ValueError, match=r"leaves out the Mamba layers' sizes \(mamba.ssm.time_step_rank\)"):
        Engine.from_pretrained(path)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_the_mamba_layers_answer_alike_on_the_kernels_and_on_torch_operators(kernel, monkeypatch):
    """The convolution and the scan on selective_scan.h or on torch operators (where no compiler built the
    kernels), over prompts, chunked prefills and decode steps of several requests at once: transformers'
    tokens and log-probabilities."""
    assert_mixing_alike("mamba", selective_scan, MambaMixer, kernel, monkeypatch)


@needs_kernels
def test_a_float32_mamba_answers_alike_on_the_kernels_and_on_torch_operators(monkeypatch):
    """In float32 the kernel's decays are a polynomial's (exp_fast), not std::exp: the same greedy tokens as the
    torch operators' and log-probabilities within 1e-4, over prompts, chunks and decode steps."""
    hf = tiny_model("falcon_mamba", seed=7)
    prompts = [random_prompt(random.Random(i), 2, 40) for i in range(4)]

    def run():
        with Engine.from_pretrained(hf, dtype=torch.float32, max_batch_size=4, max_batch_tokens=16) as engine:
            return answers(engine, prompts)
    on_kernels = run()
    monkeypatch.setattr(selective_scan, "supports", lambda x, states: False)
    on_torch = run()
    assert [tokens for tokens, _ in on_kernels] == [tokens for tokens, _ in on_torch]
    for (_, mine), (_, theirs) in zip(on_kernels, on_torch):
        assert mine == pytest.approx(theirs, abs=1e-4)
