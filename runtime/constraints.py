"""Structured output: a request's JSON schema, regex, choice or grammar turned into a token mask
for each step, with llguidance (docs/structured-output.md says why this engine).

A constrained request owns a ``Constraint`` (one llguidance matcher) from launch on. The loop
thread starts the step's masks on a helper thread just before the forward, which they overlap
(llguidance computes without the GIL), applies them to the step's logits in the sampler, and
advances each matcher by the token it sampled. The grammar ends a request when it allows no
continuation; EOS is allowed exactly where the grammar accepts.
"""

from __future__ import annotations

import json
import threading
from copy import copy
from concurrent.futures import Future, ThreadPoolExecutor

import torch

# Compact JSON: free whitespace would let a model spend its whole budget on spaces.
JSON_OPTIONS = {"whitespace_flexible": False}


def _llguidance():
    try:
        import llguidance  # not llguidance.hf (it imports transformers) nor .torch (torch.compile's machinery)
    except ImportError as error:  # a declared dependency; only a broken install lacks it
        raise RuntimeError("structured output needs llguidance: pip install llguidance") from error
    return llguidance


def schema_dict(schema) -> dict:
    """A JSON schema from a dict, a JSON string, or a pydantic model class. A pydantic class's
    objects get no properties beyond its fields (as OpenAI's strict mode and its parse() helper
    have it): else a model may add properties until it runs out of tokens."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        return _closed(schema.model_json_schema())
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise ValueError(f"json_schema is not valid JSON: {error}") from None
    if not isinstance(schema, dict):
        raise TypeError(f"json_schema must be a dict, a JSON string or a pydantic model class, got {schema!r}")
    return schema


def _closed(schema):
    if isinstance(schema, dict):
        schema = {key: _closed(value) for key, value in schema.items()}
        if schema.get("type") == "object" and "properties" in schema:
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [_closed(item) for item in schema]
    return schema


def grammar_text(config) -> str | None:
    """The llguidance grammar of a GenerationConfig's constraint; None when it has none."""
    kind = config.constraint_kind
    if kind is None:
        return None
    ll = _llguidance()
    matcher = ll.LLMatcher
    if kind == "json_schema":
        return matcher.grammar_from_json_schema(schema_dict(config.json_schema), overrides=JSON_OPTIONS)
    if kind == "regex":
        return matcher.grammar_from_regex(config.regex)
    if kind == "choice":
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in config.choice))
    return matcher.grammar_from_lark(lark_text(config.grammar))


def lark_text(grammar: str) -> str:
    """A grammar in Lark syntax; llama.cpp's GBNF (rules written ``name ::= ...``) is converted.
    Raises ValueError with the converter's message for GBNF it cannot read."""
    if "::=" not in grammar:
        return grammar
    from llguidance.gbnf_to_lark import gbnf_to_lark
    try:
        return gbnf_to_lark(grammar)
    except Exception as error:  # the converter raises a bare Exception for a missing rule, its own type for syntax
        raise ValueError(f"invalid grammar (GBNF): {error}") from None


