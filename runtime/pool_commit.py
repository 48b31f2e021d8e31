"""Committing the KV pool's memory ahead of the blocks the allocator hands out (CPU).

The pool is allocated zeroed but uncommitted (models/step.py): a block's pages get memory when first
written, and that first write is the forward's, storing the block's first K and V. The kernel then
zeroes the pages inside the step (2 MB at a time: the pool is in transparent huge pages), while the
step's other thread waits at its next barrier. Every 16 tokens each running request crosses into a
fresh block, and on this project's VM, whose host also backs guest memory only as it is touched, a
64-stream step that did so took about twice the others (docs/benchmarks-history.md, "The pool's
pages, and a lighter bench client").

So a thread at the lowest CPU priority commits the blocks past the allocator's high-water mark
before they are handed out, in the cores' idle moments (the loop thread's Python between
forwards, the workers' waits). It keeps the pool committed AHEAD_BYTES past the high-water mark,
from the engine's first step on: the pool's memory still grows with its use, only ahead of it.
(Twice the high-water mark committed more than a run would use, beside it, and lost that run's
speed.) Where it falls behind (a burst of long prompts, cores that other processes keep busy) the
forward commits the pages itself, as before. The thread ends once it has caught up, and starts
again when the allocator gets near; it holds the pool only while it works.
"""

from __future__ import annotations

import os
import threading
import weakref

from models.step import KVCache

AHEAD_BYTES = 128 << 20  # this much of the pool committed past the high-water mark
CHUNK_BYTES = 4 << 20   # committed at a time, between looks at how far to go


class PoolCommitter:
    """Commits ``kv_cache``'s blocks ahead of the allocator's high-water mark, in a thread of its own."""

    def __init__(self, kv_cache: KVCache):
        self._pool = weakref.ref(kv_cache)
        self.num_blocks = kv_cache.num_blocks
        self.ahead = max(1, AHEAD_BYTES // kv_cache.block_bytes)
        self.chunk = max(1, CHUNK_BYTES // kv_cache.block_bytes)
        self.committed = 0  # blocks [0, committed) are committed
        self.target = 0     # and [committed, target) are to be
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def keep_ahead_of(self, high_water: int) -> None:
        """In the loop thread after scheduling: commit ahead of ``high_water`` (the allocator's)
        in the background. Costs a comparison when there is nothing new to do."""
        target = min(self.num_blocks, high_water + self.ahead)
        if target <= self.target or self._closed:
            return
        with self._lock:
            self.target = max(self.target, target)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="loom-kv-commit", daemon=True)
                self._thread.start()

    def close(self) -> None:
        """Commit nothing more; blocks until the chunk in hand is done. (A daemon thread still in
        torch's native code when the interpreter exits is unwound through it, and the process
        aborts: "terminate called without an active exception".)"""
        with self._lock:
            self._closed = True
            self.target = self.committed
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        lowest_priority()
        while True:
            with self._lock:
                first, end = self.committed, min(self.target, self.committed + self.chunk)
                if first >= end:
                    self._thread = None
                    return
            pool = self._pool()
            if pool is None or not pool.commit(first, end):  # the engine is gone, or this system cannot
                self.close()
                continue
            del pool  # not held between chunks: an engine dropped meanwhile is freed
            with self._lock:
                self.committed = max(self.committed, end)


def lowest_priority() -> None:
    """The calling thread at nice 19 (Linux's setpriority takes a thread's id); elsewhere as it is."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass
