"""The KV pool's memory: blocks reused last freed first, and committed ahead of their use
(runtime/pool_commit.py) without a value in them changing."""

import ctypes
import mmap
import sys
import threading
import time

import pytest
import torch

from models.step import KVCache
from runtime import Engine, GenerationConfig, pool_commit
from runtime.block_allocator import BlockAllocator
from runtime.pool_commit import PoolCommitter

from ..conftest import new_threads

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="the pool is committed with Linux's madvise")


def resident_pages(address: int, length: int) -> list[bool]:
    """mincore(2): whether each page of the range has memory behind it."""
    first = address - address % mmap.PAGESIZE
    pages = (length + address - first + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(first, length + address - first, vector) == 0, ctypes.get_errno()
    return [bool(v & 1) for v in vector]


def blocks_resident(pool: KVCache, first: int, end: int) -> bool:
    """Whether every layer's K and V pages of blocks [first, end) are resident."""
    per_block = pool.data[0, 0, 0].numel() * pool.data.element_size()
    return all(all(resident_pages(pool.data[kv, layer].data_ptr() + first * per_block, (end - first) * per_block))
               for kv in range(2) for layer in range(pool.data.shape[1]))


def test_released_blocks_go_out_again_before_unused_ones():
    allocator = BlockAllocator(num_blocks=10, block_size=4, enable_prefix_caching=False)
    first = allocator.allocate(3)
    assert first == [0, 1, 2] and allocator.high_water == 3
    allocator.release(first)
    assert sorted(allocator.allocate(2)) == [0, 1] and allocator.high_water == 3  # warm, committed: first
    assert allocator.allocate(2) == [2, 3] and allocator.high_water == 4


@linux_only
def test_commit_backs_blocks_with_memory_and_keeps_their_values():
    # 128 MB: above glibc's largest mmap threshold, so fresh pages rather than reused heap
    pool = KVCache(num_layers=2, num_blocks=4096, block_size=16, num_kv_heads=2, head_dim=64,
                   dtype=torch.float32, device="cpu")
    pool.data[:, :, 5].normal_()  # a block in use, inside the range to commit
    values = pool.data[:, :, 5].clone()
    assert not blocks_resident(pool, 600, 700)  # allocated, untouched: no memory yet
    assert pool.commit(0, 700)
    assert blocks_resident(pool, 0, 700)
    assert not blocks_resident(pool, 2000, 3000)  # nor more than asked (far from the 2 MB pages asked for)
    assert torch.equal(pool.data[:, :, 5], values) and not pool.data[:, :, 6:].any()


@linux_only
def test_the_engine_commits_blocks_ahead_of_those_it_has_handed_out(llama, monkeypatch):
    monkeypatch.setattr(pool_commit, "AHEAD_BYTES", 1 << 20)  # 64 of this model's blocks, not the whole pool
    with Engine.from_pretrained(llama, num_kv_blocks=4000) as engine:
        committer = engine.kv_manager.committer
        assert committer.ahead == (1 << 20) // engine.kv_cache.block_bytes == 64
        handles = [engine.launch_response_tokens([4 + i] + list(range(10, 45)), GenerationConfig(max_new_tokens=20))
                   for i in range(6)]
        for handle in handles:
            list(engine.stream_response_tokens(handle, timeout=60))
        high_water = engine.kv_manager.high_water
        assert high_water >= 6 * 3  # each request took three blocks or more
        deadline = time.monotonic() + 30
        while committer.committed < high_water + committer.ahead and time.monotonic() < deadline:
            time.sleep(0.01)
        assert committer.committed == high_water + committer.ahead
        assert blocks_resident(engine.kv_cache, high_water, high_water + committer.ahead)
        assert not blocks_resident(engine.kv_cache, 2000, 2100)  # nor more than asked


@linux_only
def test_an_engine_never_used_starts_no_thread_and_commits_no_pool_memory(llama):
    before = {thread.ident for thread in threading.enumerate()}
    with Engine.from_pretrained(llama, num_kv_blocks=512) as engine:
        time.sleep(0.2)  # a committer started at creation would have begun by now
        assert {thread.ident for thread in threading.enumerate()} == before
        assert not any(resident_pages(engine.kv_cache.data.data_ptr(), engine.kv_cache.data.nbytes))
        handle = engine.launch_response_tokens([4, 5, 6], GenerationConfig(max_new_tokens=2))
        list(engine.stream_response_tokens(handle, timeout=60))
        assert blocks_resident(engine.kv_cache, 0, 1)


def test_a_closed_committer_commits_nothing_more():
    pool = KVCache(num_layers=1, num_blocks=64, block_size=16, num_kv_heads=1, head_dim=16,
                   dtype=torch.float32, device="cpu")
    committer = PoolCommitter(pool)
    committer.close()
    before = set(threading.enumerate())
    committer.keep_ahead_of(10)
    assert committer.target == 0 and not new_threads(before, "loom-kv-commit")


@linux_only
def test_shutdown_waits_for_the_committer(llama, monkeypatch):
    """A committer still in torch's native code when the interpreter exits is unwound through it
    and the process aborts ("terminate called without an active exception"; the CLI's chat test
    saw it): shutdown, which atexit runs, returns only once the committer's thread has ended."""
    monkeypatch.setattr(pool_commit, "AHEAD_BYTES", 1 << 30)  # far more than it commits in a step
    before = set(threading.enumerate())
    engine = Engine.from_pretrained(llama, num_kv_blocks=60000)
    list(engine.stream_response_tokens(engine.launch_response_tokens([4, 5, 6], GenerationConfig(max_new_tokens=2))))
    assert new_threads(before, "loom-kv-commit")  # still committing
    engine.shutdown()
    assert not new_threads(before, "loom-kv-commit")
