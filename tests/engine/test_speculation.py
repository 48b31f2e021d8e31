"""Speculative decoding by prompt lookup (GenerationConfig.speculative_tokens): a greedy stream
is the same token for token with and without it, whatever runs beside it, and every way a request
ends (stop tokens, max_new_tokens, abort, preemption) stays exact; the blocks that held rejected
proposals go back to the pool."""

import random
import threading

import pytest
import torch

from models.kernels import native
from runtime import Engine, GenerationConfig

from ..conftest import EOS, reference, tiny_model, wait_until

# Llama (the native decoder layers), GPT-2 (learned positions), Qwen2 (tied embeddings), Phi-3 (longrope,
# recomputed past 64 tokens; sliding window), Gemma 3 (its own layers, local and global attention).
FAMILIES = ["llama", "gpt2", "qwen2", "phi3", "gemma3"]


def repeating_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase, as a document quoted in an answer does: an earlier
    occurrence of the last tokens then exists, and its continuation is proposed."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(4, 256) for _ in range(rng.randint(3, 10))]
        prompts.append([rng.randrange(4, 256) for _ in range(rng.randint(0, 5))] + phrase * rng.randint(2, 5))
    return prompts


def run_threaded(engine, prompts, configs, threads=6):
    """Each prompt launched and fetched from one of ``threads`` threads; {index: (tokens, handle)}."""
    results = {}

    def work(indices):
        for i in indices:
            handle = engine.launch_response_tokens(prompts[i], configs[i])
            results[i] = (list(engine.stream_response_tokens(handle, timeout=120)), handle)

    pool = [threading.Thread(target=work, args=(range(t, len(prompts), threads),)) for t in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in pool), "a worker thread hung"
    return results


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    return tiny_model(request.param, seed=1)


@pytest.mark.parametrize("decode_path", ["kernel", "torch"])
def test_greedy_streams_are_the_same_with_and_without_speculation_from_many_threads(family_model, decode_path,
                                                                                      monkeypatch):
    if decode_path == "torch":  # as where no C++ compiler is found
        monkeypatch.setattr(native, "_library", None)
    elif native.library() is None:
        pytest.skip("no C++ compiler: the kernels are not built")
    prompts = repeating_prompts(12, seed=2)
    lengths = [random.Random(i).randint(20, 60) for i in range(len(prompts))]
    with Engine.from_pretrained(family_model, block_size=4, speculative_tokens=5) as engine:
        results = run_threaded(engine, prompts, [GenerationConfig(max_new_tokens=n) for n in lengths])
        stats = engine.stats()
    for i, prompt in enumerate(prompts):
        assert results[i][0] == reference(family_model, prompt, lengths[i]), f"request {i} diverged"
    assert stats["speculative_accepted_tokens"] > 0, "no proposal was accepted: the test proves nothing"
    assert stats["speculative_proposed_tokens"] == sum(h.proposed_tokens for _, h in results.values())
    assert stats["speculative_accepted_tokens"] == sum(h.accepted_tokens for _, h in results.values())
    assert stats["tokens_generated"] == sum(lengths) and stats["requests_finished"] == len(prompts)
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]  # rejected proposals' blocks came back


def test_speculation_saves_steps_on_text_that_repeats(llama):
    # A model that has fallen into a cycle repeats it: every proposal after the first lap stands.
    prompt = repeating_prompts(1, seed=5)[0]
    with Engine.from_pretrained(llama) as plain:
        expected = list(plain.stream_response_tokens(plain.launch_response_tokens(prompt, {"max_new_tokens": 120})))
        plain_steps = plain.stats()["steps"]
    with Engine.from_pretrained(llama) as engine:
        handle = engine.launch_response_tokens(prompt, GenerationConfig(max_new_tokens=120, speculative_tokens=8))
        assert list(engine.stream_response_tokens(handle)) == expected
        steps = engine.stats()["steps"]
    assert handle.accepted_tokens > 0
    assert steps == plain_steps - handle.accepted_tokens  # each accepted token is a step saved


