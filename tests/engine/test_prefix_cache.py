"""Prefix caching: shared prompt prefixes reuse KV blocks, and outputs never change because of it."""

import random
import threading

import pytest

from runtime import Engine, GenerationConfig

from ..conftest import random_prompt, reference


def generate_all(engine, prompts, new_tokens):
    results = [None] * len(prompts)

    def worker(i):
        handle = engine.launch_response_tokens(prompts[i], GenerationConfig(max_new_tokens=new_tokens))
        results[i] = list(engine.stream_response_tokens(handle, timeout=60))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


@pytest.mark.parametrize("num_kv_blocks", [200, 30], ids=["roomy", "preempting"])
def test_outputs_identical_with_caching_on_and_off(hf_model, num_kv_blocks):
    rng = random.Random(7)
    system = random_prompt(rng, 41, 41)
    prompts = [system + random_prompt(rng, 1, 12) for _ in range(16)]
    runs = {}
    for caching in (True, False):
        with Engine.from_pretrained(hf_model, enable_prefix_caching=caching, block_size=4, max_batch_size=6,
                                    num_kv_blocks=num_kv_blocks, max_batch_tokens=64) as engine:
            generate_all(engine, prompts[:2], 4)  # warm the cache with the shared prefix
            runs[caching] = generate_all(engine, prompts, 16)
            stats = engine.stats()
            keeps_state = engine.kv_manager.keeps_state  # (a recurrent model's past is its state: no cache)
        if caching and not keeps_state:
            assert stats["cached_prompt_tokens"] > 0 and stats["prefix_cache_hit_rate"] > 0
        else:
            assert stats["cached_prompt_tokens"] == 0
    assert runs[True] == runs[False]
    for prompt, out in zip(prompts[:4], runs[True]):
        assert out == reference(hf_model, prompt, 16)


def test_cached_token_count_per_request(llama):
    prefix = list(range(10, 50))  # 40 tokens: 10 full blocks of 4
    with Engine.from_pretrained(llama, block_size=4) as engine:
        first = engine.launch_response_tokens(prefix + [60, 61], {"max_new_tokens": 3})
        list(engine.stream_response_tokens(first))
        second = engine.launch_response_tokens(prefix + [70, 71, 72], {"max_new_tokens": 3})
        out = list(engine.stream_response_tokens(second))
        same = engine.launch_response_tokens(prefix, {"max_new_tokens": 3})
        list(engine.stream_response_tokens(same))
        stats = engine.stats()
    assert first.cached_tokens == 0
    assert second.cached_tokens == 40
    assert same.cached_tokens == 36  # the last prompt token is always computed: its logits are sampled
    assert out == reference(llama, prefix + [70, 71, 72], 3)
    assert second.finish_reason == "length"
    assert stats["cached_prompt_tokens"] == 76


def test_cached_blocks_are_evicted_only_when_free_blocks_run_out(llama):
    with Engine.from_pretrained(llama, block_size=4, num_kv_blocks=24) as engine:
        prefix = list(range(10, 42))  # 8 full blocks
        list(engine.stream_response_tokens(engine.launch_response_tokens(prefix + [5], {"max_new_tokens": 2})))
        assert engine.stats()["free_kv_blocks"] == 24  # unheld cached blocks still count as free
        small = engine.launch_response_tokens([99, 98, 97], {"max_new_tokens": 2})
        list(engine.stream_response_tokens(small))  # fits in truly free blocks: nothing evicted
        again = engine.launch_response_tokens(prefix + [6], {"max_new_tokens": 2})
        list(engine.stream_response_tokens(again))
        assert again.cached_tokens == 32
        big = engine.launch_response_tokens(list(range(100, 190)), {"max_new_tokens": 2})  # needs 23 blocks
        list(engine.stream_response_tokens(big))
        after = engine.launch_response_tokens(prefix + [7], {"max_new_tokens": 2})
        list(engine.stream_response_tokens(after))
        assert after.cached_tokens < 32
