"""Qwen3.5's gated delta-rule layers (and Qwen3.5-MoE's experts): GGUF files of them, as llama.cpp's converter
writes them, against transformers' models; their states in the pool's slots; what the engine refuses for a
model that carries a state a sequence; the configs Loom refuses. (The engine's threaded, preemption,
prefix-cache and saved-directory tests run Qwen3.5 among the other families.)"""

import random

import gguf
import pytest
import torch
import transformers
from gguf.constants import GGMLQuantizationType as Q

from models.families.qwen35 import Qwen35Spec
from models.kernels import native
from models.kernels.block_linear import GROUP, BlockLinear
from runtime import Engine, GenerationConfig

from ..conftest import CONFIGS, greedy_with_logprobs, random_prompt, tiny_model, write_gguf_of
from .test_block_formats import assert_greedy_but_near_ties, rounding_inputs
from .test_gguf import assert_same_answers, greedy

needs_kernels = pytest.mark.skipif(native.library() is None, reason="no C++ compiler: the kernels are not built")


def float32_weights(hf):
    """``hf`` with its weights rounded to float32, as a file of F32 tensors holds them."""
    with torch.no_grad():
        for tensor in hf.parameters():
            tensor.copy_(tensor.float().double())
    return hf


def test_a_qwen35_file_equals_its_transformers_model(tmp_path):
    """A file as llama.cpp's converter writes it (value heads tiled, -exp(A_log), norms as 1 + weight but the
    gated one, the layers' kinds listed), in float64, prompts long and short: transformers' greedy tokens
    and their log-probabilities."""
    hf = float32_weights(tiny_model("qwen3_5", seed=3))
    rng = random.Random(13)
    prompts = [random_prompt(rng, 1, 4), random_prompt(rng, 30, 60)]
    written = write_gguf_of(hf, tmp_path / "qwen35.gguf", "qwen35")
    assert_same_answers(greedy(written, prompts), [greedy_with_logprobs(hf, p, 16) for p in prompts])


def test_a_qwen35_file_without_its_layer_list_takes_every_fourth_as_attention(tmp_path):
    """llama.cpp's reading where the file lists no recurrent layers: full_attention_interval's (4 if absent)."""
    hf = float32_weights(tiny_model("qwen3_5", seed=4))
    path = write_gguf_of(hf, tmp_path / "qwen35.gguf", "qwen35")
    reader = gguf.GGUFReader(path)
    assert "qwen35.attention.recurrent_layers" in reader.fields
    plain = tmp_path / "plain.gguf"
    write_gguf_of(hf, plain, "qwen35", {"attention.recurrent_layers": None})
    with Engine.from_pretrained(plain, dtype=torch.float64) as engine:
        assert [block.recurrent for block in engine.model.layers] == [True, True, True, False]


def test_a_qwen35_files_prediction_layer_is_not_run(tmp_path):
    """llama.cpp's converter keeps Qwen3.5's next-token prediction layer (MTP) after the others, in
    block_count and the recurrent-layer list, and names it by nextn_predict_layers: Loom runs the layers
    before it, as llama.cpp does, and answers as the model without it."""
    types = ["linear_attention"] * 3 + ["full_attention"] * 2
    hf = float32_weights(tiny_model("qwen3_5", seed=6, num_hidden_layers=5, layer_types=types))
    path = write_gguf_of(hf, tmp_path / "mtp.gguf", "qwen35", {"nextn_predict_layers": 1})
    without = tiny_model("qwen3_5")
    without.load_state_dict({k: v for k, v in hf.state_dict().items() if not k.startswith("model.layers.4.")})
    prompts = [random_prompt(random.Random(3), 5, 30)]
    assert_same_answers(greedy(path, prompts), [greedy_with_logprobs(without, p, 16) for p in prompts])


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_the_delta_rule_layers_answer_alike_on_the_kernel_and_on_torch_operators(kernel, monkeypatch):
    """The torch layers (the native decoder layers set aside), their delta rule on delta_rule.h or on torch
    operators (where no compiler built the kernels), over prompts, chunked prefills and decode steps of
    several requests at once: transformers' tokens and log-probabilities."""
    from models.families.qwen35 import GatedDeltaNet
    from models.kernels import delta_rule
    assert_mixing_alike("qwen3_5", delta_rule, GatedDeltaNet, kernel, monkeypatch)