def ending_cases(prompts, baseline, longest: int, stops: int | None = None):
    """(prompts, configs, expected tokens) that end where they say: each prompt cut at several
    max_new_tokens up to ``longest``, and stopped at each of (the first ``stops`` of) the distinct
    tokens 5-25 of its greedy ``baseline`` (a stop token proposals run past), 6 tokens proposed."""
    cases, configs, expected = [], [], []
    for p, full in zip(prompts, baseline):
        for n in (1, 2, 3, 7, 13, 29, longest):  # every length ends where it says
            cases.append(p)
            configs.append(GenerationConfig(max_new_tokens=n, speculative_tokens=6))
            expected.append(full[:n])
        for stop in list(dict.fromkeys(full[5:25]))[:stops]:  # a stop token, where proposals run past it
            cases.append(p)
            configs.append(GenerationConfig(max_new_tokens=longest, stop_token_ids=[stop], speculative_tokens=6))
            expected.append(full[:full.index(stop) + 1])
    return cases, configs, expected


def assert_each_ends_where_it_says(results, configs, expected) -> None:
    """Each case's tokens are the expected ones, its finish reason says why, and nothing was
    recorded past a stop."""
    for i, want in enumerate(expected):
        tokens, handle = results[i]
        assert tokens == want, f"case {i} ({configs[i]}) diverged"
        stopped = len(want) < configs[i].max_new_tokens or want[-1] in configs[i].stop_token_ids
        assert handle.finish_reason == ("stop" if stopped else "length")
        assert handle.num_generated == len(want)  # nothing recorded past the stop


def test_stop_tokens_and_max_new_tokens_are_exact(llama):
    prompts = repeating_prompts(4, seed=7)
    with Engine.from_pretrained(llama, block_size=4) as engine:
        baseline = [list(engine.stream_response_tokens(engine.launch_response_tokens(p, {"max_new_tokens": 60})))
                    for p in prompts]
    cases, configs, expected = ending_cases(prompts, baseline, 60)
    with Engine.from_pretrained(llama, block_size=4) as engine:
        results = run_threaded(engine, cases, configs)
        stats = engine.stats()
    assert_each_ends_where_it_says(results, configs, expected)
    assert stats["speculative_accepted_tokens"] > 0
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_preemption_under_a_tiny_pool_keeps_speculative_streams_exact(arch):
    hf = tiny_model(arch, seed=3)
    prompts = repeating_prompts(10, seed=11)
    lengths = [random.Random(i).randint(10, 40) for i in range(len(prompts))]
    # 20 blocks of 4 tokens: far less than 10 requests need at once.
    with Engine.from_pretrained(hf, max_batch_size=5, max_batch_tokens=32, block_size=4, num_kv_blocks=28,
                                speculative_tokens=4) as engine:
        with engine.paused():  # all launched before the first step: they compete for the pool
            handles = [engine.launch_response_tokens(p, {"max_new_tokens": n}) for p, n in zip(prompts, lengths)]
        results = [list(engine.stream_response_tokens(h, timeout=120)) for h in handles]
        stats = engine.stats()
    for i, prompt in enumerate(prompts):
        assert results[i] == reference(hf, prompt, lengths[i]), f"request {i} diverged"
    assert stats["preemptions"] > 0
    assert stats["speculative_proposed_tokens"] > 0
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]
    assert stats["running"] == stats["waiting"] == stats["open_handles"] == 0


def test_abort_in_the_middle_of_speculation_frees_every_block(llama):
    prompt = repeating_prompts(1, seed=5)[0]
    with Engine.from_pretrained(llama, block_size=4, speculative_tokens=8) as engine:
        start = engine.stats()["free_kv_blocks"]
        handle = engine.launch_response_tokens(prompt, {"max_new_tokens": 200})
        first = [engine.fetch_response_tokens(handle, timeout=60) for _ in range(30)]
        engine.abort_response(handle)
        rest = list(engine.stream_response_tokens(handle, timeout=60))
        assert handle.finish_reason == "abort" and handle.proposed_tokens > 0
        wait_until(lambda: engine.stats()["running"] == 0)
        assert engine.stats()["free_kv_blocks"] == start
        # the engine goes on: the same prompt again gives the same tokens
        again = engine.launch_response_tokens(prompt, {"max_new_tokens": 30})
        assert list(engine.stream_response_tokens(again, timeout=60)) == first
    assert len(first) + len(rest) <= 200


