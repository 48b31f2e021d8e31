"""Qwen3-Next: Qwen3.5's gated delta-rule and gated attention layers (tests/models/test_qwen35.py) with each key head's
value heads side by side, its q/k/v/z and beta/alpha products each one, a key head's rows at a time, and Qwen2-MoE's
experts renormalised: checkpoints and GGUF files of both layouts llama.cpp's converter has written, against
transformers' models. (The engine's threaded, preemption, prefix-cache and saved-directory tests run it among the
other families.)"""

import random

import gguf
import pytest
import torch
from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES, GGMLQuantizationType as Q

from models.families.qwen35 import DeltaShape, ba_rows, qkvz_rows
from models.kernels import native
from models.kernels.block_linear import BlockLinear
from runtime import Engine, GenerationConfig

from ..conftest import greedy_with_logprobs, random_prompt, tiny_model, write_gguf_of
from .test_gguf import assert_same_answers, greedy
from .test_qwen35 import assert_mixing_alike, float32_weights


def experts_metadata(c) -> dict:
    """The experts' keys llama.cpp's converter writes for a Qwen3-Next config (and the end token an answer here
    reaches)."""
    return {"expert_count": c.num_experts, "expert_used_count": c.num_experts_per_tok,
            "expert_feed_forward_length": c.moe_intermediate_size,
            "expert_shared_feed_forward_length": c.shared_expert_intermediate_size,
            "tokenizer.ggml.eos_token_id": c.eos_token_id}


def answers(engine: Engine, prompts, tokens: int = 16):
    handles = [engine.launch_response_tokens(p, GenerationConfig(max_new_tokens=tokens, logprobs=0)) for p in prompts]
    return [(list(engine.stream_response_tokens(h, timeout=60)), [t.logprob for t in h.logprobs]) for h in handles]


def test_the_split_rows_take_each_part_of_a_key_heads_rows():
    """qkvz_rows and ba_rows against transformers' own split (fix_query_key_value_ordering's): every row once, q, k
    and v a key head at a time, z and beta and alpha a value head at a time, the value heads of a key head side by
    side."""
    d = DeltaShape(key_heads=2, value_heads=6, key_dim=3, value_dim=2, conv_size=4)
    per_head = 2 * d.key_dim + 2 * 3 * d.value_dim  # (three value heads a key head)
    qkv, z = qkvz_rows(d)
    heads = torch.arange(2 * per_head).view(2, per_head)
    q, k, v, gate = heads.split([3, 3, 6, 6], 1)
    assert qkv.tolist() == torch.cat([q.flatten(), k.flatten(), v.flatten()]).tolist()
    assert z.tolist() == gate.flatten().tolist()
    beta, alpha = ba_rows(d)
    assert beta.tolist() == [0, 1, 2, 6, 7, 8] and alpha.tolist() == [3, 4, 5, 9, 10, 11]


@pytest.mark.parametrize("settings, mlps", [({}, ["SparseMoE"] * 4),
                                             ({"mlp_only_layers": [1]}, ["SparseMoE", "SwiGLU", "SparseMoE", "SparseMoE"]),
                                             ({"num_experts": 0}, ["SwiGLU"] * 4)], ids=["experts", "a-dense-layer", "dense"])
def test_a_qwen3_next_model_answers_as_transformers_does(settings, mlps):
    """Qwen3-Next in memory (in_proj_qkvz and in_proj_ba split as it loads), in float64, prompts long and short:
    transformers' greedy tokens and their log-probabilities; a layer of mlp_only_layers with a dense MLP, and a
    model without experts (transformers' dense Qwen3-Next), too."""
    prompts = [random_prompt(random.Random(14), 1, 4), random_prompt(random.Random(15), 30, 60)]
    hf = tiny_model("qwen3_next", seed=3, **settings)
    with Engine.from_pretrained(hf, dtype=torch.float64) as engine:
        got = answers(engine, prompts)
        assert [type(block.mlp).__name__ for block in engine.model.layers] == mlps
    assert_same_answers(got, [greedy_with_logprobs(hf, p, 16) for p in prompts])


def test_qwen3_next_configs_loom_does_not_run_are_refused():
    """Biases on the attention's products (transformers' attention_bias), which Loom's gated attention has not:
    refused, saying so."""
    from models.families.qwen35 import Qwen35Spec

    from ..conftest import CONFIGS
    with pytest.raises(ValueError, match=r"Qwen3-Next with attention_bias \(biases on the attention's products\)"):
        Qwen35Spec.from_hf(CONFIGS["qwen3_next"]().to_dict() | {"attention_bias": True})


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_the_grouped_value_heads_answer_alike_on_the_kernel_and_on_torch_operators(kernel, monkeypatch):
    """Qwen3-Next's delta rule, each key head read by the value heads beside it, on delta_rule.h or on torch
    operators, over chunked prefills and decode steps of several requests at once: transformers' answers."""
    from models.families.qwen35 import GatedDeltaNet
    from models.kernels import delta_rule
    assert_mixing_alike("qwen3_next", delta_rule, GatedDeltaNet, kernel, monkeypatch)