def assert_mixing_alike(arch: str, kernel_module, mixer, kernel: bool, monkeypatch):
    """``arch``'s tiny model on the torch layers, its recurrent layers (``mixer``, whose ``mix`` is the torch
    operators' way) on ``kernel_module``'s kernel or (``kernel`` False) on torch operators, four requests
    at once, their prompts chunked: transformers' greedy tokens and log-probabilities."""
    if kernel and native.library() is None:
        pytest.skip("no C++ compiler: the kernels are not built")
    if not kernel:
        monkeypatch.setattr(kernel_module, "supports", lambda x, states: False)
    calls = []
    real_mix = mixer.mix
    monkeypatch.setattr(mixer, "mix", lambda *a: calls.append(1) or real_mix(*a))
    hf = tiny_model(arch, seed=4)
    prompts = [random_prompt(random.Random(i), 2, 40) for i in range(4)]
    with Engine.from_pretrained(hf, dtype=torch.float64, max_batch_size=4, max_batch_tokens=16) as engine:
        engine.model.decoder_layers = None
        handles = [engine.launch_response_tokens(p, GenerationConfig(max_new_tokens=10, logprobs=0)) for p in prompts]
        answers = [(list(engine.stream_response_tokens(h, timeout=60)), [t.logprob for t in h.logprobs])
                   for h in handles]
    assert bool(calls) != kernel
    assert_same_answers(answers, [greedy_with_logprobs(hf, p, 10) for p in prompts])


@needs_kernels
def test_a_quantized_qwen35_file_runs_in_its_blocks(tmp_path):
    """A file of 8-bit blocks runs every product in them (the delta-rule layers' five, the gated attention's
    q/gate/k/v), on the native layers, and answers as transformers over the file's values, each product's input rounded to 8 bits
    as the blocks' products round it, but near ties. (Near at 0.1 here, not 5e-3: a value that float32
    rounds to 8 bits on the other side of a tie from float64 changes the delta rule's state, which carries
    the change to every later token; measured gaps reached 0.06.)"""
    hf = tiny_model("qwen3_5", seed=5)
    with torch.no_grad():  # the file's values: each matrix through Q8_0 and back
        for name, tensor in hf.named_parameters():
            if tensor.ndim == 2:
                codes = gguf.quants.quantize(tensor.float().numpy(), Q.Q8_0)
                tensor.copy_(torch.from_numpy(gguf.quants.dequantize(codes, Q.Q8_0)).double())
    path = write_gguf_of(hf, tmp_path / "qwen35-q8.gguf", "qwen35", matrices=Q.Q8_0)
    rounding_inputs(hf, {"proj": GROUP, "lm_head": GROUP})
    prompts = [random_prompt(random.Random(i), 3, 30) for i in range(6)]
    with Engine.from_pretrained(path, max_batch_size=8) as engine:
        mixers = [block.mixer for block in engine.model.layers if block.recurrent]
        assert mixers and all(isinstance(m, BlockLinear) for d in mixers for m in (d.qkv, d.z, d.beta, d.alpha, d.out))
        assert engine.model.decoder_layers is not None  # (its decode steps and short prompts on the native layers)
        config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
        handles = [engine.launch_response_tokens(p, config) for p in prompts]
        answers = [list(engine.stream_response_tokens(h, timeout=60)) for h in handles]
    assert_greedy_but_near_ties(hf, prompts, answers, near_tie=0.1)


def test_the_pool_keeps_a_state_a_request_and_k_v_for_the_attention_layers():
    """K/V for the one attention layer alone, and for each delta-rule layer a state slot for each request that
    may run (the convolution's last inputs and the heads' matrices), outside the blocks' byte budget."""
    hf = tiny_model("qwen3_5")
    c = hf.config
    with Engine.from_pretrained(hf, dtype=torch.float64, max_batch_size=5, block_size=16) as engine:
        pool = engine.kv_cache
        conv_width = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
        assert pool.data.shape[1] == 1
        assert [tuple(s.shape) for s in pool.states] == [
            (3, 5, c.linear_conv_kernel_dim - 1, conv_width),
            (3, 5, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)]
        assert pool.block_bytes == 2 * c.num_key_value_heads * c.head_dim * 16 * 8
        assert engine.kv_manager.keeps_state


