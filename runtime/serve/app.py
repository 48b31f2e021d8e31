"""An OpenAI-compatible HTTP app over one shared Engine (``python -m runtime serve``).

Handlers never block the event loop: tokens are awaited through Engine.fetch_async. A client that
disconnects mid-stream cancels its handler, whose stream aborts the request at once. Every error
has OpenAI's JSON shape; a stream that fails after its first chunk ends with an error event, which
the openai client raises."""

from __future__ import annotations

import contextlib

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from runtime import EngineBusy, EngineClosed

from .metrics import Metrics
from .reply import Choice, Reply
from .schema import APIError, ChatRequest, CompletionRequest, Sampling

DRAIN_S = 30  # what SIGTERM leaves open requests to finish
CLOSE_S = 5  # then, for streams to send their error event and [DONE] once the engine has shut down
RETRY_AFTER_S = 1  # a full backlog drains within steps: tell a 429's client to come back soon
REQUIRED = {"/v1/chat/completions": '"model" and "messages"', "/v1/completions": '"model" and "prompt"'}
ROUTES = ("GET /v1/models", "POST /v1/chat/completions", "POST /v1/completions", "GET /health", "GET /metrics")


def create_app(engine, model_name: str | None = None, api_key: str | None = None,
               default_max_tokens: int = 256) -> FastAPI:
    name = model_name or engine.name
    metrics = Metrics(engine)
    count_tokens = lambda text: len(engine.tokenizer.encode(text, add_special_tokens=False))

    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        # uvicorn runs this after draining open connections on SIGTERM/SIGINT (and then raises
        # the signal again: after SIGINT, code after uvicorn.run does not run).
        engine.shutdown()
        print("loom: engine shut down", flush=True)

    app = FastAPI(title="Loom", description="OpenAI-compatible API over a Loom engine", lifespan=lifespan)
    app.state.metrics = metrics  # for a host that publishes them elsewhere (ray_app's replicas)

    def respond(error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(APIError)
    async def api_error(_, error: APIError):
        return respond(error)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, error: RequestValidationError):
        return respond(body_error(request.url.path, error.errors()[0]))

    @app.exception_handler(HTTPException)  # Starlette's: unknown routes and wrong methods
    async def no_route(request, error: HTTPException):
        return respond(route_error(request.method, request.url.path, error))

    @app.exception_handler(Exception)
    async def unexpected(_, error: Exception):
        return respond(APIError(500, f"internal error: {error!r}", "server_error", "internal_error"))

    if api_key:
        app.add_middleware(RequireKey, key=api_key, refuse=respond)

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
        def launch():
            config = body.chat_config(default_max_tokens, count_tokens)
            messages, tools = body.prompt(engine.tokenizer)
            return config, engine.encode(messages, tools=tools)
        return await complete(body, launch, "chat.completion", body.logprobs, body.active_tools())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise APIError.invalid("prompt must be one string (batches are not supported)", "prompt",
                                       "unsupported_value")
            prompt = prompt[0]
        return await complete(body, lambda: (body.config(default_max_tokens, body.logprobs), engine.encode(prompt)),
                              "text_completion", body.logprobs is not None)

    async def complete(body: Sampling, launch, kind: str, logprobs: bool, tools=None):
        if body.model != name:
            raise APIError(404, f"the model '{body.model}' does not exist; this server has '{name}'",
                           "invalid_request_error", "model_not_found", "model")
        try:
            config, ids = launch()
            handles = engine.launch_choices(ids, config, body.n)
        except (ValueError, TypeError) as error:
            raise APIError.invalid(str(error)) from error
        except EngineBusy as error:
            raise APIError(429, str(error), "rate_limit_error", "engine_busy",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from error
        except EngineClosed as error:
            raise APIError(503, str(error), "server_error", "engine_closed") from error
        choices = [Choice(i, h, engine.astream_text(h, config.stop)) for i, h in enumerate(handles)]
        reply = Reply(kind, name, len(ids), choices, metrics, engine.token_bytes, logprobs, tools)
        if body.stream:
            usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(reply.events(usage), media_type="text/event-stream")
        return await reply.whole()

    return app


def body_error(path: str, first: dict) -> APIError:
    """The 400 of a body that FastAPI or the request's model refused, from its first error."""
    kind, loc, given = first["type"], [str(p) for p in first["loc"] if p != "body"], first.get("input")
    wanted = f"send a JSON object with {REQUIRED.get(path, 'the fields of this route')}"
    if kind == "json_invalid":  # FastAPI puts the offset of the JSON error where a field's name would be
        return APIError.invalid(f"the request body is not valid JSON: {first['ctx']['error']} (at character "
                                f"{loc[0]}); {wanted}", code="invalid_json")
    if not loc:  # the body as a whole
        if kind == "missing":
            return APIError.invalid(f"the request body is empty; {wanted}", code="invalid_json")
        if isinstance(given, bytes):  # FastAPI reads a body as JSON only when its Content-Type says so
            return APIError.invalid(f"the request body is not JSON (its Content-Type is not application/json); "
                                    f"{wanted}", code="invalid_json")
        return APIError.invalid(f"the request body is {json_kind(given)}, not an object; {wanted}",
                                code="invalid_json")
    param = ".".join(loc)
    if kind == "extra_forbidden" and len(loc) == 1:  # OpenAI's own words
        return APIError.invalid(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    if kind == "missing":
        return APIError.invalid(f"{param} is required" + (f"; {wanted}" if len(loc) == 1 else ""), param)
    return APIError.invalid(f"{param}: {first['msg']}", param)


def json_kind(value) -> str:
    """How JSON names the type of a parsed ``value``, with its article."""
    for kind, name in ((bool, "a boolean"), (int, "a number"), (float, "a number"), (str, "a string"),
                       (list, "an array")):
        if isinstance(value, kind):
            return name
    return "null" if value is None else "an object"


def route_error(method: str, path: str, error: HTTPException) -> APIError:
    """Starlette's refusals in OpenAI's shape: a URL that is no route, a route that takes no ``method``."""
    if error.status_code == 404:
        return APIError(404, f"unknown URL: {method} {path}; the routes are {', '.join(ROUTES)}",
                        "invalid_request_error", "unknown_url")
    if error.status_code == 405:
        allowed = (error.headers or {}).get("Allow", "")
        return APIError(405, f"{path} does not take {method}; use {allowed}", "invalid_request_error",
                        "method_not_allowed", headers=error.headers)
    kind = "server_error" if error.status_code >= 500 else "invalid_request_error"
    return APIError(error.status_code, str(error.detail), kind, headers=error.headers)


class RequireKey:
    """Refuses /v1/ requests without ``Authorization: Bearer <key>``. A plain ASGI middleware: a
    function one (``@app.middleware("http")``) pipes every streamed chunk through a memory stream
    of its own, which took a quarter of the event loop's time at 64 streams (docs/benchmarks-history.md,
    "The server's event loop")."""

    def __init__(self, app, key: str, refuse):
        self.app, self.expected, self.refuse = app, f"Bearer {key}".encode(), refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization")
            if given != self.expected:
                error = APIError(401, "incorrect API key provided", "invalid_request_error", "invalid_api_key")
                return await self.refuse(error)(scope, receive, send)
        await self.app(scope, receive, send)


def run(engine, host: str, port: int, model_name: str | None = None, api_key: str | None = None,
        drain_s: float = DRAIN_S) -> None:
    """Serve ``engine`` until SIGINT or SIGTERM, then shut it down. SIGTERM (an orchestrator)
    drains: uvicorn stops accepting and lets open requests finish, ``drain_s`` at most; then the
    engine shuts down, and the requests still open end as on SIGINT. SIGINT (Ctrl-C, a person)
    stops now: the engine shuts down at once, so every open stream ends with an error event and
    [DONE] (a whole response: a 503). Returns after SIGTERM; raises KeyboardInterrupt after SIGINT
    (exit status 130 in the CLI)."""
    import signal
    import threading

    import uvicorn

    cut = threading.Timer(drain_s, engine.shutdown)
    cut.daemon = True

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if sig == signal.SIGINT:
                engine.shutdown()
            elif not self.should_exit:
                cut.start()
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:  # said once the port is bound: a port in use fails before it
                print(f"serving {model_name or engine.name} on http://{host}:{port}/v1", flush=True)

    app = create_app(engine, model_name, api_key)
    # uvicorn's own limit, past which it cancels handlers mid-stream, only backs up the engine's
    config = uvicorn.Config(app, host=host, port=port, log_level="info",
                            timeout_graceful_shutdown=drain_s + CLOSE_S)
    # Once stopped, uvicorn raises the signal again for its previous handler; SIGTERM's default
    # would then kill the process after a clean drain, so a drain ends with status 0 instead.
    quiet = (threading.current_thread() is threading.main_thread()
             and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
    if quiet:
        signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        Server(config).run()
    finally:
        cut.cancel()
        if quiet:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
