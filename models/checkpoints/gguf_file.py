"""A GGUF file's header read in one pass: its metadata and its table of tensors, whose data stay
memory-mapped where they lie.

gguf-py's GGUFReader builds a numpy view for every part of every field; for the default model's
49,152-token vocabulary that took 2.4 s of a 10 s load. Loom reads the same format (version 2 and 3,
little-endian) with struct over the mapped bytes, in well under a tenth of that. Arrays of strings
(a vocabulary's tokens and merges) are decoded when first read (StringArray).
"""

from __future__ import annotations

import mmap
import struct
import sys
from array import array
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# value type -> struct format of one scalar (8: string, 9: array are read apart)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]       # as torch lists it: the slowest dimension first
    type: GGMLQuantizationType
    data: np.ndarray             # the raw bytes in the file, [rows, bytes per row] (a view of the mapping)
    offset: int                  # where they start in the file

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


class StringArray(Sequence):
    """A GGUF array of strings, each decoded when first read: decoding every one made Gemma 3's
    262,144-token header take 0.11 s against 0.05, where a load whose tokenizer is cached reads only
    the few that end a stream (``indices_of``)."""

    def __init__(self, data: mmap.mmap, starts: array):
        self._data, self._starts = data, starts  # where each string's 8-byte length lies
        self._decoded: list[str] | None = None

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if self._decoded is not None:
            return self._decoded[i]
        at = self._starts[i]
        (length,) = struct.unpack_from("<Q", self._data, at)
        return self._data[at + 8:at + 8 + length].decode("utf-8", errors="replace")

    def __iter__(self):
        if self._decoded is None:
            self._decoded = [self[i] for i in range(len(self))]
        return iter(self._decoded)

    def indices_of(self, text: str) -> list[int]:
        """The indices of the strings equal to ``text``, found in the file's bytes."""
        if not self._starts:
            return []
        encoded = text.encode("utf-8")
        pattern, end, found = struct.pack("<Q", len(encoded)) + encoded, self._starts[-1] + 8, []
        end += struct.unpack_from("<Q", self._data, self._starts[-1])[0]
        at = self._data.find(pattern, self._starts[0], end)
        while at >= 0:
            i = bisect_left(self._starts, at)
            if i < len(self._starts) and self._starts[i] == at:  # (not a match inside another string)
                found.append(i)
            at = self._data.find(pattern, at + 1, end)
        return found


class GGUFFile:
    """``metadata``: every key's value (arrays as lists, numeric arrays as numpy arrays);
    ``tensors``: TensorInfo by name, in the file's order. Raises ValueError for a file that is not
    a GGUF file of a version Loom reads, or that ends early."""

    def __init__(self, path: Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            try:
                # private and writable: the tensors the kernels read where they lie (Q6_K, ...) become
                # torch tensors, which want writable memory; nothing writes them
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            except ValueError:  # an empty file cannot be mapped
                raise ValueError(f"{self.path} is not a readable GGUF file: it is empty") from None
        self._at = 0
        try:
            self._read_header()
        except struct.error:
            raise ValueError(f"{self.path} is not a readable GGUF file: it ends inside its header") from None

    def _read_header(self) -> None:
        if self._map[:4] != MAGIC:
            raise ValueError(f"{self.path} is not a readable GGUF file: it starts with {bytes(self._map[:4])!r}, "
                             f"not {MAGIC!r}")
        self._at = 4
        version, tensor_count, field_count = self._unpack("<IQQ")
        if version not in (2, 3):
            raise ValueError(f"{self.path} is not a readable GGUF file: version {version}; Loom reads versions 2 and 3")
        self.metadata = {}
        for _ in range(field_count):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I")[0])
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            dims = self._unpack(f"<{self._unpack('<I')[0]}Q")
            kind, offset = self._unpack("<IQ")
            infos.append((name, tuple(int(d) for d in reversed(dims)), kind, offset))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self._at // alignment) * alignment
        data = np.frombuffer(self._map, dtype=np.uint8)
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, kind, offset in infos:
            try:
                kind = GGMLQuantizationType(kind)
            except ValueError:
                raise ValueError(f"tensor {name} of {self.path.name} has type {kind}, which gguf does not know") from None
            block, block_bytes = GGML_QUANT_SIZES[kind]
            if shape[-1] % block:
                raise ValueError(f"tensor {name} of {self.path.name} has rows of {shape[-1]} values, not a multiple "
                                 f"of its {kind.name} blocks of {block}")
            row_bytes = shape[-1] // block * block_bytes
            rows = int(np.prod(shape[:-1], dtype=np.int64))
            first = start + offset
            if first + rows * row_bytes > len(data):
                raise ValueError(f"{self.path} is not a readable GGUF file: tensor {name} runs past its end")
            self.tensors[name] = TensorInfo(name, shape, kind, data[first:first + rows * row_bytes].reshape(rows, row_bytes),
                                            first)

    def populate(self, info: TensorInfo) -> None:
        """Map a tensor's pages in one call before it is copied whole (Linux's MADV_POPULATE_READ): a
        copy faulting them in a 4 KB page at a time took about twice as long."""
        if not sys.platform.startswith("linux"):
            return
        populate_read = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux's value, where Python does not name it
        try:
            self._map.madvise(populate_read, *self._pages(info))
        except OSError:  # before Linux 5.14: the copy faults them in
            pass

    def release(self, info: TensorInfo) -> None:
        """Let go of a tensor's pages once it has been converted (they stay in the page cache): else
        they would count in the process's resident memory until the file is unmapped."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED, *self._pages(info))

    @staticmethod
    def _pages(info: TensorInfo) -> tuple[int, int]:
        """(start, length) of the whole pages a tensor's bytes lie in, for madvise."""
        first = info.offset - info.offset % mmap.PAGESIZE
        return first, info.offset + info.nbytes - first

    def release_all(self) -> None:
        """Let go of every page of the file read so far (tensors used where they lie are read back
        from the page cache when next touched)."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._map, self._at)
        self._at += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        text = self._map[self._at:self._at + length]
        if len(text) < length:
            raise struct.error("short string")
        self._at += length
        return text.decode("utf-8", errors="replace")

    def _strings(self, count: int) -> StringArray:
        """An array of strings (a vocabulary's tokens and merges), walked over to its end: each
        string's place kept, its text decoded when read."""
        data, at, starts = self._map, self._at, array("q")
        length_at, remember = struct.Struct("<Q").unpack_from, starts.append
        for _ in range(count):
            remember(at)
            at += 8 + length_at(data, at)[0]
            if at > len(data):
                raise struct.error("short string")
        self._at = at
        return StringArray(data, starts)

    def _value(self, kind: int):
        if kind == STRING:
            return self._string()
        if kind == ARRAY:
            item, count = self._unpack("<IQ")
            if item == STRING:
                return self._strings(count)
            if item in SCALARS:  # numeric arrays (token scores, types) in one read
                dtype = np.dtype("<" + SCALARS[item])
                values = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._at).copy()
                self._at += dtype.itemsize * count
                return values
            return [self._value(item) for _ in range(count)]
        if kind not in SCALARS:
            raise ValueError(f"{self.path} is not a readable GGUF file: unknown value type {kind}")
        return self._unpack("<" + SCALARS[kind])[0]
