"""Every greedy stream equals transformers' generate() of that request alone, whatever else
runs beside it: many threads, more requests than max_batch_size, chunked prefill, preemption."""

import os
import random

import pytest
import torch

import models
from models.kernels import native
from runtime import Engine

from ..conftest import random_prompt, reference, run_threaded, tiny_model


@pytest.mark.parametrize("decode_path", ["kernel", "torch"])
def test_threaded_greedy_streams_match_transformers(hf_model, decode_path, monkeypatch):
    if decode_path == "torch":  # as where no C++ compiler is found: gather + SDPA
        monkeypatch.setattr(native, "_library", None)
    elif native.library() is None:
        pytest.skip("no C++ compiler: the decode kernel is not built")
    rng = random.Random(1)
    prompts = [random_prompt(rng, 1, 40) for _ in range(24)]
    new_tokens = [rng.randint(1, 24) for _ in prompts]
    # 24 blocks of 4 tokens: far less than 24 requests need at once, so requests are preempted.
    with Engine.from_pretrained(hf_model, max_batch_size=6, max_batch_tokens=32, block_size=4,
                                num_kv_blocks=24) as engine:
        results = run_threaded(engine, prompts, new_tokens, in_order=True)
        stats = engine.stats()
    for i, prompt in enumerate(prompts):
        assert results[i] == reference(hf_model, prompt, new_tokens[i]), f"request {i} diverged"
    assert stats["preemptions"] > 0
    assert stats["running"] == stats["waiting"] == stats["open_handles"] == 0
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]


def test_long_prompt_is_prefilled_in_chunks(llama):
    prompt = random_prompt(random.Random(2), 150, 150)
    with Engine.from_pretrained(llama, max_batch_tokens=16, max_batch_size=4) as engine:
        tokens = list(engine.stream_response_tokens(engine.launch_response_tokens(prompt, {"max_new_tokens": 12})))
        assert engine.stats()["steps"] >= 150 // 16 + 11
    assert tokens == reference(llama, prompt, 12)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_loads_a_checkpoint_directory(tmp_path, fmt):
    hf = tiny_model("qwen2", seed=3)
    hf.save_pretrained(tmp_path)
    if fmt == "bin":  # transformers 5 writes only safetensors; build the legacy layout by hand
        (tmp_path / "model.safetensors").unlink()
        torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    prompt = [5, 6, 7, 8, 9]
    with Engine.from_pretrained(tmp_path, dtype=torch.float64) as engine:
        out = list(engine.stream_response_tokens(engine.launch_response_tokens(prompt, {"max_new_tokens": 10})))
    assert out == reference(hf, prompt, 10)


def test_eos_ends_the_stream_unless_ignored(llama):
    prompt = [10, 11, 12]
    free_run = reference(llama, prompt, 8, eos_token_id=None)
    eos = free_run[3]  # pretend the 4th generated token is EOS
    with Engine.from_pretrained(llama) as engine:
        engine.eos_token_ids = frozenset([eos])
        stopped = list(engine.stream_response_tokens(engine.launch_response_tokens(prompt, {"max_new_tokens": 8})))
        ignored = list(engine.stream_response_tokens(
            engine.launch_response_tokens(prompt, {"max_new_tokens": 8, "ignore_eos": True})))
        by_stop_id = list(engine.stream_response_tokens(
            engine.launch_response_tokens(prompt, {"max_new_tokens": 8, "stop_token_ids": [free_run[1]],
                                                   "ignore_eos": True})))
    assert stopped == free_run[:free_run.index(eos) + 1]
    assert ignored == free_run
    assert by_stop_id == free_run[:2]


@pytest.mark.parametrize("prompt_length", [7, 45, 150])  # Loom's kernel row blocks (< 9 rows), its panels; oneDNN
def test_float32_cpu_model_with_cpu_linears_matches_transformers(prompt_length):
    """float32 on CPU swaps nn.Linear for CpuLinear: logits must stay transformers'."""
    from models.kernels.cpu_linear import KERNEL_ROWS, CpuLinear
    from models.step import KVCache, Sequence, StepInput

    if native.library() is None:
        pytest.skip("no C++ compiler: linear layers stay nn.Linear")
    assert (prompt_length > KERNEL_ROWS) == (prompt_length == 150)
    for arch in ("gpt2", "llama"):
        hf = tiny_model(arch).float()
        model = models.load(hf).model
        assert isinstance(model.layers[0].mlp.down if arch == "llama" else model.layers[0].fc, CpuLinear)
        prompt = [(7 * i + 5) % 90 for i in range(prompt_length)]
        blocks = -(-prompt_length // 16)
        kv = KVCache.for_model(model, blocks, 16, torch.float32, "cpu")
        step = StepInput.flatten([Sequence(prompt, 0, list(range(blocks)), sample=True)], 16, torch.device("cpu"))
        with torch.no_grad():
            ours = model(step, kv)[0]
            theirs = hf(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_flat_batch_refuses_one_token_entries_out_of_order():
    """The decode groups index the batch's first rows: a one-token entry after a prefill chunk (or a
    longer decode after a shorter one) would leave its attention unwritten, so flatten refuses it."""
    from models.step import Sequence, StepInput

    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="sequence 1: one-token entries must come before every prefill chunk"):
        StepInput.flatten([Sequence([5, 6], 0, [0], False), Sequence([7], 0, [1], False)], 8, cpu)
    with pytest.raises(ValueError, match="sequence 1: .* longest context first"):
        StepInput.flatten([Sequence([5], 3, [0], True), Sequence([7], 9, [1, 2], True)], 8, cpu)
    step = StepInput.flatten([Sequence([7], 9, [1, 2], True), Sequence([5], 3, [0], True),
                              Sequence([5, 6], 0, [3], False)], 8, cpu)
    assert [(g.start, g.end) for g in step.decode_groups] == [(0, 1), (1, 2)] and len(step.prefills) == 1


@pytest.mark.parametrize("decode_path", ["kernel", "torch"])
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_kv_pool_keeps_float32_logits_close(cache_dtype, decode_path, monkeypatch):
    """A float32 model over a float16 / bfloat16 pool: a prefill (the torch layers, which cast what
    they gather) and decode steps (the kernels widen as they read; the torch layers cast) give the
    logits of a float32 pool within the 16-bit rounding of the keys and values."""
    from models.step import KVCache, Sequence, StepInput

    if decode_path == "torch":
        monkeypatch.setattr(native, "_library", None)
    elif native.library() is None:
        pytest.skip("no C++ compiler: the decode kernels are not built")
    cpu = torch.device("cpu")
    for arch in ("llama", "gpt2"):
        model = models.load(tiny_model(arch).float()).model
        prompts = [[(7 * i + 5 * s) % 90 + 3 for i in range(n)] for s, n in enumerate([37, 5, 18])]
        pools = {dtype: KVCache.for_model(model, 12, 16, dtype, "cpu")
                 for dtype in (torch.float32, cache_dtype)}
        tables = [[4 * s + b for b in range(4)] for s in range(len(prompts))]
        prefill = StepInput.flatten([Sequence(p, 0, t, True) for p, t in zip(prompts, tables)], 16, cpu)
        decodes = [StepInput.flatten([Sequence([11 + k], len(prompts[s]) + k, tables[s], True) for s in (0, 2, 1)],
                                     16, cpu) for k in range(6)]
        logits = {}
        with torch.no_grad():
            for dtype, pool in pools.items():
                logits[dtype] = torch.cat([model(step, pool) for step in [prefill, *decodes]])
        assert pools[cache_dtype].dtype == cache_dtype
        scale = logits[torch.float32].abs().max()
        step = 2 ** -8 if cache_dtype == torch.bfloat16 else 2 ** -11  # the pool's relative rounding
        error = (logits[cache_dtype] - logits[torch.float32]).abs().max() / scale
        assert 0 < error < 2 * step, f"{arch}: logits {error:.2e} of their scale from float32's"


def test_a_float16_kv_pool_under_threads_and_preemption(llama):
    """kv_dtype="float16": the pool keeps float16 (twice the blocks in the same budget), and every
    stream of a threaded run with preemption equals that request run alone on such a pool (the
    float64 model keeps the rounding to float16 the same in every batch)."""
    rng = random.Random(2)
    prompts = [random_prompt(rng, 1, 40) for _ in range(16)]
    new_tokens = [rng.randint(1, 20) for _ in prompts]
    with Engine.from_pretrained(llama, kv_cache_bytes=1 << 20) as wide, \
            Engine.from_pretrained(llama, kv_cache_bytes=1 << 20, kv_dtype="float16") as half:
        assert half.kv_cache.dtype == torch.float16 and wide.kv_cache.dtype == torch.float64
        assert half.stats()["total_kv_blocks"] == 4 * wide.stats()["total_kv_blocks"]
        alone = {i: list(half.stream_response_tokens(half.launch_response_tokens(p, {"max_new_tokens": n})))
                 for i, (p, n) in enumerate(zip(prompts, new_tokens))}
        float64_pool = {i: list(wide.stream_response_tokens(wide.launch_response_tokens(p, {"max_new_tokens": n})))
                        for i, (p, n) in enumerate(zip(prompts, new_tokens))}
    with Engine.from_pretrained(llama, max_batch_size=6, max_batch_tokens=32, block_size=4, num_kv_blocks=24,
                                kv_dtype="float16") as engine:
        results = run_threaded(engine, prompts, new_tokens, in_order=True)
        assert engine.stats()["preemptions"] > 0
    assert results == alone
    assert sum(map(len, alone.values())) == sum(new_tokens)
    # the same greedy tokens as the float64 pool for most of them: float16's rounding, not noise
    same = sum(len(os.path.commonprefix([alone[i], float64_pool[i]])) for i in alone)
    assert same >= 0.8 * sum(new_tokens)
