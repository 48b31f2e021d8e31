"""Loom: an in-process LLM runtime for multithreaded Python programs."""

from .config import EngineOptions, GenerationConfig
from .engine import Engine
from .errors import EngineBusy, EngineClosed, GenerationFailed

__all__ = ["Engine", "EngineOptions", "GenerationConfig", "EngineBusy", "EngineClosed", "GenerationFailed"]
