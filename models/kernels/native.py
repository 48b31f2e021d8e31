"""Loom's C++ kernels (models/kernels/*.cpp and their headers), built with the system C++ compiler into one library on first
use, cached by sources, flags and processor, and called through ctypes (which releases the GIL).

They are plain C++ with OpenMP and no torch headers: the library builds in a few seconds, and the
OpenMP runtime it needs is the one torch has already loaded (same soname), so the thread count the
loop thread sets for its forward (runtime/cpu_threads.py) applies to them too. Where no compiler is
found or the build fails, ``library()`` returns None, one warning says why, and every caller stays
on its torch path. Setting LOOM_DISABLE_KERNELS=1 keeps them there on purpose.
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

from ..cache import cache_dir

SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
DTYPES = {torch.float32: "f32", torch.float64: "f64"}  # the kernels' element types, as symbol suffixes
# A float32 model's KV pool may keep 16-bit elements (kv_element.h); the pool kernels' symbols then
# end in _f32_kv_f16 or _f32_kv_bf16.
CACHE_DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16"}
DISABLE = "LOOM_DISABLE_KERNELS"
# The build's -march, "native" unless set: e.g. x86-64-v3 builds the AVX2 kernels on an AVX-512
# machine (to measure what an AVX2 machine runs; the build's name differs, so both stay cached).
MARCH = "LOOM_KERNEL_MARCH"

_lock = threading.Lock()
_library: ctypes.CDLL | None | bool = False  # False: not tried yet; None: unavailable
_build_name: str | None = None  # the loaded build's file name, which names its sources, flags and processor


def library() -> ctypes.CDLL | None:
    """The loaded library, building it on the first call (once per machine and set of sources)."""
    global _library
    if _library is False:
        with _lock:
            if _library is False:
                _library = _load()
    return _library


def build_name() -> str | None:
    """The loaded build's name (one per set of sources, flags and processor), None without one: a key
    for what is measured on this machine with these kernels."""
    return _build_name if library() is not None else None


def supports(device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> bool:
    """Whether the kernels run a model of ``dtype`` on ``device`` (with a KV pool of ``cache_dtype``,
    where given: the model's own, or a 16-bit type the build converts)."""
    if device.type != "cpu" or dtype not in DTYPES or library() is None:
        return False
    return hasattr(library(), _symbol("loom_decode_attention", dtype, cache_dtype))


def supports_states(x: torch.Tensor, states: list[torch.Tensor]) -> bool:
    """Whether a recurrent layer's kernels (delta_rule.py's, mamba_scan.py's, selective_scan.py's) run rows of
    ``x``'s dtype over ``states`` (the pool keeps a float32 model's in float32, a float64 model's in float64)."""
    return supports(x.device, x.dtype) and all(s.dtype == x.dtype and s.is_contiguous() for s in states)


def function(name: str, dtype: torch.dtype, argtypes: list, cache_dtype: torch.dtype | None = None) -> ctypes._CFuncPtr:
    """The kernel ``name`` for ``dtype`` (its symbol ends in _f32 or _f64; for a pool of another
    ``cache_dtype``, in _f32_kv_f16 or _f32_kv_bf16), with its argument types."""
    fn = getattr(library(), _symbol(name, dtype, cache_dtype))
    if fn.argtypes is None:  # the same object on every getattr: set once
        fn.argtypes, fn.restype = argtypes, None
    return fn


def _symbol(name: str, dtype: torch.dtype, cache_dtype: torch.dtype | None) -> str:
    if cache_dtype is None or cache_dtype == dtype:
        return f"{name}_{DTYPES[dtype]}"
    return f"{name}_{DTYPES[dtype]}_kv_{CACHE_DTYPES.get(cache_dtype, 'unbuilt')}"  # unbuilt: supports() says no


def _load() -> ctypes.CDLL | None:
    if os.environ.get(DISABLE) == "1":
        return None
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        warnings.warn("no C++ compiler found (set CXX): Loom's CPU kernels fall back to slower torch paths",
                      stacklevel=3)
        return None
    flags = [f"-march={os.environ[MARCH]}" if f == "-march=native" and os.environ.get(MARCH) else f for f in FLAGS]
    key = hashlib.sha256(b"\0".join([*(source.read_bytes() for source in SOURCES + HEADERS), compiler.encode(),
                                     " ".join(flags).encode(), platform.machine().encode(), _cpu_flags()]))
    path = cache_dir() / "kernels" / f"loom-{key.hexdigest()[:16]}.so"
    try:
        if not path.exists():
            _build(compiler, flags, path)
        loaded = ctypes.CDLL(str(path))
        global _build_name
        _build_name = path.stem
        return loaded
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", None) or e
        warnings.warn(f"building Loom's CPU kernels failed, so they fall back to slower torch paths: {detail}",
                      stacklevel=3)
        return None


def _build(compiler: str, flags: list[str], path: Path) -> None:
    """Compile every source at once, each to its object (on two cores the build takes the longest
    source's time, ~23 s on a Zen 4, where one compiler call for all took their sum, ~46 s), link
    them to a temporary name in the cache, then rename: processes building at the same time each
    write their own file, and whichever lands last is complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as work:
        objects = [Path(work) / f"{source.stem}.o" for source in SOURCES]
        compile_flags = [f for f in flags if f != "-shared"]
        jobs = [subprocess.Popen([compiler, *compile_flags, "-c", str(source), "-o", str(target)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for source, target in zip(SOURCES, objects)]
        failures = []
        for job in jobs:
            out, err = job.communicate()
            if job.returncode:
                failures.append(subprocess.CalledProcessError(job.returncode, job.args, out, err))
        if failures:
            raise failures[0]
        built = Path(work) / path.name
        subprocess.run([compiler, *flags, *map(str, objects), "-o", str(built)], check=True, capture_output=True,
                       text=True)
        os.replace(built, path)


def _cpu_flags() -> bytes:
    """-march=native builds for this processor; a cache shared with another machine must not
    hand it a build for a different one."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return platform.processor().encode()
