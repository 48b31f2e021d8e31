"""How many OpenMP threads the loop thread's forward uses, on cores that other threads and
processes may share.

An OpenMP parallel region ends when its slowest thread does. With another process busy on the
cores, a worker that the kernel deschedules for a time slice holds up every operator's barrier, and
while its partner spins there for libgomp's default ~300,000 iterations a two-thread forward ran
many times slower than a one-thread one (docs/benchmarks.md, "Shared cores"). With short spins
(runtime/openmp.py sets them when Loom is imported before torch) the partner soon sleeps instead,
but it still waits: beside one busy process two threads got one core's worth between them, and a
one-stream step took 32 ms where one thread, on a core of its own, took 19 ("Threads that carry
their own rows").

So the forward takes the cores that other threads leave free. Where they leave none, wide steps
run on every thread, which then claim their share of the busy cores' time, and a step of up to
FEW_ROWS rows on one thread, on every thread, or on every thread each carrying its own rows,
whichever its recent forwards at that row count were fastest on (FewRowsChoice): which wins depends
on how much of the memory bandwidth one core can draw, and how long a parked thread holds up a
phase's barrier (beside two busy processes on two Zen 5 cores: one row 19 ms on one thread against
35 on two; eight rows 52 on one, 55 on two, 43 on two with their own rows). With
short spins the loop thread samples, before each forward, how many threads are runnable besides
itself (/proc/loadavg), and the fewest over the last STEADY_WINDOW steps is the steady load (a
burst, or a consumer the last step woke, is not runnable at every sample; a busy process is).
Elsewhere (long spins, or a process pinned to some of the machine's cores, for which loadavg's
count speaks of other cores too) it measures how long it waited for a core during each forward (its
run-queue delay, from /proc/thread-self/schedstat): while that is a large share of the forward it
halves its thread count, and after a quiet spell it tries one more thread again, waiting twice as
long before the next try each time a try finds the cores still busy.

A step whose rows the threads split among them (the native decoder layers from 12 rows per thread;
models/decoder_layer.py) keeps every thread: each waits for no other until the step ends, so each
claims its own share of the cores.

The count is the loop thread's own (libgomp's per-thread ICV, set with omp_set_num_threads): the
application's torch threads keep theirs. ``cpu_threads`` caps it; without libgomp or /proc the
count stays at the cap.
"""

from __future__ import annotations

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
STEADY_WINDOW = 16    # steps over which the fewest other runnable threads seen is the steady load
FEW_ROWS = 16         # steps of up to this many rows choose their threads by measurement on full cores
CHOICE_SAMPLES = 4    # forwards timed with each option before FewRowsChoice compares them
CHOICE_RETRY = 64     # steps of a row count between fresh measurements of the options not chosen


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class CpuThreads:
    """``splits(step, threads)``: whether the model's forward gives each of ``threads`` threads its
    own rows of ``step`` (models/decoder_layer.py); None where it never does."""

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
        self.few_rows = FewRowsChoice()

    def before_forward(self, step=None) -> None:
        """In the loop thread: use this step's count (and, on full cores, whether its threads carry
        their own rows: step.own_rows) and start measuring its wait for a core."""
        if self.sharing:
            self.others.append(other_runnable_threads())
            steady = min(self.others)  # a busy loop is runnable at every sample; a burst or a woken consumer is not
            self.count = self._beside(steady, step)
        split = step is not None and self.splits is not None and self.splits(step, self.max)
        self._apply(self.max if split else self.count)
        # A split step waits for no thread until it ends: it says nothing of the phases' barriers.
        self.started = (run_queue_wait_ns(), time.perf_counter_ns()) if self.adaptive and not split else None

    def _beside(self, steady: int, step) -> int:
        """The count beside ``steady`` other busy threads (see the module's doc); on full cores, a
        step of few rows takes FewRowsChoice's option."""
        if steady < self.max:
            return self.max - steady
        if step is None or len(step.input_ids) > FEW_ROWS:
            return self.max
        options = [(1, False), (self.max, False)]
        step.own_rows = True
        if self.splits is not None and self.splits(step, self.max):
            options.append((self.max, True))
        count, step.own_rows = self.few_rows.pick((len(step.input_ids), bool(step.prefills)), options)
        return count

    def _apply(self, count: int) -> None:
        key = (threading.get_ident(), count)
        if self.applied != key:
            torch.get_num_threads()  # lets torch's lazy per-thread init run first, so it cannot undo ours
            if not openmp.set_thread_count(count):
                torch.set_num_threads(count)  # no libgomp: process-wide, the only knob there is
            self.applied = key

    def after_forward(self) -> None:
        """Time the forward for FewRowsChoice if it chose the count; where adaptive, choose the next
        step's count from how long this forward waited for a core."""
        self.few_rows.finish()
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


class FewRowsChoice:
    """For steps of a few rows on cores other threads keep busy: of the options given (thread count,
    whether each thread carries its own rows), the one the last CHOICE_SAMPLES forwards of steps of
    the same kind (row count, and whether any prefills) were fastest on; the others measured afresh
    every CHOICE_RETRY such steps. One thread read a one-row step's weights nearly as fast as two on
    Zen 5 cores (24 ms against 35 beside two busy processes) and half as fast on a Xeon's (74 against
    56; docs/benchmarks.md, "An Intel Xeon"); at eight rows beside two busy processes on Zen 5, own
    rows took 43 ms, the shared phases 55 ("A 16-bit KV pool")."""

    def __init__(self):
        self.times: dict[tuple, dict[tuple, deque]] = {}  # kind -> option -> recent forward times
        self.steps: dict[tuple, int] = {}
        self.picked: tuple[tuple, tuple, int] | None = None  # (kind, option, clock) of the forward being timed

    def pick(self, kind: tuple, options: list[tuple]) -> tuple:
        times = self.times.setdefault(kind, {})
        for option in options:
            times.setdefault(option, deque(maxlen=CHOICE_SAMPLES))
        self.steps[kind] = steps = self.steps.get(kind, 0) + 1
        unmeasured = [option for option in options if len(times[option]) < CHOICE_SAMPLES]
        if unmeasured:
            option = unmeasured[0]
        else:
            option = min(options, key=lambda o: sorted(times[o])[CHOICE_SAMPLES // 2])
            if steps % CHOICE_RETRY == 0:
                for other in options:
                    if other != option:
                        times[other].clear()  # measured again from the next steps: the load may have changed
        self.picked = (kind, option, time.perf_counter_ns())
        return option

    def finish(self) -> None:
        """After the forward: its time, if pick() chose its option."""
        if self.picked is not None:
            kind, option, started = self.picked
            self.times[kind][option].append(time.perf_counter_ns() - started)
            self.picked = None


def other_runnable_threads() -> int:
    """Threads runnable on this machine now, besides the caller: the kernel's count in
    /proc/loadavg includes it. Sampled by the loop thread while it holds the GIL, so the
    application's Python threads, this process's consumers among them, are rarely counted."""
    with open(LOADAVG, "rb") as stat:
        return max(0, int(stat.read().split()[3].split(b"/")[0]) - 1)


def run_queue_wait_ns() -> int:
    """Nanoseconds the calling thread has spent runnable but waiting for a core."""
    with open(SCHEDSTAT, "rb") as stat:
        return int(stat.read().split()[1])

