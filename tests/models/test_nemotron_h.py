"""Nemotron-H (single-purpose layers: Mamba2, attention without positions, squared-ReLU MLPs), run as blocks of
a mixer and the MLP after it: GGUF files as llama.cpp's converter writes them and the hub's checkpoints
(backbone.*, hybrid_override_pattern) against transformers' model; the configs Loom refuses. (The engine's
threaded, preemption, prefix-cache, saved-directory and native-layer tests run it among the other families.)"""

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.families.nemotron_h import NemotronHSpec, blocks_of
from models.kernels import native
from runtime import Engine

from ..conftest import CONFIGS, greedy_with_logprobs, random_prompt, tiny_model, write_gguf_of
from .test_block_formats import assert_greedy_but_near_ties
from .test_gguf import assert_same_answers, greedy
from .test_granite_hybrid import answers_in_blocks, eight_bit_file
from .test_qwen35 import float32_weights

needs_kernels = pytest.mark.skipif(native.library() is None, reason="no C++ compiler: the kernels are not built")


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_prompt(rng, 1, 4), random_prompt(rng, 30, 60)]


def test_layers_pair_into_blocks():
    """A mixer layer and the MLP layer after it make a block; a mixer without one a block of its own."""
    types = ["linear_attention", "mlp", "full_attention", "linear_attention", "mlp", "linear_attention"]
    assert blocks_of(types) == ((0, 1), (2, None), (3, 4), (5, None))


def test_a_nemotron_h_file_equals_its_transformers_model(tmp_path):
    """A file as llama.cpp's converter writes it (K/V heads and MLP widths a layer, naming each layer's kind;
    -exp(A_log), the gated norm a row a group), in float64, prompts long and short: transformers' greedy
    tokens and their log-probabilities."""
    hf = float32_weights(tiny_model("nemotron_h", seed=3))
    written = write_gguf_of(hf, tmp_path / "nemotron.gguf", "nemotron_h")
    asked = prompts(13)
    assert_same_answers(greedy(written, asked), [greedy_with_logprobs(hf, p, 16) for p in asked])


def test_a_hub_checkpoint_reads_its_pattern_and_backbone(tmp_path):
    """The hub's Nemotron-H directories: the layers as hybrid_override_pattern's letters beside
    num_hidden_layers, the Mamba2 sizes under their older mamba_* names, the weights under backbone:
    transformers' answers."""
    hf = tiny_model("nemotron_h", seed=5)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    letters = {"linear_attention": "M", "full_attention": "*", "mlp": "-"}
    types = config.pop("layers_block_type")
    config |= {"hybrid_override_pattern": "".join(letters[t] for t in types), "num_hidden_layers": len(types),
               "mamba_n_groups": config.pop("n_groups"), "mamba_d_conv": config.pop("conv_kernel")}
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = load_file(tmp_path / "model.safetensors")
    save_file({name.replace("model.", "backbone.", 1): t for name, t in weights.items()}, tmp_path / "model.safetensors")
    asked = prompts(6)
    with Engine.from_pretrained(tmp_path, dtype=torch.float64) as engine:
        outputs = [list(engine.stream_response_tokens(engine.launch_response_tokens(p, {"max_new_tokens": 16}),
                                                      timeout=60)) for p in asked]
    assert outputs == [greedy_with_logprobs(hf, p, 16)[0] for p in asked]


@needs_kernels
def test_an_8_bit_nemotron_h_file_runs_in_its_blocks(tmp_path):
    """A file of 8-bit blocks runs every product in them (the Mamba2 layers' two, the attention's, the
    squared-ReLU MLPs' up and down) on the native layers, and answers as transformers over the file's values,
    each product's input rounded to 8 bits as the blocks' products round it, but near ties (0.1, as Granite
    4's: a state carries a rounding across a tie to every later token)."""
    hf = tiny_model("nemotron_h", seed=5)
    path = eight_bit_file(hf, tmp_path / "nemotron-q8.gguf", "nemotron_h")
    asked = [random_prompt(random.Random(i), 3, 30) for i in range(6)]
    products = lambda model: [m for block in model.layers for m in (
        (block.mamba.in_proj, block.mamba.out) if block.recurrent else (block.attn.qkv, block.attn.out))
        + (() if block.mlp is None else (block.mlp.up, block.mlp.down))]
    assert_greedy_but_near_ties(hf, asked, answers_in_blocks(path, asked, products), near_tie=0.1)


@pytest.mark.parametrize("settings, message", [
    ({"layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"]},
     "Nemotron-H's mixture-of-experts layers"),
    ({"layers_block_type": ["linear_attention", "mlp", "mlp", "full_attention"]},
     "Nemotron-H layer 2 is an MLP that follows no Mamba2 or attention layer"),
    ({"layers_block_type": ["linear_attention", "mlp", "linear_attention"]},
     "a Nemotron-H model without attention layers is not supported"),
    ({"mlp_hidden_act": "silu"}, "Nemotron-H with mlp_hidden_act 'silu' is not supported; supported: relu2"),
    ({"time_step_limit": [0.0, 10.0]}, r"Mamba2 with time steps clamped to \[0.0, 10.0\] is not supported"),
    ({"n_groups": 3}, r"Mamba2's groups \(3\) must divide its heads \(8\)"),
])
def test_nemotron_h_configs_loom_does_not_run_are_refused(settings, message):
    config = CONFIGS["nemotron_h"]().to_dict() | settings
    with pytest.raises(ValueError, match=message):
        NemotronHSpec.from_hf(config)
