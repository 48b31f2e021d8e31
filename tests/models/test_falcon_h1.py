"""Falcon-H1: each layer attending and mixing through Mamba2 at once over one normed input, its μP multipliers
folded into the weights as it loads: checkpoints and GGUF files (whose converter folded them already) against
transformers' models; the configs Loom refuses. (The engine's threaded, preemption and saved-directory tests run it
among the other families.)"""

import random
import re

import gguf
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from models.families.falcon_h1 import FalconH1Spec
from runtime import Engine, GenerationConfig

from ..conftest import CONFIGS, greedy_with_logprobs, random_prompt, tiny_model, write_gguf_of
from .test_gguf import assert_same_answers, greedy
from .test_qwen35 import float32_weights

# Falcon-H1's Mamba2 answers normed after their gate (its checkpoints' other way, llama.cpp's and Loom's one)
NORMED = {"mamba_rms_norm": True, "mamba_norm_before_gate": False}


def answers(engine: Engine, prompts, tokens: int = 16):
    handles = [engine.launch_response_tokens(p, GenerationConfig(max_new_tokens=tokens, logprobs=0)) for p in prompts]
    return [(list(engine.stream_response_tokens(h, timeout=60)), [t.logprob for t in h.logprobs]) for h in handles]


def alone_and_together(engine: Engine, prompts, tokens: int = 10) -> tuple[list, list]:
    """Each prompt's greedy answer run alone, one after another, and all of them launched at once."""
    config = GenerationConfig(max_new_tokens=tokens, ignore_eos=True)
    alone = [list(engine.stream_response_tokens(engine.launch_response_tokens(p, config), timeout=60)) for p in prompts]
    handles = [engine.launch_response_tokens(p, config) for p in prompts]
    return alone, [list(engine.stream_response_tokens(h, timeout=60)) for h in handles]


def tensor_kinds(path) -> set[str]:
    """A file's tensor names without their kinds (ssm_a and ssm_d have none), a layer's as blk.{bid}'s, as
    gguf-py's TENSOR_NAMES lists them."""
    kinds = lambda name: name if name.count(".") == 2 else name.rpartition(".")[0]
    return {re.sub(r"^blk\.\d+\.", "blk.{bid}.", kinds(t.name)) for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("settings", [{}, NORMED], ids=["gated", "normed"])
def test_a_falcon_h1_model_answers_as_transformers_does(settings):
    """Falcon-H1 in memory, every multiplier of its own (conftest's), its Mamba2 answers gated alone or normed too,
    in float64, prompts long and short, chunked and decoded beside each other: transformers' greedy tokens and
    their log-probabilities."""
    hf = tiny_model("falcon_h1", seed=3, **settings)
    prompts = [random_prompt(random.Random(14), 1, 4), random_prompt(random.Random(15), 30, 60)]
    with Engine.from_pretrained(hf, dtype=torch.float64, max_batch_size=4, max_batch_tokens=16) as engine:
        got = answers(engine, prompts)
        assert engine.kv_cache.data.shape[1] == len(engine.model.layers) == len(engine.kv_cache.states[0])
    assert_same_answers(got, [greedy_with_logprobs(hf, p, 16) for p in prompts])


@pytest.mark.parametrize("settings", [{}, NORMED], ids=["gated", "normed"])
def test_a_falcon_h1_file_equals_its_transformers_model(tmp_path, settings):
    """A falcon-h1 file as llama.cpp's converter writes it (the multipliers folded into its weights, -exp(A_log),
    D and A a row a head, the norm a row a group where there is one), in float64: transformers' answers; its
    tensors all among those llama.cpp's falcon-h1 reads."""
    from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES
    hf = float32_weights(tiny_model("falcon_h1", seed=5, **settings))
    path = write_gguf_of(hf, tmp_path / "falcon-h1.gguf", "falcon-h1",  # (an answer here reaches its end token)
                         {"tokenizer.ggml.eos_token_id": hf.config.eos_token_id})
    known = {TENSOR_NAMES[t] for t in MODEL_TENSORS[MODEL_ARCH.FALCON_H1]}
    names = tensor_kinds(path)
    assert names <= known and ("blk.{bid}.ssm_norm" in names) == bool(settings)
    prompts = [random_prompt(random.Random(16), 1, 4), random_prompt(random.Random(17), 30, 60)]
    assert_same_answers(greedy(path, prompts), [greedy_with_logprobs(hf, p, 16) for p in prompts])


def test_a_quantized_falcon_h1_file_runs_in_its_blocks(tmp_path):
    """A file of 8-bit blocks: its products (Mamba2's two among them) run in them, on the native layers, and every
    request's greedy answer equals the one it gets alone (the pool's K/V and state slots kept apart across
    requests)."""
    from models.kernels.block_linear import BlockLinear
    hf = tiny_model("falcon_h1", seed=6)
    path = write_gguf_of(hf, tmp_path / "falcon-h1-q8.gguf", "falcon-h1", matrices=Q.Q8_0)
    prompts = [random_prompt(random.Random(i), 3, 30) for i in range(5)]
    with Engine.from_pretrained(path, max_batch_size=8) as engine:
        block = engine.model.layers[0]
        assert all(isinstance(m, BlockLinear) for m in (block.mamba.in_proj, block.mamba.out, block.attn.qkv))
        assert engine.model.decoder_layers is not None  # (decode steps on the native layers)
        alone, together = alone_and_together(engine, prompts)
    assert together == alone


def test_the_multipliers_fold_into_a_bfloat16_checkpoint_rounded_once():
    """A bfloat16 checkpoint's weights times their multipliers in float32 (the model's dtype taken after), not
    rounded to bfloat16 twice: the queries' rows exactly float32(w) x float32(attention_in_multiplier)."""
    from models.families.falcon_h1 import FalconH1
    hf = tiny_model("falcon_h1").to(torch.bfloat16)
    spec = FalconH1Spec.from_hf(hf.config.to_dict())
    out = FalconH1.convert(dict(hf.state_dict()), spec)
    q = hf.model.layers[0].self_attn.q_proj.weight
    factor = torch.tensor(hf.config.attention_in_multiplier, dtype=torch.float64).float()
    assert out["layers.0.attn.qkv.weight"].dtype == torch.float32
    assert torch.equal(out["layers.0.attn.qkv.weight"][:q.shape[0]], q.float() * factor)
    assert out["layers.0.mamba.in_proj.weight"].dtype == torch.float32


def test_falcon_h1_configs_loom_does_not_run_are_refused():
    """Mamba2 answers normed before their gate, biases, clamped time steps: refused, saying what is wrong."""
    config = CONFIGS["falcon_h1"]().to_dict()
    with pytest.raises(ValueError, match="mamba_norm_before_gate .* is not supported; Loom, as llama.cpp, gates"):
        FalconH1Spec.from_hf(config | {"mamba_rms_norm": True, "mamba_norm_before_gate": True})
    with pytest.raises(ValueError, match=r"Falcon-H1 with biases \(attention_bias, projectors_bias\) is not"):
        FalconH1Spec.from_hf(config | {"attention_bias": True, "projectors_bias": True})
    with pytest.raises(ValueError, match=r"time steps clamped to \[0.0, 10.0\] is not supported"):
        FalconH1Spec.from_hf(config | {"time_step_limit": [0.0, 10.0]})
