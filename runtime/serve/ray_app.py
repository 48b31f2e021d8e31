"""Loom replicas on Ray Serve. Each replica holds one Engine behind the very app that
``python -m runtime serve`` runs (create_app), so every route, error and stream behaves the same.
In front, a thin ingress reads each request's prompt and forwards the raw HTTP request to a
replica chosen with prefix affinity: requests whose prompts start alike go to the same replica,
where its prefix cache holds their shared blocks, unless that replica's queue is much longer than
the others'. (Ray's HTTP proxy routes before it reads a body, so affinity needs this hop.) Needs the
"ray" extra; docs/scale-out.md says how to run it and what it does not do yet.

    from ray import serve
    from runtime.serve.ray_app import loom_application
    serve.run(loom_application("path/to/checkpoint", replicas=2), route_prefix="/")
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path

import ray

from fastapi import FastAPI, Request  # at module level: the route's annotations are resolved here
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import FIFOMixin, RequestRouter

REPLICA_HEADER = "x-loom-replica"
AFFINITY_CHARS = 256  # prompts alike over this many leading characters share a replica
METRICS_PERIOD_S = 2.0  # how often each replica publishes its Prometheus text
NICENESS_VARIABLE = "RAY_worker_niceness"  # Ray's own setting, read by each worker process as it starts
PROXY_READY_VARIABLE = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"  # read by a local instance's Serve controller
PROXY_READY_S = 60  # as long as serve.start waits for the proxy (Ray's own default: 5)
DRAIN_S = 30  # what a stopped replica leaves its open requests to finish (the single server's too)
CLOSE_S = 5  # then, for the ingress to end the streams cut short
APP_NAME = "default"  # serve.run's own


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Rank the replicas by rendezvous hash of (the request's affinity key, replica): the same key
    goes to the same replica while the set of replicas stays, and a replica's departure moves only
    its own keys. The first choice is skipped when it holds a whole batch (half its
    max_ongoing_requests, see loom_application) more requests than the least busy replica: until
    then an engine runs the extra requests in the same steps, and the cached prefix is worth more."""

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        key = pending_request.kwargs.get("affinity") if pending_request is not None else None
        if key is None or len(candidate_replicas) < 2:
            return [candidate_replicas]
        ranked = sorted(candidate_replicas, key=lambda r: hashlib.sha1(
            f"{key}/{r.replica_id.unique_id}".encode()).digest())
        queues = self.replica_queue_len_cache
        lengths = {r.replica_id: queues.get(r.replica_id) or 0 for r in ranked}
        shortest = min(lengths.values())
        balanced = [r for r in ranked if lengths[r.replica_id] < shortest + r.max_ongoing_requests // 2]
        return [balanced[:1], ranked]


def affinity_key(path: str, body: bytes) -> str | None:
    """The leading characters of a completion request's prompt (chat: its rendered messages)."""
    if not path.endswith("completions"):
        return None
    try:
        request = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict):
        return None
    if isinstance(request.get("messages"), list):
        text = "".join(f"{m.get('role')}:{m.get('content')}\n" for m in request["messages"] if isinstance(m, dict))
    else:
        text = str(request.get("prompt", ""))
    return hashlib.sha1(text[:AFFINITY_CHARS].encode()).hexdigest()


