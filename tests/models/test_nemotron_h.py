"""Nemotron-H (single-purpose layers: Mamba2, attention without positions, squared-ReLU MLPs, and Nemotron 3's
mixtures of squared-ReLU experts), run as blocks of a mixer and the MLP or experts after it: GGUF files as
llama.cpp's converter writes them (nemotron_h, nemotron_h_moe) and the hub's checkpoints (backbone.*,
hybrid_override_pattern, an expert's matrices apart) against transformers' model; Nemotron 3's files of 8-bit
blocks on the native layers; group-limited routing; the configs and files Loom refuses. (The engine's threaded,
preemption, prefix-cache, saved-directory and native-layer tests run both among the other families.)"""

import json
import random

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from models.families.nemotron_h import NemotronHSpec, blocks_of
from models.kernels import native
from models.kernels.block_experts import BlockExperts
from runtime import Engine

from ..conftest import CONFIGS, EOS, greedy_with_logprobs, random_prompt, tiny_model, write_gguf_of
from .test_block_formats import assert_greedy_but_near_ties
from .test_gguf import assert_same_answers, greedy
from .test_gguf_experts import native_and_torch_answers
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


@pytest.mark.parametrize("arch", ["nemotron_h", "nemotron_h_moe"])
def test_a_hub_checkpoint_reads_its_pattern_and_backbone(tmp_path, arch):
    """The hub's Nemotron-H directories: the layers as hybrid_override_pattern's letters beside
    num_hidden_layers, the Mamba2 sizes under their older mamba_* names, the weights under backbone (Nemotron
    3's experts a matrix an expert, as the hub keeps them): transformers' answers."""
    hf = tiny_model(arch, seed=5)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    letters = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
    types = config.pop("layers_block_type")
    config |= {"hybrid_override_pattern": "".join(letters[t] for t in types), "num_hidden_layers": len(types),
               "mamba_n_groups": config.pop("n_groups"), "mamba_d_conv": config.pop("conv_kernel")}
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = {}
    for name, t in load_file(tmp_path / "model.safetensors").items():
        name = name.replace("model.", "backbone.", 1)
        if name.endswith(("experts.up_proj", "experts.down_proj")):  # [experts, rows, width]: a matrix an expert
            weights |= {f"{name.rpartition('.')[0]}.{e}.{name.rpartition('.')[2]}.weight": m.clone()
                        for e, m in enumerate(t)}
        else:
            weights[name] = t
    save_file(weights, tmp_path / "model.safetensors")
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


def test_a_nemotron_3_file_equals_its_transformers_model(tmp_path):
    """Nemotron 3's file (nemotron_h_moe: the experts' layers told by their widths, two stacks an experts layer
    and no gate, the shared expert's up and down, the selection bias, sigmoid scores renormalised and scaled by
    2.5), in float64, prompts long and short: transformers' greedy tokens and their log-probabilities."""
    hf = float32_weights(tiny_model("nemotron_h_moe", seed=3))
    written = write_gguf_of(hf, tmp_path / "nemotron3.gguf", "nemotron_h_moe")
    asked = prompts(13)
    assert_same_answers(greedy(written, asked), [greedy_with_logprobs(hf, p, 16) for p in asked])


def test_a_nemotron_3_super_file_equals_its_transformers_model(tmp_path):
    """Nemotron 3 Super's latent mixtures (moe_latent_size: the experts 32 wide in a model 64 wide, the hidden
    state projected down before them and their sum back up, ffn_latent_down and ffn_latent_up in the file; the
    router and the shared expert on the hidden state), in float64: transformers' greedy tokens and their
    log-probabilities."""
    hf = float32_weights(tiny_model("nemotron_h_moe", seed=3, moe_latent_size=32))
    written = write_gguf_of(hf, tmp_path / "nemotron3-super.gguf", "nemotron_h_moe")
    asked = prompts(14)
    with Engine.from_pretrained(written) as engine:
        experts = [b.mlp for b in engine.model.layers if b.mlp is not None]
        assert all(m.latent_down.out_features == m.experts.hidden == 32 for m in experts)
    assert_same_answers(greedy(written, asked), [greedy_with_logprobs(hf, p, 16) for p in asked])


