"""Structured output: whatever the weights say, a constrained stream matches its JSON schema,
regex, choice or grammar; constrained requests mix with free ones under preemption and prefix
caching, and each greedy one equals the same request run alone."""

import json
import re
import threading

import jsonschema
import pydantic
import pytest
import torch
import transformers

from runtime import Engine, GenerationConfig

from ..conftest import reference

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "email"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 130},
                         "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}}
ORDER = {"type": "object", "additionalProperties": False, "required": ["id", "status", "items", "address"],
         "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99999},
                        "status": {"enum": ["open", "paid", "shipped"]},
                        "items": {"type": "array", "minItems": 1, "maxItems": 3,
                                  "items": {"type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                                            "properties": {"sku": {"type": "string", "maxLength": 6},
                                                           "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
                        "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                    "properties": {"city": {"type": "string", "maxLength": 10},
                                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
FLAGS = {"type": "object", "additionalProperties": False, "required": ["ok", "level", "note", "tags"],
         "properties": {"ok": {"type": "boolean"}, "level": {"enum": [1, 2, 3, None]},
                        "note": {"type": ["string", "null"], "maxLength": 8},
                        "tags": {"type": "array", "maxItems": 4, "items": {"enum": ["a", "b\"q", "c\\d"]}}}}
MEASURE = {"type": "object", "additionalProperties": False, "required": ["value", "unit"],
           "properties": {"value": {"type": "number", "minimum": -100, "maximum": 100},
                          "unit": {"enum": ["m", "s", "kg"]}}}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
LABELS = ["positive", "negative", "neutral"]
GRAMMAR = 'start: "(" expr ")"\nexpr: NUMBER (("+" | "*") NUMBER){0,3}\nNUMBER: /[0-9]{1,3}/'
GBNF = 'root ::= "(" num (("+" | "*") num){0,3} ")"\nnum ::= [0-9]{1,3}'  # the same language, llama.cpp's way


def constrained_cases():
    """(config fields, check of the text): greedy and seeded-sampled, each kind of constraint."""
    cases = []
    for i, schema in enumerate([PERSON, ORDER, FLAGS]):
        for extra in ({}, {"temperature": 1.0, "seed": i}, {"temperature": 0.7, "seed": 20 + i}):
            cases.append(({"json_schema": schema, **extra}, lambda t, s=schema: jsonschema.validate(json.loads(t), s)))
    # A free number may go on for ever under greedy decoding of random weights: sample it.
    for seed in range(3):
        cases.append(({"json_schema": MEASURE, "temperature": 1.0, "seed": 10 + seed},
                      lambda t: jsonschema.validate(json.loads(t), MEASURE)))
    for extra in ({}, {"temperature": 1.0, "seed": 5}, {"temperature": 1.0, "top_p": 0.9, "seed": 6}):
        cases.append(({"regex": DATE, **extra}, lambda t: re.fullmatch(DATE, t) or pytest.fail(t)))
        cases.append(({"choice": LABELS, **extra}, lambda t: t in LABELS or pytest.fail(t)))
        for grammar in (GRAMMAR, GBNF):
            cases.append(({"grammar": grammar, **extra},
                          lambda t: re.fullmatch(r"\(\d{1,3}([+*]\d{1,3}){0,3}\)", t) or pytest.fail(t)))
    return cases


@pytest.fixture(scope="module")
def tokenizer():
    from models.checkpoints.gguf import default_model_path, read_tokenizer
    return read_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def wide_llama(tokenizer):
    """Random weights over the default model's vocabulary, so that its tokenizer applies."""
    torch.manual_seed(1)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id, bos_token_id=1)
    return transformers.LlamaForCausalLM(config).to(torch.float64).eval()


def test_concurrent_constrained_requests_always_match_and_equal_each_run_alone(wide_llama, tokenizer):
    cases = constrained_cases()
    # Two blocks' worth of shared text first: requests admitted after the first step (more than the
    # batch holds) take it from the prefix cache whatever the threads' timing.
    prompts = [tokenizer(f"The shared system text that every request starts with, before its own part: request {i}, "
                         f"number {i * 7}.")["input_ids"] for i in range(len(cases))]
    free = [tokenizer(f"free text {i}")["input_ids"] for i in range(6)]
    results, alone = {}, {}
    # 40 blocks of 8 tokens cannot hold every request at once: some are preempted and recomputed.
    with Engine.from_pretrained(wide_llama, tokenizer=tokenizer, num_kv_blocks=40, block_size=8,
                                max_batch_size=16) as engine:
        def worker(indices):
            handles = [(i, engine.launch_response_tokens(prompts[i], GenerationConfig(max_new_tokens=120,
                                                                                      **cases[i][0])))
                       for i in indices]
            for i, handle in handles:
                results[i] = (list(engine.stream_response_tokens(handle, timeout=120)), handle.finish_reason)

        def free_worker(prompt):
            engine.response(tokenizer.decode(prompt), GenerationConfig(max_new_tokens=30, ignore_eos=True))

        threads = [threading.Thread(target=worker, args=(range(t, len(cases), 6),)) for t in range(6)]
        threads += [threading.Thread(target=free_worker, args=(p,)) for p in free]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads), "a worker thread hung"
        stats = engine.stats()
        for i, (fields, _) in enumerate(cases):
            handle = engine.launch_response_tokens(prompts[i], GenerationConfig(max_new_tokens=120, **fields))
            alone[i] = list(engine.stream_response_tokens(handle, timeout=120))
    assert len(cases) >= 20 and stats["preemptions"] > 0 and stats["cached_prompt_tokens"] > 0
    for i, (fields, check) in enumerate(cases):
        tokens, reason = results[i]
        assert reason == "stop", (fields, tokenizer.decode(tokens))
        check(tokenizer.decode(tokens, skip_special_tokens=True))
        assert tokens == alone[i], fields


def test_a_constraint_ends_the_request_when_nothing_more_is_allowed(wide_llama, tokenizer):
    with Engine.from_pretrained(wide_llama, tokenizer=tokenizer) as engine:
        done = engine.complete("Pick one:", GenerationConfig(choice=["yes", "no"], max_new_tokens=50))
        long = {"type": "object", "required": ["a"], "properties": {"a": {"type": "string", "minLength": 40}}}
        cut = engine.complete("Tell me:", GenerationConfig(json_schema=long, max_new_tokens=3))
    assert done.text in ("yes", "no") and done.finish_reason == "stop" and len(done.token_ids) < 50
    assert cut.finish_reason == "length" and len(cut.token_ids) == 3 and cut.text.startswith("{")
    with pytest.raises(ValueError):
        cut.parsed


def test_unconstrained_output_is_unchanged_beside_constrained_requests(llama):
    """Masks are per row: a free request's greedy tokens are those of transformers alone."""
    prompt = [5, 6, 7, 8]
    with Engine.from_pretrained(llama) as engine:
        handle = engine.launch_response_tokens(prompt, GenerationConfig(max_new_tokens=12, ignore_eos=True))
        assert list(engine.stream_response_tokens(handle, timeout=30)) == reference(llama, prompt, 12, eos_token_id=None)


@pytest.mark.parametrize("fields,message", [
    ({"json_schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "invalid json_schema"),
    ({"regex": "a(b"}, "invalid regex"),
    ({"grammar": "start: (("}, "invalid grammar"),
    ({"grammar": 'root ::= "a'}, "invalid grammar \\(GBNF\\): Unexpected end of input"),
    ({"grammar": "root ::= undefined-rule"}, "invalid grammar"),
    ({"json_schema": "{not json"}, "not valid JSON"),
])
def test_a_bad_constraint_is_refused_at_launch_and_harms_nothing(wide_llama, tokenizer, fields, message):
    with Engine.from_pretrained(wide_llama, tokenizer=tokenizer) as engine:
        running = engine.launch_response_tokens([5, 6, 7], GenerationConfig(max_new_tokens=8, ignore_eos=True))
        with pytest.raises(ValueError, match=message):
            engine.launch_response_tokens([5, 6], GenerationConfig(**fields))
        assert len(list(engine.stream_response_tokens(running, timeout=30))) == 8


def test_constraint_fields_are_checked_on_construction():
    with pytest.raises(ValueError, match="at most one of"):
        GenerationConfig(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="non-empty list"):
        GenerationConfig(choice=[])
    with pytest.raises(TypeError, match="choice must be a list"):
        GenerationConfig(choice="yes")
    with pytest.raises(TypeError, match="json_schema must be"):
        GenerationConfig(json_schema=5)
    with pytest.raises(TypeError, match="regex must be a non-empty str"):
        GenerationConfig(regex="")


def test_a_constraint_without_a_tokenizer_says_what_to_pass(llama):
    with Engine.from_pretrained(llama) as engine:
        with pytest.raises(ValueError, match="tokenizer="):
            engine.launch_response_tokens([5, 6], GenerationConfig(regex="[a-z]+"))


def test_the_default_model_keeps_to_every_kind_of_constraint_concurrently(smollm):
    cases = constrained_cases()
    configs = [GenerationConfig(max_new_tokens=120, **fields) for fields, _ in cases]
    handles = [smollm.launch_response([{"role": "user", "content": f"Give record number {i} in the asked format."}],
                                      config) for i, config in enumerate(configs)]
    texts = ["".join(smollm.stream_text(h)) for h in handles]
    for (fields, check), handle, text in zip(cases, handles, texts):
        assert handle.finish_reason == "stop", (fields, text)
        check(text)


class Pet(pydantic.BaseModel):  # Loom closes its objects: no properties beyond these fields
    name: str = pydantic.Field(max_length=16)
    species: str = pydantic.Field(pattern="^(cat|dog|bird)$")
    age: int = pydantic.Field(ge=0, le=30)


def test_the_default_model_answers_in_its_schema(smollm):
    prompts = ["Describe a cat named Tom, aged 3, as JSON.", "Give me a dog called Rex who is 7 as JSON.",
               "A bird named Kiwi, one year old, in JSON please.", "Invent a pet and describe it as JSON."]
    config = GenerationConfig(json_schema=Pet, max_new_tokens=48)
    handles = [smollm.launch_response([{"role": "user", "content": p}], config) for p in prompts]
    texts = ["".join(smollm.stream_text(h)) for h in handles]
    pets = [Pet.model_validate_json(t) for t in texts]
    assert [h.finish_reason for h in handles] == ["stop"] * 4
    assert pets[0].name == "Tom" and pets[0].species == "cat" and pets[0].age == 3, texts[0]
    alone = smollm.complete([{"role": "user", "content": prompts[1]}], config)
    assert alone.parsed == pets[1] and alone.text == texts[1]
