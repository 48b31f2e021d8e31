"""llguidance against xgrammar on this machine, for Loom's constrained decoding (docs/structured-output.md).

For each engine and the default model's tokenizer (SmolLM2, 49,152 tokens): the time to prepare the
tokenizer, the time to compile each constraint below, and the time to compute one token mask along
a walk where each step takes the best allowed token of random logits (the same seeded logits for
both engines), up to 256 tokens. Every finished walk is checked: the JSON ones parse and validate
against their schema (jsonschema), the regex and choice ones match. Run from a checkout's root:

    pip install llguidance xgrammar jsonschema
    python docs/bench/grammar_engines.py
"""

import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())

import jsonschema  # noqa: E402
import torch  # noqa: E402

VOCAB = 49152
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "email"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0,
                                                                              "maximum": 130},
                         "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}}
ORDER = {"type": "object", "additionalProperties": False, "required": ["id", "items", "status", "address"],
         "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99999},
                        "status": {"enum": ["open", "paid", "shipped"]},
                        "items": {"type": "array", "minItems": 1, "maxItems": 3,
                                  "items": {"type": "object", "additionalProperties": False,
                                            "required": ["sku", "qty"],
                                            "properties": {"sku": {"type": "string", "maxLength": 8},
                                                           "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
                        "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                    "properties": {"city": {"type": "string", "maxLength": 16},
                                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
MEASURE = {"type": "object", "additionalProperties": False, "required": ["value", "unit", "ok"],
           "properties": {"value": {"type": "number", "minimum": -1000, "maximum": 1000},
                          "unit": {"enum": ["m", "s", "kg"]}, "ok": {"type": "boolean"},
                          "note": {"type": ["string", "null"], "maxLength": 10}}}
CONSTRAINTS = {
    "person": ("json", PERSON),
    "order (nested, arrays, enum)": ("json", ORDER),
    "measure (number, bool, null)": ("json", MEASURE),
    "any JSON object": ("json", {"type": "object"}),
    "regex (date)": ("regex", r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"),
    "choice (3 labels)": ("choice", ["positive", "negative", "neutral"]),
}


def check(kind, spec, text):
    if kind == "json":
        jsonschema.validate(json.loads(text), spec)
    elif kind == "regex":
        assert re.fullmatch(spec, text), text
    else:
        assert text in spec, text


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, eos):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.ll, self.llt = llguidance, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB, eos_token=eos)
        self.version = llguidance.get_version() if hasattr(llguidance, "get_version") else "?"

    def compile(self, kind, spec):
        M = self.ll.LLMatcher
        grammar = {"json": lambda: M.grammar_from_json_schema(spec, overrides={"whitespace_flexible": False}),
                   "regex": lambda: M.grammar_from_regex(spec),
                   "choice": lambda: M.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in spec))}[kind]()
        return lambda: self.ll.LLMatcher(self.tokenizer, grammar)

    def fill(self, matcher, bitmask):
        self.llt.fill_next_token_bitmask(matcher, bitmask, 0)

    def accept(self, matcher, token):
        assert matcher.consume_token(token), matcher.get_error()
        return matcher.is_stopped()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, eos):
        import xgrammar
        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB, stop_token_ids=eos)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        from importlib.metadata import version
        self.version = version("xgrammar")

    def compile(self, kind, spec):
        c = self.compiler
        compiled = {"json": lambda: c.compile_json_schema(json.dumps(spec), any_whitespace=False),
                    "regex": lambda: c.compile_regex(spec),
                    "choice": lambda: c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec))}[kind]()
        return lambda: self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask):
        matcher.fill_next_token_bitmask(bitmask, 0)

    def accept(self, matcher, token):
        assert matcher.accept_token(token)
        return matcher.is_terminated()


def walk(engine, new_matcher, tokenizer, eos, seed):
    """Greedy over random logits under the mask; (text, mask times in ms, finished)."""
    generator = torch.Generator().manual_seed(seed)
    bitmask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    bits = torch.arange(32, dtype=torch.int32)
    matcher, tokens, times = new_matcher(), [], []
    for _ in range(256):
        start = time.perf_counter()
        engine.fill(matcher, bitmask)
        times.append((time.perf_counter() - start) * 1e3)
        allowed = ((bitmask[0, :, None] >> bits) & 1).flatten()[:VOCAB].bool()
        logits = torch.randn(VOCAB, generator=generator).masked_fill(~allowed, float("-inf"))
        token = int(logits.argmax())
        stopped = engine.accept(matcher, token)
        if token == eos:
            return tokenizer.decode(tokens), times, True
        tokens.append(token)
        if stopped:
            return tokenizer.decode(tokens), times, True
    return tokenizer.decode(tokens), times, False


def main():
    from models.checkpoints.gguf import default_model_path, read_tokenizer
    tokenizer = read_tokenizer(default_model_path())
    eos = tokenizer.eos_token_id
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, tokenizer vocabulary {len(tokenizer)}")
    for engine_type in (Llguidance, Xgrammar):
        start = time.perf_counter()
        engine = engine_type(tokenizer, eos)
        print(f"\n## {engine.name} {engine.version}: tokenizer prepared in {time.perf_counter() - start:.2f} s")
        print("| constraint | compile ms | mask ms mean | mask ms p99 | tokens | valid | text |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        all_times = []
        for label, (kind, spec) in CONSTRAINTS.items():
            start = time.perf_counter()
            new_matcher = engine.compile(kind, spec)
            new_matcher()
            compiled = (time.perf_counter() - start) * 1e3
            texts, times, valid = [], [], 0
            for seed in range(5):
                text, walk_times, finished = walk(engine, new_matcher, tokenizer, eos, seed)
                times += walk_times
                texts.append(text)
                if finished:
                    try:
                        check(kind, spec, text)
                        valid += 1
                    except Exception as error:  # noqa: BLE001 - reported in the table
                        print(f"  invalid: {text!r}: {error}")
            all_times += times
            p99 = sorted(times)[int(0.99 * (len(times) - 1))]
            print(f"| {label} | {compiled:.1f} | {statistics.mean(times):.3f} | {p99:.3f} | {len(times)} | "
                  f"{valid}/5 | `{texts[0][:48]}` |")
        print(f"all masks: mean {statistics.mean(all_times):.3f} ms, "
              f"p99 {sorted(all_times)[int(0.99 * (len(all_times) - 1))]:.3f} ms over {len(all_times)} tokens")


if __name__ == "__main__":
    main()