def test_a_nemotron_3_file_with_a_prediction_layer_runs_the_layers_before_it(tmp_path):
    """A file whose last block is a next-token prediction layer (nextn_predict_layers; the K/V heads and widths
    listed for it too, an attention and an experts layer in one, its eh_proj beside): the layers before it
    alone, transformers' answers without it."""
    c = CONFIGS["nemotron_h_moe"]()
    types = c.layers_block_type
    hf = float32_weights(tiny_model("nemotron_h_moe", seed=4, layers_block_type=types + ["moe"],
                                    num_hidden_layers=len(types) + 1))
    metadata = {"tokenizer.ggml.eos_token_id": EOS, "nextn_predict_layers": 1,
                "attention.head_count_kv": [c.num_key_value_heads if t == "full_attention" else 0 for t in types]
                + [c.num_key_value_heads],
                "feed_forward_length": [c.moe_intermediate_size if t == "moe" else 0 for t in types]
                + [c.moe_intermediate_size]}
    eh_proj = np.random.default_rng(0).standard_normal((c.hidden_size, 2 * c.hidden_size))
    path = write_gguf_of(hf, tmp_path / "mtp.gguf", "nemotron_h_moe", metadata,
                         tensors={f"blk.{len(types)}.nextn.eh_proj.weight": eh_proj})
    without = tiny_model("nemotron_h_moe")
    without.load_state_dict({k: v for k, v in hf.state_dict().items()
                             if not k.startswith(f"model.layers.{len(types)}.")})
    asked = prompts(12)
    assert_same_answers(greedy(path, asked), [greedy_with_logprobs(without, p, 16) for p in asked])


@needs_kernels
@pytest.mark.parametrize("latent", [None, 32])
def test_an_8_bit_nemotron_3_file_runs_its_experts_in_its_blocks_on_the_native_layers(tmp_path, latent):
    """A Nemotron 3 file of 8-bit blocks keeps its experts' up and down stacks in them (no gate, no float copy)
    and its shared expert's products (Nemotron 3 Super's latent projections too), and its decode steps on the
    native layers answer as the torch layers over the same blocks."""
    hf = tiny_model("nemotron_h_moe", seed=5, moe_latent_size=latent)
    path = write_gguf_of(hf, tmp_path / "nemotron3-q8.gguf", "nemotron_h_moe", matrices=Q.Q8_0)
    with Engine.from_pretrained(path) as engine:
        experts = [b.mlp.experts for b in engine.model.layers if b.mlp is not None]
        assert experts and all(isinstance(e, BlockExperts) and e.squared_relu and set(e.formats) == {"up", "down"}
                               for e in experts)
    asked = [random_prompt(random.Random(i), 3, 30) for i in range(6)]
    native_and_torch_answers(path, asked)


def test_group_limited_routing_chooses_within_the_best_groups(tmp_path):
    """Transformers' Nemotron 3 scores its groups (n_group > 1) by their best two experts and chooses a token's
    experts from the best topk_group groups: Loom's torch layers do so (the native layers' router has no
    groups), in float64 and float32, as transformers."""
    hf = tiny_model("nemotron_h_moe", seed=7, n_group=4, topk_group=2)
    asked = prompts(8)
    with Engine.from_pretrained(hf, dtype=torch.float64) as engine:
        assert engine.model.spec.moe.groups == (4, 2, 2)
        assert engine.model.decoder_layers is None
        outputs = [list(engine.stream_response_tokens(engine.launch_response_tokens(p, {"max_new_tokens": 16}),
                                                      timeout=60)) for p in asked]
    assert outputs == [greedy_with_logprobs(hf, p, 16)[0] for p in asked]


def test_nemotron_3_files_loom_does_not_run_are_refused(tmp_path):
    """NVIDIA's Puzzle files (experts taken a layer at a time) are refused before a weight is read."""
    hf = float32_weights(tiny_model("nemotron_h_moe", seed=3))
    layers = hf.config.num_hidden_layers
    path = write_gguf_of(hf, tmp_path / "puzzle.gguf", "nemotron_h_moe",
                         {"expert_used_count": [2] * (layers - 1) + [4]})
    with pytest.raises(ValueError, match="take different numbers of experts.*Puzzle"):
        Engine.from_pretrained(path)


@pytest.mark.parametrize("settings, message", [
    ({"layers_block_type": ["linear_attention", "mlp", "mlp", "full_attention"]},
     "Nemotron-H layer 2 is an MLP that follows no Mamba2 or attention layer"),
    ({"layers_block_type": ["linear_attention", "moe", "full_attention"], "mlp_bias": True},
     "Nemotron-H experts with mlp_bias are not supported"),
    ({"layers_block_type": ["moe", "full_attention"]},
     "Nemotron-H layer 0 is a mixture of experts that follows no Mamba2 or attention layer"),
    ({"mlp_hidden_act": "silu"}, "Nemotron-H with mlp_hidden_act 'silu' is not supported; supported: relu2"),
    ({"time_step_limit": [0.0, 10.0]}, r"Mamba2 with time steps clamped to \[0.0, 10.0\] is not supported"),
    ({"n_groups": 3}, r"Mamba2's groups \(3\) must divide its heads \(8\)"),
])
def test_nemotron_h_configs_loom_does_not_run_are_refused(settings, message):
    config = CONFIGS["nemotron_h"]().to_dict() | settings
    with pytest.raises(ValueError, match=message):
        NemotronHSpec.from_hf(config)
