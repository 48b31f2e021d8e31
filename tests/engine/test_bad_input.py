"""Every bad input gets an error that says what is wrong, and the engine keeps serving.
Each row here is a row of the table in docs/reliability.md."""

from pathlib import Path

import pytest
import torch

from runtime import Engine, GenerationConfig

from ..conftest import VOCAB

BAD_PROMPTS = [
    ([], ValueError, "empty"),
    ("hello", TypeError, "use launch_response for text"),
    (5, TypeError, "sequence of token ids"),
    ([1, "a"], TypeError, r"input_tokens\[1\] is 'a'"),
    ([1, 2.5], TypeError, r"input_tokens\[1\] is 2.5"),
    ([True], TypeError, "not an int token id"),
    ([1, -1], ValueError, r"input_tokens\[1\] = -1 is outside the vocabulary"),
    ([VOCAB], ValueError, f"outside the vocabulary \\[0, {VOCAB}\\)"),
    ([5] * 256, ValueError, "the prompt has 256 tokens; the context holds 256"),
    (torch.ones(2, 3, dtype=torch.long), ValueError, "must be 1-D"),
    (torch.ones(3), TypeError, "must hold integers"),
]

BAD_CONFIGS = [
    (dict(max_new_tokens=0), ValueError, "max_new_tokens must be >= 1"),
    (dict(max_new_tokens=2.0), TypeError, "max_new_tokens must be an int"),
    (dict(temperature=-0.5), ValueError, r"temperature must be in \[0.0, inf\]"),
    (dict(temperature=float("nan")), ValueError, "temperature must be a finite number, got nan"),
    (dict(temperature=float("inf")), ValueError, "temperature must be a finite number, got inf"),
    (dict(temperature="hot"), TypeError, "temperature must be a number"),
    (dict(do_sample=True, temperature=0), ValueError, "do_sample=True with temperature=0"),
    (dict(top_k=-1), ValueError, "top_k must be >= 0"),
    (dict(top_p=1.5), ValueError, r"top_p must be in \(0.0, 1.0\]"),
    (dict(top_p=0.0), ValueError, r"top_p must be in \(0.0, 1.0\]"),
    (dict(top_p=float("nan")), ValueError, "top_p must be a finite number"),
    (dict(repetition_penalty=0), ValueError, "repetition_penalty must be in"),
    (dict(repetition_penalty=float("inf")), ValueError, "repetition_penalty must be a finite number"),
    (dict(do_sample="yes"), TypeError, "do_sample must be a bool"),
    (dict(seed=-3), ValueError, "seed must be >= 0"),
    (dict(seed=2**64), ValueError, "seed must be <= 18446744073709551615"),
    (dict(priority=2**40), ValueError, "priority must be <= 2147483647"),
    (dict(stop_token_ids=["x"]), TypeError, "each of stop_token_ids must be an int"),
    (dict(stop_token_ids="ab"), TypeError, "stop_token_ids must be a list of ints"),
    (dict(stop=[""]), ValueError, "non-empty str"),
    (dict(stop=5), TypeError, "stop must be a str or a list of str"),
    (dict(nonsense=1), TypeError, "unexpected keyword argument 'nonsense'"),
    (dict(logit_bias={"40": 1.0}), TypeError, "logit_bias keys must be token ids"),
]

BAD_OPTIONS = [
    (dict(max_batch_size=0), ValueError, "max_batch_size must be >= 1"),
    (dict(max_batch_tokens=4, max_batch_size=8), ValueError, "must be >= max_batch_size"),
    (dict(block_size=0), ValueError, "block_size must be >= 1"),
    (dict(policy="lifo"), ValueError, "policy must be one of"),
    (dict(num_kv_blocks=-1), ValueError, "num_kv_blocks must be >= 1"),
    (dict(max_waiting=-1), ValueError, "max_waiting must be >= 0"),
    (dict(batch_size=4), TypeError, r"unknown engine option\(s\) \['batch_size'\]"),
    (dict(kv_cache_bytes=10), ValueError, "cannot hold one KV block"),
    (dict(cpu_threads=0), ValueError, "cpu_threads must be >= 1"),
    (dict(kv_dtype="int8"), ValueError, r"kv_dtype must be None \(the model's dtype\) or one of"),
    (dict(kv_dtype=16), ValueError, "kv_dtype must be None"),
]


@pytest.fixture(scope="module")
def engine(llama):
    with Engine.from_pretrained(llama) as engine:
        yield engine


