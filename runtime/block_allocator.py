"""The bookkeeping of the paged KV pool: which blocks are free, who holds each, and the prefix
cache. The tensors themselves are models.step.KVCache; this side is scheduling.

A full block is named by a chained hash of (parent block's hash, the block's tokens), so equal
prefixes map to equal chains. Blocks are reference-counted; a hashed block that no request holds
stays resident and is evicted least-recently-used only when no free block is left.

Free blocks go out last freed, first: a block just released is warm in cache and its memory
committed, where one never used yet is neither (runtime/pool_commit.py). Blocks never used go out
in order, so the blocks ever used are those below ``high_water``.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockAllocator:
    """Hands out block ids, counts their holders, and remembers full blocks by content."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = enable_prefix_caching
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: the next is last
        self.high_water = 0  # blocks [0, high_water) have been handed out at some time
        self.evictable: OrderedDict[int, None] = OrderedDict()  # hashed, unheld; oldest first
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple | None] = [None] * num_blocks
        self.by_hash: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.evictable)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise MemoryError(f"asked for {n} KV blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self.free:
                block = self.free.pop()
                self.high_water = max(self.high_water, block + 1)
            else:
                block, _ = self.evictable.popitem(last=False)
                del self.by_hash[self.block_hash[block]]
                self.block_hash[block] = self.block_tokens[block] = None
            self.ref_count[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: list[int]) -> None:
        # Released in reverse so that a sequence's tail is evicted before the prefix it extends.
        for block in reversed(blocks):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                if self.block_hash[block] is None:
                    self.free.append(block)
                else:
                    self.evictable[block] = None

    def match_prefix(self, tokens: list[int], root: int | None = None) -> list[int]:
        """Take a reference on the cached blocks of ``tokens``' longest cached prefix, whose chain
        of hashes starts from ``root`` (the parent register_full_blocks was first given).

        The last token is never matched: the step that computes it produces the logits the
        request samples from.
        """
        if not self.caching:
            return []
        bs = self.block_size
        usable = (len(tokens) - 1) // bs
        blocks, parent = [], root
        for i in range(usable):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = hash((parent, chunk))
            block = self.by_hash.get(h)
            if block is None or self.block_tokens[block] != chunk:
                break
            blocks.append(block)
            parent = h
        for block in blocks:
            if self.ref_count[block] == 0:
                del self.evictable[block]
            self.ref_count[block] += 1
        return blocks

    def register_full_blocks(self, tokens: list[int], block_table: list[int], num_computed: int,
                             start: int = 0, parent: int | None = None) -> tuple[int, int | None]:
        """Name each block of a sequence, from block ``start`` on, whose tokens are all computed,
        so that later requests can share it. ``parent`` is the chained hash of the first ``start``
        blocks; returns the pair to pass as (start, parent) next time."""
        if not self.caching:
            return start, parent
        bs = self.block_size
        end = num_computed // bs
        for i in range(start, end):
            block = block_table[i]
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            parent = hash((parent, chunk))
            if self.block_hash[block] is None and parent not in self.by_hash:
                self.by_hash[parent] = block
                self.block_hash[block] = parent
                self.block_tokens[block] = chunk
        return max(start, end), parent

    def chain_hash(self, blocks: list[int]) -> int | None:
        """The chained hash after a prefix returned by ``match_prefix``."""
        return self.block_hash[blocks[-1]] if blocks else None
