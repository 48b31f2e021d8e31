"""The grammar of a forced tool call (tool_choice "required" or a named tool): a JSON schema
that always ends as a valid call within the request's max_tokens.

An ordinary OpenAI tool schema is open: objects take properties beyond those listed, strings and
arrays have no length, numbers no size. Under a grammar that allows all of it a model may write
properties or digits until max_tokens cuts the JSON. So, as OpenAI's strict mode does, objects
take only their listed properties; and every string, array and number gets a bound, shrunk until
the longest call the schema allows fits max_tokens (its fixed text counted in the model's tokens,
the free characters at one token each), optional properties left out where they do not fit. A
max_tokens too small even for the shortest bounds is refused before anything runs. (Text outside
ASCII can take more than a token a character: only there can a call still reach max_tokens.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# Bounds tried in turn until the longest call fits: shorter strings and arrays first, then without
# the optional properties (better than arguments cut to a few characters), then shorter still.
STRING_CHARS = (64, 32, 16, 8, 4, 1)
ARRAY_ITEMS = (8, 4, 2, 1)
BOUNDS_TRIED = [(True, chars, items) for chars in STRING_CHARS[:4] for items in ARRAY_ITEMS] + \
               [(False, chars, items) for chars in STRING_CHARS for items in ARRAY_ITEMS]
NUMBER_BOUND = 10**9                   # |number| at most this, in steps of NUMBER_STEP
NUMBER_STEP = 1e-6
NUMBER_CHARS = {"integer": 11, "number": 18}  # the longest such a bounded number can be written


class CallTooLong(ValueError):
    """max_tokens cannot hold even the shortest bounded call."""


@dataclass
class Bounds:
    optional: bool  # whether properties not required are kept
    string_chars: int
    array_items: int


def call_schema(tools, max_tokens: int, count_tokens) -> dict:
    """The schema of one call to any of ``tools`` ({"name": ..., "arguments": {...}}), bounded to
    end within ``max_tokens``; ``count_tokens(text)`` is the model's token count of a text.
    Raises CallTooLong when no bounds fit."""
    needed = None
    for bounds in BOUNDS_TRIED:
        options = [_call(t.function.name, bounded(t.function.parameters or {}, Bounds(*bounds))) for t in tools]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        text, free = longest(schema)
        needed = count_tokens(text) + free + 1  # + 1: the end of the stream
        if needed <= max_tokens:
            return schema
    raise CallTooLong(f"max_tokens={max_tokens} cannot hold a forced call of "
                      f"{' or '.join(repr(t.function.name) for t in tools)}: it needs up to {needed} tokens even with "
                      "only its required properties, every string and array cut short; raise max_tokens")


def _call(name: str, arguments: dict) -> dict:
    return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": name}, "arguments": arguments}}


def bounded(schema, bounds: Bounds):
    """``schema`` closed (objects take only their listed properties) and bounded."""
    if isinstance(schema, list):
        return [bounded(item, bounds) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: bounded(value, bounds) if key != "enum" and key != "const" else value
              for key, value in schema.items()}
    if "enum" in schema or "const" in schema:
        return schema
    types = _types(schema)
    if "object" in types:
        properties = schema.setdefault("properties", {})
        if not bounds.optional:
            schema["properties"] = {k: v for k, v in properties.items() if k in schema.get("required", ())}
        schema["additionalProperties"] = False
    if "string" in types and "format" not in schema:
        schema["maxLength"] = min(schema.get("maxLength", bounds.string_chars), bounds.string_chars)
    if "array" in types:
        schema["maxItems"] = min(schema.get("maxItems", bounds.array_items), bounds.array_items)
    if types & {"number", "integer"}:
        if "minimum" not in schema and "exclusiveMinimum" not in schema:
            schema["minimum"] = -NUMBER_BOUND
        if "maximum" not in schema and "exclusiveMaximum" not in schema:
            schema["maximum"] = NUMBER_BOUND
        if "number" in types and "multipleOf" not in schema:
            schema["multipleOf"] = NUMBER_STEP
    return schema


def _types(schema: dict) -> set[str]:
    kind = schema.get("type")
    if kind is None and "properties" in schema:
        return {"object"}
    return set(kind) if isinstance(kind, list) else {kind} if kind else set()


def longest(schema) -> tuple[str, int]:
    """The longest text a bounded schema allows, as its fixed JSON text and a count of free
    characters (a string's content, a number's digits) left out of that text."""
    if not isinstance(schema, dict):
        return "", 0
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        return max((json.dumps(v, separators=(",", ":")) for v in values), key=len), 0
    options = [longest(option) for option in schema.get("anyOf", []) + schema.get("oneOf", [])]
    for kind in _types(schema) or ({"object"} if not options else set()):
        options.append(_longest_of_type(schema, kind))
    return max(options, key=lambda option: len(option[0]) + option[1], default=("", 0))


def _longest_of_type(schema: dict, kind: str) -> tuple[str, int]:
    if kind == "object":
        parts, free = [], 0
        for key, value in schema.get("properties", {}).items():
            text, chars = longest(value)
            parts.append(json.dumps(key) + ":" + text)
            free += chars
        return "{" + ",".join(parts) + "}", free
    if kind == "array":
        text, chars = longest(schema.get("items", {}))
        count = schema.get("maxItems", 0)
        return "[" + ",".join([text] * count) + "]", chars * count
    if kind == "string":
        return '""', schema.get("maxLength", 64)  # a format (date, uuid, ...) is short
    if kind in NUMBER_CHARS:
        return "", NUMBER_CHARS[kind]
    return {"boolean": "false", "null": "null"}.get(kind, ""), 0
