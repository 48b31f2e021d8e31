"""The text layer over the token API: prompts and chat messages in, text pieces out.

Runs in the caller's thread; the loop thread never touches a tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from functools import partial

from .config import GenerationConfig
from .request_checks import as_config
from .context import END
from .sampler import TokenLogprob


class Detokenizer:
    """Turns a growing token list into text pieces without splitting a multi-byte character.

    Decodes a short window of recent tokens twice (with and without the newest) and emits the
    difference, holding back while the newest bytes are an incomplete character ("\\ufffd").
    """

    def __init__(self, tokenizer):
        # A fast tokenizer's decode without cleanup is its Rust backend's: called directly, it
        # skips transformers' per-call argument handling, a third of a streamed token's text work.
        backend = tokenizer.backend_tokenizer if getattr(tokenizer, "is_fast", False) else None
        self._decode = (partial(backend.decode, skip_special_tokens=True) if backend is not None
                        else partial(tokenizer.decode, skip_special_tokens=True, clean_up_tokenization_spaces=False))
        self.tokens: list[int] = []
        self.prefix_offset = 0  # start of the window decoded for context
        self.read_offset = 0    # tokens before this are already emitted

    def push(self, token: int) -> str:
        self.tokens.append(token)
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back at the end of the stream."""
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.tokens)
        return full[len(prefix):]


