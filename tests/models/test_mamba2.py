"""Mamba2's own language models (Mamba2 layers alone, no attention nor MLP), run as Nemotron-H's blocks of Mamba2
layers: checkpoints and GGUF files against transformers' models, a pool holding states and no K/V; the configs
Loom refuses. (The engine's threaded, preemption, saved-directory and native-layer tests run it among the other
families.)"""

import random

import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from models.families.nemotron_h import NemotronHSpec
from models.families.recurrent import UNBOUNDED_CONTEXT
from runtime import Engine

from ..conftest import CONFIGS, greedy_with_logprobs, random_prompt, tiny_model, write_gguf_of
from .test_falcon_h1 import alone_and_together, answers, tensor_kinds
from .test_gguf import assert_same_answers, greedy
from .test_qwen35 import float32_weights


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_mamba2_model_answers_as_transformers_does(tied):
    """Mamba2 in memory, in float64, prompts long and short, chunked and decoded beside each other:
    transformers' greedy tokens and their log-probabilities. Its pool holds a state a layer and no K/V (its
    blocks take no memory), sized for its 2^20 positions."""
    hf = tiny_model("mamba2", seed=3, tie_word_embeddings=tied)
    prompts = [random_prompt(random.Random(14), 1, 4), random_prompt(random.Random(15), 30, 60)]
    with Engine.from_pretrained(hf, dtype=torch.float64, max_batch_size=4, max_batch_tokens=16) as engine:
        got = answers(engine, prompts)
        pool = engine.kv_cache
        assert pool.data.numel() == 0 and pool.block_bytes == 0
        assert len(pool.states[0]) == len(engine.model.layers) == hf.config.num_hidden_layers
        assert engine.model.max_position == UNBOUNDED_CONTEXT and pool.num_blocks * pool.block_size >= UNBOUNDED_CONTEXT
    assert_same_answers(got, [greedy_with_logprobs(hf, p, 16) for p in prompts])


def test_a_mamba2_file_equals_its_transformers_model(tmp_path):
    """A mamba2 file as llama.cpp's converter writes it (no heads, -exp(A_log), D and A a row a head, the gated
    norm a row a group, its context 2^20), in float64: transformers' answers; its tensors all among those
    llama.cpp's mamba2 reads."""
    from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES
    hf = float32_weights(tiny_model("mamba2", seed=5))
    path = write_gguf_of(hf, tmp_path / "mamba2.gguf", "mamba2",  # (an answer here reaches its end token)
                         {"tokenizer.ggml.eos_token_id": hf.config.eos_token_id})
    known = {TENSOR_NAMES[t] for t in MODEL_TENSORS[MODEL_ARCH.MAMBA2]}
    names = tensor_kinds(path)
    assert names <= known and "output" in names
    prompts = [random_prompt(random.Random(16), 1, 4), random_prompt(random.Random(17), 30, 60)]
    assert_same_answers(greedy(path, prompts), [greedy_with_logprobs(hf, p, 16) for p in prompts])


def test_a_quantized_mamba2_file_runs_in_its_blocks(tmp_path):
    """A file of 8-bit blocks: its two products a layer run in them, on the native layers, and every request's
    greedy answer equals the one it gets alone (the state slots kept apart across requests, more requests than
    slots waiting their turn)."""
    from models.kernels.block_linear import BlockLinear
    hf = tiny_model("mamba2", seed=6)
    path = write_gguf_of(hf, tmp_path / "mamba2-q8.gguf", "mamba2", matrices=Q.Q8_0)
    prompts = [random_prompt(random.Random(i), 3, 30) for i in range(7)]
    with Engine.from_pretrained(path, max_batch_size=4) as engine:
        block = engine.model.layers[0]
        assert all(isinstance(m, BlockLinear) for m in (block.mamba.in_proj, block.mamba.out))
        assert engine.model.decoder_layers is not None  # (decode steps on the native layers)
        alone, together = alone_and_together(engine, prompts)
    assert together == alone


@pytest.mark.parametrize("settings,message", [
    ({"head_dim": 8}, r"Mamba2's 8 heads of 8 must make its inner width 128 \(expand x hidden_size\)"),
    ({"n_groups": 3}, r"Mamba2's groups \(3\) must divide its heads \(8\)"),
    ({"time_step_limit": [0.0, 10.0]}, r"Mamba2 with time steps clamped to \[0.0, 10.0\] is not supported"),
    ({"hidden_act": "gelu"}, "Mamba2 with hidden_act 'gelu' is not supported; supported: silu"),
])
def test_mamba2_configs_loom_does_not_run_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        NemotronHSpec.from_hf(CONFIGS["mamba2"]().to_dict() | settings)