@pytest.mark.parametrize("prompt,error,message", BAD_PROMPTS)
def test_bad_prompt(engine, prompt, error, message):
    with pytest.raises(error, match=message):
        engine.launch_response_tokens(prompt)
    assert list(engine.stream_response_tokens(engine.launch_response_tokens([5, 6], {"max_new_tokens": 2})))


@pytest.mark.parametrize("fields,error,message", BAD_CONFIGS)
def test_bad_generation_config(engine, fields, error, message):
    with pytest.raises(error, match=message):
        engine.launch_response_tokens([5, 6], fields)
    with pytest.raises(error, match=message):
        GenerationConfig(**fields)


def test_stop_token_outside_the_vocabulary_is_refused_at_launch(engine):
    with pytest.raises(ValueError, match=f"stop_token_ids holds {10**9}, outside the vocabulary \\[0, {VOCAB}\\)"):
        engine.launch_response_tokens([5, 6], {"stop_token_ids": [10**9]})


def test_config_of_the_wrong_type(engine):
    with pytest.raises(TypeError, match="config must be a GenerationConfig"):
        engine.launch_response_tokens([5, 6], 0.5)


@pytest.mark.parametrize("options,error,message", BAD_OPTIONS)
def test_bad_engine_option(llama, options, error, message):
    with pytest.raises(error, match=message):
        Engine.from_pretrained(llama, **options)


def test_bad_sources(tmp_path, llama):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        Engine.from_pretrained(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        Engine.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    supported = ("afmoe, apertus, arcee, bloom, cohere, cohere2, cohere2_moe, dbrx, deepseek_v2, deepseek_v3, dots1, "
                 "ernie4_5, ernie4_5_moe, exaone, exaone4, exaone_moe, falcon, falcon_h1, falcon_mamba, gemma, gemma2, "
                 "gemma3_text, gemma3n_text, gemma4_text, glm, glm4, glm4_moe, glm4_moe_lite, gpt2, gpt_bigcode, "
                 "gpt_neox, gpt_oss, granite, granite_swa, granitemoe, granitemoe_swa, granitemoehybrid, "
                 "granitemoeshared, hunyuan_v1_dense, hunyuan_v1_moe, jais2, jamba, lfm2, lfm2_moe, llama, "
                 "llama4_text, mamba, mamba2, minicpm3, minimax_m2, ministral3, mistral, mistral4, mixtral, mpt, "
                 "nemotron, nemotron_h, olmo, olmo2, olmo3, olmoe, phi, phi3, qwen2, qwen2_moe, qwen3, qwen3_5, "
                 "qwen3_5_moe, qwen3_5_moe_text, qwen3_5_text, qwen3_moe, qwen3_next, seed_oss, smollm3, stablelm, "
                 "starcoder2 "
                 r"\(and, for their text, qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe, gemma3, gemma4, gemma3n, "
                 r"mistral3, llama4\)")
    with pytest.raises(ValueError, match=f"unsupported model_type 'bert'; supported: {supported}") as refused:
        Engine.from_pretrained(tmp_path)
    assert str(refused.value) in (Path(__file__).parents[2] / "docs" / "reliability.md").read_text()  # as quoted
    with pytest.raises(TypeError, match="expected a transformers PreTrainedModel"):
        Engine.from_pretrained(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unknown dtype 'float7'"):
        Engine.from_pretrained(llama, dtype="float7")


def test_a_checkpoint_of_8_bit_float_weights_is_refused(tmp_path, llama):
    """An FP8 checkpoint (its matrices float8 beside scales of their own, as GLM-4.5-FP8's and DeepSeek-V3's) is
    refused before a weight is read, rather than run on its codes without their scales."""
    import json

    from safetensors.torch import load_file, save_file

    llama.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = {}
    for name, t in load_file(tmp_path / "model.safetensors").items():
        if name.endswith("proj.weight"):
            weights[name + "_scale_inv"] = torch.ones(1, 1)
            t = t.to(torch.float8_e4m3fn)
        weights[name] = t
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"the llama checkpoint keeps its weights in 8-bit floats with scales of their "
                                         r"own \(model.layers.0.*quant_method: fp8\), which Loom does not read"):
        Engine.from_pretrained(tmp_path)


def test_text_api_without_tokenizer(engine):
    with pytest.raises(RuntimeError, match="loaded without a tokenizer"):
        engine.response("hello")