def test_requests_take_state_slots_and_give_them_back():
    """More requests than slots, one after another and together: each admitted request holds a slot of
    its own while it runs, and every slot is free once they end."""
    hf = tiny_model("qwen3_5")
    prompts = [random_prompt(random.Random(i), 2, 12) for i in range(9)]
    with Engine.from_pretrained(hf, dtype=torch.float64, max_batch_size=3) as engine:
        held = []
        real = engine.kv_manager.take_cached_prefix

        def taking(ctx):
            cached = real(ctx)
            running = [engine.kv_manager.state_slot(c) for c in engine.scheduler.running] + [
                engine.kv_manager.state_slot(ctx)]
            held.append(running)
            return cached

        engine.kv_manager.take_cached_prefix = taking
        handles = [engine.launch_response_tokens(p, {"max_new_tokens": 4}) for p in prompts]
        for h in handles:
            list(engine.stream_response_tokens(h, timeout=60))
        assert sorted(engine.kv_manager.free_slots) == [0, 1, 2]
    assert len(held) == len(prompts) and all(len(set(slots)) == len(slots) for slots in held)


def test_speculative_decoding_is_refused_for_a_model_that_carries_a_state():
    """Proposals a recurrent layer has taken in cannot be taken back: the engine's speculative_tokens, a
    request's, and a Qwen3.5 draft are refused, saying so; nothing running is lost."""
    hf = tiny_model("qwen3_5")
    with pytest.raises(ValueError, match="runs without speculative decoding"):
        Engine.from_pretrained(hf, dtype=torch.float64, speculative_tokens=2)
    with Engine.from_pretrained(hf, dtype=torch.float64) as engine:
        running = engine.launch_response_tokens([5, 6, 7], {"max_new_tokens": 6})
        with pytest.raises(ValueError, match="speculative_tokens=3: .* cannot take back rejected proposals"):
            engine.launch_response_tokens([5, 6, 7], {"max_new_tokens": 4, "speculative_tokens": 3})
        assert len(list(engine.stream_response_tokens(running, timeout=60))) == 6
    with pytest.raises(ValueError, match="the draft .* carries a state a sequence"):
        Engine.from_pretrained(tiny_model("llama"), dtype=torch.float64, draft=hf, speculative_tokens=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # (the native layers', the torch layers')
def test_a_step_without_a_slot_of_its_own_is_refused_before_any_state_is_touched(dtype):
    """The model's contract, used directly: a sequence without a state slot, two sharing one, or one past the
    pool's slots raise ValueError (the native layers would have written another sequence's state)."""
    from models.step import Sequence, StepInput
    with Engine.from_pretrained(tiny_model("qwen3_5"), dtype=dtype, max_batch_size=4) as engine:
        before = [s.clone() for s in engine.kv_cache.states]
        for sequences in ([Sequence([5, 6], 0, [0], True)],
                          [Sequence([5], 3, [0], True, state_slot=1), Sequence([6], 3, [1], True, state_slot=1)],
                          [Sequence([5], 3, [0], True, state_slot=4)]):
            with pytest.raises(ValueError, match="needs each sequence to name one of the pool's 4 state slots"):
                engine.model(StepInput.flatten(sequences, 16, torch.device("cpu")), engine.kv_cache)
        assert all(torch.equal(a, b) for a, b in zip(before, engine.kv_cache.states))


def test_qwen35_configs_loom_does_not_run_are_refused(tmp_path):
    """A layer type other than the two, layer types that miss layers, value heads that key heads do not
    divide, a scaled rope, and a file without its delta-rule sizes: refused, saying what is wrong."""
    config = CONFIGS["qwen3_5"]().to_dict()
    with pytest.raises(ValueError, match=r"Qwen3.5 layer types \['mamba'\] are not supported"):
        Qwen35Spec.from_hf(config | {"layer_types": ["linear_attention", "mamba", "linear_attention", "full_attention"]})
    with pytest.raises(ValueError, match="layer_types lists 3 layers of 4"):
        Qwen35Spec.from_hf(config | {"layer_types": ["linear_attention"] * 3})
    with pytest.raises(ValueError, match=r"value heads \(3\) must be a multiple of its key heads \(2\)"):
        Qwen35Spec.from_hf(config | {"linear_num_value_heads": 3})
    with pytest.raises(ValueError, match="Qwen3.5 with a yarn rope scaling is not supported"):
        Qwen35Spec.from_hf(config | {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}})
    hf = tiny_model("qwen3_5")
    path = write_gguf_of(hf, tmp_path / "bare.gguf", "qwen35", {"ssm.state_size": 0})
    with pytest.raises(ValueError, match=r"leaves out the delta-rule layers' sizes \(linear_key_head_dim\)"):
        Engine.from_pretrained(path)


