"""Per-request generation settings and engine options, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral, Real

POLICIES = ("fcfs", "priority")


def _check_int(name, value, minimum, *, optional=False):
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_real(name, value, low, high, *, low_open=False):
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} ({value!r})")
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value}")


@dataclass
class GenerationConfig:
    """How one request generates. Names follow transformers' GenerationConfig.

    Greedy unless ``do_sample`` is set. ``top_k=0`` and ``top_p=1.0`` disable those filters.
    ``priority`` matters only under the engine's ``policy="priority"``: larger runs first.
    ``stop`` strings apply to the text API (they need a tokenizer); they end generation
    and are not returned.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    do_sample: bool = False
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    priority: int = 0
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        _check_int("max_new_tokens", self.max_new_tokens, 1)
        _check_real("temperature", self.temperature, 0.0, float("inf"), low_open=True)
        _check_int("top_k", self.top_k, 0)
        _check_real("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_real("repetition_penalty", self.repetition_penalty, 0.0, float("inf"), low_open=True)
        if not isinstance(self.do_sample, bool):
            raise TypeError(f"do_sample must be a bool, got {self.do_sample!r}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        _check_int("seed", self.seed, 0, optional=True)
        _check_int("priority", self.priority, -(2**31))
        if isinstance(self.stop_token_ids, Integral):
            self.stop_token_ids = (self.stop_token_ids,)
        self.stop_token_ids = tuple(self.stop_token_ids)
        for token in self.stop_token_ids:
            _check_int("each of stop_token_ids", token, 0)
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"each stop string must be a non-empty str, got {s!r}")

    @property
    def greedy(self) -> bool:
        return not self.do_sample


@dataclass
class EngineOptions:
    """Engine-wide settings; passed as keyword arguments to ``Engine.from_pretrained``.

    max_batch_size     requests that run in one step
    max_batch_tokens   tokens in one forward: bounds each prefill chunk
    block_size         tokens per KV block
    num_kv_blocks      size of the KV pool; None derives it from ``kv_cache_bytes``
    kv_cache_bytes     memory budget for the pool when num_kv_blocks is None
                       (None: 2 GiB on CPU, 60% of free memory on CUDA)
    policy             "fcfs" (arrival order) or "priority" (GenerationConfig.priority, larger first)
    max_waiting        bound on the backlog: waiting requests beyond the batch's free slots;
                       a launch past it raises EngineBusy
    max_unfetched_tokens  a request whose consumer lags this many tokens behind is paused
    enable_prefix_caching reuse KV blocks of identical prompt prefixes across requests
    """

    max_batch_size: int = 64
    max_batch_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    policy: str = "fcfs"
    max_waiting: int | None = None
    max_unfetched_tokens: int = 4096
    enable_prefix_caching: bool = True
    seed: int = 0

    def __post_init__(self):
        _check_int("max_batch_size", self.max_batch_size, 1)
        _check_int("max_batch_tokens", self.max_batch_tokens, 1)
        _check_int("block_size", self.block_size, 1)
        _check_int("num_kv_blocks", self.num_kv_blocks, 1, optional=True)
        _check_int("kv_cache_bytes", self.kv_cache_bytes, 1, optional=True)
        _check_int("max_waiting", self.max_waiting, 0, optional=True)
        _check_int("max_unfetched_tokens", self.max_unfetched_tokens, 1)
        _check_int("seed", self.seed, 0)
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if self.max_batch_tokens < self.max_batch_size:
            raise ValueError(
                f"max_batch_tokens ({self.max_batch_tokens}) must be >= max_batch_size "
                f"({self.max_batch_size}): every running request needs one token per step"
            )

    @classmethod
    def from_kwargs(cls, options: dict) -> "EngineOptions":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known options: {sorted(known)}")
        return cls(**options)
