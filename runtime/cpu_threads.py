"""How many OpenMP threads the loop thread's forward uses, on cores that other threads and
processes may share.

An OpenMP parallel region ends when its slowest thread does. With another process busy on the
cores, a worker that the kernel deschedules for a time slice holds up every operator's barrier, and
while its partner spins there for libgomp's default ~300,000 iterations a two-thread forward ran
many times slower than a one-thread one (docs/benchmarks.md, "Shared cores"). With short spins
(runtime/openmp.py sets them when Loom is imported before torch) the partner soon sleeps, and every
thread helps: beside two busy processes two threads beat one at 1 to 64 streams ("Short spins"), so
the count stays at its cap.

Where libgomp spins long (torch loaded first, or a long spin the application chose), the loop
thread measures how long it waited for a core during each forward (its run-queue delay, from
/proc/thread-self/schedstat): while that is a large share of the forward it halves its thread
count, and after a quiet spell it tries one more thread again, waiting twice as long before the
next try each time a try finds the cores still busy.

The count is the loop thread's own (libgomp's per-thread ICV, set with omp_set_num_threads): the
application's torch threads keep theirs. ``cpu_threads`` caps it; without libgomp or schedstat the
count stays at the cap.
"""

from __future__ import annotations

import os
import threading
import time

import torch

from . import openmp

BUSY_SHARE = 0.25     # a forward that waited this share of its time for a core ran on busy cores
FIRST_BACKOFF = 8     # quiet steps before trying one more thread; doubled after each failed try
MAX_BACKOFF = 256
SCHEDSTAT = "/proc/thread-self/schedstat"


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class CpuThreads:
    def __init__(self, cap: int | None):
        self.max = min(cap, available_cores()) if cap else available_cores()
        self.adaptive = not openmp.SHORT_SPIN and openmp.available() and os.path.exists(SCHEDSTAT) and self.max > 1
        self.count = self.max
        self.backoff = FIRST_BACKOFF
        self.quiet_steps = 0
        self.trying = False  # the current count is a try at more threads
        self.applied: tuple[int, int] | None = None  # (thread ident, count) last set
        self.started: tuple[int, float] = (0, 0.0)

    def before_forward(self) -> None:
        """In the loop thread: use this step's count and start measuring its wait for a core."""
        key = (threading.get_ident(), self.count)
        if self.applied != key:
            torch.get_num_threads()  # lets torch's lazy per-thread init run first, so it cannot undo ours
            if not openmp.set_thread_count(self.count):
                torch.set_num_threads(self.count)  # no libgomp: process-wide, the only knob there is
            self.applied = key
        if self.adaptive:
            self.started = (run_queue_wait_ns(), time.perf_counter_ns())

    def after_forward(self) -> None:
        """Choose the next step's count from how long this forward waited for a core."""
        if not self.adaptive:
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


def run_queue_wait_ns() -> int:
    """Nanoseconds the calling thread has spent runnable but waiting for a core."""
    with open(SCHEDSTAT, "rb") as stat:
        return int(stat.read().split()[1])

