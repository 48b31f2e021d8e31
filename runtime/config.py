"""Per-request generation settings and engine options, validated on construction."""

from __future__ import annotations

import math
from typing import Any
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from numbers import Integral, Real

POLICIES = ("fcfs", "priority")
KV_DTYPES = ("float32", "float16", "bfloat16", "float64")


def check_int(name, value, minimum, *, optional=False, maximum=None):
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")


def _check_real(name, value, low, high, *, low_open=False, optional=False):
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} ({value!r})")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value}")


def _check_bool(name, value, *, optional=False):
    if value is None and optional:
        return
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


# A temperature below this samples as greedy decoding would (the softmax is one-hot in float32
# anyway); treating it as greedy keeps 1/temperature finite.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs
CONSTRAINTS = ("json_schema", "regex", "choice", "grammar")
# Proposed tokens a step may verify for one request: past a dozen, a run of accepted proposals that
# long is rare, and each rejected one costs a row of the forward.
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class GenerationConfig:
    """How one request generates. Names follow transformers' GenerationConfig.

    Immutable: a field cannot be assigned after construction (dataclasses.FrozenInstanceError),
    so a request's settings cannot change under the loop thread while it runs. For a changed copy
    use ``dataclasses.replace(config, seed=7)``, which checks the fields again as the constructor does.

    Greedy or sampled, one rule everywhere (in-process, the command line, the server):
    ``do_sample`` decides when given; left as None, a request samples exactly when it sets a
    sampling knob (``temperature`` > 0, ``top_k`` > 0 or ``top_p`` < 1). ``temperature=0`` is
    greedy (as OpenAI's API has it); ``do_sample=False`` beside a sampling knob warns that the
    knob is ignored, as transformers does; ``do_sample=True`` with ``temperature=0`` is an error.
    ``priority`` matters only under the engine's ``policy="priority"``: larger runs first.
    ``stop`` strings apply to the text API (they need a tokenizer); they end generation and are
    not returned. ``stop_token_ids`` (and EOS, unless ``ignore_eos``) end it too, and are
    delivered as the stream's last token, as transformers' generate() returns them.

    Penalties and bias follow OpenAI's API: ``presence_penalty`` and ``frequency_penalty``
    (in [-2, 2]) subtract from the logit of each token already generated, once and per
    occurrence; ``logit_bias`` ({int token id: bias in [-100, 100]}, copied; the server turns
    JSON's string keys into ints) is added to the logits;
    ``min_p`` drops tokens less likely than min_p times the most likely one (when sampling).

    Structured output, at most one of: ``json_schema`` (a dict, a JSON string or a pydantic model
    class), ``regex``, ``choice`` (a list of strings), ``grammar`` (Lark, or llama.cpp's GBNF).
    The output then always matches it; the request ends when the constraint allows nothing more
    (finish_reason "stop") or at ``max_new_tokens`` ("length"). They need the model's tokenizer.

    ``logprobs=k`` records, for each generated token, its log-probability under the model and
    the ``k`` most likely alternatives (k in [0, 20]); see Handle.logprobs.

    ``speculative_tokens=k`` (0 to 16; None: the engine's ``speculative_tokens``) lets a step verify
    up to k tokens proposed from an earlier occurrence of the request's last few tokens in its
    prompt and output (prompt lookup, runtime/speculation.py), or by the engine's draft model where
    it has one (runtime/draft.py): several tokens a step where the proposals hold, the same tokens
    as without it (greedy) or tokens as likely (sampled: rejection sampling).
    0 turns it off. A sampled request with a seed does not speculate: for it this changes nothing.
    Structured output speculates within its grammar; penalties count the proposals before each row.
    """

    max_new_tokens: int = 128
    temperature: float | None = None
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    do_sample: bool | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    priority: int = 0
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    json_schema: Any = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    logprobs: int | None = None
    speculative_tokens: int | None = None

    def __post_init__(self):
        check_int("max_new_tokens", self.max_new_tokens, 1)
        _check_real("temperature", self.temperature, 0.0, float("inf"), optional=True)
        check_int("top_k", self.top_k, 0)
        _check_real("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_real("repetition_penalty", self.repetition_penalty, 0.0, float("inf"), low_open=True)
        _check_bool("do_sample", self.do_sample, optional=True)
        _check_bool("ignore_eos", self.ignore_eos)
        check_int("seed", self.seed, 0, optional=True, maximum=2**64 - 1)  # torch.Generator's range
        check_int("priority", self.priority, -(2**31), maximum=2**31 - 1)
        if isinstance(self.stop_token_ids, Integral):
            self._normalize("stop_token_ids", (self.stop_token_ids,))
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, Iterable):
            raise TypeError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
        self._normalize("stop_token_ids", tuple(self.stop_token_ids))
        for token in self.stop_token_ids:
            check_int("each of stop_token_ids", token, 0)
        if isinstance(self.stop, str):
            self._normalize("stop", (self.stop,))
        if not isinstance(self.stop, Iterable):
            raise TypeError(f"stop must be a str or a list of str, got {self.stop!r}")
        self._normalize("stop", tuple(self.stop))
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"each stop string must be a non-empty str, got {s!r}")
        _check_real("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_real("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_real("min_p", self.min_p, 0.0, 1.0)
        check_int("logprobs", self.logprobs, 0, optional=True, maximum=MAX_LOGPROBS)
        check_int("speculative_tokens", self.speculative_tokens, 0, optional=True, maximum=MAX_SPECULATIVE_TOKENS)
        self._check_logit_bias()
        self._check_constraint()
        knobs = [name for name, on in (("temperature", (self.temperature or 0) > 0), ("top_k", self.top_k > 0),
                                       ("top_p", self.top_p < 1.0), ("min_p", self.min_p > 0)) if on]
        if self.do_sample and self.temperature == 0:
            raise ValueError("do_sample=True with temperature=0: a temperature must be > 0 to sample; "
                             "for greedy decoding leave do_sample unset or False")
        if self.do_sample is False and knobs:
            warnings.warn(f"do_sample=False, so {', '.join(knobs)} is ignored and decoding is greedy; "
                          "set do_sample=True (or leave it unset) to sample", UserWarning, stacklevel=3)

    def _normalize(self, name: str, value) -> None:
        # Only __post_init__ writes a frozen field, to give it its normal form (a tuple, logit_bias's
        # own copy) before anyone else holds the config.
        object.__setattr__(self, name, value)

    def _check_logit_bias(self):
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise TypeError(f"logit_bias must be a dict of token id to bias, got {self.logit_bias!r}")
        bias = {}
        for token, value in self.logit_bias.items():
            if isinstance(token, str):
                raise TypeError(f"logit_bias keys must be token ids (ints), got the str {token!r}; "
                                "the server converts JSON's string keys, in-process use the ids")
            check_int("each logit_bias token id", token, 0)
            _check_real(f"logit_bias[{token}]", value, -100.0, 100.0)
            bias[int(token)] = float(value)
        self._normalize("logit_bias", bias or None)

    def _check_constraint(self):
        given = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"at most one of {', '.join(CONSTRAINTS)} may be set, got {' and '.join(given)}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"{name} must be a non-empty str, got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, Iterable):
                raise TypeError(f"choice must be a list of strings, got {self.choice!r}")
            self._normalize("choice", tuple(self.choice))
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"choice must be a non-empty list of non-empty strings, got {list(self.choice)!r}")
        schema = self.json_schema
        if schema is not None and not (isinstance(schema, (dict, str)) or hasattr(schema, "model_json_schema")):
            raise TypeError(f"json_schema must be a dict, a JSON string or a pydantic model class, got {schema!r}")

    @property
    def constraint_kind(self) -> str | None:
        """Which structured-output field is set ("json_schema", "regex", ...), if any."""
        return next((name for name in CONSTRAINTS if getattr(self, name) is not None), None)

    @property
    def sampled(self) -> bool:
        """Whether tokens are drawn at random (else greedy), by the rule in the class docstring."""
        if self.do_sample is None:
            wanted = self.temperature is not None or self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0
        else:
            wanted = self.do_sample
        return wanted and self.sampling_temperature >= GREEDY_TEMPERATURE

    @property
    def sampling_temperature(self) -> float:
        return 1.0 if self.temperature is None else self.temperature


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
    cpu_threads        at most this many OpenMP threads for the forward on CPU (None: the cores this
                       process may run on); fewer while other threads or processes keep the cores busy
    kv_dtype           the KV pool's element type: None (the model's) or one of KV_DTYPES. "float16"
                       or "bfloat16" hold twice the tokens in the same memory, and a float32 model's
                       decode attention reads half the bytes (llama.cpp keeps float16 by default)
    speculative_tokens the GenerationConfig.speculative_tokens of requests that leave it None: up to
                       this many tokens proposed by prompt lookup (or by the draft model, where the
                       engine has one: Engine.from_pretrained's ``draft``) verified per step (0: off)
    speculation_max_rows  a step's decode rows, proposed tokens included, stay within this many: a
                       step of a few rows is bound by reading the weights and a proposal's row costs
                       little; past that a rejected proposal's row costs as much as any other (a
                       step of this many decoding requests does not speculate)
    draft_num_kv_blocks   the draft model's KV pool, in blocks (None: as many as the target's pool);
                       a request whose draft blocks do not fit does not speculate until they do
    draft_max_streams  a step speculates with the draft model only while at most this many requests
                       decode: the draft's forwards run one after another, each about as long as a
                       target's step of few rows, so a wider batch pays more than it gets back (the
                       default model in float32, its Q4_1 blocks drafting, k = 4: 1 stream 1.59x,
                       2 streams 1.23x, 4 streams 0.67x before this limit; Zen 5, two threads)
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
    cpu_threads: int | None = None
    kv_dtype: str | None = None
    speculative_tokens: int = 0
    speculation_max_rows: int = 8
    draft_num_kv_blocks: int | None = None
    draft_max_streams: int = 2
    seed: int = 0

    def __post_init__(self):
        check_int("max_batch_size", self.max_batch_size, 1)
        check_int("max_batch_tokens", self.max_batch_tokens, 1)
        check_int("block_size", self.block_size, 1)
        check_int("num_kv_blocks", self.num_kv_blocks, 1, optional=True)
        check_int("kv_cache_bytes", self.kv_cache_bytes, 1, optional=True)
        check_int("max_waiting", self.max_waiting, 0, optional=True)
        check_int("max_unfetched_tokens", self.max_unfetched_tokens, 1)
        check_int("seed", self.seed, 0)
        check_int("cpu_threads", self.cpu_threads, 1, optional=True)
        check_int("speculative_tokens", self.speculative_tokens, 0, maximum=MAX_SPECULATIVE_TOKENS)
        check_int("speculation_max_rows", self.speculation_max_rows, 1)
        check_int("draft_num_kv_blocks", self.draft_num_kv_blocks, 1, optional=True)
        check_int("draft_max_streams", self.draft_max_streams, 0)
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be None (the model's dtype) or one of {KV_DTYPES}, got {self.kv_dtype!r}")
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