class LoomReplica:
    """One Engine behind create_app; ``forward`` runs one HTTP request through that app and
    streams back its status and headers, then its body as the app sends it."""

    def __init__(self, source, device, dtype, weights, model_name, api_key, engine_options, draft=None,
                 draft_weights=None):
        from runtime import Engine
        from runtime.serve import create_app

        self.engine = Engine.from_pretrained(source, device=device, dtype=dtype, weights=weights, draft=draft,
                                             draft_weights=draft_weights, **engine_options)
        self.app = create_app(self.engine, model_name, api_key)
        context = serve.get_replica_context()
        self.name = context.replica_id.unique_id
        board = MetricsBoard.options(name=f"loom-metrics-{context.app_name}", namespace="serve", get_if_exists=True,
                                     lifetime="detached").remote()
        threading.Thread(target=self._publish, args=(board,), name="loom-metrics", daemon=True).start()

    def _publish(self, board):
        """Every METRICS_PERIOD_S, this replica's Prometheus text to the board the ingress reads."""
        while not self.engine.closed:
            board.put.remote(self.name, self.app.state.metrics.render())
            time.sleep(METRICS_PERIOD_S)

    async def forward(self, method: str, path: str, query: bytes, headers: list, body: bytes, affinity=None):
        """Run one request through the app. ``affinity`` is read by PrefixAffinityRouter before the
        call reaches this replica; the replica itself has no use for it."""
        sent: asyncio.Queue = asyncio.Queue()
        done = asyncio.Event()

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
                 "root_path": "", "headers": headers, "client": None, "server": None}
        body_once = [body]

        async def receive_once():
            if body_once:
                return {"type": "http.request", "body": body_once.pop() or b"", "more_body": False}
            await done.wait()  # the response ended, or the caller went away
            return {"type": "http.disconnect"}

        app = asyncio.create_task(self.app(scope, receive_once, sent.put))
        try:
            while True:
                getter = asyncio.create_task(sent.get())
                await asyncio.wait({getter, app}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    app.result()  # raises what the app raised
                    return
                message = getter.result()
                if message["type"] == "http.response.start":
                    headers = [(k.decode(), v.decode()) for k, v in message.get("headers", [])]
                    yield {"status": message["status"], "headers": headers + [(REPLICA_HEADER, self.name)]}
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body"):
                        return
        finally:
            done.set()  # a caller that went away cancels this generator: the app sees a disconnect
            if not app.done():
                app.cancel()

    def __del__(self):  # Ray Serve calls it once the replica's open requests have drained
        self.engine.shutdown()

    def check_health(self):
        if self.engine.closed:  # its loop died: Ray replaces this replica
            raise RuntimeError(f"the engine of replica {self.name} is closed")


@ray.remote(num_cpus=0)
class MetricsBoard:
    """The latest Prometheus text of each replica of one application."""

    def __init__(self):
        self.texts: dict[str, tuple[float, str]] = {}

    def put(self, replica: str, text: str) -> None:
        self.texts[replica] = (time.monotonic(), text)

    def recent(self) -> dict[str, str]:
        """Texts published in the last three periods: a dead replica's drop out."""
        now = time.monotonic()
        return {r: text for r, (at, text) in self.texts.items() if now - at < 3 * METRICS_PERIOD_S}


def merge_metrics(texts: dict[str, str]) -> str:
    """Every replica's samples under one HELP/TYPE per metric, each labelled replica="id"
    (Prometheus sums them with sum by (...))."""
    families: dict[str, list[str]] = {}
    for replica, text in sorted(texts.items()):
        family = None
        for line in text.splitlines():
            if line.startswith("# HELP "):
                family = line.split()[2]
                families.setdefault(family, [line])
            elif line.startswith("# TYPE "):
                if len(families[family]) == 1:
                    families[family].append(line)
            elif line:
                name, _, value = line.rpartition(" ")
                base, brace, labels = name.partition("{")
                label = f'replica="{replica}"' + ("," + labels if brace else "}")
                families[family].append(f"{base}{{{label} {value}")
    return "\n".join(line for lines in families.values() for line in lines) + "\n"


def front_app(replicas):
    """The ingress: each request read once, its affinity key computed, the raw request forwarded
    to a replica, the replica's response streamed back as it comes. A replica that fails before its
    first byte is a 503; one that fails mid-stream ends the stream with an error event and [DONE],
    as the single-process server's streams end."""
    app = FastAPI(title="Loom replicas")

    @app.get("/health")
    async def health():
        """The state of every replica (Ray Serve's view): ok when all are running."""
        context = serve.get_replica_context()
        deployment = serve.status().applications[context.app_name].deployments["LoomReplica"]
        states = {str(state): count for state, count in deployment.replica_states.items()}
        running = states.get("RUNNING", 0)
        return JSONResponse({"status": "ok" if running and running == sum(states.values()) else "degraded",
                             "replicas": states}, status_code=200 if running else 503)

    @app.get("/metrics")
    async def metrics():
        """Every replica's Prometheus metrics, labelled by replica."""
        from fastapi.responses import PlainTextResponse
        board = ray.get_actor(f"loom-metrics-{serve.get_replica_context().app_name}", namespace="serve")
        return PlainTextResponse(merge_metrics(await board.recent.remote()), media_type="text/plain; version=0.0.4")

    # every method goes to a replica, whose app answers one its route does not take in OpenAI's shape
    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])
    async def forward(path: str, request: Request):
        body = await request.body()
        stream = replicas.options(stream=True).forward.remote(
            request.method, "/" + path, request.url.query.encode(), request.headers.raw, body,
            affinity=affinity_key(path, body))
        try:
            start = await stream.__anext__()
        except Exception as error:  # noqa: BLE001 - a replica died or the app is shutting down
            return JSONResponse(replica_error(error), status_code=503)

        async def rest():
            try:
                async for chunk in stream:
                    yield chunk
            except Exception as error:  # noqa: BLE001 - the replica died mid-stream
                yield f"data: {json.dumps(replica_error(error))}\n\ndata: [DONE]\n\n".encode()

        headers = {k: v for k, v in start["headers"] if k.lower() not in ("content-length", "transfer-encoding")}
        return StreamingResponse(rest(), status_code=start["status"], headers=headers)

    return app


