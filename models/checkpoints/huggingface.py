"""Hugging Face checkpoints: a directory (config.json, safetensors or .bin weights, tokenizer
files), or a transformers model already in memory; a vision-language one's text model
(vision_language.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from . import Contents
from .vision_language import text_config, text_tensors


def read(directory: Path, config: dict | None = None) -> Contents:
    """The directory's config (``config``: read_config's answer, where the caller has it), tensors, EOS ids and
    tokenizer."""
    config = read_config(directory) if config is None else config
    return Contents(config, text_tensors(read_tensors(directory), config), read_eos_ids(directory, config),
                    read_tokenizer(directory), directory.name)


def read_module(hf_model) -> Contents:
    """A transformers causal LM in memory: its config and state dict (no tokenizer)."""
    config = getattr(hf_model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise TypeError(f"expected a transformers PreTrainedModel, got {type(hf_model).__name__}")
    config = text_config(config.to_dict())
    generation = getattr(hf_model, "generation_config", None)
    eos = getattr(generation, "eos_token_id", None)
    eos = eos_set(eos if eos is not None else config.get("eos_token_id"))
    return Contents(config, text_tensors(hf_model.state_dict(), config), eos, None, config.get("_name_or_path") or config["model_type"])


def read_config(directory: Path) -> dict:
    """config.json (a vision-language model's text part)."""
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a Hugging Face checkpoint: it has no config.json")
    return text_config(json.loads(path.read_text()))


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint: *.safetensors, else pytorch_model*.bin loaded with
    weights_only=True (no pickled code runs)."""
    files = sorted(directory.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file
        return {name: t for f in files for name, t in load_file(f).items()}
    files = sorted(directory.glob("pytorch_model*.bin"))
    if files:
        return {name: t for f in files
                for name, t in torch.load(f, map_location="cpu", weights_only=True).items()}
    raise FileNotFoundError(f"{directory} has no *.safetensors or pytorch_model*.bin weights")


def read_eos_ids(directory: Path, config: dict) -> frozenset[int]:
    generation = directory / "generation_config.json"
    eos = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
    return eos_set(eos if eos is not None else config.get("eos_token_id"))


def eos_set(eos) -> frozenset[int]:
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def read_tokenizer(directory: Path):
    """The checkpoint's tokenizer, or None when it ships none."""
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not any((directory / n).is_file() for n in names):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(directory)