class Constraint:
    """One request's grammar state: which tokens it allows next, and whether it has ended."""

    def __init__(self, matcher, consumed: int = 0, ended_after: int | None = None):
        self.matcher = matcher
        self.consumed = consumed  # tokens accepted so far ...
        self.ended_after = ended_after  # ... and how many when the grammar first allowed no continuation

    def accept(self, token: int) -> None:
        """Advance by a sampled token; raises ValueError if the grammar does not allow it (the
        mask makes that impossible unless the matcher itself failed)."""
        if not self.matcher.consume_token(token):
            raise ValueError(f"the grammar refused token {token}: {self.matcher.get_error()}")
        self.consumed += 1
        if self.ended_after is None and self.matcher.is_stopped():
            self.ended_after = self.consumed

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens``, from the current state on, the grammar allows (proposed tokens
        past that are not verified: their rows would have no mask)."""
        return self.matcher.validate_tokens(tokens)

    def copy(self) -> "Constraint":
        """An independent one in the same state (for each choice of Engine.launch_choices)."""
        return Constraint(self.matcher.deep_copy(), self.consumed, self.ended_after)

    @property
    def ended(self) -> bool:
        """The grammar allows no continuation (it may still allow EOS, which also ends it)."""
        return self.matcher.is_stopped()

    def ended_at(self, generated: int) -> bool:
        """Whether the grammar had ended once the request's first ``generated`` tokens were accepted:
        a step that keeps several tokens (speculative decoding) advances the grammar past all of
        them before they are recorded one by one."""
        return self.ended_after is not None and self.ended_after <= generated


class Grammars:
    """Per engine: the tokenizer as llguidance sees it (made on first use, ~1 s), compiling each
    request's constraint at launch (in the launching thread), and the step's masks."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int]):
        self._source = tokenizer
        self.vocab_size = vocab_size
        self.eos = sorted(eos_token_ids)
        self._tokenizer = None
        self._lock = threading.Lock()
        self._helper: ThreadPoolExecutor | None = None
        self._executor = None

    def compile(self, config) -> Constraint | None:
        """The request's Constraint, or None when it has no constraint. Raises ValueError with
        llguidance's message for a schema, regex or grammar it cannot compile."""
        grammar = grammar_text(config)
        if grammar is None:
            return None
        # The matcher compiles the grammar once and keeps any error (warnings are not errors).
        matcher = _llguidance().LLMatcher(self.tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {config.constraint_kind}: {matcher.get_error()}")
        return Constraint(matcher)

    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                if self._source is None:
                    raise ValueError("structured output needs the model's tokenizer, and this checkpoint has "
                                     "none; pass tokenizer= to Engine.from_pretrained")
                backend = getattr(self._source, "backend_tokenizer", None)
                if backend is None:
                    raise ValueError("structured output needs a fast (Rust) tokenizer; this checkpoint's is "
                                     f"{type(self._source).__name__}")
                # As llguidance.hf does for a transformers tokenizer: the Rust tokenizer serialized
                # without padding or truncation, with the model's vocabulary size and EOS ids.
                backend = copy(backend)
                backend.no_padding()
                backend.no_truncation()
                self._tokenizer = _llguidance().LLTokenizer(backend.to_str(), n_vocab=self.vocab_size,
                                                            eos_token=self.eos or self._source.eos_token_id)
            return self._tokenizer

    def start_masks(self, constraints: list[Constraint | None],
                    proposals: list[int | None] | None = None) -> Future | None:
        """Begin computing the masks of a step's sampled rows (``constraints[i]`` for row i, None
        when unconstrained) on a helper thread; None when no row is constrained. ``proposals``
        (StepPlan.proposals): a request's rows that verify proposed tokens share its constraint,
        and each row's mask is the grammar's after the proposals before it. The future's result is
        an int32 bitmask [rows, ceil(vocab / 32)], every bit set on free rows."""
        rows = [(c.matcher, i) for i, c in enumerate(constraints)
                if c is not None and (i == 0 or constraints[i - 1] is not c)]  # a request's first row
        if not rows:
            return None
        drafts = []  # each request's proposals: llguidance writes its later rows' masks after its first
        if proposals is not None:
            for matcher, first in rows:
                end = first
                while proposals[end] is not None:
                    end += 1
                drafts.append(proposals[first:end])
        if self._helper is None:
            ll = _llguidance()
            self._executor = ll.LLExecutor(num_threads=1)  # beside the forward, on a shared machine
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="loom-grammar")
        bitmask = torch.full((len(constraints), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)

        def fill():  # llguidance writes each row's words at its row of the buffer, without the GIL
            if any(drafts):
                self._executor.unsafe_compute_mask_ptr_with_draft_token(
                    [(m, i, d) for (m, i), d in zip(rows, drafts)], bitmask.data_ptr(), bitmask.shape[1] * 4,
                    len(constraints))
            else:
                self._executor.unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), bitmask.shape[1] * 4, len(constraints))
            return bitmask

        return self._helper.submit(fill)

    def close(self) -> None:
        if self._helper is not None:
            self._helper.shutdown(wait=False)


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits`` with every token that ``bitmask`` forbids set to -inf, on the given rows. Each
    byte of the bitmask (little-endian: byte b of word w holds tokens 32w + 8b ...) looks up its 8
    additive 0/-inf values in a 256-row table and one index_add applies them: about a third of the
    time of shifting bits out of the int32 words (docs/structured-output.md)."""
    index = torch.tensor(rows, device=logits.device)
    table = _byte_table(logits.dtype, logits.device)
    words = bitmask[rows].to(logits.device, non_blocking=True)
    bias = table[words.view(torch.uint8).int()].flatten(1)[:, :logits.shape[-1]]
    return logits.index_add(0, index, bias)


_tables: dict = {}


def _byte_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8]: for each byte value, 0 where its bit k is set (allowed), -inf where not."""
    key = (dtype, device)
    if key not in _tables:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        _tables[key] = torch.where(bits == 1, 0.0, float("-inf")).to(dtype=dtype, device=device)
    return _tables[key]