def test_who_speculates(llama):
    prompt = repeating_prompts(1, seed=5)[0]
    with Engine.from_pretrained(llama, speculative_tokens=4) as engine:
        def proposed(config):
            handle = engine.launch_response_tokens(prompt, config)
            list(engine.stream_response_tokens(handle))
            return handle.proposed_tokens
        assert proposed({"max_new_tokens": 40}) > 0  # the engine's default
        assert proposed({"max_new_tokens": 40, "speculative_tokens": 0}) == 0  # off for this request
        assert proposed({"max_new_tokens": 40, "temperature": 0.3}) > 0  # sampled: rejection sampling
        assert proposed({"max_new_tokens": 40, "temperature": 0.8, "seed": 1}) == 0  # its draws stay its own
        assert proposed({"max_new_tokens": 40, "repetition_penalty": 1.05}) > 0  # penalties count the proposals
        assert proposed({"max_new_tokens": 40, "logit_bias": {7: 2.0}}) > 0  # the same at every position
    with Engine.from_pretrained(llama) as engine:  # off by default
        handle = engine.launch_response_tokens(prompt, {"max_new_tokens": 40})
        list(engine.stream_response_tokens(handle))
        assert handle.proposed_tokens == 0
        handle = engine.launch_response_tokens(prompt, {"max_new_tokens": 40, "speculative_tokens": 3})
        list(engine.stream_response_tokens(handle))
        assert handle.proposed_tokens > 0


def test_logprobs_and_logit_bias_are_the_same_with_speculation(llama):
    prompt = repeating_prompts(1, seed=5)[0]
    results = []
    for k in (0, 6):
        with Engine.from_pretrained(llama) as engine:
            config = GenerationConfig(max_new_tokens=50, logprobs=3, logit_bias={40: 1.5}, speculative_tokens=k)
            handle = engine.launch_response_tokens(prompt, config)
            results.append((list(engine.stream_response_tokens(handle)), handle.logprobs, handle.accepted_tokens))
    (tokens, logprobs, _), (spec_tokens, spec_logprobs, accepted) = results
    assert spec_tokens == tokens and accepted > 0
    for plain, spec in zip(logprobs, spec_logprobs, strict=True):
        assert plain.token == spec.token and plain.logprob == pytest.approx(spec.logprob, abs=1e-9)
        assert [t for t, _ in plain.top] == [t for t, _ in spec.top]


