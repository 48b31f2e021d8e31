"""LFM2's short convolutions: GGUF files of them, as llama.cpp's converter writes them, against
transformers' models; their rows in the KV pool; the configs Loom refuses. (The engine's threaded,
prefix-cache, preemption, saved-directory and speculative tests run LFM2 among the other families.)"""

import random

import pytest
import torch
import transformers
from gguf.constants import GGMLQuantizationType as Q

from models.checkpoints import gguf as gguf_reader
from models.families.lfm2 import Lfm2Spec, feed_forward_width
from models.kernels import native
from models.kernels.block_linear import GROUP, BlockLinear
from runtime import Engine, GenerationConfig

from ..conftest import CONFIGS, greedy_with_logprobs, random_prompt, tiny_model, write_gguf_of
from .test_block_formats import assert_greedy_but_near_ties, rounding_inputs
from .test_gguf import assert_same_answers, greedy

needs_kernels = pytest.mark.skipif(native.library() is None, reason="no C++ compiler: the kernels are not built")


def test_an_lfm2_file_equals_its_transformers_model(tmp_path):
    """A file's layers read as llama.cpp reads them (no K/V heads: a convolution layer; the MLP's width as
    the file keeps it; the final norm under token_embd_norm), in float64, prompts long and short: the
    greedy tokens and their log-probabilities of transformers' model."""
    hf = tiny_model("lfm2", seed=3)
    rng = random.Random(13)
    prompts = [random_prompt(rng, 1, 4), random_prompt(rng, 30, 60)]
    written = write_gguf_of(hf, tmp_path / "lfm2.gguf", "lfm2")
    assert_same_answers(greedy(written, prompts), [greedy_with_logprobs(hf, p, 16) for p in prompts])


@needs_kernels
def test_a_quantized_lfm2_file_runs_in_its_blocks(tmp_path):
    """A file of 8-bit blocks runs its convolution layers' products in them, as the attention's and the
    MLP's (no float copy), on the native layers, and answers as transformers over the file's values, each product's input
    rounded to 8 bits as the blocks' products round it, but near ties."""
    hf = tiny_model("lfm2", seed=4)
    path = write_gguf_of(hf, tmp_path / "lfm2-q8.gguf", "lfm2", matrices=Q.Q8_0)
    shapes = hf.state_dict()
    hf.load_state_dict({name: tensor.double().reshape(shapes[name].shape)
                        for name, tensor in gguf_reader.read(path).tensors.items()}, strict=False)
    rounding_inputs(hf, {"proj": GROUP, "feed_forward.w1": GROUP, "feed_forward.w2": GROUP,
                         "feed_forward.w3": GROUP, "lm_head": GROUP})
    prompts = [random_prompt(random.Random(i), 3, 30) for i in range(6)]
    with Engine.from_pretrained(path, max_batch_size=8) as engine:
        convolutions = [block.conv for block in engine.model.layers if block.convolves]
        assert convolutions and all(isinstance(m, BlockLinear) for c in convolutions for m in (c.in_proj, c.out))
        assert engine.model.decoder_layers is not None  # (its decode steps and short prompts on the native layers)
        config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
        handles = [engine.launch_response_tokens(p, config) for p in prompts]
        answers = [list(engine.stream_response_tokens(h, timeout=60)) for h in handles]
    assert_greedy_but_near_ties(hf, prompts, answers)


def test_the_pool_keeps_a_row_a_token_for_each_convolution_layer():
    """K/V for the attention layers alone and a hidden-wide row a token for each convolution layer, in
    the same blocks: a byte budget holds as many blocks as both together allow."""
    hf = tiny_model("lfm2")
    c = hf.config
    attention, convolutions = c.layer_types.count("full_attention"), c.layer_types.count("conv")
    block_size, head_dim = 16, c.hidden_size // c.num_attention_heads
    per_block = (2 * attention * c.num_key_value_heads * head_dim + convolutions * c.hidden_size) * block_size * 8
    with Engine.from_pretrained(hf, dtype=torch.float64, block_size=block_size, kv_cache_bytes=10 * per_block) as engine:
        pool = engine.kv_cache
        assert pool.data.shape[1] == attention and pool.conv.shape == (convolutions, 10, block_size, c.hidden_size)
        assert pool.block_bytes == per_block


def test_the_mlp_width_is_derived_as_transformers_derives_it():
    """Two thirds of intermediate_size, times the multiplier, rounded up to the multiple (LFM2-1.2B's
    12288 -> 8192), or as given where the config says not to adjust it (a GGUF file's)."""
    for fields in ({"intermediate_size": 12288}, {"intermediate_size": 1000, "block_ffn_dim_multiplier": 1.5},
                   {"intermediate_size": 700, "block_multiple_of": 64},
                   {"intermediate_size": 4608, "block_auto_adjust_ff_dim": False}):
        config = transformers.Lfm2Config(**fields)
        assert feed_forward_width(config.to_dict()) == transformers.models.lfm2.modeling_lfm2.Lfm2MLP(config).w1.out_features
    assert feed_forward_width(transformers.Lfm2Config(intermediate_size=12288).to_dict()) == 8192


def test_lfm2_models_loom_does_not_run_are_refused(tmp_path):
    """A layer type other than attention and convolution, layer types that miss layers, a sliding
    window, and a file whose attention layers differ in K/V heads: refused, saying what is wrong."""
    config = CONFIGS["lfm2"]().to_dict()
    with pytest.raises(ValueError, match=r"LFM2 layer types \['mamba'\] are not supported"):
        Lfm2Spec.from_hf(config | {"layer_types": ["conv", "mamba", "conv", "conv"]})
    with pytest.raises(ValueError, match="layer_types lists 3 layers of 4"):
        Lfm2Spec.from_hf(config | {"layer_types": ["conv"] * 3})
    with pytest.raises(ValueError, match="LFM2 with a sliding window is not supported"):
        Lfm2Spec.from_hf(config | {"sliding_window": 512})
    hf = tiny_model("lfm2")
    path = write_gguf_of(hf, tmp_path / "uneven.gguf", "lfm2", {"attention.head_count_kv": [0, 2, 0, 4]})
    with pytest.raises(ValueError, match=r"attention layers have different K/V head counts \(\[2, 4\]\)"):
        Engine.from_pretrained(path)
