"""Fuzzing GenerationConfig: every value is either refused at construction or launch with a
clear TypeError/ValueError, or it runs to the end of its stream; and a greedy batch-mate of each
request finishes exactly as it would alone. The counts are recorded in docs/reliability.md."""

import random
import warnings

from runtime import Engine, GenerationConfig

from ..conftest import random_prompt, reference

NAN, INF = float("nan"), float("inf")
VALUES = {
    "max_new_tokens": [1, 3, 8, 0, -1, 10**30, 2.5, None, "3", True],
    "temperature": [None, 0, 0.0, 5e-324, 1e-300, 1e-39, 1e-37, 1e-5, 0.7, 1.0, 7.0, 1e300, NAN, INF, -INF, -1, "x",
                    True],
    "top_k": [0, 1, 5, 255, 256, 10**30, -1, 2.5, None],
    "top_p": [1.0, 0.5, 1e-300, 5e-324, 0.0, 1.5, NAN, None],
    "repetition_penalty": [1.0, 1e-300, 1e-30, 1e300, 0.5, 2.0, 0, -1, NAN, INF],
    "do_sample": [None, True, False, 1, "yes"],
    "seed": [None, 0, 7, 2**63, 2**64 - 1, 2**64, -1, 1.5],
    "stop_token_ids": [(), [5], [255], [256], [10**9], [-1], "x", [None], 5],
    "ignore_eos": [False, True, None],
    "priority": [0, 5, -5, 2**31, -(2**31) - 1],
    "stop": [(), ["a"], [""], "zz", 5],
    "presence_penalty": [0.0, 2.0, -2.0, 2.5, NAN],
    "frequency_penalty": [0.0, 1.0, -2.0, INF, "1"],
    "min_p": [0.0, 0.5, 1.0, 5e-324, -0.1, 1.5],
    "logit_bias": [None, {5: 100}, {"7": -100}, {255: 1e-300}, {256: 1}, {5: 101}, {-1: 1}, [5], {5: NAN}],
    "logprobs": [None, 0, 5, 20, 21, -1, 2.5],
    "choice": [None, ["a", "b"], [], "a"],
}
CASES = 300  # --stress: 3000


def random_config(rng: random.Random) -> dict:
    fields = rng.sample(sorted(VALUES), rng.randint(1, 3))
    return {name: rng.choice(VALUES[name]) for name in fields}


def test_fuzzed_configs_are_refused_or_run_and_never_harm_a_batch_mate(llama, request):
    count = 3000 if request.config.getoption("--stress") else CASES
    rng = random.Random(13)
    counts = {"refused at construction": 0, "refused at launch": 0, "ran": 0}
    with Engine.from_pretrained(llama, max_batch_size=16) as engine, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # do_sample=False beside a knob, and context-limit warnings
        cases = [random_config(rng) for _ in range(count)]
        for start in range(0, len(cases), 10):
            mate_prompt = random_prompt(rng, 3, 12)
            mate = engine.launch_response_tokens(mate_prompt, {"max_new_tokens": 12})
            launched = []
            for fields in cases[start:start + 10]:
                try:
                    config = GenerationConfig(**fields)
                except (TypeError, ValueError):
                    counts["refused at construction"] += 1
                    continue
                try:
                    launched.append((fields, engine.launch_response_tokens(random_prompt(rng, 1, 20), config)))
                except ValueError:
                    counts["refused at launch"] += 1
            for fields, handle in launched:
                try:
                    tokens = list(engine.stream_response_tokens(handle, timeout=60))
                except Exception as error:
                    raise AssertionError(f"{fields} failed") from error
                assert handle.finish_reason in ("stop", "length"), fields
                assert all(0 <= t < 256 for t in tokens), fields
                counts["ran"] += 1
            assert list(engine.stream_response_tokens(mate, timeout=60)) == reference(llama, mate_prompt, 12)
        stats = engine.stats()
    print(f"\n{len(cases)} fuzzed configs: {counts}")
    assert stats["step_failures"] == 0
    assert sum(counts.values()) == len(cases) and min(counts.values()) > 0


def test_a_temperature_too_small_to_sample_is_greedy(llama):
    prompt = [5, 6, 7, 8]
    with Engine.from_pretrained(llama) as engine:
        mate = engine.launch_response_tokens([9, 10], {"max_new_tokens": 10})
        tiny = [engine.launch_response_tokens(prompt, {"max_new_tokens": 10, "temperature": t, "do_sample": True})
                for t in (1e-300, 1e-39, 5e-324)]
        for handle in tiny:
            assert list(engine.stream_response_tokens(handle, timeout=60)) == reference(llama, prompt, 10)
        assert list(engine.stream_response_tokens(mate, timeout=60)) == reference(llama, [9, 10], 10)
