"""Logprobs, OpenAI's penalties, logit_bias, min_p and n choices, each checked against a plain
transformers computation of the same request."""

import dataclasses
import math

import pytest
import torch

from runtime import Engine, GenerationConfig

from ..conftest import VOCAB, reference


def manual_greedy(hf, prompt, steps, adjust):
    """Greedy decoding with transformers' full forward and ``adjust(logits, generated)`` applied
    to each step's logits: the reference for penalties and bias."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = hf(torch.tensor([tokens])).logits[0, -1].clone()
            tokens.append(int(adjust(logits, tokens[len(prompt):]).argmax()))
    return tokens[len(prompt):]


def test_logprobs_are_the_models_log_softmax_with_its_top_alternatives(llama):
    prompt = [5, 6, 7, 8, 9]
    greedy = reference(llama, prompt, 10, eos_token_id=None)
    with torch.no_grad():  # each generated position's distribution (transformers' rotary is float32: 1e-8 apart)
        expected = llama(torch.tensor([prompt + greedy])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
    with Engine.from_pretrained(llama) as engine:
        handle = engine.launch_response_tokens(prompt, GenerationConfig(max_new_tokens=10, ignore_eos=True, logprobs=3))
        tokens = list(engine.stream_response_tokens(handle, timeout=30))
        plain = engine.launch_response_tokens(prompt, GenerationConfig(max_new_tokens=2))
        list(engine.stream_response_tokens(plain, timeout=30))
    assert tokens == greedy
    assert [e.token for e in handle.logprobs] == tokens and plain.logprobs == []
    for entry, row in zip(handle.logprobs, expected):
        assert math.isclose(entry.logprob, row[entry.token].item(), abs_tol=1e-6)
        values, ids = row.topk(3)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert all(math.isclose(v, w, abs_tol=1e-6) for (_, v), w in zip(entry.top, values.tolist()))
        assert entry.top[0][0] == entry.token  # greedy takes the most likely


def test_presence_and_frequency_penalties_follow_openai(llama):
    prompt = [5, 6, 7]

    def penalise(logits, generated):
        for token in set(generated):
            logits[token] -= 0.8 * generated.count(token) + 1.5
        return logits

    config = GenerationConfig(max_new_tokens=16, ignore_eos=True, frequency_penalty=0.8, presence_penalty=1.5)
    with Engine.from_pretrained(llama) as engine:
        handle = engine.launch_response_tokens(prompt, config)
        mate = engine.launch_response_tokens([9, 10], GenerationConfig(max_new_tokens=16, ignore_eos=True))
        tokens = list(engine.stream_response_tokens(handle, timeout=30))
        mate_tokens = list(engine.stream_response_tokens(mate, timeout=30))
    assert tokens == manual_greedy(llama, prompt, 16, penalise)
    assert tokens != reference(llama, prompt, 16, eos_token_id=None)  # the penalty changed something
    assert mate_tokens == reference(llama, [9, 10], 16, eos_token_id=None)


def test_logit_bias_is_added_to_the_logits(llama):
    bias = {17: 100.0, 40: -100.0}
    with Engine.from_pretrained(llama) as engine:
        handle = engine.launch_response_tokens([5, 6], GenerationConfig(max_new_tokens=4, ignore_eos=True, logit_bias=bias))
        assert list(engine.stream_response_tokens(handle, timeout=30)) == [17] * 4
        handle = engine.launch_response_tokens([5, 6], GenerationConfig(max_new_tokens=6, ignore_eos=True,
                                                                         logit_bias={40: -3.0}))
        tokens = list(engine.stream_response_tokens(handle, timeout=30))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.launch_response_tokens([5], GenerationConfig(logit_bias={VOCAB: 1.0}))

    def shift(logits, _):
        logits[40] -= 3.0
        return logits

    assert tokens == manual_greedy(llama, [5, 6], 6, shift)


def test_logit_bias_takes_token_ids_not_strings():
    """JSON's string keys ("40") are the server's to convert; in-process a key is a token id."""
    with pytest.raises(TypeError, match=r"logit_bias keys must be token ids \(ints\), got the str '40'"):
        GenerationConfig(logit_bias={"40": -3.0})
    assert GenerationConfig(logit_bias={40: -3}).logit_bias == {40: -3.0}


@pytest.mark.parametrize("fields", [{"logit_bias": {1: 101}}, {"logit_bias": {-1: 1}}, {"logit_bias": [1]},
                                    {"presence_penalty": 2.5}, {"frequency_penalty": float("nan")},
                                    {"min_p": 1.5}, {"logprobs": 21}, {"logprobs": -1}])
def test_bad_option_values_are_refused(fields):
    with pytest.raises((TypeError, ValueError)):
        GenerationConfig(**fields)


def test_min_p_of_one_keeps_only_the_most_likely_token(llama):
    prompt = [5, 6, 7]
    with Engine.from_pretrained(llama) as engine:
        handle = engine.launch_response_tokens(prompt, GenerationConfig(max_new_tokens=12, ignore_eos=True,
                                                                        temperature=1.5, min_p=1.0, seed=3))
        assert list(engine.stream_response_tokens(handle, timeout=30)) == reference(llama, prompt, 12, eos_token_id=None)


def test_seeded_sampling_does_not_depend_on_batch_mates_filters(llama):
    """A seeded request draws the same tokens alone and beside a top-p request (and vice versa)."""
    plain = GenerationConfig(max_new_tokens=12, ignore_eos=True, temperature=1.0, seed=4)
    nucleus = GenerationConfig(max_new_tokens=12, ignore_eos=True, temperature=1.0, top_p=0.9, seed=5)
    with Engine.from_pretrained(llama) as engine:
        alone = [list(engine.stream_response_tokens(engine.launch_response_tokens([5, 6, 7], c), timeout=30))
                 for c in (plain, nucleus)]
        handles = [engine.launch_response_tokens([5, 6, 7], c) for c in (plain, nucleus)]
        together = [list(engine.stream_response_tokens(h, timeout=30)) for h in handles]
    assert together == alone


def test_n_choices_share_the_prompts_blocks(llama):
    prompt = list(range(10, 50))  # 40 tokens: two full blocks of 16 to share
    with Engine.from_pretrained(llama) as engine:
        greedy = engine.launch_choices(prompt, GenerationConfig(max_new_tokens=8, ignore_eos=True), n=4)
        outputs = [list(engine.stream_response_tokens(h, timeout=30)) for h in greedy]
        assert [h.cached_tokens for h in greedy] == [0, 32, 32, 32]
        config = GenerationConfig(max_new_tokens=12, ignore_eos=True, temperature=1.0, seed=9)
        sampled = [[list(engine.stream_response_tokens(h, timeout=30)) for h in engine.launch_choices(prompt, config, 3)]
                   for _ in range(2)]
        with pytest.raises(ValueError, match="n must be >= 1"):
            engine.launch_choices(prompt, config, 0)
    assert outputs == [reference(llama, prompt, 8, eos_token_id=None)] * 4
    assert sampled[0] == sampled[1] and len({tuple(s) for s in sampled[0]}) == 3


def test_each_choice_samples_with_its_own_checked_copy_of_the_config(llama):
    """Choice i of a seeded request samples with seed + i (wrapped into the seed's range) from a
    copy built as any config is: immutable, the other fields the same. A greedy request's choices
    draw nothing and share the one config."""
    config = GenerationConfig(max_new_tokens=4, ignore_eos=True, temperature=1.0, seed=2**64 - 1, logit_bias={7: 1.0})
    with Engine.from_pretrained(llama) as engine:
        handles = engine.launch_choices([5, 6, 7], config, 3)
        configs = [h.context.config for h in handles]
        greedy = engine.launch_choices([5, 6, 7], GenerationConfig(max_new_tokens=4, seed=3), 2)
        assert greedy[0].context.config is greedy[1].context.config
        for h in handles + greedy:
            list(engine.stream_response_tokens(h, timeout=30))
    assert configs[0] is config
    assert [c.seed for c in configs] == [2**64 - 1, 0, 1]
    assert all(dataclasses.replace(c, seed=None) == dataclasses.replace(config, seed=None) for c in configs)
    with pytest.raises(dataclasses.FrozenInstanceError):
        configs[1].seed = 5