def replica_error(error: BaseException) -> dict:
    return {"error": {"message": f"the replica serving this request failed: {type(error).__name__}: {error}",
                      "type": "server_error", "param": None, "code": "replica_failed"}}


def loom_application(source=None, *, replicas: int = 2, num_cpus: float = 1, num_gpus: float = 0,
                     device: str = "cpu", dtype=None, weights: str | None = None, model_name: str | None = None,
                     api_key: str | None = None, prefix_affinity: bool = True, drain_s: float = DRAIN_S,
                     draft=None, draft_weights: str | None = None, **engine_options):
    """A Ray Serve application for ``serve.run``: ``replicas`` Loom replicas behind one ingress.
    Each replica loads ``source`` (a path every node can read; None: the embedded default model)
    with ``engine_options`` (EngineOptions) and its ``draft`` model, if any (Engine.from_pretrained),
    and reserves ``num_cpus``/``num_gpus``. Every response
    names its replica in the ``x-loom-replica`` header. ``prefix_affinity=False`` leaves routing to
    Ray's default (power of two choices). Stopped, a replica lets its open requests finish for
    ``drain_s`` at most; past that, its open streams end with an error event and [DONE]. Raises
    ValueError/TypeError for bad counts or options before anything starts."""
    from runtime.config import EngineOptions, check_int

    check_int("replicas", replicas, 1)
    options = EngineOptions.from_kwargs(engine_options)  # bad options fail here, not in every replica
    source = None if source is None else str(Path(source).expanduser().resolve())
    if draft is not None and draft != "default":
        draft = str(Path(draft).expanduser().resolve())
    router = RequestRouterConfig(request_router_class=PrefixAffinityRouter) if prefix_affinity else None
    # Ray's default of 5 requests in flight per replica would turn affinity into spill-over: an
    # engine batches all it is given (up to max_batch_size, then its own waiting queue).
    in_flight = options.max_batch_size * 2
    engines = serve.deployment(LoomReplica, name="LoomReplica", num_replicas=replicas, max_ongoing_requests=in_flight,
                               graceful_shutdown_timeout_s=drain_s,
                               ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus,
                                                  "runtime_env": {"env_vars": at_application_priority()}},
                               **({"request_router_config": router} if router else {}))
    engines = engines.bind(source, device, dtype, weights, model_name, api_key, engine_options, draft, draft_weights)

    def build():  # evaluated in the ingress replica, where the replicas' handle is looked up by name
        context = serve.get_replica_context()
        return front_app(serve.get_deployment_handle("LoomReplica", app_name=context.app_name))

    class LoomIngress:
        def __init__(self, replicas):  # binding the replicas here deploys them with the application
            self.replicas = replicas

    ingress = serve.deployment(serve.ingress(build)(LoomIngress), name="LoomIngress",
                               max_ongoing_requests=in_flight * replicas,
                               # outlives the replicas it waits on: a stream cut by a replica's end
                               # still gets its error event and [DONE] through it
                               graceful_shutdown_timeout_s=drain_s + CLOSE_S,
                               # a thin hop that waits on the network, like Ray's own proxy: it
                               # reserves no CPU (Serve's default of 1 left `--replicas 2` on two
                               # cores waiting forever for the third)
                               ray_actor_options={"num_cpus": 0,
                                                  "runtime_env": {"env_vars": at_application_priority()}})
    return ingress.bind(engines)


def at_application_priority() -> dict[str, str]:
    """Environment variables that run a Ray worker at the niceness of the process that started Ray
    (Ray adds RAY_worker_niceness to it: 0 here), unless RAY_worker_niceness says otherwise. Ray
    adds 15, for batch jobs that must not slow the node; beside busy processes at the default nice 0
    a replica then weighs 36 to their 1024 each (two replicas beside one busy process served
    115 tok/s against 181 at nice 0; beside two they never came up). A replica serves the
    application's requests, so it runs at the application's own priority (docs/scale-out.md,
    "Shared cores")."""
    return {NICENESS_VARIABLE: os.environ.get(NICENESS_VARIABLE, "0")}