def filtered(logits: torch.Tensor, top_k: int = 0, min_p: float = 0.0) -> torch.Tensor:
    """The probabilities a request with temperature 1 and these filters draws from (sampler.py's rules)."""
    probs = logits.softmax(-1)
    if top_k:
        probs = torch.where(probs >= probs.topk(top_k).values[-1], probs, 0.0)
    if min_p:
        probs = torch.where(probs >= min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


def exact_joint(hf, prompt: list[int], depth: int, **filters) -> dict[tuple, float]:
    """Every continuation of ``depth`` tokens the request could draw, with its probability."""
    with torch.no_grad():
        probs = filtered(hf(torch.tensor([prompt])).logits[0, -1], **filters)
    out = {}
    for token in probs.nonzero()[:, 0].tolist():
        p = probs[token].item()
        if depth == 1 or token == EOS:  # EOS ends the stream
            out[(token,)] = p
        else:
            for rest, q in exact_joint(hf, prompt + [token], depth - 1, **filters).items():
                out[(token,) + rest] = p * q
    return out


@pytest.mark.parametrize("filters,depth", [({"top_k": 3}, 4), ({"min_p": 0.3}, 4)])
def test_sampled_streams_keep_the_models_distribution(filters, depth):
    """Rejection sampling: over thousands of requests, each continuation comes as often as the model
    gives it, proposals kept and proposals replaced alike (a chi-square test against the exact
    distribution, enumerated with transformers). top_k draws in sorted order, min_p in the vocabulary's."""
    hf = tiny_model("llama", seed=1)
    with torch.no_grad():
        hf.lm_head.weight.mul_(12)  # a peaked model: proposals are kept often, and few continuations are likely
    base = [5, 6, 7, 8]
    echo = reference(hf, base, 40)
    prompt = base + echo + base + echo[:10]  # the continuation it would draw greedily, seen before
    expected = exact_joint(hf, prompt, depth, **filters)
    runs = 4000
    with Engine.from_pretrained(hf, speculative_tokens=4, speculation_max_rows=128, seed=3) as engine:
        config = GenerationConfig(max_new_tokens=depth, temperature=1.0, **filters)
        handles = [engine.launch_response_tokens(prompt, config) for _ in range(runs)]
        drawn = [tuple(engine.stream_response_tokens(h)) for h in handles]
        stats = engine.stats()
    assert stats["speculative_accepted_tokens"] > 100  # both rules ran: proposals kept ...
    assert stats["speculative_proposed_tokens"] - stats["speculative_accepted_tokens"] > 100  # ... and replaced
    assert_drawn_as(expected, drawn)


def assert_drawn_as(expected: dict, drawn: list) -> None:
    """The continuations ``drawn`` are distributed as ``expected`` gives (continuation -> probability):
    nothing it rules out, and a chi-square test where each continuation expected at least 5 times is a
    cell and the rare ones join the least likely of those."""
    from scipy.stats import chisquare
    runs = len(drawn)
    assert set(drawn) <= set(expected)  # nothing the filters rule out
    counts = {outcome: 0 for outcome in expected}
    for outcome in drawn:
        counts[outcome] += 1
    common = sorted((o for o in expected if expected[o] * runs >= 5), key=expected.get, reverse=True)
    observed = [counts[o] for o in common]
    wanted = [expected[o] * runs for o in common]
    observed[-1] += runs - sum(observed)
    wanted[-1] += runs - sum(wanted)
    assert chisquare(observed, wanted).pvalue > 1e-3


def test_a_steps_decode_rows_stay_within_speculation_max_rows(llama):
    prompts = repeating_prompts(6, seed=13)
    with Engine.from_pretrained(llama, speculative_tokens=4, speculation_max_rows=6) as engine:
        with engine.paused():
            handles = [engine.launch_response_tokens(p, {"max_new_tokens": 6}) for p in prompts]
        for h in handles:
            list(engine.stream_response_tokens(h))
        assert engine.stats()["speculative_proposed_tokens"] == 0  # all six decode together, every step

        rows = []
        model = engine.model

        def counting(step, kv_cache):
            if not step.prefills:
                rows.append(len(step.input_ids))
            return model(step, kv_cache)
        engine.model = counting
        with engine.paused():
            handles = [engine.launch_response_tokens(p, {"max_new_tokens": 40}) for p in prompts[:3]]
        for h in handles:
            list(engine.stream_response_tokens(h))
        assert sum(h.proposed_tokens for h in handles) > 0 and max(rows) <= 6


@pytest.mark.parametrize("field,value,error", [
    ("speculative_tokens", -1, ValueError), ("speculative_tokens", 17, ValueError),
    ("speculative_tokens", 2.0, TypeError), ("speculative_tokens", True, TypeError)])
def test_bad_speculation_settings_are_refused(field, value, error):
    with pytest.raises(error, match=field):
        GenerationConfig(**{field: value})
    with pytest.raises(error, match=field):
        Engine.from_pretrained(torch.nn.Module(), **{field: value})  # refused before anything loads
    with pytest.raises(ValueError, match="speculation_max_rows"):
        Engine.from_pretrained(torch.nn.Module(), speculation_max_rows=0)


def test_the_default_model_repeats_a_text_the_same_with_speculation(smollm):
    text = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single "
            "step. All that glitters is not gold.")
    prompt = [{"role": "user", "content": f"Repeat this text exactly: {text}"}]
    plain = smollm.complete(prompt, GenerationConfig(max_new_tokens=40))
    speculative = smollm.complete(prompt, GenerationConfig(max_new_tokens=40, speculative_tokens=6))
    assert speculative.token_ids == plain.token_ids and speculative.text == plain.text
    assert plain.proposed_tokens == 0 and speculative.accepted_tokens > 0
    assert speculative.proposed_tokens >= speculative.accepted_tokens


