"""Granite 4's hybrids (Mamba2 layers beside a few attention layers): GGUF files of them, as llama.cpp's
converter writes them, against transformers' models (dense and with experts, without rotary and with it);
the Mamba2 layers on the kernel and on torch operators; their states in the pool's slots; the configs Loom
refuses. (The engine's threaded, preemption, prefix-cache, saved-directory and native-layer tests run them
among the other families.)"""

import random

import gguf
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from models.families import mamba2
from models.families.granite_hybrid import GraniteHybridSpec
from models.kernels import mamba_scan, native
from models.kernels.block_linear import GROUP, BlockLinear
from runtime import Engine, GenerationConfig

from ..conftest import CONFIGS, greedy_with_logprobs, random_prompt, tiny_model, write_gguf_of
from .test_block_formats import assert_greedy_but_near_ties, rounding_inputs
from .test_gguf import assert_same_answers, greedy
from .test_qwen35 import assert_mixing_alike, float32_weights

needs_kernels = pytest.mark.skipif(native.library() is None, reason="no C++ compiler: the kernels are not built")


@pytest.mark.parametrize("settings", [{}, {"num_local_experts": 0}, {"position_embedding_type": "rope"}],
                         ids=["experts", "dense", "rotary"])
def test_a_granite_hybrid_file_equals_its_transformers_model(tmp_path, settings):
    """A file as llama.cpp's converter writes it (no K/V heads for a Mamba2 layer, -exp(A_log), the gated
    norm a row a group, the multipliers; a dense model's shared MLP as Llama's; the rotary on where the file
    says, the queries' and keys' rows permuted for it), in float64, prompts long and short: transformers'
    greedy tokens and their log-probabilities."""
    hf = float32_weights(tiny_model("granitemoehybrid", seed=3, **settings))
    rng = random.Random(13)
    prompts = [random_prompt(rng, 1, 4), random_prompt(rng, 30, 60)]
    written = write_gguf_of(hf, tmp_path / "granite.gguf", "granitehybrid")
    assert_same_answers(greedy(written, prompts), [greedy_with_logprobs(hf, p, 16) for p in prompts])


def test_the_scan_agrees_with_transformers_own(monkeypatch):
    """The reference the other tests take is the conftest's float64 scan; against transformers' own (its
    chunked and recurrent forms, in float32 whatever the model's dtype): the same greedy tokens, their
    log-probabilities within 1e-5."""
    import transformers

    from ..conftest import TRANSFORMERS_MAMBA2_SCAN
    monkeypatch.setattr(transformers.models.granitemoehybrid.modeling_granitemoehybrid, "mamba2_scan_forward",
                        TRANSFORMERS_MAMBA2_SCAN)
    hf = tiny_model("granitemoehybrid", seed=7)
    prompts = [random_prompt(random.Random(8), 20, 40)]
    with Engine.from_pretrained(hf, dtype=torch.float64) as engine:
        handles = [engine.launch_response_tokens(p, GenerationConfig(max_new_tokens=12, logprobs=0)) for p in prompts]
        answers = [(list(engine.stream_response_tokens(h, timeout=60)), [t.logprob for t in h.logprobs])
                   for h in handles]
    assert_same_answers(answers, [greedy_with_logprobs(hf, p, 12) for p in prompts])


def test_a_granite_4_model_whose_layers_all_attend_keeps_no_state():
    """Granite 4.0's non-hybrid models share the hybrids' model_type with every layer attending: no state slots,
    the prefix cache and speculative decoding as for any attention model; transformers' answers, on the native
    layers and on the torch layers."""
    hf = tiny_model("granitemoehybrid", seed=9, layer_types=["full_attention"] * 4)
    prompts = [random_prompt(random.Random(10), 5, 30)]
    for native_layers in (True, False):
        with Engine.from_pretrained(hf, dtype=torch.float64) as engine:
            assert not engine.kv_manager.keeps_state and not engine.kv_cache.states
            if not native_layers:
                engine.model.decoder_layers = None
            outputs = [list(engine.stream_response_tokens(engine.launch_response_tokens(p, {"max_new_tokens": 12}),
                                                          timeout=60)) for p in prompts]
        assert outputs == [greedy_with_logprobs(hf, p, 12)[0] for p in prompts]
    with Engine.from_pretrained(hf, dtype=torch.float64, speculative_tokens=2) as engine:
        assert engine.kv_manager.allocator.caching


def test_a_granite_hybrid_file_without_its_convolutions_biases_runs_without_them(tmp_path):
    """A file may leave ssm_conv1d's bias out (llama.cpp's loader does not require it): such a file answers as
    the model with zero biases."""
    hf = float32_weights(tiny_model("granitemoehybrid", seed=6))
    path = write_gguf_of(hf, tmp_path / "no-bias.gguf", "granitehybrid", leave_out=("ssm_conv1d.bias",))
    with torch.no_grad():
        for name, tensor in hf.named_parameters():
            if name.endswith("conv1d.bias"):
                tensor.zero_()
    prompts = [random_prompt(random.Random(5), 5, 30)]
    assert_same_answers(greedy(path, prompts, 12), [greedy_with_logprobs(hf, p, 12) for p in prompts])


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_the_mamba2_layers_answer_alike_on_the_kernel_and_on_torch_operators(kernel, monkeypatch):
    """The torch layers (the native decoder layers set aside), their Mamba2 mixing on mamba_scan.h or on
    torch operators (where no compiler built the kernels), over prompts, chunked prefills and decode steps
    of several requests at once: transformers' tokens and log-probabilities."""
    assert_mixing_alike("granitemoehybrid", mamba_scan, mamba2.Mamba2Mixer, kernel, monkeypatch)


