"""The errors an application sees. Each says what went wrong; the cause rides on __cause__."""


class EngineClosed(RuntimeError):
    """The engine was shut down, or its loop died; see __cause__ for why."""


class EngineBusy(RuntimeError):
    """Launch refused: the waiting queue is at its bound (EngineOptions.max_waiting)."""


class GenerationFailed(RuntimeError):
    """This request failed inside a step (its cause is __cause__); other requests go on."""
