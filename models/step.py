"""The contract between the runtime and the models: what one forward reads (a StepInput) and
where keys and values live (the KVCache tensors). The runtime builds a StepInput from its
requests; a model reads it and knows nothing of requests, threads or scheduling.

Every token of a step sits in one 1-D sequence: first the one-token entries (decodes), longest
context first, then each prefill chunk. Nothing is padded to the longest request. A sequence that
verifies proposed tokens (speculative decoding: every token's logits sampled) comes as one-token
rows of its own, one per token, among the decodes (StepInput.verifies). Decode attention
runs as a few batched calls, one per group of similar context lengths, each padding its block
tables only to the longest in its group.

A model whose K/V depend on how many tokens the sequence holds (longrope's two factor sets) has
an attribute ``recompute_past``, a length: a sequence that grows past it is recomputed from its
first token, and K/V computed on one side of that length never serve a sequence on the other.
A model without it may leave K/V in place whatever the length.

A model with layers that keep a row a token instead of K/V (LFM2's short convolutions, which read
the rows of the tokens before) has an attribute ``conv_rows``, (those layers, the rows' width): the
pool keeps those rows beside the K/V, in the same blocks, so that prefix caching, preemption and
speculative decoding treat them as K/V. Its ``num_layers`` counts the layers that keep K/V.

A model with layers that carry a state a sequence from token to token (Qwen3.5's gated delta rule,
whose state is a matrix a head: megabytes a sequence, too much to keep a token or a block) has an
attribute ``state_shapes``, (those layers, the shapes of a sequence's state tensors in each): the
pool keeps ``state_slots`` such states, and each Sequence names the slot it reads and writes
(``state_slot``). A sequence's computed tokens are its state: a chunk at position 0 starts from
zeros (the model's part), and none can be shared, skipped or rolled back, so such a model runs without
prefix caching and without speculative decoding (the runtime's part).

A model whose K/V layers differ in heads or head size (Gemma 4's sliding-window layers keep more,
narrower heads than its global ones) has an attribute ``kv_layer_shapes``, (kv heads, head size) for
each of its ``num_layers`` K/V layers: each layer's K and V then lie in the pool as their own
contiguous tensors, and a block's bytes are the sum of theirs.

A model whose forward may give each CPU thread rows of its own (the native decoder layers) has a
method ``splits_rows(step, threads, kv_cache)`` saying whether it will for a step: the runtime
chooses the step's thread count by it.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from dataclasses import dataclass

import torch

from .pages import fresh_zeros

# madvise(2)'s MADV_POPULATE_WRITE (Linux 5.14): back a range with memory now, its contents kept.
POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


@dataclass
class Sequence:
    """One request's share of a step: the tokens it computes and where their K/V go."""

    token_ids: list[int]    # the tokens computed this step
    start: int              # position of the first of them in the request
    block_table: list[int]  # the request's KV blocks, covering at least start + len(token_ids)
    sample: bool            # the step ends the request's known tokens: its last logits are sampled
    length: int | None = None  # the tokens the request holds (prompt and output so far); None: the step's end
    # With sample: how many of its last tokens' logits are sampled. More than one where a step verifies
    # proposed tokens (speculative decoding): the logits after each of them, and after the token before.
    num_sampled: int = 1
    state_slot: int = -1  # the pool's state slot of the request (a model with state_shapes), else -1


@dataclass
class PrefillChunk:
    start: int                 # where its tokens begin in the flat batch
    end: int
    first_position: int        # position of its first token in its sequence
    block_table: torch.Tensor  # the blocks that hold positions [0, first_position + end - start)


@dataclass
class DecodeGroup:
    start: int                  # its one-token entries are tokens [start, end) of the batch
    end: int
    block_tables: torch.Tensor  # [end - start, max_blocks], padded with block 0
    context_lens: torch.Tensor  # [end - start] keys each token attends to


# A decode whose table is shorter than this share of its group's longest starts a new group:
# padding costs copies and attention over masked keys, a group costs a few calls per layer.
GROUP_FILL = 0.6
MAX_GROUPS = 4


