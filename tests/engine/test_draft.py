"""Speculative decoding with a draft model (Engine.from_pretrained(draft=...)): a greedy stream is
the same token for token with and without the draft, whatever runs beside it; the same model as its
own draft (float64) has every proposal kept; every way a request ends stays exact; the draft's blocks
all go back; a sampled stream keeps the target's distribution; a draft of another vocabulary is refused."""

import random

import pytest
import torch
import transformers

import models
from runtime import Engine, GenerationConfig
from runtime.config import EngineOptions

from ..conftest import CONFIGS, EOS, MODEL_CLASSES, reference, tiny_model, wait_until
from .test_speculation import (assert_drawn_as, assert_each_ends_where_it_says, ending_cases, exact_joint,
                              repeating_prompts, run_threaded)


def noisy_copy(hf, scale: float, seed: int = 0):
    """``hf`` with every weight moved by noise of ``scale`` times its spread: a draft that mostly
    agrees with its target, so that steps keep some proposals and replace others."""
    draft = type(hf)(hf.config).to(torch.float64).eval()
    draft.load_state_dict(hf.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in draft.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator, dtype=weight.dtype) * weight.std() * scale)
    return draft


def small_model(arch: str, seed: int):
    """A smaller random model of ``arch`` (one layer, narrower) with the tests' vocabulary."""
    config = CONFIGS[arch]()
    config.num_hidden_layers = 1
    if arch == "qwen2":
        config.hidden_size, config.intermediate_size = 32, 64
    torch.manual_seed(seed)
    return MODEL_CLASSES[arch](config).to(torch.float64).eval()


def assert_all_blocks_back(stats):
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]
    assert stats["free_draft_kv_blocks"] == stats["total_draft_kv_blocks"] > 0
    assert stats["draft_failures"] == 0 and stats["step_failures"] == 0


# target family, draft: "same" (the target itself), "noisy" (a perturbed copy), or another family's small model
CASES = [("llama", "same"), ("gpt2", "same"), ("phi3", "same"), ("llama", "noisy"), ("gemma3", "qwen2"), ("lfm2", "noisy")]


@pytest.mark.parametrize("arch,draft_kind", CASES)
def test_greedy_streams_are_the_same_with_a_draft_from_many_threads(arch, draft_kind):
    hf = tiny_model(arch, seed=1)
    if draft_kind == "same":
        draft = hf
    elif draft_kind == "noisy":
        draft = noisy_copy(hf, 0.3)
    else:
        draft = small_model(draft_kind, seed=2)
    prompts = repeating_prompts(12, seed=2)
    lengths = [random.Random(i).randint(20, 60) for i in range(len(prompts))]
    with Engine.from_pretrained(hf, draft_max_streams=64, draft=draft, block_size=4, speculative_tokens=5) as engine:
        results = run_threaded(engine, prompts, [GenerationConfig(max_new_tokens=n) for n in lengths])
        stats = engine.stats()
    for i, prompt in enumerate(prompts):
        assert results[i][0] == reference(hf, prompt, lengths[i]), f"request {i} diverged"
    handles = [h for _, h in results.values()]
    assert stats["speculative_proposed_tokens"] == sum(h.proposed_tokens for h in handles) > 0
    assert stats["speculative_accepted_tokens"] == sum(h.accepted_tokens for h in handles)
    assert stats["tokens_generated"] == sum(len(tokens) for tokens, _ in results.values())
    assert stats["draft_forwards"] > 0 and stats["draft_seconds"] > 0
    assert_all_blocks_back(stats)
    if draft_kind == "same":  # in float64 the draft's argmax is the target's: nothing is ever rejected
        kept = [h for tokens, h in results.values() if EOS not in tokens]  # a kept EOS ends its proposals
        assert all(h.accepted_tokens == h.proposed_tokens for h in kept) and sum(h.proposed_tokens for h in kept)
    if draft_kind == "noisy":
        assert 0 < stats["speculative_accepted_tokens"] < stats["speculative_proposed_tokens"]


def test_a_draft_of_another_vocabulary_is_refused(llama):
    config = CONFIGS["llama"]()
    config.vocab_size = 300
    other = transformers.LlamaForCausalLM(config).to(torch.float64).eval()
    with pytest.raises(ValueError, match="300 tokens and the target's 256"):
        Engine.from_pretrained(llama, draft=other)
    with pytest.raises(ValueError, match="draft_weights needs a draft"):
        Engine.from_pretrained(llama, draft_weights="int4")
    with pytest.raises(ValueError, match="draft_num_kv_blocks"):
        Engine.from_pretrained(llama, draft=llama, draft_num_kv_blocks=0)


def test_the_default_model_drafting_for_itself_in_its_own_weights_is_refused():
    """draft="default" in the target's own weights would propose exactly what the target computes:
    refused before anything loads, saying which weights to give instead."""
    for weights, draft_weights in ((None, None), ("stored", None), (None, "stored"), ("float32", "float32")):
        with pytest.raises(ValueError, match="target's own weights.*weights='float32', draft_weights='stored'"):
            Engine.from_pretrained(weights=weights, draft="default", draft_weights=draft_weights)


