"""``python -m runtime serve``: an OpenAI-compatible HTTP server over one shared Engine.

Handlers never block the event loop: tokens are awaited through Engine.fetch_async. A client that
disconnects mid-stream cancels its handler, whose stream aborts the request at once."""

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

from .config import GenerationConfig
from .errors import EngineBusy, EngineClosed
from .metrics import Metrics


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


class Message(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields Loom does not use
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

    def config(self, default_max_tokens: int) -> GenerationConfig:
        if self.n != 1:
            raise APIError(400, "only n=1 is supported", "invalid_request_error", "unsupported_value", "n")
        sampled = bool(self.temperature)  # temperature 0 (or none given) means greedy
        return GenerationConfig(
            max_new_tokens=self.max_completion_tokens or self.max_tokens or default_max_tokens,
            do_sample=sampled, temperature=self.temperature if sampled else 1.0,
            top_p=self.top_p or 1.0, seed=self.seed,
            stop=tuple([self.stop] if isinstance(self.stop, str) else self.stop or ()))


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
        prompt = [m.model_dump() for m in body.messages]
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
        return reply.whole("".join([piece async for piece in pieces]))

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
        async for piece in pieces:
            yield send(self.envelope([self.choice(piece, None, chunk=True)], chunk=True))
        self.metrics.observe(self.handle)
        yield send(self.envelope([self.choice(None, self.finish_reason(), chunk=True)], chunk=True))
        if include_usage:
            yield send(self.envelope([], chunk=True, usage=self.usage()))
        yield "data: [DONE]\n\n"


def add_parser(commands, add_model_arguments) -> None:
    p = commands.add_parser("serve", help="OpenAI-compatible HTTP server",
                            description="Serve the model over an OpenAI-compatible HTTP API (FastAPI + uvicorn).")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/ routes")
    p.add_argument("--max-waiting", type=int, default=None, help="requests allowed to wait; past it: HTTP 429")
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the checkpoint's name)")
    add_model_arguments(p)
    p.set_defaults(run=serve)


def serve(args) -> int:
    import uvicorn

    from .engine import Engine
    engine = Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype,
                                    max_batch_size=args.max_batch_size, max_waiting=args.max_waiting)
    app = create_app(engine, args.model_name, args.api_key)
    print(f"serving {args.model_name or engine.name} on http://{args.host}:{args.port}/v1", flush=True)
    # SIGTERM/SIGINT: uvicorn stops accepting, lets open requests finish (30 s at most), then the
    # app's lifespan shuts the engine down.
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=30)
    return 0
