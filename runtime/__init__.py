"""Loom: an in-process LLM runtime for multithreaded Python programs."""

import gc

# Importing torch and Loom's models makes some 200k objects that live as long as the process: the collector's
# full passes over them while the imports ran took 0.25 s of a 3 s import (a Zen 3) and freed nothing.
_collecting = gc.isenabled()
gc.disable()
try:
    from . import openmp  # first: it chooses libgomp's spin count, which must happen before torch loads
    from .config import EngineOptions, GenerationConfig
    from .engine import Engine
    from .errors import ContextLimitWarning, EngineBusy, EngineClosed, GenerationFailed, HandleReleased
    from .sampler import TokenLogprob
    from .text import Completion
finally:
    if _collecting:
        gc.enable()

__all__ = ["Engine", "EngineOptions", "GenerationConfig", "EngineBusy", "EngineClosed", "GenerationFailed",
           "HandleReleased", "ContextLimitWarning", "Completion", "TokenLogprob"]