@pytest.mark.parametrize("fused_qkvz", [False, True], ids=["qkv-and-gate", "ssm_in"])
def test_a_qwen3_next_file_equals_its_transformers_model(tmp_path, fused_qkvz):
    """A qwen3next file as llama.cpp's converter writes it (value heads as the checkpoint's, beta and alpha one
    product, q/k/v and z apart, or one ssm_in as its first converter wrote them; -exp(A_log), norms as 1 + weight
    but the gated one, the experts' stacks and the shared expert's router), in float64: transformers' answers; on
    the float32 native layers too."""
    hf = float32_weights(tiny_model("qwen3_next", seed=5))
    path = write_gguf_of(hf, tmp_path / "qwen3next.gguf", "qwen3next", experts_metadata(hf.config),
                         fused_qkvz=fused_qkvz)
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert ("blk.0.ssm_in.weight" if fused_qkvz else "blk.0.attn_gate.weight") in names
    known = {TENSOR_NAMES[t] for t in MODEL_TENSORS[MODEL_ARCH.QWEN3NEXT]}  # (the names llama.cpp's qwen3next reads)
    kinds = lambda name: name if name.count(".") == 2 else name.rpartition(".")[0]  # (ssm_a has no kind)
    assert {kinds(name).replace("blk.0.", "blk.{bid}.") for name in names if name.startswith("blk.0.")} <= known
    prompts = [random_prompt(random.Random(16), 1, 4), random_prompt(random.Random(17), 30, 60)]
    assert_same_answers(greedy(path, prompts), [greedy_with_logprobs(hf, p, 16) for p in prompts])
    with Engine.from_pretrained(path, dtype=torch.float32) as engine:
        assert engine.model.decoder_layers is not None and engine.model.spec.delta.grouped


@pytest.mark.skipif(native.library() is None, reason="no C++ compiler: the kernels are not built")
@pytest.mark.parametrize("fused_qkvz", [False, True], ids=["qkv-and-gate", "ssm_in"])
def test_a_quantized_qwen3_next_file_runs_in_its_blocks(tmp_path, fused_qkvz):
    """A file of 8-bit blocks: the split products' rows taken from the file's blocks (laid out sixteen rows side by
    side where they are many enough) give, a hidden unit at a time, what transformers' own split gives over the
    file's values; every delta-rule product runs in blocks, and the native layers answer as the torch layers."""
    from .test_gguf_experts import native_and_torch_answers
    hf = tiny_model("qwen3_next", seed=6, moe_intermediate_size=32)  # (experts a whole block wide)
    with torch.no_grad():  # the file's values: each matrix the file quantizes through Q8_0 and back
        for name, tensor in hf.named_parameters():
            if name.endswith(("in_proj_qkvz.weight", "in_proj_ba.weight")):
                codes = gguf.quants.quantize(tensor.float().numpy(), Q.Q8_0)
                tensor.copy_(torch.from_numpy(gguf.quants.dequantize(codes, Q.Q8_0)).double())
    path = write_gguf_of(hf, tmp_path / "qwen3next-q8.gguf", "qwen3next", experts_metadata(hf.config),
                         matrices=Q.Q8_0, fused_qkvz=fused_qkvz)
    units = torch.eye(hf.config.hidden_size)  # (rounded to 8 bits as they are: one value a block)
    with Engine.from_pretrained(path) as engine:
        for block, theirs in zip(engine.model.layers, hf.model.layers):
            if not block.recurrent:
                continue
            d = block.mixer
            assert all(isinstance(m, BlockLinear) for m in (d.qkv, d.z, d.beta, d.alpha, d.out))
            with torch.no_grad():
                mixer = theirs.linear_attn
                q, k, v, z, b, a = mixer.fix_query_key_value_ordering(mixer.in_proj_qkvz(units.double()[None]),
                                                                      mixer.in_proj_ba(units.double()[None]))
                expected = [torch.cat([t.flatten(2) for t in (q, k, v)], -1), z.flatten(2), b, a]
                for ours, want in zip((d.qkv, d.z, d.beta, d.alpha), expected):
                    torch.testing.assert_close(ours(units).double(), want[0], rtol=1e-6, atol=1e-6)
    prompts = [random_prompt(random.Random(i), 3, 30) for i in range(6)]
    native_and_torch_answers(path, prompts)


def test_a_file_that_rotates_whole_heads_is_read_so(tmp_path):
    """A qwen3next file whose rotary turns every value of a head (rope.dimension_count = the head's width): read as
    the file says, not as the configs' default quarter; transformers' answers."""
    hf = float32_weights(tiny_model("qwen3_next", seed=7, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}))
    path = write_gguf_of(hf, tmp_path / "whole.gguf", "qwen3next", experts_metadata(hf.config))
    prompts = [random_prompt(random.Random(18), 20, 40)]
    assert_same_answers(greedy(path, prompts), [greedy_with_logprobs(hf, p, 16) for p in prompts])
