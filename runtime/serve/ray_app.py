"""Loom replicas on Ray Serve: N replicas, each one Engine behind the very app that
``python -m runtime serve`` runs (create_app), so every route, error and stream behaves the same.
Needs the "ray" extra (ray[serve]). docs/scale-out.md says how to run it and what it does not do yet.

    from ray import serve
    from runtime.serve.ray_app import loom_application
    serve.run(loom_application("path/to/checkpoint", replicas=2), route_prefix="/")
"""

from __future__ import annotations

import os
from pathlib import Path

REPLICA_HEADER = "x-loom-replica"


def loom_application(source=None, *, replicas: int = 2, num_cpus: float = 1, num_gpus: float = 0,
                     device: str = "cpu", dtype=None, weights: str = "float32", model_name: str | None = None,
                     api_key: str | None = None, **engine_options):
    """A Ray Serve application of ``replicas`` Loom replicas, for ``serve.run``. Each replica loads
    ``source`` (a path every node can read, or None for the embedded default model) with
    ``engine_options`` (EngineOptions) and reserves ``num_cpus``/``num_gpus``. Every response
    names its replica in the ``x-loom-replica`` header. Raises ValueError for bad counts or
    options, before anything starts."""
    from ray import serve

    from runtime.config import EngineOptions, check_int

    check_int("replicas", replicas, 1)
    EngineOptions.from_kwargs(engine_options)  # bad options fail here, not in every replica
    source = None if source is None else str(Path(source).expanduser().resolve())

    def build():  # runs in each replica (a plain function: Ray Serve calls it to make the ASGI app)
        return replica_app(source, device, dtype, weights, model_name, api_key, engine_options)

    deployment = serve.deployment(name="Loom", num_replicas=replicas,
                                  ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus})
    return deployment(serve.ingress(build)(type("LoomReplica", (), {}))).bind()


def replica_app(source, device, dtype, weights, model_name, api_key, engine_options):
    """One replica: its Engine behind create_app, each response tagged with the replica's id."""
    from ray import serve

    from runtime import Engine
    from runtime.serve import create_app

    engine = Engine.from_pretrained(source, device=device, dtype=dtype, weights=weights, **engine_options)
    app = create_app(engine, model_name, api_key)
    replica = serve.get_replica_context().replica_id.unique_id

    @app.middleware("http")
    async def tag(request, call_next):
        response = await call_next(request)
        response.headers[REPLICA_HEADER] = replica
        return response

    return app


def start_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Join the Ray cluster at ``address`` (or RAY_ADDRESS), or start a local one. A local one's
    workers import this same Loom (its checkout on PYTHONPATH), whether or not it is installed."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
        return
    checkout = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (checkout, os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})


def run(args) -> None:
    """``python -m runtime serve --replicas N``: serve until SIGINT or SIGTERM, then drain and stop
    every replica."""
    import signal
    import threading

    from ray import serve

    start_ray(args.ray_address)
    serve.start(http_options={"host": args.host, "port": args.port})
    options = {"max_batch_size": args.max_batch_size, "cpu_threads": args.cpu_threads,
               "max_waiting": args.max_waiting}
    serve.run(loom_application(args.model, replicas=args.replicas, num_cpus=args.replica_cpus,
                               num_gpus=args.replica_gpus, device=args.device, dtype=args.dtype,
                               weights=args.weights, model_name=args.model_name, api_key=args.api_key, **options),
              route_prefix="/", blocking=False)
    print(f"serving {args.replicas} replicas on http://{args.host}:{args.port}/v1", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()  # replicas finish their requests (graceful_shutdown_timeout_s), then stop
    print("loom: replicas shut down", flush=True)
