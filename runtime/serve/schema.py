"""OpenAI's request bodies, validated, and what each means for Loom: a GenerationConfig and a prompt.

Structured output (``response_format``) and forced tool calls become a ``json_schema`` constraint;
tools are rendered through the model's chat template when it takes them, else described in the
system message."""

from __future__ import annotations

import json
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from runtime import GenerationConfig
from runtime.config import MAX_SPECULATIVE_TOKENS

from .forced_call import CallTooLong, call_schema


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    @classmethod
    def invalid(cls, message: str, param: str | None = None, code: str = "invalid_value") -> "APIError":
        return cls(400, message, "invalid_request_error", code, param)


class Body(BaseModel):
    # OpenAI clients send fields Loom does not use; NaN and Infinity (which Python's JSON reads)
    # are refused here rather than deep in a step.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)


class TextPart(Body):
    type: Literal["text"]
    text: str


class FunctionCall(Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @property
    def text(self) -> str:
        """OpenAI's list-of-parts content joins into the one string a chat template takes."""
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class Function(Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})


class Tool(Body):
    type: Literal["function"]
    function: Function


class FunctionName(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(Body):
    name: str = "response"
    description: str | None = None
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Sampling(Body):
    # An unknown top-level argument is refused, as OpenAI refuses it: a misspelt one ("max_token")
    # would otherwise be dropped without a word. Nested objects still ignore extra fields: a message
    # sent back from a response carries "refusal" and "annotations", a function "strict".
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    n: int = Field(default=1, ge=1, le=128)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: dict | None = None
    response_format: ResponseFormat | None = None
    # Extensions, named as vLLM names them: ignore_eos (for benchmarks), top_k, min_p, repetition_penalty.
    ignore_eos: bool = False
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, gt=0)
    # Loom's: tokens proposed by prompt lookup (or the server's --draft model) and verified per step
    # (GenerationConfig.speculative_tokens); None: the server's --speculative-tokens.
    speculative_tokens: int | None = Field(default=None, ge=0, le=MAX_SPECULATIVE_TOKENS)
    # OpenAI's arguments that do not change the answer: accepted, and ignored.
    user: str | None = None
    metadata: dict | None = None
    store: bool | None = None
    service_tier: str | None = None

    def config(self, default_max_tokens: int, logprobs: int | None = None, json_schema=None) -> GenerationConfig:
        """The request's GenerationConfig; GenerationConfig's one rule: no temperature or top_p
        (or temperature 0) is greedy. APIError for a logit_bias key that is no token id; ValueError
        for what only GenerationConfig checks (a bias out of range)."""
        if json_schema is None and self.response_format is not None:
            json_schema = self.response_format_schema()
        return GenerationConfig(
            max_new_tokens=self.new_tokens(default_max_tokens),
            temperature=self.temperature, top_p=1.0 if self.top_p is None else self.top_p, seed=self.seed,
            stop=tuple([self.stop] if isinstance(self.stop, str) else self.stop or ()), ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            logit_bias=self.token_bias(), top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, json_schema=json_schema, logprobs=logprobs,
            speculative_tokens=self.speculative_tokens)

    def token_bias(self) -> dict[int, float] | None:
        """logit_bias with int keys: JSON object keys are strings ("123"), GenerationConfig's are token ids."""
        if self.logit_bias is None:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not re.fullmatch(r"-?[0-9]+", key):
                raise APIError.invalid(f"logit_bias keys must be token ids (integers), got {key!r}", "logit_bias")
            bias[int(key)] = value
        return bias

    def new_tokens(self, default_max_tokens: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default_max_tokens

    def response_format_schema(self) -> dict | None:
        fmt = self.response_format
        if fmt.type == "json_object":
            return {"type": "object"}
        if fmt.type == "json_schema":
            if fmt.json_schema is None or not fmt.json_schema.schema_:
                raise APIError.invalid("response_format json_schema needs a 'json_schema' with a 'schema'",
                                       "response_format.json_schema")
            return fmt.json_schema.schema_
        return None


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # ignored: an answer holds at most one call

    def chat_config(self, default_max_tokens: int, count_tokens) -> GenerationConfig:
        """As config, with a forced tool call's schema bounded to end within max_tokens
        (forced_call.py); ``count_tokens(text)`` is the model's token count of a text."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError.invalid("top_logprobs needs logprobs=true", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        forced = self.forced_tools()
        if forced and self.response_format is not None and self.response_format.type != "text":
            raise APIError.invalid("a forced tool call and response_format cannot both constrain the output",
                                   "tool_choice")
        if not forced:
            return self.config(default_max_tokens, logprobs)
        try:
            schema = call_schema(forced, self.new_tokens(default_max_tokens), count_tokens)
        except CallTooLong as error:
            raise APIError.invalid(str(error), "max_tokens") from None
        return self.config(default_max_tokens, logprobs, schema)

    def active_tools(self) -> list[Tool]:
        """The tools the model may call: none with tool_choice "none" or without tools."""
        if self.tool_choice is not None and not self.tools:
            raise APIError.invalid("tool_choice needs tools", "tool_choice")
        if not self.tools or self.tool_choice == "none":
            return []
        return self.tools

    def forced_tools(self) -> list[Tool]:
        """The tools among which a call is forced ("required" or a named one), else []."""
        tools = self.active_tools()
        if isinstance(self.tool_choice, NamedToolChoice):
            named = [t for t in tools if t.function.name == self.tool_choice.function.name]
            if not named:
                raise APIError.invalid(f"tool_choice names '{self.tool_choice.function.name}', which is not "
                                       "among the tools", "tool_choice")
            return named
        return tools if self.tool_choice == "required" else []

    def prompt(self, tokenizer) -> tuple[list[dict], list[dict] | None]:
        """The chat messages and tools as a transformers chat template takes them. A template that
        knows no tools gets them described in the system message, and earlier calls as text."""
        tools = [t.model_dump(exclude_none=True) for t in self.active_tools()] or None
        native = tools is not None and "tools" in (getattr(tokenizer, "chat_template", None) or "")
        messages = []
        for m in self.messages:
            message = {"role": m.role, "content": m.text}
            if m.tool_calls:
                calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)} for c in m.tool_calls]
                if native:
                    message["tool_calls"] = [{"type": "function", "function": c} for c in calls]
                else:
                    message["content"] += "".join(json.dumps(c) for c in calls)
            if m.tool_call_id and native:
                message["tool_call_id"] = m.tool_call_id
            messages.append(message)
        if tools and not native:
            described = tool_instructions(tools)
            if messages[0]["role"] == "system":
                messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + described}
            else:
                messages.insert(0, {"role": "system", "content": described})
            tools = None
        return messages, tools


class CompletionRequest(Sampling):
    prompt: str | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=5)


def tool_instructions(tools: list[dict]) -> str:
    functions = json.dumps([t["function"] for t in tools])
    return (f"You can call these functions: {functions}\nTo call one, answer with only a JSON object "
            '{"name": <the function name>, "arguments": <an object of its arguments>}.')


def parse_call(text: str, tools: list[Tool]) -> dict | None:
    """The call that a generated ``text`` makes, if it is one: {"name", "arguments"} with a known
    name and an object of arguments (bare JSON, or in <tool_call> tags as Hermes-style models write)."""
    text = text.strip()
    if text.startswith("<tool_call>") and text.endswith("</tool_call>"):
        text = text[len("<tool_call>"):-len("</tool_call>")].strip()
    try:
        call = json.loads(text)
    except json.JSONDecodeError:
        return None
    names = {t.function.name for t in tools}
    if isinstance(call, dict) and call.get("name") in names and isinstance(call.get("arguments"), dict):
        return call
    return None


def _arguments(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
