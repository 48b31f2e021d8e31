"""The CPU decode-attention kernel (paged_decode.cpp): built with the system C++ compiler on
first use, cached by source and flags, and called through ctypes.

It reads each key and value once, straight from the pool through the block tables; the torch path
(gather into a padded buffer, then SDPA) reads the cache twice and writes it once. Where no compiler
is found or the build fails, ``kernel()`` returns None and attention stays on the torch path, with
one warning that says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from .gguf import cache_dir

SOURCE = Path(__file__).with_name("paged_decode.cpp")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
SYMBOLS = {torch.float32: "loom_decode_attention_f32", torch.float64: "loom_decode_attention_f64"}
DISABLE = "LOOM_DISABLE_KERNELS"  # set to 1 to keep attention on the torch path

_lock = threading.Lock()
_library: ctypes.CDLL | None | bool = False  # False: not tried yet; None: unavailable


def kernel() -> ctypes.CDLL | None:
    """The loaded library, building it on the first call (once per machine and source)."""
    global _library
    if _library is False:
        with _lock:
            if _library is False:
                _library = _load()
    return _library


def supports(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in SYMBOLS and kernel() is not None


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, out, scale: float, window: int | None):
    """out[s] = attention of q[s] ([heads, dim]) over the first context_lens[s] keys of sequence
    s (its last ``window`` only, if given), found through block_tables[s]. k_cache, v_cache:
    [blocks, block_size, kv_heads, dim] of one layer; q and out may be row slices of larger
    tensors, as long as each row's heads and dims are contiguous."""
    num_seqs, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    for t in (q, out):
        if t.stride(2) != 1 or t.stride(1) != dim:
            raise ValueError("decode_attention needs each row of q and out contiguous")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("decode_attention needs a contiguous KV cache")
    tables = block_tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    getattr(kernel(), SYMBOLS[q.dtype])(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
        lens.data_ptr(), out.data_ptr(), out.stride(0), num_seqs, heads, kv_heads, dim, block_size,
        window or 0, ctypes.c_double(scale))
    return out


def _load() -> ctypes.CDLL | None:
    if os.environ.get(DISABLE) == "1":
        return None
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        warnings.warn("no C++ compiler found (set CXX): decode attention runs on the slower torch path", stacklevel=3)
        return None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, compiler.encode(), " ".join(FLAGS).encode(),
                                     platform.machine().encode(), _cpu_flags()])).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"paged_decode-{key}.so"
    try:
        if not path.exists():
            _build(compiler, path)
        library = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", None) or e
        warnings.warn(f"building the decode-attention kernel failed, so it runs on the slower torch path: {detail}",
                      stacklevel=3)
        return None
    int64, pointer = ctypes.c_int64, ctypes.c_void_p
    for name in SYMBOLS.values():
        fn = getattr(library, name)
        fn.argtypes = [pointer, int64, pointer, pointer, pointer, int64, pointer, pointer, int64,
                       int64, int64, int64, int64, int64, int64, ctypes.c_double]
        fn.restype = None
    return library


def _build(compiler: str, path: Path) -> None:
    """Compile to a temporary name in the cache, then rename: processes building at the same
    time each write their own file, and whichever lands last is complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp], check=True, capture_output=True, text=True)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _cpu_flags() -> bytes:
    """-march=native builds for this processor; a cache shared with another machine must not
    hand it a build for a different one."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return platform.processor().encode()
