"""Memory in pages of its own, for the large buffers a model keeps: the KV pool (models/step.py)
and the weights laid out anew at load (models/kernels/block_linear.py's rows16 and padded_rows);
and how much memory there is to take (whether to lay out a model's weights anew at all)."""

from __future__ import annotations

import mmap
from pathlib import Path

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
    """Bytes this process could take without swapping or being killed: Linux's MemAvailable (free
    memory and the page cache the system can drop), or what the process's control group (a
    container's limit) has left if that is less; None where the system does not say."""
    try:
        with open("/proc/meminfo") as info:
            available = next((int(line.split()[1]) * 1024 for line in info if line.startswith("MemAvailable:")), None)
    except OSError:
        return None
    headroom = _group_headroom()
    return available if available is None or headroom is None else min(available, headroom)


PROC_GROUPS = "/proc/self/cgroup"  # this process's control groups, a line each
# a control group's memory files, by version: (the group's folder, its limit, what it uses)
GROUP_MEMORY = {"v2": ("/sys/fs/cgroup", "memory.max", "memory.current"),
                "v1": ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes")}


def _group_headroom() -> int | None:
    """What this process's control group may still take under its memory limit (None: no limit
    read). cgroup v2 names its group on the line "0::PATH" of /proc/self/cgroup, v1 on the memory
    controller's line; v1's usage counts the group's page cache too, so there the figure is low."""
    try:
        lines = Path(PROC_GROUPS).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(":", 2)  # id:controllers:path
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        version = "v2" if controllers == "" else "v1" if "memory" in controllers.split(",") else None
        if version is None:
            continue
        root, limit_file, usage_file = GROUP_MEMORY[version]
        group = Path(root) / path.lstrip("/")
        try:
            limit = (group / limit_file).read_text().strip()
            if limit == "max" or int(limit) >= 2**60:  # no limit (v1 writes one near 2**63)
                continue
            return int(limit) - int((group / usage_file).read_text())
        except (OSError, ValueError):
            continue
    return None
