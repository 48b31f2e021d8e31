"""Give back a thread's OpenMP workers, so that the engine's forward runs with spinning ones.

torch on Linux runs its CPU operators on GNU OpenMP (libgomp), which gives every thread that
starts a parallel region its own pool of workers. Between two regions a worker spins for a few
milliseconds before it sleeps, so the next operator starts at once; but once libgomp manages more
threads than there are CPUs, it cuts that spin to almost nothing. The thread that loaded the model
keeps its pool; beside the loop thread's own, each of the ~400 operators of a GPT-2 small step then
woke a sleeping worker through the kernel (11,400 voluntary context switches in 33 steps, against
10 on the loading thread alone), and the same forward ran 7% slower on the loop thread than on the
main thread (W1 decode step p50 125.7 against 116.9 ms over 5 runs). So the engine gives back the
loading thread's pool once, and the loop thread's own after every step: a worker left spinning
would hold a core for milliseconds while the consumers of the step's tokens wait for one (hand-off
p99 at 4 consumers 2.3-4.9 ms when the loop gave its pool back only when idle; 0.39, 0.39 and 2.79
ms in three runs giving it back after every step). A new pool costs ~0.07 ms at the next
forward's first operator; the release 0.12-0.16 ms.
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


@functools.cache  # two threads racing here would both find the same loaded library: no lock needed
def _libgomp() -> ctypes.CDLL | None:
    import torch  # noqa: F401  (loads torch's libgomp, which dlopen then finds by its soname)
    try:
        library = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        library.omp_pause_resource_all.argtypes = [ctypes.c_int]
        return library
    except (OSError, AttributeError):  # not loaded, or older than OpenMP 5 (GCC 9)
        return None
