"""One response in OpenAI's shapes: a whole object, or server-sent chunks ending in [DONE], for
one or ``n`` choices, with logprobs and tool calls where asked."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from runtime import EngineClosed, GenerationFailed

from .metrics import Metrics
from .schema import APIError, Tool, parse_call


def generation_error(error: BaseException) -> APIError:
    """The error of a request that failed after it was accepted."""
    if isinstance(error, EngineClosed):
        return APIError(503, str(error), "server_error", "engine_closed")
    return APIError(500, f"generation failed: {error}", "server_error", "generation_failed")


class Choice:
    """One handle's stream of text pieces, and the logprobs of the tokens behind each piece."""

    def __init__(self, index: int, handle, pieces):
        self.index, self.handle, self.pieces = index, handle, pieces
        self.text = ""
        self.reported = 0  # logprobs already sent
        self.template: tuple[str, str] | None = None  # its text chunks' event around the piece (Reply.text_event)

    def new_logprobs(self, upto: int | None = None) -> list:
        """The TokenLogprobs of tokens fetched since the last call (up to the ``upto``-th), without
        a final stop token (EOS and stop tokens are not part of the text, as in OpenAI's responses)."""
        ctx = self.handle.context
        end = ctx.num_fetched if upto is None else upto
        if ctx.finished and ctx.finish_reason == "stop" and ctx.tokens and ctx.tokens[-1] in ctx.stop_ids:
            end = min(end, ctx.num_generated - 1)
        entries = ctx.logprobs[self.reported:end]
        self.reported = max(self.reported, end)
        return entries

    def finish_reason(self) -> str:
        return "length" if self.handle.finish_reason == "length" else "stop"