def start_ray(address: str | None = None, num_cpus: int | None = None) -> bool:
    """Join the Ray cluster at ``address`` (or RAY_ADDRESS), or start a local one; whether it
    started a local one. A local one's workers import this same Loom (its checkout on
    PYTHONPATH), whether or not it is installed."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
        return False
    checkout = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (checkout, os.environ.get("PYTHONPATH")) if p)
    # Serve's controller and HTTP proxy run at the application's priority too, and the proxy has
    # PROXY_READY_S to start: Serve kills one not ready after 5 s, and serve.start then fails on the
    # dead actor ("killed by ray.kill"); beside two busy processes on 2 cores it took 44 s.
    ready_s = os.environ.get(PROXY_READY_VARIABLE, str(PROXY_READY_S))
    env = {"PYTHONPATH": path, PROXY_READY_VARIABLE: ready_s, **at_application_priority()}
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    return True


def missing_room(replicas: int, cpus: float, gpus: float) -> str | None:
    """What the running Ray instance lacks to place every replica at once, or None. Ray Serve
    would wait for the missing room forever, saying so only in its own logs."""
    have = ray.cluster_resources()
    for name, each in (("CPU", cpus), ("GPU", gpus)):
        need, available = replicas * each, have.get(name, 0)
        if need > available:
            return (f"{replicas} replicas reserving {each:g} {name} each need {need:g} {name}s, and this Ray instance "
                    f"has {available:g}: lower --replicas or --replica-{name.lower()}s")
    return None


def run(args) -> None:
    """``python -m runtime serve --replicas N``: serve until SIGINT or SIGTERM, then drain and stop
    every replica. Returns after SIGTERM; raises KeyboardInterrupt after SIGINT (exit status 130 in
    the CLI, as the single-process server)."""
    import signal

    if start_ray(args.ray_address):  # a cluster may grow; this machine does not
        short = missing_room(args.replicas, args.replica_cpus, args.replica_gpus)
        if short:
            ray.shutdown()
            raise SystemExit(f"error: {short}")
    # Right after Ray starts (which installs its own handlers) and before anything is served: a
    # SIGTERM that comes while the replicas start (the app may answer before serve.run returns)
    # still drains and stops them instead of killing the process.
    stopped_by = []
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda number, _: (stopped_by.append(number), stop.set()))
    serve.start(http_options={"host": args.host, "port": args.port})
    options = {"max_batch_size": args.max_batch_size, "cpu_threads": args.cpu_threads,
               "max_waiting": args.max_waiting, "speculative_tokens": args.speculative_tokens}
    with without(logging.getLogger("ray.serve"), RECONNECT):
        serve.run(loom_application(args.model, replicas=args.replicas, num_cpus=args.replica_cpus,
                                   num_gpus=args.replica_gpus, device=args.device, dtype=args.dtype,
                                   weights=args.weights, model_name=args.model_name, api_key=args.api_key,
                                   drain_s=args.drain_timeout, draft=args.draft, draft_weights=args.draft_weights,
                                   **options),
                  name=APP_NAME, route_prefix="/", blocking=False)
    print(f"serving {args.replicas} replicas on http://{args.host}:{args.port}/v1", flush=True)
    stop.wait()
    # The application only, not serve.shutdown(): Serve's controller ends that by killing itself
    # under the call that asked for it, which Ray reports as "(raylet) Task ServeController.
    # graceful_shutdown failed ... killed by ray.kill"; and a cluster's Serve may hold other
    # applications. A local instance's controller and proxy end with it in ray.shutdown().
    serve.delete(APP_NAME)  # each replica finishes its requests first (drain_s at most)
    ray.shutdown()
    print("loom: replicas shut down", flush=True)
    if stopped_by[0] == signal.SIGINT:
        raise KeyboardInterrupt


# Logged by serve.run as it joins the Serve that serve.start has just started with --host and
# --port: no news. (serve.start's own, for a Serve already running on a cluster, still shows.)
RECONNECT = "Connecting to existing Serve app"


@contextlib.contextmanager
def without(logger: logging.Logger, prefix: str):
    """``logger``'s records that start with ``prefix`` dropped, inside the block."""
    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(prefix)

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)
