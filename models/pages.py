"""Memory in pages of its own, for the large buffers a model keeps: the KV pool (models/step.py)
and the weights laid out anew at load (models/kernels/block_linear.py's rows16)."""

from __future__ import annotations

import mmap

import numpy as np
import torch


def fresh_zeros(size: int) -> torch.Tensor:
    """``size`` zero bytes in pages of their own (a private anonymous mapping), in 2 MB pages where
    the system allows (madvise's MADV_HUGEPAGE: on a kernel set to give them only where asked, as
    the Zen 3's was, a product streaming weights from 4 KB pages read a one-row Q4_K matrix at
    22.1-23.4 GB/s, from 2 MB pages 27.1-27.4). Zero, so a KV pool's masked, never-written slots
    hold no NaN, yet committed only as pages are first written (or just ahead of a pool's use:
    KVCache.commit), so a generous pool costs nothing up front. Memory from the heap (numpy's zeros
    of a size glibc's malloc chose to serve from it) would be committed already, and kept by the
    process after the buffer is gone."""
    if not hasattr(mmap, "MAP_PRIVATE"):  # Windows
        return torch.from_numpy(np.zeros(size, dtype=np.uint8))
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)  # the tensor keeps it alive
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(memory, dtype=torch.uint8)


def available_memory() -> int | None:
    """Bytes the system could give this process without swapping (Linux's MemAvailable: free
    memory and the page cache it can drop); None where it does not say."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
