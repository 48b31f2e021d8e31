"""The handle table: every open request's context by its number, the reasons recent ones ended,
and the handles the application let go of. The consumer's side (find, take) reads it without the
lock; everything that changes it holds the engine's lock."""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from typing import Callable

from .context import END, Failure, Handle, ResponseContext
from .errors import HandleReleased

ENDED_REMEMBERED = 4096  # ended handles whose reason a later fetch can still name


class Handles:
    """``took(ctx)`` is called in the consumer's thread as it takes each item (the host's hand-off);
    ``max_unfetched_tokens`` is where a request pauses for its consumer (EngineOptions)."""

    def __init__(self, lock: threading.RLock, wakeup: threading.Condition, max_unfetched_tokens: int,
                 took: Callable[[ResponseContext], None]):
        self.lock, self.wakeup = lock, wakeup
        self.max_unfetched_tokens = max_unfetched_tokens
        self.took = took
        self.open: dict[int, ResponseContext] = {}
        self.ended: OrderedDict[int, str] = OrderedDict()  # recent handles gone, and why
        self.dropped: deque[int] = deque()  # handles the application let go of (see Handle)
        self.launched = 0  # handles are 0, 1, 2, ... in launch order

    def __len__(self) -> int:
        return len(self.open)

    def contexts(self) -> list[ResponseContext]:
        return list(self.open.values())

    # -- under the lock ---------------------------------------------------------------------------

    def next_number(self) -> int:
        number, self.launched = self.launched, self.launched + 1
        return number

    def add(self, ctx: ResponseContext) -> None:
        self.open[ctx.handle] = ctx

    def handle(self, ctx: ResponseContext) -> Handle:
        """The application's Handle of ``ctx``: dropping its last reference queues its release."""
        handle = Handle(ctx.handle)
        handle.dropped, handle.context = self.dropped, ctx
        return handle

    def open_context(self, handle: int) -> ResponseContext | None:
        """``handle``'s context while it is open; None once released. KeyError for a handle never launched."""
        try:
            return self.find(handle)
        except HandleReleased:
            return None

    def release_dropped(self, stop: Callable[[ResponseContext], None]) -> None:
        """Release the requests whose Handle the application dropped (``stop`` takes each out of
        the scheduler); a thread blocked fetching one by its int id wakes with HandleReleased."""
        while self.dropped:
            handle = self.dropped.popleft()
            ctx = self.open.get(handle)
            if ctx is None:
                continue
            stop(ctx)
            if not ctx.finished:
                ctx.finish("abort")
            ctx.discard_unfetched()
            reason = "its Handle object was dropped (keep the Handle, not int(handle), while you fetch)"
            ctx.put(Failure(HandleReleased(f"handle {handle} was released: {reason}")))
            self.forget(handle, reason)

    def forget(self, handle: int, reason: str) -> None:
        with self.lock:
            if self.open.pop(handle, None) is not None:
                # The number, not the Handle: a Handle kept here would keep its whole context.
                self.ended[int(handle)] = reason
                if len(self.ended) > ENDED_REMEMBERED:
                    self.ended.popitem(last=False)

    # -- the consumer's side ----------------------------------------------------------------------

    def find(self, handle: int) -> ResponseContext:
        """``handle``'s context. Raises HandleReleased (a KeyError) once it was released, and
        KeyError for a handle never launched."""
        ctx = self.open.get(handle)  # a single dict read is atomic; no lock needed
        if ctx is None:
            reason = self.ended.get(handle)
            if reason is not None:
                raise HandleReleased(f"handle {handle} was released: {reason}")
            if self.was_launched(handle):
                raise HandleReleased(f"handle {handle} was released long ago (its stream ended, or its "
                                     "Handle was dropped)")
            raise KeyError(f"unknown handle {handle!r}: this engine never launched it")
        return ctx

    def take(self, handle: int, ctx: ResponseContext, item) -> int:
        """What a fetch returns for ``item``, taken from ``ctx``'s queue: a token, or END (the
        handle is then released); raises the request's error for a Failure."""
        self.took(ctx)
        if item == END or isinstance(item, Failure):
            self.forget(handle, "its stream ended and -1 was fetched" if item == END else "its request failed")
            if isinstance(item, Failure):
                raise item.error
            return END
        ctx.num_fetched += 1
        if ctx.num_unfetched == self.max_unfetched_tokens - 1:
            with self.lock:  # the consumer caught up: a paused request may run again
                self.wakeup.notify()
        return item

    def was_launched(self, handle) -> bool:
        return isinstance(handle, int) and 0 <= handle < self.launched
