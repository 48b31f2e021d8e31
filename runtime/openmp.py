"""Loom and libgomp, the OpenMP runtime under torch's CPU operators: how long its idle workers
spin, and giving back a thread's workers.

Spinning. A worker that reaches the end of a parallel region before its partners spins for
GOMP_SPINCOUNT iterations (300,000 by default, about a millisecond) before it sleeps. On idle cores
that is what makes short regions fast; on cores that other processes share it burns the worker's
time slice while the partner it waits for waits for a core: beside busy processes two threads ran
slower than one. 2,000 spins ended that at no cost measurable on quiet cores
(docs/benchmarks-history.md, "Panel products and short spins"). libgomp reads the setting once,
when it loads with torch, so importing this module loads torch with LOAD_SETTINGS if no libgomp is
loaded yet and the application chose neither variable (they are removed again: child processes do
not inherit them). ``SHORT_SPIN`` says whether the loaded libgomp's workers wait briefly
(runtime/cpu_threads.py adapts the thread count where they do not).

Pools. libgomp gives every thread that starts a parallel region its own pool of workers, and cuts
every spin short (LOAD_SETTINGS) once it manages more threads than there are CPUs. So the engine
gives back the loading thread's pool once, and, where the spins are long, the loop thread's own
after every step, before delivery (a worker spinning for a millisecond holds the core a woken
consumer needs). With short spins the worker is asleep within microseconds anyway, and giving it
back would cost each step a join and the next forward a new thread (docs/benchmarks-history.md,
"Against the targets (2-core CPU)", "4-bit weights").
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

OMP_PAUSE_SOFT = 1
SHORT_SPIN_COUNT = 2000
# What libgomp loads with where nobody chose. The active policy changes one thing beside the count
# given: the spin of a process whose OpenMP threads outnumber its CPUs, which is what any
# application thread that has run a torch operator (and so keeps a pool) beside the loop thread
# makes it. libgomp then spins 100 iterations unless the policy is active (1,000): at 100 every
# barrier of a one-row step ended in a futex sleep and wake, a cost 1,000 spins do not have
# (docs/benchmarks-history.md, "An Intel Xeon").
LOAD_SETTINGS = {"GOMP_SPINCOUNT": str(SHORT_SPIN_COUNT), "OMP_WAIT_POLICY": "ACTIVE"}
_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def _libgomp_loaded() -> bool:
    try:
        with open("/proc/self/maps") as maps:
            return "libgomp" in maps.read()
    except OSError:  # not Linux: torch brings its OpenMP runtime with it
        return "torch" in sys.modules


def _spin_count(value: str) -> float:
    """GOMP_SPINCOUNT's value as libgomp reads it: a count with an optional k/M/G/T, or infinite."""
    value = value.strip().lower()
    if value in ("infinite", "infinity"):
        return float("inf")
    try:
        return int(value[:-1]) * _SUFFIXES[value[-1]] if value[-1:] in _SUFFIXES else int(value)
    except ValueError:
        return float("inf")  # libgomp ignores what it cannot read: its long default stays


def _load_torch() -> None:
    import torch  # noqa: F401  (loads libgomp, which reads its settings from the environment as it loads)


def _choose_spin() -> bool:
    """Where nobody chose and it is not too late, choose short spins; say whether they are short."""
    if "GOMP_SPINCOUNT" in os.environ:
        return _spin_count(os.environ["GOMP_SPINCOUNT"]) <= 10 * SHORT_SPIN_COUNT
    policy = os.environ.get("OMP_WAIT_POLICY", "").strip().lower()
    if policy:
        return policy == "passive"
    if _libgomp_loaded():  # torch came first: its libgomp spins as long as it always did
        return False
    # Only while libgomp loads: left in the environment, they would reach every child process (a
    # peer server in the bench, the application's own tools), which should choose for themselves.
    os.environ.update(LOAD_SETTINGS)
    try:
        _load_torch()
    finally:
        for name in LOAD_SETTINGS:
            del os.environ[name]
    return True


SHORT_SPIN = _choose_spin()


def release_thread_pool() -> bool:
    """Free the OpenMP workers of the calling thread (not inside a parallel region) and say
    whether it did. A no-op where torch does not use libgomp (macOS, Windows, Intel OpenMP)."""
    library = _libgomp()
    return library is not None and library.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0


def available() -> bool:
    return _libgomp() is not None


def set_thread_count(count: int) -> bool:
    """Set the calling thread's OpenMP thread count (libgomp's per-thread nthreads ICV), leaving
    other threads' alone; say whether it could."""
    library = _libgomp()
    if library is None:
        return False
    library.omp_set_num_threads(count)
    return True


@functools.cache  # two threads racing here would both find the same loaded library: no lock needed
def _libgomp() -> ctypes.CDLL | None:
    import torch  # noqa: F401  (loads torch's libgomp, which dlopen then finds by its soname)
    try:
        library = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        library.omp_pause_resource_all.argtypes = [ctypes.c_int]
        library.omp_set_num_threads.argtypes = [ctypes.c_int]
        return library
    except (OSError, AttributeError):  # not loaded, or older than OpenMP 5 (GCC 9)
        return None
