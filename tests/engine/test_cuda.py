"""The CUDA path: the same promises as on the CPU (greedy streams equal transformers' under
threads and preemption, structured output, logprobs, seeded sampling), on a GPU. Skipped where
torch sees none (CI); run on a lent GPU machine with ``python -m pytest tests/engine/test_cuda.py``."""

import json
import random

import pytest
import torch

from runtime import Engine, GenerationConfig

from ..conftest import random_prompt, reference, run_threaded

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_threaded_greedy_streams_match_transformers_on_cuda(hf_model):
    rng = random.Random(3)
    prompts = [random_prompt(rng, 1, 40) for _ in range(24)]
    new_tokens = [rng.randint(1, 24) for _ in prompts]
    with Engine.from_pretrained(hf_model, device="cuda", dtype=torch.float64, max_batch_size=6,
                                max_batch_tokens=32, block_size=4, num_kv_blocks=24) as engine:
        results = run_threaded(engine, prompts, new_tokens, in_order=True)
        stats = engine.stats()
    for i, prompt in enumerate(prompts):
        assert results[i] == reference(hf_model, prompt, new_tokens[i]), f"request {i} diverged"
    assert stats["preemptions"] > 0 and stats["free_kv_blocks"] == stats["total_kv_blocks"]


def test_logprobs_and_seeded_sampling_on_cuda(llama):
    prompt = [5, 6, 7, 8]
    greedy = reference(llama, prompt, 8, eos_token_id=None)
    with torch.no_grad():
        expected = llama(torch.tensor([prompt + greedy])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
    sampled = GenerationConfig(max_new_tokens=8, ignore_eos=True, temperature=1.0, top_p=0.9, seed=11)
    with Engine.from_pretrained(llama, device="cuda", dtype=torch.float64) as engine:
        handle = engine.launch_response_tokens(prompt, GenerationConfig(max_new_tokens=8, ignore_eos=True, logprobs=2))
        assert list(engine.stream_response_tokens(handle, timeout=60)) == greedy
        runs = [list(engine.stream_response_tokens(engine.launch_response_tokens(prompt, sampled), timeout=60))
                for _ in range(2)]
    assert runs[0] == runs[1]
    for entry, row in zip(handle.logprobs, expected):
        assert abs(entry.logprob - row[entry.token].item()) < 1e-6 and entry.top[0][0] == entry.token


def test_structured_output_on_cuda():
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = ['{"name": "Ann", "age": 31, "tags": ["a", "b"]}', '{"ok": true, "level": null}', "yes no maybe"] * 50
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         eos_token_id=tokenizer.eos_token_id)).to(torch.float64)
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "maximum": 99}}}
    with Engine.from_pretrained(model, tokenizer=tokenizer, device="cuda") as engine:
        configs = [GenerationConfig(max_new_tokens=60, json_schema=schema, **extra)
                   for extra in ({}, {"temperature": 1.0, "seed": 1}, {"temperature": 1.0, "seed": 2})]
        configs.append(GenerationConfig(max_new_tokens=20, choice=["yes", "no"]))
        handles = [engine.launch_response(f"record {i}", c) for i, c in enumerate(configs)]
        texts = ["".join(engine.stream_text(h)) for h in handles]
    for text in texts[:3]:
        value = json.loads(text)
        assert set(value) == {"name", "age"} and len(value["name"]) <= 8 and 0 <= value["age"] <= 99, text
    assert texts[3] in ("yes", "no")


def test_a_gguf_of_mixed_formats_on_cuda_equals_float64_over_its_values(tmp_path):
    # On CUDA a GGUF's blocks are widened to the engine's dtype at load (the block kernels are the
    # CPU's): in float64 its greedy tokens are the reference's over the file's own values, exactly.
    from concurrent.futures import ThreadPoolExecutor

    from ..models.test_block_formats import mixed_gguf

    model = mixed_gguf(tmp_path / "mixed.gguf")
    prompts = [[5 + i, 17, 200 - i, 33, 8] for i in range(6)]
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    with Engine.from_pretrained(tmp_path / "mixed.gguf", device="cuda", dtype=torch.float64) as engine:
        def run(prompt):
            return list(engine.stream_response_tokens(engine.launch_response_tokens(prompt, config), timeout=60))

        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(run, prompts))
    for prompt, tokens in zip(prompts, results):
        assert tokens == reference(model, prompt, 16, eos_token_id=None), prompt
