"""Checkpoint readers: a Hugging Face directory, a GGUF file or an in-memory transformers model,
each read into the same Contents for models.build."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Contents:
    """What a reader hands the builder: a transformers-style config, tensors under transformers'
    names and layout, the EOS ids, the tokenizer (None when the checkpoint has none) and a name.
    ``owned``: every float tensor is a copy made for this load (none a view of a mapped file or
    another model's parameter), which the builder may keep as it is."""
    config: dict
    tensors: dict[str, torch.Tensor] = field(repr=False)
    eos_token_ids: frozenset[int]
    tokenizer: object | None
    name: str
    owned: bool = False
