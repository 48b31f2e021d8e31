"""Loom: an in-process LLM runtime for multithreaded Python programs."""

from . import openmp  # first: it chooses libgomp's spin count, which must happen before torch loads
from .config import EngineOptions, GenerationConfig
from .engine import Engine
from .errors import ContextLimitWarning, EngineBusy, EngineClosed, GenerationFailed, HandleReleased
from .sampler import TokenLogprob
from .text import Completion

__all__ = ["Engine", "EngineOptions", "GenerationConfig", "EngineBusy", "EngineClosed", "GenerationFailed",
           "HandleReleased", "ContextLimitWarning", "Completion", "TokenLogprob"]