class TextAssembler:
    """Tokens in, text pieces out, for one stream: detokenizes, finds ``stop`` strings, and holds
    back text that may be the start of one, so that a stop string is never returned."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.detokenizer = Detokenizer(tokenizer)
        self.stops = stops
        self.hold = max(map(len, stops), default=1) - 1
        self.text, self.emitted = "", 0
        self.stopped = False  # a stop string was found

    def add(self, token: int) -> str:
        """The text that is safe to emit after ``token`` (END flushes the rest)."""
        ended = token == END
        new = self.detokenizer.flush() if ended else self.detokenizer.push(token)
        if not self.stops:  # nothing to find or hold back (a streamed token's path in most requests)
            return new
        self.text += new
        # Held-back text ensures a stop string never starts before `emitted`.
        cut = min((i for i in (self.text.find(s, self.emitted) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            end = cut
        else:
            end = len(self.text) if ended else len(self.text) - self.hold
        if end <= self.emitted:
            return ""
        piece, self.emitted = self.text[self.emitted:end], end
        return piece


@dataclass
class Completion:
    """One whole answer of the text API (Engine.complete)."""

    text: str
    token_ids: list[int]     # every generated token, a final stop token included
    finish_reason: str       # "stop" (EOS, a stop token or string, the constraint's end) or "length"
    logprobs: list[TokenLogprob] | None = None  # with GenerationConfig(logprobs=k)
    json_schema: object = field(default=None, repr=False)
    proposed_tokens: int = 0  # speculative decoding (GenerationConfig.speculative_tokens): tokens proposed,
    accepted_tokens: int = 0  # and of them delivered (each one a step saved)

    @property
    def parsed(self):
        """The text read as JSON: an instance of the pydantic model when ``json_schema`` was one,
        else the decoded value. Raises ValueError when the text is not JSON (say, cut at
        max_new_tokens)."""
        if isinstance(self.json_schema, type) and hasattr(self.json_schema, "model_validate_json"):
            return self.json_schema.model_validate_json(self.text)
        return json.loads(self.text)


class TextAPI:
    """Mixed into Engine: needs ``tokenizer``, ``launch_response_tokens``, ``launch_choices``,
    ``fetch_response_tokens``, ``fetch_async``, ``abort_response`` and ``_grammars``."""

    def encode(self, prompt, tools: list[dict] | None = None) -> list[int]:
        """A str is tokenized as is; a list of {"role", "content"} messages goes through the
        tokenizer's chat template with the assistant's turn opened (and ``tools``, OpenAI-style
        function descriptions, for a template that takes them)."""
        tokenizer = self._require_tokenizer()
        if isinstance(prompt, str):
            return tokenizer(prompt)["input_ids"]
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            for i, message in enumerate(prompt):
                if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
                    raise ValueError(f"message {i} needs a str 'role' and a str 'content', got {message!r}")
            if tokenizer.chat_template is None:
                raise ValueError(f"the tokenizer of {self.name} has no chat template; pass a str prompt")
            encoded = tokenizer.apply_chat_template(list(prompt), tools=tools, add_generation_prompt=True, tokenize=True)
            return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
        raise TypeError(f"prompt must be a str or a non-empty list of chat messages, got {type(prompt).__name__}")

    def launch_response(self, prompt, config: GenerationConfig | None = None) -> int:
        """Tokenize ``prompt`` and launch it; returns the token handle (see launch_response_tokens)."""
        return self.launch_response_tokens(self.encode(prompt), config)

    def stream_response(self, prompt, config: GenerationConfig | None = None) -> Iterator[str]:
        """Yield text pieces as tokens arrive. Stops at EOS, a stop token, ``max_new_tokens`` or a
        ``config.stop`` string (which is not returned). Closing the iterator early aborts the request."""
        config = as_config(config)
        return self.stream_text(self.launch_response(prompt, config), config.stop)

    def response(self, prompt, config: GenerationConfig | None = None) -> str:
        """The whole answer; blocks until it is done. Equal to joining stream_response's pieces."""
        return "".join(self.stream_response(prompt, config))

    def complete(self, prompt, config: GenerationConfig | None = None) -> Completion:
        """The whole answer with its tokens, finish reason and (when asked) logprobs; blocks."""
        return self.complete_choices(prompt, config, 1)[0]

    def complete_choices(self, prompt, config: GenerationConfig | None = None, n: int = 2) -> list[Completion]:
        """``n`` answers to one prompt (see Engine.launch_choices); blocks until all are done."""
        config = as_config(config)
        handles = self.launch_choices(self.encode(prompt), config, n)
        completions = []
        for handle in handles:
            text = TextAssembler(self._require_tokenizer(), config.stop)
            text_pieces = list(self.stream_text(handle, config.stop, text))
            ctx = handle.context
            reason = "stop" if text.stopped else ctx.finish_reason
            completions.append(Completion("".join(text_pieces), ctx.tokens[ctx.num_prompt:], reason,
                                          list(ctx.logprobs) if config.logprobs is not None else None,
                                          config.json_schema, ctx.num_proposed, ctx.num_accepted))
        return completions

    async def astream_response(self, prompt, config: GenerationConfig | None = None) -> AsyncIterator[str]:
        """stream_response for asyncio: awaits tokens without blocking the event loop."""
        config = as_config(config)
        async for piece in self.astream_text(self.launch_response(prompt, config), config.stop):
            yield piece

    def stream_text(self, handle: int, stops: tuple[str, ...] = (), text: TextAssembler | None = None) -> Iterator[str]:
        """The text of a launched request, piece by piece; aborts it if left early."""
        text = text or TextAssembler(self._require_tokenizer(), stops)
        token = None
        try:
            while token != END and not text.stopped:
                token = self.fetch_response_tokens(handle)
                if piece := text.add(token):
                    yield piece
        finally:
            if token != END:  # a stop string, an error, or a consumer that let go
                self._release(handle)

    async def astream_text(self, handle: int, stops: tuple[str, ...] = ()) -> AsyncIterator[str]:
        text = TextAssembler(self._require_tokenizer(), stops)
        token = None
        try:
            while token != END and not text.stopped:
                token = await self.fetch_async(handle)
                if piece := text.add(token):
                    yield piece
        finally:
            if token != END:  # includes the task being cancelled: a client that went away
                self._release(handle)

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (a piece of a character, for some byte-level tokens)."""
        return self._grammars.tokenizer().decode_bytes([token])

    def _release(self, handle: int) -> None:
        try:
            self.abort_response(handle)
            while self.fetch_response_tokens(handle, timeout=0) != END:  # abort left only -1
                pass
        except (KeyError, RuntimeError, TimeoutError):  # already released, or the engine shut down
            pass

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise RuntimeError(f"{self.name} was loaded without a tokenizer; use the token API "
                               "(launch_response_tokens) or load a checkpoint that ships one")
        return self.tokenizer