def test_a_draft_with_another_tokenizer_is_refused(llama):
    tokenizers = pytest.importorskip("tokenizers")

    def tokenizer(shift: int):
        # byte-level ids, shifted: the same vocabulary size, other ids for the same text
        vocab = {chr(i): (i + shift) % 256 for i in range(256)}
        model = tokenizers.models.WordLevel(vocab, unk_token=chr(0))
        backend = tokenizers.Tokenizer(model)
        backend.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), "isolated")
        return transformers.PreTrainedTokenizerFast(tokenizer_object=backend)
    target = models.load(llama)
    target.tokenizer = tokenizer(0)
    draft = models.load(llama)
    draft.tokenizer = tokenizer(0)
    Engine(target, torch.device("cpu"), EngineOptions(), draft).shutdown()  # the same ids: accepted
    draft.tokenizer = tokenizer(1)
    with pytest.raises(ValueError, match="the draft model's tokenizer encodes"):
        Engine(target, torch.device("cpu"), EngineOptions(), draft)


def test_stop_tokens_and_max_new_tokens_are_exact_with_a_draft(llama):
    prompts = repeating_prompts(3, seed=7)
    draft = noisy_copy(llama, 0.2)
    baseline = [reference(llama, p, 40) for p in prompts]
    cases, configs, expected = ending_cases(prompts, baseline, 40, stops=6)
    with Engine.from_pretrained(llama, draft_max_streams=64, draft=draft, block_size=4) as engine:
        results = run_threaded(engine, cases, configs)
        stats = engine.stats()
    assert_each_ends_where_it_says(results, configs, expected)
    assert stats["speculative_accepted_tokens"] > 0
    assert_all_blocks_back(stats)


@pytest.mark.parametrize("draft_blocks", [None, 6])
def test_preemption_and_a_full_draft_pool_keep_streams_exact(draft_blocks):
    """A tiny target pool preempts; a draft pool of 6 blocks holds few requests' draft caches, and
    the others do not speculate until it has room: nothing fails or waits for it."""
    hf = tiny_model("llama", seed=3)
    prompts = repeating_prompts(10, seed=11)
    lengths = [random.Random(i).randint(10, 40) for i in range(len(prompts))]
    with Engine.from_pretrained(hf, draft_max_streams=64, draft=noisy_copy(hf, 0.2), max_batch_size=5, max_batch_tokens=32, block_size=4,
                                num_kv_blocks=28, draft_num_kv_blocks=draft_blocks, speculative_tokens=4) as engine:
        with engine.paused():  # all launched before the first step: they compete for the pools
            handles = [engine.launch_response_tokens(p, {"max_new_tokens": n}) for p, n in zip(prompts, lengths)]
        results = [list(engine.stream_response_tokens(h, timeout=120)) for h in handles]
        stats = engine.stats()
    for i, prompt in enumerate(prompts):
        assert results[i] == reference(hf, prompt, lengths[i]), f"request {i} diverged"
    assert stats["preemptions"] > 0 and stats["speculative_accepted_tokens"] > 0
    assert stats["total_draft_kv_blocks"] == (draft_blocks or 28)
    assert_all_blocks_back(stats)
    assert stats["running"] == stats["waiting"] == stats["open_handles"] == 0


def test_abort_in_the_middle_of_drafting_frees_every_block(llama):
    prompt = repeating_prompts(1, seed=5)[0]
    with Engine.from_pretrained(llama, draft_max_streams=64, draft=llama, block_size=4, speculative_tokens=8) as engine:
        handle = engine.launch_response_tokens(prompt, {"max_new_tokens": 200})
        first = [engine.fetch_response_tokens(handle, timeout=60) for _ in range(30)]
        engine.abort_response(handle)
        list(engine.stream_response_tokens(handle, timeout=60))
        assert handle.finish_reason == "abort" and handle.proposed_tokens > 0
        wait_until(lambda: engine.stats()["running"] == 0)
        assert_all_blocks_back(engine.stats())
        again = engine.launch_response_tokens(prompt, {"max_new_tokens": 30})  # the engine goes on
        assert list(engine.stream_response_tokens(again, timeout=60)) == first


def test_who_drafts(llama):
    prompt = repeating_prompts(1, seed=5)[0]
    with Engine.from_pretrained(llama, draft=llama) as engine:  # speculative_tokens 0: off by default
        def proposed(config):
            handle = engine.launch_response_tokens(prompt, config)
            list(engine.stream_response_tokens(handle))
            return handle.proposed_tokens
        assert proposed({"max_new_tokens": 30}) == 0 and engine.stats()["draft_forwards"] == 0
        assert proposed({"max_new_tokens": 30, "speculative_tokens": 3}) > 0
        assert proposed({"max_new_tokens": 30, "speculative_tokens": 3, "temperature": 0.7}) > 0  # p/q
        assert proposed({"max_new_tokens": 30, "speculative_tokens": 3, "temperature": 0.7, "seed": 1}) == 0
        assert proposed({"max_new_tokens": 30, "speculative_tokens": 3, "frequency_penalty": 0.5}) > 0


def test_a_batch_wider_than_draft_max_streams_does_not_draft(llama):
    """Four requests decoding together (launched while paused) run no draft forward at the default
    draft_max_streams (2), not even to catch up on their prompts; alone, a request drafts."""
    prompts = repeating_prompts(4, seed=7)
    with Engine.from_pretrained(llama, draft=llama, speculative_tokens=3) as engine:
        with engine.paused():
            handles = [engine.launch_response_tokens(p, {"max_new_tokens": 8, "ignore_eos": True}) for p in prompts]
        for handle in handles:
            list(engine.stream_response_tokens(handle))
        assert engine.stats()["draft_forwards"] == 0 and sum(h.proposed_tokens for h in handles) == 0
        alone = engine.launch_response_tokens(prompts[0], {"max_new_tokens": 8, "ignore_eos": True})
        list(engine.stream_response_tokens(alone))
        assert engine.stats()["draft_forwards"] > 0 and alone.proposed_tokens > 0
        assert_all_blocks_back(engine.stats())


def test_penalised_and_biased_greedy_streams_are_the_same_with_a_draft():
    hf = tiny_model("llama", seed=1)
    with torch.no_grad():
        hf.lm_head.weight.mul_(12)  # peaked enough that some proposals survive the penalties
    prompts = repeating_prompts(6, seed=17)
    config = GenerationConfig(max_new_tokens=30, repetition_penalty=1.2, frequency_penalty=0.5,
                              logit_bias={40: 1.5}, speculative_tokens=5)
    outputs = []
    for draft in (None, noisy_copy(hf, 0.2)):
        with Engine.from_pretrained(hf, draft_max_streams=64, draft=draft) as engine:
            results = run_threaded(engine, prompts, [config] * len(prompts))
            outputs.append([results[i][0] for i in range(len(prompts))])
            accepted = engine.stats()["speculative_accepted_tokens"]
    assert outputs[1] == outputs[0] and accepted > 0


@pytest.mark.parametrize("filters", [{"top_k": 3}, {"min_p": 0.3}])
def test_sampled_streams_keep_the_models_distribution_with_a_draft(filters):
    """p/q rejection sampling: the draft draws each proposal from its own q, the target keeps it with
    min(1, p/q) or draws from max(0, p - q); over thousands of requests each continuation comes as
    often as the target gives it (a chi-square test against the exact distribution)."""
    hf = tiny_model("llama", seed=1)
    with torch.no_grad():
        hf.lm_head.weight.mul_(12)  # a few likely tokens at each step: few continuations, each often drawn
    draft = noisy_copy(hf, 0.15, seed=4)  # its q far enough from p that proposals are often replaced
    prompt = [5, 6, 7, 8, 9, 10]
    depth = 4
    expected = exact_joint(hf, prompt, depth, **filters)
    runs = 3000
    with Engine.from_pretrained(hf, draft_max_streams=64, draft=draft, speculative_tokens=3, speculation_max_rows=128, seed=3) as engine:
        config = GenerationConfig(max_new_tokens=depth, temperature=1.0, **filters)
        handles = [engine.launch_response_tokens(prompt, config) for _ in range(runs)]
        drawn = [tuple(engine.stream_response_tokens(h)) for h in handles]
        stats = engine.stats()
    assert stats["speculative_accepted_tokens"] > 1000  # both rules ran: proposals kept ...
    assert stats["speculative_proposed_tokens"] - stats["speculative_accepted_tokens"] > 1000  # ... and replaced
    assert_drawn_as(expected, drawn)


def test_the_default_models_blocks_draft_for_its_float32_self_within_a_grammar():
    """The embedded model's Q4_1 blocks (weights "stored") drafting for it in float32 (plain text:
    tests/serve/test_cli.py): a JSON-schema answer is the same tokens with and without the draft,
    proposals kept; a sampled one drafts greedily within its schema and stays in it."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    prompt = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
    with Engine.from_pretrained(weights="float32", draft="default", draft_weights="stored", max_batch_size=4) as engine:
        plain = engine.complete(prompt, GenerationConfig(max_new_tokens=30, json_schema=schema))
        drafted = engine.complete(prompt, GenerationConfig(max_new_tokens=30, speculative_tokens=4, json_schema=schema))
        assert drafted.token_ids == plain.token_ids and drafted.finish_reason == plain.finish_reason == "stop"
        assert plain.proposed_tokens == 0 and drafted.accepted_tokens > 0
        sampled = engine.complete(prompt, GenerationConfig(max_new_tokens=30, temperature=0.8, speculative_tokens=4,
                                                           json_schema=schema))
        assert sampled.proposed_tokens > 0
        if sampled.finish_reason == "stop":
            assert set(sampled.parsed) == {"name", "age"}
        assert_all_blocks_back(engine.stats())
