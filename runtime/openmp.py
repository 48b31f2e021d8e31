"""Give back a thread's OpenMP workers, so that the engine's forward runs with spinning ones.

torch's CPU operators run on libgomp, which gives every thread that starts a parallel region its
own pool of workers, and stops letting them spin between regions once it manages more threads than
there are CPUs. So the engine gives back the loading thread's pool once, and the loop thread's own
after every step, before delivery (a worker still spinning holds the core a woken consumer needs).
The measurements behind this are in docs/benchmarks.md ("OpenMP worker pools").
"""

from __future__ import annotations

import ctypes
import functools
import os

OMP_PAUSE_SOFT = 1


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