@dataclass
class StepInput:
    input_ids: torch.Tensor        # [T]
    positions: torch.Tensor        # [T]
    slot_mapping: torch.Tensor     # [T] where each token's K/V is written in the pool
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    sample_indices: torch.Tensor   # [S] flat positions whose logits are sampled, in the sequences' order
    block_size: int
    lengths: list[int] | None = None  # Sequence.length of each one-token row's and then each chunk's sequence
    # Some one-token rows verify proposed tokens (Sequence.num_sampled): rows of one sequence, each of
    # which reads the K/V the others at lower positions write in this step. A forward must write every
    # row's K/V before any row attends (what a layer does), and so must not give threads rows of their
    # own to carry through the layers alone.
    verifies: bool = False
    # each one-token row's and then each chunk's Sequence.state_slot, as ``lengths`` (None: no slots)
    state_slots: torch.Tensor | None = None

    def sequence_starts(self) -> list[int]:
        """The rows where a sequence starts, in order: each decode row (they come first; a step that
        verifies proposals has rows of one sequence among them), then each prefill chunk's first."""
        chunks = [chunk.start for chunk in self.prefills]
        decode_rows = chunks[0] if chunks else len(self.input_ids)
        return list(range(decode_rows)) + chunks

    def row_state_slots(self) -> torch.Tensor:
        """Each row's state slot (``state_slots`` is a sequence's: one a decode row, one a chunk's rows)."""
        starts = self.sequence_starts() + [len(self.input_ids)]
        rows = torch.tensor([end - start for start, end in zip(starts, starts[1:])], device=self.state_slots.device)
        return torch.repeat_interleave(self.state_slots, rows)

    @classmethod
    def flatten(cls, sequences: list[Sequence], block_size: int, device: torch.device) -> "StepInput":
        """One flat batch of ``sequences``, which must list one-token entries first, longest
        context first. A sequence whose every token is sampled (num_sampled > 1: it verifies the
        tokens proposed after its last one) is laid out as one-token rows, merged among the others
        by context length: each row attends to its own prefix, as a prefill chunk's tokens would, and
        a step of decodes and verifications stays a decode-only step. Sampled rows come out in the
        order of their sequences (a sequence's several, in the order of its tokens)."""
        rows, chunks, plain = [], [], []  # rows: (context length, sequence, token); chunks: sequences
        for i, seq in enumerate(sequences):
            n = len(seq.token_ids)
            if seq.sample and not 1 <= seq.num_sampled <= n:
                raise ValueError(f"sequence {i}: num_sampled must be in [1, {n}] (its tokens), got {seq.num_sampled}")
            if n == 1:
                if chunks or plain and seq.start + 1 > plain[-1]:
                    # the decode groups index the batch's first rows: anything else would leave a row's
                    # attention unwritten (or pad a group's tables to the wrong width)
                    raise ValueError(f"sequence {i}: one-token entries must come before every prefill chunk, "
                                     "longest context first")
                plain.append(seq.start + 1)
                rows.append((seq.start + 1, i, 0))
            elif seq.sample and seq.num_sampled == n:
                rows += [(seq.start + j + 1, i, j) for j in range(n)]
            else:
                chunks.append(i)
        verifies = len(rows) > len(plain)
        if verifies:
            rows.sort(key=lambda row: -row[0])  # stable: the plain decodes keep their order

        ids, positions, slots, lengths, tables, context_lens, state_slots = [], [], [], [], [], [], []
        where = {}  # (sequence, token) -> a row's flat position; (sequence, 0) -> where a chunk starts
        for flat, (context, i, j) in enumerate(rows):
            seq = sequences[i]
            position = context - 1
            table = seq.block_table
            ids.append(seq.token_ids[j])
            positions.append(position)
            slots.append(table[position // block_size] * block_size + position % block_size)
            tables.append(table[:-(-context // block_size)])
            context_lens.append(context)
            lengths.append(seq.length or seq.start + len(seq.token_ids))
            state_slots.append(seq.state_slot)
            where[i, j] = flat
        prefills = []
        for i in chunks:
            seq = sequences[i]
            start, first, n = len(ids), seq.start, len(seq.token_ids)
            span = range(first, first + n)
            table = seq.block_table
            ids += seq.token_ids
            positions += span
            slots += [table[p // block_size] * block_size + p % block_size for p in span]
            prefills.append(PrefillChunk(start, start + n, first,
                                         torch.tensor(table[:-(-(first + n) // block_size)], device=device)))
            lengths.append(seq.length or first + n)
            state_slots.append(seq.state_slot)
            where[i, 0] = start
        samples = []
        for i, seq in enumerate(sequences):
            if not seq.sample:
                continue
            n = len(seq.token_ids)
            if n == 1 or seq.num_sampled == n:  # rows, wherever the sort put them
                samples += [where[i, j] for j in range(n)]
            else:  # a chunk's last tokens
                samples += range(where[i, 0] + n - seq.num_sampled, where[i, 0] + n)

        as_tensor = lambda data: torch.tensor(data, dtype=torch.long).to(device, non_blocking=True)
        groups = []
        for start, end in group_by_length([len(t) for t in tables]):
            width = len(tables[start])
            padded = [t + [0] * (width - len(t)) for t in tables[start:end]]
            groups.append(DecodeGroup(start, end, as_tensor(padded).view(end - start, width),
                                      as_tensor(context_lens[start:end])))
        keeps_state = any(slot >= 0 for slot in state_slots)
        return cls(as_tensor(ids), as_tensor(positions), as_tensor(slots), groups, prefills,
                   as_tensor(samples), block_size, lengths, verifies, as_tensor(state_slots) if keeps_state else None)


def group_by_length(widths: list[int]) -> list[tuple[int, int]]:
    """Split decodes (sorted by block-table width, longest first) into ranges of similar width."""
    groups, start = [], 0
    for i, width in enumerate(widths):
        if width < GROUP_FILL * widths[start] and len(groups) < MAX_GROUPS - 1:
            groups.append((start, i))
            start = i
    return groups + [(start, len(widths))] if widths else []


class KVCache:
    """Per-layer K and V tensors of shape [num_blocks, block_size, num_kv_heads, head_dim] (a layer's own
    heads and size where ``layer_shapes`` lists them), and for a model with convolution layers
    (``conv_rows``: their count and width) each such layer's input rows, [num_blocks, block_size, width];
    allocated once, a step writes only its new tokens' rows and reads through block tables. For a model
    with recurrent layers (``state_shapes``: their count and the shapes of a sequence's state in each),
    ``state_slots`` states a layer, in float32 at least (as llama.cpp keeps them): on the CPU their
    memory is taken as slots are first used, on a GPU at once.

    ``data`` holds every layer's K/V: [2, layers, num_blocks, block_size, heads, head size] where the
    layers are alike, else one flat buffer of runs [K of each layer][V of each layer]; either way each
    run is num_blocks blocks of one layer's K or V (``commit`` backs a range of blocks run by run)."""

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device,
                 conv_rows: tuple[int, int] = (0, 0), state_shapes: tuple[int, tuple] = (0, ()), state_slots: int = 0,
                 layer_shapes: tuple[tuple[int, int], ...] | None = None):
        self.layer_shapes = self.layer_shapes_of(num_layers, num_kv_heads, head_dim, layer_shapes)
        if len(set(self.layer_shapes)) <= 1:
            self.data = self._pool((2, num_layers, num_blocks, block_size, num_kv_heads, head_dim), dtype, device)
            self.runs = [self.data[kv, layer] for kv in range(2) for layer in range(num_layers)]
        else:
            shapes = self.layer_shapes * 2  # (each layer's K, then each layer's V)
            sizes = [num_blocks * block_size * heads * dim for heads, dim in shapes]
            self.data = self._pool((sum(sizes),), dtype, device)
            self.runs = [run.view(num_blocks, block_size, *shape)
                         for run, shape in zip(self.data.split(sizes), shapes)]
        conv_layers, conv_width = conv_rows
        self.conv = self._pool((conv_layers, num_blocks, block_size, conv_width), dtype, device)
        state_layers, shapes = state_shapes
        state_dtype = torch.promote_types(dtype, torch.float32)
        self.states = [self._pool((state_layers, state_slots, *s), state_dtype, device) for s in shapes]
        self.num_state_slots = state_slots if shapes else 0
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch = [torch.empty(0, dtype=dtype, device=device) for _ in range(2)]  # for K, for V

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int, dtype: torch.dtype, device,
                  state_slots: int = 1) -> "KVCache":
        """A pool of ``num_blocks`` blocks in ``model``'s geometry (geometry_of), and ``state_slots``
        sequences' states where the model keeps any."""
        return cls(num_blocks=num_blocks, block_size=block_size, dtype=dtype, device=device,
                   state_shapes=getattr(model, "state_shapes", (0, ())), state_slots=state_slots,
                   **cls.geometry_of(model))

    @staticmethod
    def geometry_of(model) -> dict:
        """What a pool for ``model`` holds a block, by this class's argument names: the model's K/V layers,
        heads and head size (each layer's, where they differ), and its convolution layers' rows where it
        has them (the module docstring, and models/__init__.py's contract). (A recurrent layer's state is a
        sequence's, not a block's.)"""
        return {"num_layers": model.num_layers, "num_kv_heads": model.num_kv_heads, "head_dim": model.head_dim,
                "conv_rows": getattr(model, "conv_rows", (0, 0)),
                "layer_shapes": getattr(model, "kv_layer_shapes", None)}

    @staticmethod
    def layer_shapes_of(num_layers, num_kv_heads, head_dim, layer_shapes) -> list[tuple[int, int]]:
        """(heads, head size) of each K/V layer: ``layer_shapes`` where given, else every layer alike."""
        if layer_shapes is None:
            return [(num_kv_heads, head_dim)] * num_layers
        if len(layer_shapes) != num_layers:
            raise ValueError(f"{len(layer_shapes)} K/V layer shapes for {num_layers} K/V layers")
        return [tuple(shape) for shape in layer_shapes]

    @staticmethod
    def _pool(shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
        if torch.device(device).type == "cpu" and torch.Size(shape).numel() > 0:
            size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            return fresh_zeros(size).view(dtype).view(shape)
        return torch.zeros(shape, dtype=dtype, device=device)

    @property
    def dtype(self) -> torch.dtype:
        """The elements' type: the model's, or a 16-bit one the attention widens as it reads."""
        return self.data.dtype

    @property
    def block_bytes(self) -> int:
        """The memory one block takes, K and V of every layer (and the convolution layers' rows)."""
        conv_layers, _, _, conv_width = self.conv.shape
        return self.bytes_per_block(self.num_layers, self.block_size, 0, 0, self.dtype, (conv_layers, conv_width),
                                    self.layer_shapes)

    def commit(self, first: int, end: int) -> bool:
        """Back blocks [first, end) with memory now, their contents unchanged, so that the first
        K/V written there does not wait for the pages (runtime/pool_commit.py). False where
        that cannot be done: a GPU pool, or a system without MADV_POPULATE_WRITE."""
        if self.data.device.type != "cpu" or not _populate_write.available:
            return False
        # runs of num_blocks blocks: each layer's K, each layer's V, then each convolution layer's rows
        for run in (*self.runs, *self.conv):
            per_block = run[0].numel() * run.element_size()
            if per_block and not _populate_write(run.data_ptr() + first * per_block, (end - first) * per_block):
                return False
        return True

    def zero_(self) -> None:
        """Zero every element (and so touch every page: a benchmark commits the pool before it times)."""
        for pool in (self.data, self.conv, *self.states):
            pool.zero_()

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V layer ``index``'s K and V, [num_blocks, block_size, heads, head size] each."""
        return self.runs[index], self.runs[self.num_layers + index]

    def conv_layer(self, index: int) -> torch.Tensor:
        """Convolution layer ``index``'s rows, [num_blocks, block_size, width]."""
        return self.conv[index]

    def state_layer(self, index: int) -> list[torch.Tensor]:
        """Recurrent layer ``index``'s states, a tensor [state_slots, *shape] for each of the model's shapes."""
        return [states[index] for states in self.states]

    def gather(self, cache: torch.Tensor, blocks: torch.Tensor, which: int, dtype: torch.dtype) -> torch.Tensor:
        """``cache[blocks]`` (which: 0 for K, 1 for V) in ``dtype``, the model's (a 16-bit pool is
        widened here), gathered into a buffer reused by every layer and step: a fresh tensor of this
        size (100+ MB for a large decode batch) comes from new pages each time, and the page faults
        cost ten times the copy. Only the loop thread calls this."""
        shape = (blocks.numel(),) + tuple(cache.shape[1:])
        need = torch.Size(shape).numel()
        if self.scratch[which].numel() < need:
            self.scratch[which] = torch.empty(need + need // 4, dtype=cache.dtype, device=cache.device)
        out = self.scratch[which][:need].view(shape)
        return torch.index_select(cache, 0, blocks, out=out).to(dtype)

    @classmethod
    def bytes_per_block(cls, num_layers, block_size, num_kv_heads, head_dim, dtype,
                        conv_rows: tuple[int, int] = (0, 0), layer_shapes=None) -> int:
        """The memory one block of a pool of this geometry takes, K and V of every layer and the
        convolution layers' rows: the engine sizes the pool from it before the pool exists."""
        element = torch.empty((), dtype=dtype).element_size()
        conv_layers, conv_width = conv_rows
        kv = sum(heads * dim for heads, dim in cls.layer_shapes_of(num_layers, num_kv_heads, head_dim, layer_shapes))
        return (2 * kv + conv_layers * conv_width) * block_size * element


class _PopulateWrite:
    """madvise(MADV_POPULATE_WRITE) over the pages of a range, through ctypes (which releases the
    GIL for the call). Unavailable off Linux, and from its first refusal on: a kernel older than
    5.14 (EINVAL), or no memory to commit now (ENOMEM; the forward's own writes then fault it in)."""

    def __init__(self):
        self.available = sys.platform == "linux"
        if self.available:
            self._madvise = ctypes.CDLL(None, use_errno=True).madvise
            self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            self._madvise.restype = ctypes.c_int

    def __call__(self, address: int, length: int) -> bool:
        first = address - address % mmap.PAGESIZE  # madvise takes whole pages
        if self._madvise(first, length + address - first, POPULATE_WRITE) == 0:
            return True
        self.available = False
        return False


_populate_write = _PopulateWrite()
