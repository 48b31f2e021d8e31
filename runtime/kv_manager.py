"""The KV cache's owner: the pool's tensors (models.step.KVCache), sized here; which blocks each
request holds (BlockAllocator's ids and counts); where each request stands in the prefix cache; and,
on the CPU, the committer that backs the pool with memory ahead of its use (runtime/pool_commit.py).

The scheduler decides who runs and how many tokens each; it asks this room for the blocks those
tokens need (allocate), gives them back (free) and has the computed ones named for later requests
(cache_computed_blocks). Nothing else touches a block id. For a model with recurrent layers it also
hands each admitted request a state slot (models/step.py), and keeps no prefix cache: such a
request's past is its state, which the blocks of a shared prefix do not hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from models.step import KVCache

from .block_allocator import BlockAllocator
from .config import EngineOptions
from .pool_commit import PoolCommitter


@dataclass
class HeldBlocks:
    """One request's blocks, in the order of its tokens, and how far the prefix cache names them."""

    table: list[int] = field(default_factory=list)
    num_hashed: int = 0            # leading blocks already named in the prefix cache ...
    chain_hash: int | None = None  # ... and the chained hash after them
    state_slot: int = -1           # its recurrent layers' state slot (a model with state_shapes), else -1


class KVManager:
    """Blocks for requests (keyed by their handle), over one pool. ``recompute_past``: the model's
    (models/step.py), None where it has none."""

    def __init__(self, cache: KVCache, enable_prefix_caching: bool, recompute_past: int | None = None):
        self.cache = cache
        self.block_size = cache.block_size
        self.allocator = BlockAllocator(cache.num_blocks, cache.block_size, enable_prefix_caching)
        # Its thread starts with the loop's first plan: an engine never used costs no thread and no memory.
        # (none for a pool without K/V: Mamba2's models keep states alone, taken as their slots are first used)
        self.committer = PoolCommitter(cache) if cache.data.device.type == "cpu" and cache.block_bytes else None
        self.recompute_past = recompute_past
        # The prefix cache names blocks of sequences longer than recompute_past under a root of their
        # own: their K/V were computed differently, so neither side may take the other's blocks.
        self.long_root = None if recompute_past is None else hash(("longer than", recompute_past))
        self.held: dict[int, HeldBlocks] = {}
        self.free_slots = list(range(cache.num_state_slots))[::-1]  # (popped from the end: the lowest first)

    @classmethod
    def for_model(cls, model, options: EngineOptions, device: torch.device) -> "KVManager":
        """A pool of the model's geometry: ``options.num_kv_blocks`` blocks, or as many as
        ``kv_cache_bytes`` holds. Raises ValueError when the budget cannot hold one block."""
        dtype = getattr(torch, options.kv_dtype) if options.kv_dtype else next(model.parameters()).dtype
        block_bytes = KVCache.bytes_per_block(block_size=options.block_size, dtype=dtype, **KVCache.geometry_of(model))
        num_blocks = options.num_kv_blocks or blocks_in_budget(block_bytes, options, model.max_position, device)
        # a state slot for each request that may run at once (the scheduler admits no more)
        cache = KVCache.for_model(model, num_blocks, options.block_size, dtype, device, options.max_batch_size)
        return cls(cache, options.enable_prefix_caching and not cache.num_state_slots,
                   getattr(model, "recompute_past", None))

    @property
    def keeps_state(self) -> bool:
        """Whether the model carries a state a sequence (models/step.py): its requests cannot take a
        cached prefix, nor have proposed tokens verified and the rejected ones rolled back."""
        return self.cache.num_state_slots > 0

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks no request holds, those the prefix cache keeps for later requests included."""
        return self.allocator.num_free

    @property
    def high_water(self) -> int:
        return self.allocator.high_water

    # -- the scheduler's side (under the engine's lock) -------------------------------------------

    def take_cached_prefix(self, ctx) -> int:
        """At admission: ``ctx`` takes the blocks of the longest prefix of its tokens that the prefix
        cache holds; returns how many tokens they cover (never the last one: its logits are sampled)."""
        root = self.hash_root(ctx)
        cached = self.allocator.match_prefix(ctx.tokens, root)
        held = HeldBlocks(cached, len(cached), self.allocator.chain_hash(cached) if cached else root)
        if self.keeps_state:
            held.state_slot = self.free_slots.pop()  # (IndexError: more requests running than max_batch_size)
        self.held[ctx.handle] = held
        return len(cached) * self.block_size

    def state_slot(self, ctx) -> int:
        """The state slot ``ctx`` holds (admitted with take_cached_prefix), -1 for a model without state."""
        return self.held[ctx.handle].state_slot

    def allocate(self, ctx, num_tokens: int, reserve: int = 0) -> list[int] | None:
        """Grow the blocks of ``ctx`` (admitted with take_cached_prefix) to hold its first
        ``num_tokens`` tokens and return its block table; None, taking nothing, where that needs
        more than the free blocks less ``reserve``."""
        held = self.held[ctx.handle]
        need = -(-num_tokens // self.block_size) - len(held.table)
        if need > self.allocator.num_free - reserve:
            return None
        held.table += self.allocator.allocate(need)
        return held.table

    def free(self, ctx) -> None:
        """Give back every block ``ctx`` holds (those the prefix cache names stay there until
        evicted) and forget where it stood in the prefix cache. A no-op where it holds none."""
        held = self.held.pop(ctx.handle, None)
        if held is not None:
            self.allocator.release(held.table)
            if held.state_slot >= 0:
                self.free_slots.append(held.state_slot)

    def trim(self, ctx, num_tokens: int) -> None:
        """Give back the blocks of ``ctx`` past those its first ``num_tokens`` tokens need: after a
        speculative step, blocks that held only rejected proposals (never named in the prefix
        cache: only computed tokens' blocks are)."""
        held = self.held[ctx.handle]
        keep = -(-num_tokens // self.block_size)
        if len(held.table) > keep:
            self.allocator.release(held.table[keep:])
            del held.table[keep:]

    def cache_computed_blocks(self, ctx) -> None:
        """After a step: name each block of ``ctx`` whose tokens are all computed, so that later
        requests with the same prefix share it instead of computing it."""
        held = self.held[ctx.handle]
        held.num_hashed, held.chain_hash = self.allocator.register_full_blocks(
            ctx.tokens, held.table, ctx.num_computed, held.num_hashed, held.chain_hash)

    def hash_root(self, ctx) -> int | None:
        """Where the chain of ``ctx``'s prefix-cache hashes starts (see __init__)."""
        long = self.recompute_past is not None and len(ctx.tokens) > self.recompute_past
        return self.long_root if long else None

    # -- the pool's memory ------------------------------------------------------------------------

    def commit_ahead(self) -> None:
        """In the loop thread after planning: on the CPU, have the pool's memory committed ahead
        of the blocks handed out so far."""
        if self.committer is not None:
            self.committer.keep_ahead_of(self.allocator.high_water)

    def close(self) -> None:
        if self.committer is not None:
            self.committer.close()

    def after_fork_in_child(self) -> None:
        self.committer = None  # its thread did not survive os.fork(), and its lock may be held


def blocks_in_budget(block_bytes: int, options: EngineOptions, max_position: int, device: torch.device) -> int:
    budget = options.kv_cache_bytes
    if budget is None:
        budget = int(torch.cuda.mem_get_info(device)[0] * 0.6) if device.type == "cuda" else 2 << 30
    # More blocks than every running request at full context could use would be idle memory.
    useful = options.max_batch_size * -(-max_position // options.block_size)
    if block_bytes == 0:  # a pool of states alone (Mamba2's models): its blocks count positions, one context's
        return -(-max_position // options.block_size)
    blocks = min(budget // block_bytes, useful)
    if blocks < 1:
        raise ValueError(f"kv_cache_bytes={budget} cannot hold one KV block of {block_bytes} bytes")
    return blocks