@needs_kernels
def test_a_quantized_granite_hybrid_file_runs_in_its_blocks(tmp_path):
    """A file of 8-bit blocks runs every product in them (the Mamba2 layers' two, the attention's, the
    MLPs'), on the native layers, and answers as transformers over the file's
    values, each product's input rounded to 8 bits as the blocks' products round it, but near ties (0.1, as
    Qwen3.5's: a state carries a rounding across a tie to every later token)."""
    hf = tiny_model("granitemoehybrid", seed=5, num_local_experts=0)  # (transformers' experts take no hooks)
    path = eight_bit_file(hf, tmp_path / "granite-q8.gguf", "granitehybrid")
    prompts = [random_prompt(random.Random(i), 3, 30) for i in range(6)]
    mixers = lambda model: [m for b in model.layers if b.recurrent for m in (b.mamba.in_proj, b.mamba.out)]
    assert_greedy_but_near_ties(hf, prompts, answers_in_blocks(path, prompts, mixers), near_tie=0.1)


def eight_bit_file(hf, path, arch: str):
    """``hf``'s Q8_0 file at ``path``, and ``hf`` made transformers' model of it: each matrix through Q8_0 and
    back, each product's input rounded to 8 bits as the blocks' products round it."""
    with torch.no_grad():
        for name, tensor in hf.named_parameters():
            if tensor.ndim == 2 and not name.endswith("norm.weight"):
                codes = gguf.quants.quantize(tensor.float().numpy(), Q.Q8_0)
                tensor.copy_(torch.from_numpy(gguf.quants.dequantize(codes, Q.Q8_0)).double())
    written = write_gguf_of(hf, path, arch, matrices=Q.Q8_0)
    rounding_inputs(hf, {"proj": GROUP, "lm_head": GROUP, "linear": GROUP})
    return written


def answers_in_blocks(path, prompts: list, products) -> list:
    """Greedy answers (12 tokens, past any end) over a file whose ``products(model)`` all run in its blocks,
    on the native layers."""
    with Engine.from_pretrained(path, max_batch_size=8) as engine:
        multiplied = products(engine.model)
        assert multiplied and all(isinstance(m, BlockLinear) for m in multiplied)
        assert engine.model.decoder_layers is not None
        config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
        handles = [engine.launch_response_tokens(p, config) for p in prompts]
        return [list(engine.stream_response_tokens(h, timeout=60)) for h in handles]


def test_the_pool_keeps_a_mamba2_state_a_request_and_k_v_for_the_attention_layer():
    """K/V for the one attention layer alone, and for each Mamba2 layer a state slot for each request that
    may run: the convolution's last inputs (x, B and C) and the heads' matrices."""
    hf = tiny_model("granitemoehybrid")
    c = hf.config
    with Engine.from_pretrained(hf, dtype=torch.float64, max_batch_size=5, block_size=16) as engine:
        pool = engine.kv_cache
        conv_width = c.mamba_n_heads * c.mamba_d_head + 2 * c.mamba_n_groups * c.mamba_d_state
        assert pool.data.shape[1] == 1
        assert [tuple(s.shape) for s in pool.states] == [
            (3, 5, c.mamba_d_conv - 1, conv_width), (3, 5, c.mamba_n_heads, c.mamba_d_head, c.mamba_d_state)]
        assert engine.kv_manager.keeps_state


def test_granite_hybrid_configs_loom_does_not_run_are_refused(tmp_path):
    """Clamped time steps, groups that do not divide the heads, heads that do not make the inner width, an
    unknown layer type, and a file without its Mamba2 sizes: refused, saying what is wrong."""
    config = CONFIGS["granitemoehybrid"]().to_dict()
    with pytest.raises(ValueError, match=r"time steps clamped to \[0.001, 0.1\] is not supported"):
        GraniteHybridSpec.from_hf(config | {"time_step_limit": [0.001, 0.1]})
    with pytest.raises(ValueError, match=r"groups \(3\) must divide its heads \(8\)"):
        GraniteHybridSpec.from_hf(config | {"mamba_n_groups": 3})
    with pytest.raises(ValueError, match="8 heads of 8 must make its inner width 128"):
        GraniteHybridSpec.from_hf(config | {"mamba_d_head": 8})
    with pytest.raises(ValueError, match=r"Granite 4 layer types \['conv'\] are not supported"):
        GraniteHybridSpec.from_hf(config | {"layer_types": ["mamba", "conv", "mamba", "attention"]})
    path = write_gguf_of(tiny_model("granitemoehybrid"), tmp_path / "bare.gguf", "granitehybrid",
                         {"ssm.state_size": None})
    with pytest.raises(ValueError, match=r"leaves out the Mamba2 layers' sizes \(granitehybrid.ssm.state_size\)"):
        Engine.from_pretrained(path)