def test_fuzzed_configs_run_with_speculation_and_greedy_ones_give_the_same_tokens(llama):
    """test_fuzz's configs, on prompts that repeat, launched together with speculation on by
    default: each that constructs runs to the end of its stream, and a greedy one gives the
    tokens it gives without speculation."""
    import warnings

    from runtime.config import GenerationConfig as Config

    from .test_fuzz import random_config
    rng = random.Random(29)
    prompts = repeating_prompts(120, seed=31)
    cases = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for prompt in prompts:
            fields = random_config(rng)
            fields.pop("choice", None)  # structured output needs a tokenizer
            try:
                cases.append((prompt, Config(**fields)))
            except (TypeError, ValueError):
                continue
        outputs = []
        for k in (0, 4):
            with Engine.from_pretrained(llama, max_batch_size=16, speculative_tokens=k) as engine:
                handles = []
                for prompt, config in cases:
                    try:
                        handles.append(engine.launch_response_tokens(prompt, config))
                    except ValueError:
                        handles.append(None)
                outputs.append([None if h is None else (list(engine.stream_response_tokens(h, timeout=60)), h)
                                for h in handles])
                stats = engine.stats()
            assert stats["step_failures"] == 0 and stats["free_kv_blocks"] == stats["total_kv_blocks"]
    assert stats["speculative_accepted_tokens"] > 0
    compared = 0
    for (prompt, config), plain, fast in zip(cases, *outputs):
        if plain is None:
            assert fast is None
            continue
        assert fast[1].finish_reason in ("stop", "length")
        if not config.sampled:
            assert fast[0] == plain[0], config
            compared += 1
    assert compared >= 30


@pytest.mark.parametrize("constraint", [
    {"json_schema": {"type": "array", "minItems": 4, "maxItems": 4, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"], "additionalProperties": False}}},
    {"regex": r"(Step [0-9]: [a-z ]{3,30}\.\n){4}"},
    {"grammar": 'start: line line line\nline: "The answer is " /[a-z]{2,12}/ ".\\n"'}])
def test_structured_output_speculates_within_its_grammar_and_gives_the_same_tokens(smollm, constraint):
    """Proposals are cut where the grammar refuses them, each row is masked by the grammar's state
    after the proposals before it, and the grammar takes only the tokens kept."""
    prompt = [{"role": "user", "content": "List four people with their name and age, or four steps to make tea."}]
    plain = smollm.complete(prompt, GenerationConfig(max_new_tokens=120, **constraint))
    fast = smollm.complete(prompt, GenerationConfig(max_new_tokens=120, speculative_tokens=4, **constraint))
    assert fast.token_ids == plain.token_ids and fast.text == plain.text and fast.finish_reason == plain.finish_reason
    assert fast.accepted_tokens > 0
    sampled = [smollm.complete(prompt, GenerationConfig(max_new_tokens=120, temperature=0.8, speculative_tokens=4,
                                                        **constraint)) for _ in range(3)]
    if "json_schema" in constraint:
        assert all(len(c.parsed) == 4 for c in sampled)  # sampled and speculating, still in the schema
    assert all(c.finish_reason == "stop" for c in sampled + [fast])


@pytest.mark.parametrize("penalty", [{"repetition_penalty": 1.2}, {"frequency_penalty": 0.5}, {"presence_penalty": 1.0},
                                     {"frequency_penalty": 0.5, "repetition_penalty": 0.8}])
def test_penalties_count_the_proposals_before_each_row(penalty):
    """A penalty at a proposed position counts the proposals before it, as it will count them once
    delivered: greedy penalised streams are the same with and without speculation."""
    hf = tiny_model("llama", seed=1)
    with torch.no_grad():
        hf.lm_head.weight.mul_(12)  # peaked enough that some proposals survive the penalties
    prompts = repeating_prompts(8, seed=17)
    outputs = []
    for k in (0, 6):
        with Engine.from_pretrained(hf, speculative_tokens=k) as engine:
            results = run_threaded(engine, prompts, [GenerationConfig(max_new_tokens=40, **penalty)] * len(prompts))
            outputs.append([results[i][0] for i in range(len(prompts))])
            accepted = engine.stats()["speculative_accepted_tokens"]
    assert outputs[1] == outputs[0]
    assert accepted > 0
