"""What a launch checks before its request waits, each failure a message that says what is wrong:
the config, the prompt and the config's token ids against the model's vocabulary, room for the
answer in the context, and room in the waiting queue (EngineOptions.max_waiting)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from numbers import Integral
from typing import Any

from .config import EngineOptions, GenerationConfig
from .errors import ContextLimitWarning, EngineBusy


def as_config(config) -> GenerationConfig:
    """A GenerationConfig from None (the defaults), a dict of its fields (checked as the
    constructor checks them), or one already made (returned as is: it is immutable). Raises
    TypeError for anything else, TypeError/ValueError for a bad field."""
    if config is None:
        return GenerationConfig()
    if isinstance(config, dict):
        return GenerationConfig(**config)
    if not isinstance(config, GenerationConfig):
        raise TypeError(f"config must be a GenerationConfig, a dict or None, got {type(config).__name__}")
    return config


def check_prompt(tokens: Any, vocab_size: int) -> list[int]:
    """A prompt as a list of ids in [0, vocab_size): from a sequence, a 1-D tensor or array."""
    if hasattr(tokens, "ndim") and hasattr(tokens, "dtype"):  # a torch tensor or numpy array
        if tokens.ndim != 1:
            raise ValueError(f"input_tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if not _integer_dtype(tokens.dtype):
            raise TypeError(f"input_tokens must hold integers, got dtype {tokens.dtype}")
        tokens = tokens.tolist()
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Iterable):
        raise TypeError(f"input_tokens must be a sequence of token ids, got {type(tokens).__name__}"
                        + (" (use launch_response for text)" if isinstance(tokens, str) else ""))
    tokens = list(tokens)
    if not tokens:
        raise ValueError("input_tokens is empty: a prompt needs at least one token")
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, Integral):
            raise TypeError(f"input_tokens[{i}] is {t!r} ({type(t).__name__}), not an int token id")
        if not 0 <= t < vocab_size:
            raise ValueError(f"input_tokens[{i}] = {t} is outside the vocabulary [0, {vocab_size})")
    return [int(t) for t in tokens]


def check_token_ids(config: GenerationConfig, vocab_size: int) -> None:
    """The config's token ids (stop_token_ids, logit_bias) lie inside the model's vocabulary."""
    for token in config.stop_token_ids:
        if token >= vocab_size:
            raise ValueError(f"stop_token_ids holds {token}, outside the vocabulary [0, {vocab_size})")
    for token in config.logit_bias or ():
        if token >= vocab_size:
            raise ValueError(f"logit_bias names token {token}, outside the vocabulary [0, {vocab_size})")


def _integer_dtype(dtype) -> bool:
    if hasattr(dtype, "is_floating_point"):  # torch; a bool tensor fails later, element by element
        return not (dtype.is_floating_point or dtype.is_complex)
    return getattr(dtype, "kind", None) in ("i", "u", "b")  # numpy


def check_room(prompt_length: int, max_new_tokens: int, *, max_context: int, max_position: int,
               num_blocks: int, block_size: int) -> None:
    """ValueError where the prompt leaves no room in the context (the model's positions or the KV
    pool, whichever ends first); ContextLimitWarning where the answer would be cut short of
    ``max_new_tokens``."""
    if prompt_length >= max_context:
        raise ValueError(f"the prompt has {prompt_length} tokens; the context holds {max_context} "
                         f"(model limit {max_position}, KV pool {num_blocks} "
                         f"blocks of {block_size}), leaving no room to generate")
    room = max_context - prompt_length
    if max_new_tokens > room:
        # stacklevel: this function, Engine._launch, the launch method, then the application's line
        warnings.warn(f"max_new_tokens={max_new_tokens}, but the context holds {max_context} tokens and "
                      f"the prompt has {prompt_length}: at most {room} tokens will be generated "
                      "(finish_reason 'length')", ContextLimitWarning, stacklevel=4)


def check_backlog(num_waiting: int, num_running: int, n: int, options: EngineOptions) -> None:
    """EngineBusy where ``n`` more requests would take the backlog, the waiting requests beyond the
    batch's free slots (those the next step cannot admit), past ``options.max_waiting``."""
    bound = options.max_waiting
    if bound is None:
        return
    free_slots = max(0, options.max_batch_size - num_running)
    if max(0, num_waiting - free_slots) + n > bound:
        raise EngineBusy(f"{bound} requests are already waiting (max_waiting={bound}); retry later")