def tiny_qwen35_moe(seed: int):
    """Qwen3.5-MoE's text model, conftest's Qwen3.5 with four experts, two a token, beside a shared expert (its
    router drawn wide, as tiny_model draws Qwen2-MoE's), in float64."""
    torch.manual_seed(seed)
    dense = CONFIGS["qwen3_5"]().to_dict()
    fields = {k: v for k, v in dense.items() if k in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "max_position_embeddings", "eos_token_id", "bos_token_id", "pad_token_id", "linear_num_key_heads",
        "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "initializer_range",
        "rope_parameters")}
    config = transformers.Qwen3_5MoeTextConfig(**fields, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                               shared_expert_intermediate_size=32, experts_implementation="eager")
    model = transformers.Qwen3_5MoeForCausalLM(config).to(torch.float64).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith(("shared_expert_gate.weight", "dt_bias")):
                tensor.normal_(0.0, 0.5)
    return model


def test_a_qwen35_moe_model_answers_as_transformers_does():
    """Qwen3.5-MoE (every layer's MLP four experts, two a token, renormalised, beside a shared expert gated by
    its own router) in memory, on the native layers and on the torch layers: transformers' greedy tokens and
    their log-probabilities."""
    hf = tiny_qwen35_moe(seed=3)
    prompts = [random_prompt(random.Random(14), 1, 4), random_prompt(random.Random(15), 30, 60)]
    expected = [greedy_with_logprobs(hf, p, 16) for p in prompts]
    for native_layers in (True, False):
        with Engine.from_pretrained(hf, dtype=torch.float64) as engine:
            if not native_layers:
                engine.model.decoder_layers = None
            handles = [engine.launch_response_tokens(p, GenerationConfig(max_new_tokens=16, logprobs=0))
                       for p in prompts]
            answers = [(list(engine.stream_response_tokens(h, timeout=60)), [t.logprob for t in h.logprobs])
                       for h in handles]
        assert_same_answers(answers, expected)


def test_a_qwen35_moe_file_equals_its_transformers_model(tmp_path):
    """A qwen35moe file as llama.cpp's converter writes it (the experts' stacks, the router, the shared expert
    and its one-row router as ffn_gate_inp_shexp): transformers' answers, on the float32 native layers too."""
    hf = float32_weights(tiny_qwen35_moe(seed=4))
    text = hf.config
    written = write_gguf_of(hf, tmp_path / "qwen35moe.gguf", "qwen35moe", {
        "expert_count": text.num_experts, "expert_used_count": text.num_experts_per_tok,
        "expert_feed_forward_length": text.moe_intermediate_size,
        "expert_shared_feed_forward_length": text.shared_expert_intermediate_size,
        "tokenizer.ggml.eos_token_id": text.eos_token_id})  # (an answer here reaches it)
    prompts = [random_prompt(random.Random(16), 1, 4), random_prompt(random.Random(17), 30, 60)]
    assert_same_answers(greedy(written, prompts), [greedy_with_logprobs(hf, p, 16) for p in prompts])
    with Engine.from_pretrained(written, dtype=torch.float32) as engine:
        assert engine.model.decoder_layers is not None and engine.model.layers[0].mlp.shared is not None
