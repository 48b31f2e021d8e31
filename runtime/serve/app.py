"""An OpenAI-compatible HTTP app over one shared Engine (``python -m runtime serve``).

Handlers never block the event loop: tokens are awaited through Engine.fetch_async. A client that
disconnects mid-stream cancels its handler, whose stream aborts the request at once. Every error
has OpenAI's JSON shape; a stream that fails after its first chunk ends with an error event, which
the openai client raises."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from runtime import EngineBusy, EngineClosed, GenerationConfig, GenerationFailed

from .metrics import Metrics


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    @classmethod
    def from_generation(cls, error: BaseException) -> "APIError":
        """The error of a request that failed after it was accepted."""
        if isinstance(error, EngineClosed):
            return cls(503, str(error), "server_error", "engine_closed")
        return cls(500, f"generation failed: {error}", "server_error", "generation_failed")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart]

    def as_chat(self) -> dict:
        """OpenAI's list-of-parts content joins into the one string a chat template takes."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


class Sampling(BaseModel):
    # OpenAI clients send fields Loom does not use; NaN and Infinity (which Python's JSON reads)
    # are refused here rather than deep in a step.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0)
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None
    ignore_eos: bool = False  # an extension (vLLM and llama.cpp's server take it too): for benchmarks

    def config(self, default_max_tokens: int) -> GenerationConfig:
        if self.n != 1:
            raise APIError(400, "only n=1 is supported", "invalid_request_error", "unsupported_value", "n")
        # GenerationConfig's one rule: no temperature or top_p (or temperature 0) is greedy.
        return GenerationConfig(
            max_new_tokens=self.max_completion_tokens or self.max_tokens or default_max_tokens,
            temperature=self.temperature, top_p=1.0 if self.top_p is None else self.top_p, seed=self.seed,
            stop=tuple([self.stop] if isinstance(self.stop, str) else self.stop or ()), ignore_eos=self.ignore_eos)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(Sampling):
    prompt: str | list[str]


def create_app(engine, model_name: str | None = None, api_key: str | None = None,
               default_max_tokens: int = 256) -> FastAPI:
    name = model_name or engine.name
    metrics = Metrics(engine)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        # uvicorn runs this after draining open connections on SIGTERM/SIGINT (and then re-raises
        # the signal, so code after uvicorn.run may never run).
        engine.shutdown()
        print("loom: engine shut down", flush=True)

    app = FastAPI(title="Loom", description="OpenAI-compatible API over a Loom engine", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(_, error: APIError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_, error: RequestValidationError):
        first = error.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if p != "body")
        return APIError(400, f"{param}: {first['msg']}", "invalid_request_error", "invalid_value", param).response()

    @app.exception_handler(Exception)
    async def unexpected(_, error: Exception):
        return APIError(500, f"internal error: {error!r}", "server_error", "internal_error").response()

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization") != f"Bearer {api_key}":
                return APIError(401, "incorrect API key provided", "invalid_request_error", "invalid_api_key").response()
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "loom"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest):
        prompt = [m.as_chat() for m in body.messages]
        return await complete(body, prompt, "chat.completion")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise APIError(400, "prompt must be one string (batches are not supported)",
                               "invalid_request_error", "unsupported_value", "prompt")
            prompt = prompt[0]
        return await complete(body, prompt, "text_completion")

    async def complete(body: Sampling, prompt, kind: str):
        if body.model != name:
            raise APIError(404, f"the model '{body.model}' does not exist; this server has '{name}'",
                           "invalid_request_error", "model_not_found", "model")
        try:
            config = body.config(default_max_tokens)
            ids = engine.encode(prompt)
            handle = engine.launch_response_tokens(ids, config)
        except (ValueError, TypeError) as error:
            raise APIError(400, str(error), "invalid_request_error", "invalid_value") from error
        except EngineBusy as error:
            raise APIError(429, str(error), "rate_limit_error", "engine_busy") from error
        except EngineClosed as error:
            raise APIError(503, str(error), "server_error", "engine_closed") from error
        reply = Reply(kind, name, len(ids), handle, metrics)
        pieces = engine.astream_text(handle, config.stop)
        if body.stream:
            usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(reply.events(pieces, usage), media_type="text/event-stream")
        try:
            text = "".join([piece async for piece in pieces])
        except (GenerationFailed, EngineClosed) as error:
            raise APIError.from_generation(error) from error
        return reply.whole(text)

    return app


class Reply:
    """One response in OpenAI's shapes: a whole object, or server-sent chunks ending in [DONE]."""

    def __init__(self, kind: str, model: str, prompt_tokens: int, handle, metrics: Metrics):
        self.kind, self.model, self.prompt_tokens, self.handle, self.metrics = kind, model, prompt_tokens, handle, metrics
        self.id = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def finish_reason(self) -> str:
        return "length" if self.handle.finish_reason == "length" else "stop"

    def usage(self) -> dict:
        completion = self.handle.context.num_generated
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def choice(self, text: str | None, finish: str | None, first: bool = False, chunk: bool = False) -> dict:
        if self.kind == "text_completion":
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if not chunk:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text is not None else {})
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    def envelope(self, choices: list, chunk: bool, **extra) -> dict:
        kind = self.kind + (".chunk" if chunk and self.kind == "chat.completion" else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices, **extra}

    def whole(self, text: str) -> dict:
        self.metrics.observe(self.handle)
        return self.envelope([self.choice(text, self.finish_reason())], chunk=False, usage=self.usage())

    async def events(self, pieces, include_usage: bool):
        send = lambda payload: f"data: {json.dumps(payload)}\n\n"
        if self.kind == "chat.completion":
            yield send(self.envelope([self.choice(None, None, first=True, chunk=True)], chunk=True))
        try:
            async for piece in pieces:
                yield send(self.envelope([self.choice(piece, None, chunk=True)], chunk=True))
        except (GenerationFailed, EngineClosed) as error:
            yield send(APIError.from_generation(error).body())
            yield "data: [DONE]\n\n"
            return
        self.metrics.observe(self.handle)
        yield send(self.envelope([self.choice(None, self.finish_reason(), chunk=True)], chunk=True))
        if include_usage:
            yield send(self.envelope([], chunk=True, usage=self.usage()))
        yield "data: [DONE]\n\n"


def run(engine, host: str, port: int, model_name: str | None = None, api_key: str | None = None) -> None:
    """Serve ``engine`` until SIGINT or SIGTERM. SIGTERM (an orchestrator) drains: uvicorn stops
    accepting and lets open requests finish, 30 s at most. SIGINT (Ctrl-C, a person) stops now:
    the engine shuts down at once, so open streams end with an error event and [DONE] instead
    of being cut after the drain timeout. Either way the app's lifespan then shuts the engine down."""
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if sig == signal.SIGINT:
                engine.shutdown()
            super().handle_exit(sig, frame)

    app = create_app(engine, model_name, api_key)
    print(f"serving {model_name or engine.name} on http://{host}:{port}/v1", flush=True)
    config = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=30)
    Server(config).run()
