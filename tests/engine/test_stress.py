"""Threads hammer one engine: random prompts, lengths, sampling and priorities; aborts part-way;
tiny fetch timeouts with retries; handles never fetched; a pool small enough to preempt. Every
greedy stream that was not aborted must equal the request run alone, no thread may hang, and
nothing may be left behind or grow from round to round."""

import gc
import random
import threading
import time
import tracemalloc

import pytest

from runtime import Engine, GenerationConfig

from ..conftest import random_prompt, reference, tiny_model

BEHAVIOURS = ["greedy", "greedy", "sampled", "abort", "tiny_timeouts", "never_fetched"]


def client(engine, rng, count, greedy_results, problems):
    pending = []
    for _ in range(count):
        behaviour = rng.choice(BEHAVIOURS)
        prompt = random_prompt(rng, 1, 48)
        knobs = dict(temperature=rng.uniform(0.5, 1.5), top_k=rng.choice([0, 20]), top_p=rng.choice([1.0, 0.9]))
        config = GenerationConfig(max_new_tokens=rng.randint(1, 32), priority=rng.randint(0, 3),
                                  do_sample=behaviour == "sampled", seed=rng.choice([None, rng.randrange(1000)]),
                                  **(knobs if behaviour == "sampled" else {}))
        handle = engine.launch_response_tokens(prompt, config)
        if behaviour != "never_fetched":
            pending.append((behaviour, prompt, config, handle))
        if rng.random() < 0.5 and pending:  # fetch some while launching more
            run_one(engine, rng, *pending.pop(0), greedy_results, problems)
    for item in pending:
        run_one(engine, rng, *item, greedy_results, problems)


def run_one(engine, rng, behaviour, prompt, config, handle, greedy_results, problems):
    tokens = []
    if behaviour == "abort":
        for _ in range(rng.randint(0, 3)):
            token = engine.fetch_response_tokens(handle, timeout=60)
            if token == -1:
                return
        engine.abort_response(handle)
        if engine.fetch_response_tokens(handle, timeout=60) != -1:
            problems.append("a fetch after abort did not return -1")
        return
    while True:
        try:
            token = engine.fetch_response_tokens(handle, timeout=0.0005 if behaviour == "tiny_timeouts" else 60)
        except TimeoutError:
            continue
        if token == -1:
            break
        tokens.append(token)
    if not config.do_sample:
        greedy_results.append((prompt, config.max_new_tokens, tokens))


def stress_round(engine, seed, threads, per_thread):
    greedy_results, problems = [], []
    rngs = [random.Random(seed * 1000 + t) for t in range(threads)]
    workers = [threading.Thread(target=client, args=(engine, rngs[t], per_thread, greedy_results, problems))
               for t in range(threads)]
    for w in workers:
        w.start()
    deadline = time.monotonic() + 300
    for w in workers:
        w.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(w.is_alive() for w in workers), "a client thread hung past the global deadline"
    assert not problems, problems
    gc.collect()
    deadline = time.monotonic() + 30
    while engine.stats()["open_handles"] and time.monotonic() < deadline:
        time.sleep(0.01)  # never-fetched handles are released by the loop
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == stats["open_handles"] == 0, stats
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"], stats
    return greedy_results, stats


def run_stress(arch, threads, per_thread, rounds):
    hf = tiny_model(arch)
    memory = []
    tracemalloc.start()
    try:
        with Engine.from_pretrained(hf, max_batch_size=8, max_batch_tokens=48, block_size=4, num_kv_blocks=40,
                                    policy="priority") as engine:
            checked = 0
            for r in range(rounds):
                greedy_results, stats = stress_round(engine, r, threads, per_thread)
                gc.collect()
                memory.append(tracemalloc.get_traced_memory()[0])
                for prompt, new_tokens, tokens in greedy_results:
                    assert tokens == reference(hf, prompt, new_tokens), "a greedy stream diverged under load"
                checked += len(greedy_results)
            assert stats["preemptions"] > 0
    finally:
        tracemalloc.stop()
    # Python-side memory after a round must not keep growing with the rounds.
    assert memory[-1] - memory[1] < 512 * 1024, memory
    return checked, stats


def test_stress_small():
    checked, stats = run_stress("llama", threads=6, per_thread=6, rounds=3)
    assert checked > 0


@pytest.mark.stress
@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2", "mistral"])
def test_stress_large(arch):
    checked, stats = run_stress(arch, threads=32, per_thread=16, rounds=4)
    print(f"{arch}: {checked} greedy streams checked; {stats}")
