"""How many OpenMP threads the loop thread's forward uses, on cores that other threads and
processes may share.

A parallel region ends when its slowest thread does, so on busy cores a descheduled worker holds up
every barrier and two threads can run slower than one. So the forward takes the cores that other
threads leave free; where they leave none, every thread for wider steps (which then claim their
share of the busy cores), and for one-row steps whichever count was faster lately (OneRowChoice); a
step whose rows the threads split keeps every thread, since none waits for another until it ends.

With short spins (runtime/openmp.py) the load is the fewest threads runnable besides the loop thread
(/proc/loadavg) over the last STEADY_WINDOW steps, sampled at each step's end: by then what the last
delivery woke (consumers, the server's event loop, a local client) has had a forward to finish,
where before the forward it looked like load. Elsewhere (long spins, or a process pinned to some of
the machine's cores, for which loadavg counts other cores' threads too) the loop thread's run-queue
delay during each forward (/proc/thread-self/schedstat) decides: a large share halves the count, a
quiet spell tries one more thread, and each try that finds the cores still busy doubles the wait
before the next. The reasoning at length: docs/architecture.md, "Shared cores"; the figures:
docs/benchmarks-history.md, "Shared cores", "Threads that carry their own rows", "The load's sample".

The count is the loop thread's own (libgomp's per-thread ICV, set with omp_set_num_threads): the
application's torch threads keep theirs. ``cpu_threads`` caps it; without libgomp or /proc the
count stays at the cap.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections import deque
from typing import Callable

import torch

from . import openmp

BUSY_SHARE = 0.25     # a forward that waited this share of its time for a core ran on busy cores
FIRST_BACKOFF = 8     # quiet steps before trying one more thread; doubled after each failed try
MAX_BACKOFF = 256
SCHEDSTAT = "/proc/thread-self/schedstat"
LOADAVG = "/proc/loadavg"
# Steps over which the fewest other runnable threads seen is the steady load: sampled at the steps'
# ends, bursts rarely last four, and a process that starts beside a stream counts only once it has
# filled the window (16 steps were half of a 32-token answer; "The load's sample").
STEADY_WINDOW = 4
ONE_ROW_SAMPLES = 4   # one-row forwards timed at each count before OneRowChoice compares them
ONE_ROW_RETRY = 64    # one-row steps on full cores between fresh measurements of the count not chosen
# A step that verifies proposed tokens (speculative decoding) with this many rows or fewer is still
# bound by reading the weights, as a one-row step is: it chooses its count the same way, measured for
# its own row count. On every thread beside a busy process such a 5-row step took 56 ms where one
# thread's one-row steps took 20.
NARROW_ROWS = 8


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class CpuThreads:
    """``splits(step, threads)``: whether the model's forward gives each of ``threads`` threads its
    own rows of ``step`` (models/kernels/decoder_layer.py); None where it never does."""

    def __init__(self, cap: int | None, splits: Callable[[object, int], bool] | None = None):
        self.max = min(cap, available_cores()) if cap else available_cores()
        self.splits = splits
        # /proc/loadavg counts every CPU's runnable threads: it speaks for this process's cores
        # only where they are all of them (not in a container pinned to some).
        self.sharing = (openmp.SHORT_SPIN and os.path.exists(LOADAVG) and self.max > 1
                        and available_cores() == os.cpu_count())
        self.adaptive = not self.sharing and openmp.available() and os.path.exists(SCHEDSTAT) and self.max > 1
        self.count = self.max  # for steps whose rows the threads do not split
        self.backoff = FIRST_BACKOFF
        self.quiet_steps = 0
        self.trying = False  # the current count is a try at more threads
        self.applied: tuple[int, int] | None = None  # (thread ident, count) last set
        self.started: tuple[int, float] | None = None  # (wait, clock) at the start of a measured forward
        self.others: deque[int] = deque(maxlen=STEADY_WINDOW)  # other runnable threads, one sample a step
        self.one_row = OneRowChoice(self.max)
        self.narrow = {}  # rows -> OneRowChoice, for steps that verify proposals (NARROW_ROWS)
        self.choosing: OneRowChoice | None = None  # the choice whose forward is being timed

    def before_forward(self, step=None) -> None:
        """In the loop thread: use this step's count and start measuring its wait for a core."""
        split = step is not None and self.splits is not None and self.splits(step, self.max)
        if self.sharing:
            steady = min(self.others, default=0)  # a busy loop is runnable at every sample; a burst is not
            self.count = self._beside(steady, self._choice(step))
        self._apply(self.max if split else self.count)
        # A split step waits for no thread until it ends: it says nothing of the phases' barriers.
        self.started = (run_queue_wait_ns(), time.perf_counter_ns()) if self.adaptive and not split else None

    def _choice(self, step) -> "OneRowChoice | None":
        """Where ``step`` chooses between one thread and all by timing: one row, or a few rows that
        verify proposals (NARROW_ROWS); None for wider steps."""
        rows = 0 if step is None else len(step.input_ids)
        if rows == 1:
            return self.one_row
        if getattr(step, "verifies", False) and rows <= NARROW_ROWS:
            return self.narrow.setdefault(rows, OneRowChoice(self.max))
        return None

    def _beside(self, steady: int, choice: "OneRowChoice | None") -> int:
        """The count beside ``steady`` other busy threads (see the module's doc): with no core free,
        a step wider than one row was faster on every thread ("Threads that carry their own rows")."""
        self.choosing = None
        if steady < self.max:
            return self.max - steady
        if choice is None:
            return self.max
        self.choosing = choice
        return choice.pick()

    def _apply(self, count: int) -> None:
        key = (threading.get_ident(), count)
        if self.applied != key:
            torch.get_num_threads()  # lets torch's lazy per-thread init run first, so it cannot undo ours
            if not openmp.set_thread_count(count):
                torch.set_num_threads(count)  # no libgomp: process-wide, the only knob there is
            self.applied = key

    def after_sampling(self) -> None:
        """At the step's end, after sampling: sample the load where sharing; time the forward for
        OneRowChoice if it chose the count; where adaptive, choose the next step's count from how
        long this forward waited for a core."""
        if self.sharing:
            self.others.append(other_runnable_threads())
        if self.choosing is not None:
            self.choosing.finish()
        if self.started is None:
            return
        waited = run_queue_wait_ns() - self.started[0]
        elapsed = time.perf_counter_ns() - self.started[1]
        busy = elapsed > 0 and waited > BUSY_SHARE * elapsed
        if busy and self.count > 1:
            if self.trying:
                self.backoff = min(2 * self.backoff, MAX_BACKOFF)
            self.count, self.trying, self.quiet_steps = max(1, self.count // 2), False, 0
        elif busy:
            self.quiet_steps = 0
        else:
            if self.trying:  # the try held up: more threads are worth it again
                self.backoff, self.trying = FIRST_BACKOFF, False
            self.quiet_steps += 1
            if self.count < self.max and self.quiet_steps >= self.backoff:
                self.count, self.trying, self.quiet_steps = self.count + 1, True, 0


class OneRowChoice:
    """One thread or every thread for one-row steps on cores other threads keep busy: whichever the
    last ONE_ROW_SAMPLES forwards on each were faster on, the other measured afresh every
    ONE_ROW_RETRY steps. A one-row step is bound by reading the weights, so the answer is the
    machine's: one core read them nearly as fast as two on Zen 5, at half the rate on an Emerald
    Rapids Xeon (docs/benchmarks-history.md, "An Intel Xeon")."""

    def __init__(self, most: int):
        self.times = {count: deque(maxlen=ONE_ROW_SAMPLES) for count in (1, most)}
        self.steps = 0
        self.picked: tuple[int, int] | None = None  # (count, clock) of the forward being timed

    def pick(self) -> int:
        self.steps += 1
        unmeasured = [count for count, times in self.times.items() if len(times) < ONE_ROW_SAMPLES]
        if unmeasured:
            count = unmeasured[0]
        else:
            count = min(self.times, key=lambda c: sorted(self.times[c])[ONE_ROW_SAMPLES // 2])
            if self.steps % ONE_ROW_RETRY == 0 and len(self.times) > 1:
                other = next(c for c in self.times if c != count)
                self.times[other].clear()  # measured again from the next step: the load may have changed
        self.picked = (count, time.perf_counter_ns())
        return count

    def finish(self) -> None:
        """After the forward: its time, if pick() chose its count."""
        if self.picked is not None:
            count, started = self.picked
            self.times[count].append(time.perf_counter_ns() - started)
            self.picked = None


def other_runnable_threads() -> int:
    """Threads runnable on this machine now, besides the caller: the kernel's count in
    /proc/loadavg includes it. Sampled by the loop thread while it holds the GIL, so the
    application's Python threads, this process's consumers among them, are rarely counted. Read
    with pread through a descriptor kept open: opening the file each step cost the loop thread
    several times as much, cold right after a forward (docs/benchmarks-history.md, "4-bit weights")."""
    fields = os.pread(_loadavg(), 128, 0).split()
    return max(0, int(fields[3].split(b"/")[0]) - 1)


@functools.cache  # two loop threads racing here would each open one: harmless
def _loadavg() -> int:
    return os.open(LOADAVG, os.O_RDONLY | os.O_CLOEXEC)


def run_queue_wait_ns() -> int:
    """Nanoseconds the calling thread has spent runnable but waiting for a core."""
    with open(SCHEDSTAT, "rb") as stat:
        return int(stat.read().split()[1])

