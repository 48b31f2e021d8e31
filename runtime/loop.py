"""The loop thread's life: how it starts, sleeps, wakes and ends, and how it lets consumers take
their tokens before the next forward (Handoff, which the CPU host uses: runtime/cpu_host.py). What
it does in a step is the worker's (runtime/worker.py)."""

from __future__ import annotations

import threading
import time
import weakref

import torch

from .errors import EngineClosed


def start(worker, wakeup: threading.Condition) -> threading.Thread:
    """Start the loop thread of ``worker``, holding it only weakly; ``worker`` going away wakes it."""
    owner = weakref.ref(worker, lambda _: notify(wakeup))
    thread = threading.Thread(target=run, args=(owner, wakeup), name="loom-engine-loop", daemon=True)
    thread.start()
    return thread


def run(owner: weakref.ref, wakeup: threading.Condition) -> None:
    """The loop thread: plan under the lock, step outside it, sleep on ``wakeup`` when there is
    nothing to run. Like concurrent.futures' workers, it holds its worker only through a weak
    reference between steps: the engine holds the worker, so an engine the application drops is
    collected, its worker with it, and the loop ends."""
    with torch.inference_mode():
        idle = True  # (started by a launch, which may be the first of a burst)
        while (worker := owner()) is not None:
            try:
                with wakeup:
                    if idle:
                        gather(wakeup)
                        idle = False
                    if worker.closed is not None:
                        return
                    plan = worker.plan()
                    if not plan:  # None: nothing runnable; empty: work that does not fit yet
                        worker = None  # sleep without keeping the worker alive
                        idle = plan is None
                        wakeup.wait(None if plan is None else 0.01)
                        continue
                worker.step(plan)
            except BaseException as error:  # the loop cannot go on: nobody may wait forever
                if worker is not None:
                    worker.close(EngineClosed(f"the engine loop died: {error!r}"), cause=error)
                return
            del worker, plan


# Woken from idleness, the loop lets a burst of launches gather before its first step, as long as
# they come less than GATHER_GAP apart (GATHER_MAX at most): threads started together launch ~0.1-1 ms
# apart. A step of a few rows costs about what reading the weights costs, one prompt or sixteen, and
# without the pause the first step took the one to four prompts launched before it began, the others
# waiting for it: W6's 16 threads, each launching a 20-token prompt on the 1.7B F32 file, had their
# first tokens after 9.1-9.2 s (a first step of 1.1 / 2.3 s, then the rest's), gathered 8.4-8.7 s; the
# default model's 16 / 64 0.62-0.65 / 2.1-2.2 s, gathered 0.50-0.52 / 1.9-2.0 (docs/benchmarks.md). A
# request alone waits GATHER_GAP more for its first token.
GATHER_GAP, GATHER_MAX = 0.002, 0.05


def gather(wakeup: threading.Condition) -> None:
    """Under ``wakeup``'s lock: wait while launches keep notifying it (GATHER_GAP, GATHER_MAX)."""
    end = time.perf_counter() + GATHER_MAX
    while (left := end - time.perf_counter()) > 0 and wakeup.wait(min(GATHER_GAP, left)):
        pass


def notify(wakeup: threading.Condition) -> None:
    with wakeup:
        wakeup.notify_all()


class Handoff:
    """After a step's delivery, the loop thread holds the next forward until the consumers that
    were blocked in fetch have taken their tokens (or a deadline passes). On the CPU the forward
    occupies every core: a consumer woken during it waits for a core and then for the GIL, which
    the loop thread keeps between operators, and the tail of the hand-off grows to milliseconds.
    Their work is done on these cores either way; doing it first costs the forward little.

    The last of them to take its token wakes the loop thread: polling their queues held a step for
    longer than the consumers needed (docs/benchmarks-history.md, "4-bit weights")."""

    def __init__(self):
        self._taken = threading.Condition(threading.Lock())
        self._waiting: set = set()  # the contexts whose consumers have yet to take this step's token

    def expect(self, contexts: list) -> None:
        """Before delivering: the consumers of ``contexts`` are blocked in fetch."""
        with self._taken:
            self._waiting = set(contexts)

    def took(self, ctx) -> None:
        """A consumer took an item of ``ctx``'s stream (called in its own thread)."""
        if ctx in self._waiting:  # a set's membership test is atomic under the GIL: no lock unless expected
            with self._taken:
                self._waiting.discard(ctx)
                if not self._waiting:
                    self._taken.notify()

    def wait(self, deadline: float) -> None:
        """Until the expected consumers have taken their tokens, or ``deadline`` (perf_counter)."""
        with self._taken:
            while self._waiting and (left := deadline - time.perf_counter()) > 0:
                self._taken.wait(left)
            self._waiting = set()
