"""The OpenAI-compatible server: ``create_app(engine)`` for any ASGI host, ``run(engine, host,
port)`` for uvicorn. Needs the "server" extra (FastAPI, uvicorn)."""

from .app import create_app, run

__all__ = ["create_app", "run"]
