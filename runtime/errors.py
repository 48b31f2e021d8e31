"""The errors an application sees. Each says what went wrong; the cause rides on __cause__."""


class EngineClosed(RuntimeError):
    """The engine was shut down, or its loop died; see __cause__ for why."""


class EngineBusy(RuntimeError):
    """Launch refused: the waiting queue is at its bound (EngineOptions.max_waiting)."""


class GenerationFailed(RuntimeError):
    """This request failed inside a step (its cause is __cause__); other requests go on."""


class HandleReleased(KeyError):
    """The request behind a handle is gone: its stream ended and was fetched, or its Handle
    object was dropped. A KeyError, as for any unknown handle, with a message that says which."""

    def __str__(self):  # KeyError would print the message in quotes
        return str(self.args[0]) if self.args else ""


class ContextLimitWarning(UserWarning):
    """A request cannot generate max_new_tokens: the context ends first. Turn it into an error
    with ``warnings.simplefilter("error", ContextLimitWarning)``."""
