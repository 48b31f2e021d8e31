"""Loom: an in-process LLM runtime for multithreaded Python programs."""

import gc

# Importing torch and Loom's models makes some 200k objects that live as long as the process: the collector's
# passes over them while the imports ran (386 of them, 0.45 s of a 3 s import on a Zen 3) freed nothing. The pause
# is the whole process's, for the import's few seconds; a host thread that turns collection on or off meanwhile
# finds its choice undone here.
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
    del _collecting

__all__ = ["Engine", "EngineOptions", "GenerationConfig", "EngineBusy", "EngineClosed", "GenerationFailed",
           "HandleReleased", "ContextLimitWarning", "Completion", "TokenLogprob"]