class Reply:
    def __init__(self, kind: str, model: str, prompt_tokens: int, choices: list[Choice], metrics: Metrics,
                 token_bytes, logprobs: bool = False, tools: list[Tool] | None = None):
        self.kind, self.model, self.prompt_tokens, self.choices = kind, model, prompt_tokens, choices
        self.metrics, self.token_bytes, self.logprobs, self.tools = metrics, token_bytes, logprobs, tools or []
        self.id = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    @property
    def chat(self) -> bool:
        return self.kind == "chat.completion"

    def usage(self) -> dict:
        completion = sum(c.handle.context.num_generated for c in self.choices)
        cached = self.choices[0].handle.cached_tokens  # the first choice computed the prompt
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}

    def envelope(self, choices: list, chunk: bool, **extra) -> dict:
        kind = self.kind + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices, **extra}

    # -- logprobs in OpenAI's two shapes ------------------------------------------------------

    def logprob_block(self, entries: list) -> dict | None:
        if not self.logprobs:
            return None
        if self.chat:
            return {"content": [self.chat_logprob(e) for e in entries], "refusal": None}
        tokens = [self.token_text(e.token) for e in entries]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self.token_text(t): v for t, v in e.top} for e in entries], "text_offset": offsets}

    def chat_logprob(self, entry) -> dict:
        def one(token, logprob):
            raw = self.token_bytes(token)
            return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}
        return {**one(entry.token, entry.logprob), "top_logprobs": [one(t, v) for t, v in entry.top]}

    def token_text(self, token: int) -> str:
        return self.token_bytes(token).decode("utf-8", errors="replace")

    # -- a whole response ------------------------------------------------------------------------

    async def whole(self) -> dict:
        async def collect(choice: Choice):
            choice.text = "".join([piece async for piece in choice.pieces])

        try:
            await asyncio.gather(*(collect(c) for c in self.choices))
        except (GenerationFailed, EngineClosed) as error:
            raise generation_error(error) from error
        for choice in self.choices:
            self.metrics.observe(choice.handle)
        return self.envelope([self.whole_choice(c) for c in self.choices], chunk=False, usage=self.usage())

    def whole_choice(self, choice: Choice) -> dict:
        logprobs = self.logprob_block(choice.new_logprobs())
        if not self.chat:
            return {"index": choice.index, "text": choice.text, "logprobs": logprobs,
                    "finish_reason": choice.finish_reason()}
        message, finish = self.message(choice)
        return {"index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": finish}

    def message(self, choice: Choice) -> tuple[dict, str]:
        """The assistant's message and finish reason: a tool call when the text is one."""
        call = parse_call(choice.text, self.tools) if self.tools else None
        if call is None:
            return {"role": "assistant", "content": choice.text}, choice.finish_reason()
        tool_call = {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                     "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}
        return {"role": "assistant", "content": None, "tool_calls": [tool_call]}, "tool_calls"

    # -- a stream ----------------------------------------------------------------------------------

    async def events(self, include_usage: bool):
        """Server-sent chunks. With tools, a choice's text is held until it ends, since only the
        whole text tells a tool call from an answer."""
        if self.chat:
            yield server_sent(self.envelope([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None} for c in self.choices],
                                            chunk=True))
        try:
            async for choice, piece, fetched in merged(self.choices):
                if piece is not None:
                    choice.text += piece
                    if not self.tools:
                        yield self.text_event(choice, piece, fetched)
                    continue
                self.metrics.observe(choice.handle)
                yield server_sent(self.envelope([self.last_chunk(choice)], chunk=True))
        except (GenerationFailed, EngineClosed) as error:
            yield server_sent(generation_error(error).body())
            yield "data: [DONE]\n\n"
            return
        if include_usage:
            yield server_sent(self.envelope([], chunk=True, usage=self.usage()))
        yield "data: [DONE]\n\n"

    def text_event(self, choice: Choice, piece: str, fetched: int) -> str:
        """The event of a text chunk of ``choice``: with logprobs built whole, else its template
        around the piece's JSON string (text_chunk_template)."""
        if self.logprobs:
            chunk = self.chunk(choice, {"content": piece}, piece, upto=fetched)
            return server_sent(self.envelope([chunk], chunk=True))
        if choice.template is None:
            choice.template = self.text_chunk_template(choice)
        before, after = choice.template
        return before + json.dumps(piece) + after

    def text_chunk_template(self, choice: Choice) -> tuple[str, str]:
        """A text chunk of ``choice`` without logprobs, as the event's text before and after the
        piece's JSON string: a streamed token then costs one json.dumps of its piece, where building
        and encoding the whole chunk was a measurable share of the event loop's time at 64 streams
        (docs/benchmarks-history.md, "A few rows, one weight row at a time")."""
        marker = "\0piece\0"
        event = server_sent(self.envelope([self.chunk(choice, {"content": marker}, marker)], chunk=True))
        before, after = event.split(json.dumps(marker))
        return before, after

    def chunk(self, choice: Choice, delta: dict, text: str, finish: str | None = None,
              upto: int | None = None) -> dict:
        logprobs = self.logprob_block(choice.new_logprobs(upto))
        if not self.chat:
            return {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return {"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def last_chunk(self, choice: Choice) -> dict:
        if not self.tools:
            return self.chunk(choice, {}, "", choice.finish_reason())
        message, finish = self.message(choice)
        if message["content"] is None:
            calls = [{"index": 0, **call} for call in message["tool_calls"]]
            return self.chunk(choice, {"tool_calls": calls}, "", finish)
        return self.chunk(choice, {"content": message["content"]}, message["content"], finish)


def server_sent(payload: dict) -> str:
    """A server-sent event carrying ``payload`` as JSON."""
    return f"data: {json.dumps(payload)}\n\n"


async def merged(choices: list[Choice]):
    """(choice, piece, tokens fetched so far) as each choice's pieces arrive, then (choice, None,
    None) when that choice ends.
    Raises the first choice's failure. Leaving early cancels every choice's stream, which aborts
    its request (the client went away)."""
    if len(choices) == 1:  # awaited in place: no task and queue of its own per token (see text_chunk_template)
        choice = choices[0]
        try:
            async for piece in choice.pieces:
                yield choice, piece, choice.handle.context.num_fetched
        finally:
            await choice.pieces.aclose()  # left early: its request is aborted now, not when collected
        yield choice, None, None
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice):
        try:
            async for piece in choice.pieces:
                await queue.put((choice, piece, choice.handle.context.num_fetched, None))
            await queue.put((choice, None, None, None))
        except (GenerationFailed, EngineClosed) as error:
            await queue.put((choice, None, None, error))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        for _ in range(len(choices)):
            while True:
                choice, piece, fetched, error = await queue.get()
                if error is not None:
                    raise error
                yield choice, piece, fetched
                if piece is None:
                    break
    finally:
        for task in tasks:
            task.cancel()
