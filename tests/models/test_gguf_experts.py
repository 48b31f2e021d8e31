"""GGUF mixtures of experts (Mixtral's files, which say "llama", Qwen2-MoE's, Granite MoE Shared's and ERNIE
4.5's with their shared experts, Qwen3-MoE's, Granite MoE's, OLMoE's and gpt-oss's): the experts' three
stacks multiplied where the file keeps them, in its own formats, an expert at a time, on the torch
layers and on the native ones, against float64 products over the file's values and against
transformers' models of the same weights."""

import random

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType as Q

import models
from models.checkpoints import gguf as gguf_reader
from models.checkpoints.gguf_file import GGUFFile
from models.families.moe import SparseMoE
from models.kernels import native
from models.kernels.block_experts import BlockExperts
from models.kernels.block_formats import block_format, to_blocks, to_rows16
from models.kernels.block_linear import (GGUF_MXFP4, GGUF_MXFP4_ROWS16, BlockLinear, multiplies_rows16,
                                        round_activations, rounding)
from runtime import Engine, GenerationConfig

from ..conftest import greedy_with_logprobs, random_prompt, reference as reference_tokens, tiny_model, write_gguf_of
from .test_block_formats import assert_greedy_but_near_ties, file_values, random_tensor
from .test_gguf import assert_same_answers, greedy

needs_kernels = pytest.mark.skipif(native.library() is None, reason="no C++ compiler: the kernels are not built")

# each family's llama.cpp architecture, and the metadata its converter writes for the tiny models'
# experts (every Qwen3-MoE layer routes in llama.cpp: the tiny one's dense layer is routed too)
MIXTURES = {"mixtral": ("llama", lambda c: {"expert_count": c.num_local_experts,
                                            "expert_used_count": c.num_experts_per_tok}),
            "qwen2_moe": ("qwen2moe", lambda c: {"expert_count": c.num_experts, "expert_used_count": c.num_experts_per_tok,
                                                 "expert_feed_forward_length": c.moe_intermediate_size,
                                                 "expert_shared_feed_forward_length":
                                                     c.shared_expert_intermediate_size}),
            "qwen3_moe": ("qwen3moe", lambda c: {"expert_count": c.num_experts, "expert_used_count": c.num_experts_per_tok,
                                                 "expert_feed_forward_length": c.moe_intermediate_size}),
            "granitemoe": ("granitemoe", lambda c: {"expert_count": c.num_local_experts,
                                                    "expert_used_count": c.num_experts_per_tok,
                                                    "embedding_scale": c.embedding_multiplier,
                                                    "residual_scale": c.residual_multiplier,
                                                    "attention.scale": c.attention_multiplier,
                                                    "logit_scale": c.logits_scaling}),
            "granitemoeshared": ("granitemoe", lambda c: {"expert_count": c.num_local_experts,
                                                          "expert_used_count": c.num_experts_per_tok,
                                                          "expert_shared_feed_forward_length": c.shared_intermediate_size,
                                                          "embedding_scale": c.embedding_multiplier,
                                                          "residual_scale": c.residual_multiplier,
                                                          "attention.scale": c.attention_multiplier,
                                                          "logit_scale": c.logits_scaling}),
            "ernie4_5_moe": ("ernie4_5-moe", lambda c: {"expert_count": c.moe_num_experts, "expert_used_count": c.moe_k,
                                                        "expert_feed_forward_length": c.moe_intermediate_size,
                                                        "expert_shared_feed_forward_length":
                                                            c.moe_intermediate_size * c.moe_num_shared_experts,
                                                        "leading_dense_block_count": c.moe_layer_start_index,
                                                        "interleave_moe_layer_step": c.moe_layer_interval}),
            "olmoe": ("olmoe", lambda c: {"expert_count": c.num_experts, "expert_used_count": c.num_experts_per_tok}),
            "lfm2_moe": ("lfm2moe", lambda c: {"expert_count": c.num_experts, "expert_used_count": c.num_experts_per_tok,
                                               "expert_feed_forward_length": c.moe_intermediate_size,
                                               "leading_dense_block_count": c.num_dense_layers,
                                               "expert_weights_scale": c.routed_scaling_factor,
                                               "expert_gating_func": 2}),
            "gpt_oss": ("gpt-oss", lambda c: {"expert_count": c.num_local_experts,
                                              "expert_used_count": c.num_experts_per_tok,
                                              "expert_feed_forward_length": c.intermediate_size,
                                              "attention.sliding_window": c.sliding_window,
                                              "rope.scaling.type": "yarn",
                                              "rope.scaling.factor": c.rope_parameters["factor"],
                                              "rope.scaling.original_context_length":
                                                  c.rope_parameters["original_max_position_embeddings"]}),
            # (write_gguf_of writes GLM-4.5's: conftest's _glm4_moe_metadata)
            "glm4_moe": ("glm4moe", lambda c: {}),
            "dots1": ("dots1", lambda c: {"expert_count": c.n_routed_experts, "expert_used_count": c.num_experts_per_tok,
                                          "expert_feed_forward_length": c.moe_intermediate_size,
                                          "expert_shared_count": c.n_shared_experts,
                                          "leading_dense_block_count": c.first_k_dense_replace,
                                          "expert_weights_scale": float(c.routed_scaling_factor),
                                          "expert_weights_norm": c.norm_topk_prob, "expert_gating_func": 2}),
            # (its converter: every width intermediate_size's, the shared MLP's said again)
            "hunyuan_v1_moe": ("hunyuan-moe", lambda c: {"expert_count": c.num_experts, "expert_used_count": c.moe_topk,
                                                         "expert_feed_forward_length": c.intermediate_size,
                                                         "expert_shared_feed_forward_length": c.intermediate_size,
                                                         "expert_shared_count": 1}),
            "minimax_m2": ("minimax-m2", lambda c: {"expert_count": c.num_local_experts,
                                                    "expert_used_count": c.num_experts_per_tok,
                                                    "expert_feed_forward_length": c.intermediate_size,
                                                    "expert_gating_func": 2, "rope.dimension_count": c.rotary_dim}),
            # (llama.cpp's: three window layers in four, the fourth unrotated; the embeddings times sqrt(hidden))
            "afmoe": ("afmoe", lambda c: {"expert_count": c.num_experts, "expert_used_count": c.num_experts_per_tok,
                                          "expert_feed_forward_length": c.moe_intermediate_size,
                                          "expert_shared_count": c.num_shared_experts,
                                          "leading_dense_block_count": c.num_dense_layers,
                                          "expert_weights_norm": True, "expert_weights_scale": float(c.route_scale),
                                          "expert_gating_func": 2, "attention.sliding_window": c.sliding_window}),
            # (its clamp of q/k/v)
            "dbrx": ("dbrx", lambda c: {"expert_count": c.ffn_config.moe_num_experts,
                                        "expert_used_count": c.ffn_config.moe_top_k,
                                        "attention.clamp_kqv": c.attn_config.clip_qkv}),
            # (its window layers listed, a flag a layer)
            "exaone_moe": ("exaone-moe", lambda c: {
                "expert_count": c.num_experts, "expert_used_count": c.num_experts_per_tok,
                "expert_feed_forward_length": c.moe_intermediate_size, "expert_shared_count": c.num_shared_experts,
                "expert_shared_feed_forward_length": c.moe_intermediate_size * c.num_shared_experts,
                "leading_dense_block_count": c.first_k_dense_replace, "expert_weights_norm": c.norm_topk_prob,
                "expert_weights_scale": float(c.routed_scaling_factor), "expert_gating_func": 2,
                "attention.sliding_window": c.sliding_window,
                "attention.sliding_window_pattern": [t == "sliding_attention" for t in c.layer_types]}),
            # (every other layer's experts; its chunks and temperature llama.cpp's fixed ones: SETTINGS)
            "llama4_text": ("llama4", lambda c: {"expert_count": c.num_local_experts,
                                                 "expert_used_count": c.num_experts_per_tok,
                                                 "expert_feed_forward_length": c.intermediate_size,
                                                 "interleave_moe_layer_step": c.interleave_moe_layer_step}),
            # (as its converter writes it: no gating function, which llama.cpp reads as sigmoid; its window layers a
            # flag a layer; SETTINGS' sigmoid and RMSNorms)
            "cohere2_moe": ("cohere2moe", lambda c: {
                "expert_count": c.num_experts, "expert_used_count": c.num_experts_per_tok,
                "expert_feed_forward_length": c.intermediate_size, "expert_shared_count": c.num_shared_experts,
                "expert_shared_feed_forward_length": c.intermediate_size * c.num_shared_experts,
                "leading_dense_block_count": 1, "expert_weights_norm": c.norm_topk_prob, "logit_scale": c.logit_scale,
                "attention.sliding_window": c.sliding_window,
                "attention.sliding_window_pattern": [t == "sliding_attention" for t in c.layer_types]})}
# gpt-oss: llama.cpp's yarn rounds its correction range (transformers' truncate), and its clamp is
# the model's 7.0 (the files do not say)
SETTINGS = {"mixtral": {}, "qwen3_moe": {"mlp_only_layers": [], "moe_intermediate_size": 64}, "granitemoe": {},
            "qwen2_moe": {"mlp_only_layers": [], "moe_intermediate_size": 64, "shared_expert_intermediate_size": 96},
            "granitemoeshared": {"shared_intermediate_size": 96}, "ernie4_5_moe": {},
            "olmoe": {}, "lfm2_moe": {}, "glm4_moe": {}, "dots1": {}, "hunyuan_v1_moe": {}, "minimax_m2": {},
            "afmoe": {}, "dbrx": {}, "exaone_moe": {},
            "llama4_text": {"attention_chunk_size": 8192, "attn_scale": 0.1, "floor_scale": 8192},
            "cohere2_moe": {"expert_selection_fn": "sigmoid", "norm_topk_prob": True, "rms_norm_eps": 1e-5},
            "gpt_oss": {"swiglu_limit": 7.0, "intermediate_size": 64, "rope_parameters": {
                "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": True, "original_max_position_embeddings": 64}}}


def mixture_file(path, arch: str, seed: int = 3, matrices: Q | None = None):
    """A tiny ``arch`` model and its GGUF file as llama.cpp's converter writes it (matrices in float32
    or ``matrices``)."""
    hf = tiny_model(arch, seed=seed, **SETTINGS[arch])
    gguf_arch, metadata = MIXTURES[arch]
    return hf, write_gguf_of(hf, path, gguf_arch, metadata(hf.config), matrices=matrices)


@pytest.mark.parametrize("arch", sorted(MIXTURES))
def test_a_mixture_file_equals_its_transformers_model(tmp_path, arch):
    """Every mixture's file (every expert's matrices of a product one stack, the router a matrix of its
    own; Granite's four multipliers; OLMoE's and Qwen2-MoE's weights not renormalised; a shared expert,
    Qwen2-MoE's weighted by its router; ERNIE 4.5's and LFM2-MoE's bias to choose experts by, LFM2-MoE's
    sigmoid scores and scaled weights): Loom's greedy tokens
    and log-probabilities equal transformers' over the same weights."""
    hf, path = mixture_file(tmp_path / f"{arch}.gguf", arch)
    rng = random.Random(5)
    prompts = [random_prompt(rng, 5, 10), random_prompt(rng, 30, 40)]
    assert_same_answers(greedy(path, prompts, 12), [greedy_with_logprobs(hf, p, 12) for p in prompts])


def test_an_ernie_file_without_its_selection_bias_chooses_experts_by_probability(tmp_path):
    """llama.cpp reads an ERNIE 4.5 MoE file without exp_probs_b: its experts are then chosen by probability
    alone, as transformers' model with a zero bias chooses them."""
    hf = tiny_model("ernie4_5_moe", seed=3)
    with torch.no_grad():
        for name, tensor in hf.named_parameters():
            if name.endswith("e_score_correction_bias"):
                tensor.zero_()
    gguf_arch, metadata = MIXTURES["ernie4_5_moe"]
    path = write_gguf_of(hf, tmp_path / "ernie.gguf", gguf_arch, metadata(hf.config), leave_out=("exp_probs_b.bias",))
    assert not any(name.endswith("exp_probs_b.bias") for name in GGUFFile(path).tensors)
    prompts = [random_prompt(random.Random(6), 5, 30) for _ in range(2)]
    assert_same_answers(greedy(path, prompts, 12), [greedy_with_logprobs(hf, p, 12) for p in prompts])


def expected_expert(x: torch.Tensor, stacks: dict, kind: Q, index: int, hidden: int, inner: int) -> torch.Tensor:
    """float64's SwiGLU of expert ``index`` over the stacks' file values (relu(up)^2 where there is no gate
    stack), each product's input rounded to 8-bit blocks as the block products round theirs."""
    span = rounding(block_format(kind))
    matrix = lambda name, rows, width: file_values(stacks[name], kind, width)[index * rows:(index + 1) * rows]
    rounded = round_activations(x, span).double()
    up = rounded @ matrix("up", inner, hidden).T
    activated = F.relu(up).square() if "gate" not in stacks else F.silu(rounded @ matrix("gate", inner, hidden).T) * up
    return round_activations(activated.float(), span).double() @ matrix("down", hidden, inner).T


@needs_kernels
@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.MXFP4], ids=lambda k: k.name)
@pytest.mark.parametrize("layout", ["file", "rows16"])
@pytest.mark.parametrize("gated", [True, False], ids=["swiglu", "squared_relu"])
def test_each_experts_product_over_a_files_stacks_equals_float64(kind, layout, gated):
    """An expert's gate, up and down products read its rows of the file's stacks (as the file lays them
    out, or sixteen rows side by side where the build multiplies that layout): its SwiGLU equals
    float64 over the file's values, for every expert of the stack and one to many input rows; so do the
    up and down products of experts without a gate (Nemotron 3's), relu(up)^2 between them."""
    count, hidden, inner = 3, 256, 512
    stacks = {"gate": random_tensor(kind, count * inner, hidden, seed=1),
              "up": random_tensor(kind, count * inner, hidden, seed=2),
              "down": random_tensor(kind, count * hidden, inner, seed=3)}
    if not gated:
        del stacks["gate"]
    widths = {"gate": hidden, "up": hidden, "down": inner}
    kept = {name: to_rows16(data, kind, widths[name]) if layout == "rows16" else to_blocks(data, kind, widths[name])
            for name, data in stacks.items()}
    if any(blocks is None for blocks in kept.values()):
        pytest.skip(f"this build lays no {kind.name} out side by side")
    experts = BlockExperts(kept.get("gate"), kept["up"], kept["down"], count, hidden, inner)
    for rows in (1, 5, 40):
        x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows))
        for index in range(count):
            expected = expected_expert(x, stacks, kind, index, hidden, inner)
            torch.testing.assert_close(experts(index, x).double(), expected, rtol=2e-3, atol=2e-3 * expected.abs().max())


def test_a_stack_whose_experts_are_not_its_rows_is_refused():
    blocks = to_blocks(random_tensor(Q.Q8_0, 40, 64), Q.Q8_0, 64)
    with pytest.raises(ValueError, match="the experts' gate stack holds 40 rows, not 3 x 16"):
        BlockExperts(blocks, blocks, blocks, 3, 64, 16)


@needs_kernels
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_a_quantized_mixture_runs_its_experts_in_the_files_blocks_on_the_native_layers(tmp_path, arch):
    """A Qwen3-MoE file of 8-bit blocks runs its experts in them (no float copy), and a Qwen2-MoE's its
    shared expert too, and its decode steps on the native layers, whose greedy tokens equal the torch
    layers' (the reference) over the same blocks, and transformers' over the file's values but where
    their two best logits lie within a near tie."""
    hf, path = mixture_file(tmp_path / f"{arch}-q8.gguf", arch, matrices=Q.Q8_0)
    contents = gguf_reader.read(path)  # the file's values in float32: transformers' model of them
    shapes = hf.state_dict()
    state = {name: tensor.double().reshape(shapes[name].shape)  # (the shared expert's router: a vector in the file)
             for name, tensor in contents.tensors.items() if "mlp.experts" not in name}
    for i in range(hf.config.num_hidden_layers):
        stack = lambda n: contents.tensors[f"model.layers.{i}.mlp.experts.{n}_proj.weight"].double()
        state[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([stack("gate"), stack("up")], dim=1)
        state[f"model.layers.{i}.mlp.experts.down_proj"] = stack("down")
    hf.load_state_dict(state, strict=False)  # (the output layer: tied to the embeddings)
    prompts = [random_prompt(random.Random(9), 3, 30) for _ in range(6)]
    assert_greedy_but_near_ties(hf, prompts, native_and_torch_answers(path, prompts))


@needs_kernels
@pytest.mark.parametrize("arch", ["glm4_moe", "afmoe"])
def test_an_8_bit_mixture_file_runs_its_experts_in_its_blocks_on_the_native_layers(tmp_path, arch):
    """A GLM-4.5 file of 8-bit blocks (a dense first layer, then experts beside a shared one, DeepSeek-V3's
    routing, q/k/v biases and norms, half of each head rotated), and an AFMoE one (its attention's gate a part of
    the q/k/v product, beside the queries' blocks), run their experts in them, and their decode steps on the native
    layers answer as the torch layers over the same blocks."""
    _, path = mixture_file(tmp_path / f"{arch}-q8.gguf", arch, matrices=Q.Q8_0)
    native_and_torch_answers(path, [random_prompt(random.Random(i), 3, 30) for i in range(6)])


def test_a_file_that_keeps_each_experts_gate_and_up_as_one_stack(tmp_path):
    """llama.cpp's converter writes ffn_gate_up_exps with --fuse-gate-up-exps (which llama.cpp reads for every
    mixture): each expert's gate rows, then its up rows, one stack. In float64: transformers' answers; in 8-bit blocks, on
    the native layers: each expert's products and the answers of the same model's file with the two apart."""
    hf = tiny_model("qwen3_moe", seed=3, **SETTINGS["qwen3_moe"])
    arch, metadata = MIXTURES["qwen3_moe"]
    together = write_gguf_of(hf, tmp_path / "together.gguf", arch, metadata(hf.config), fused_experts=True)
    names = {t.name for t in gguf.GGUFReader(together).tensors}
    assert "blk.0.ffn_gate_up_exps.weight" in names and "blk.0.ffn_gate_exps.weight" not in names
    prompts = [random_prompt(random.Random(i), 3, 30) for i in range(4)]
    assert_same_answers(greedy(together, prompts, 12), [greedy_with_logprobs(hf, p, 12) for p in prompts])
    quantized = [write_gguf_of(hf, tmp_path / f"{name}-q8.gguf", arch, metadata(hf.config), matrices=Q.Q8_0,
                               fused_experts=fused) for name, fused in (("apart", False), ("together", True))]
    x = torch.randn(5, hf.config.hidden_size)
    products = []
    for path in quantized:  # every expert's product over the same blocks, where each file keeps them
        with Engine.from_pretrained(path) as engine:
            stacks = [block.mlp.experts for block in engine.model.layers]
            products.append(torch.stack([e(i, x) for e in stacks for i in range(e.count)]))
            assert all(e.fused == (path == quantized[1]) for e in stacks)
    torch.testing.assert_close(products[1], products[0], atol=1e-6, rtol=1e-6)
    assert native_and_torch_answers(quantized[1], prompts) == native_and_torch_answers(quantized[0], prompts)


def native_and_torch_answers(path, prompts: list, experts_format: int | None = None) -> list:
    """The greedy answers of a file whose experts run in its blocks (``experts_format``'s, where given),
    on the native layers, which equal the torch layers' (the reference) over the same blocks."""
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    answers = []
    for native_layers in (True, False):
        with Engine.from_pretrained(path, max_batch_size=8) as engine:
            # (a dense layer's MLP, or none: GLM-4.5's first, a Nemotron-H mixer's without one)
            mixtures = [block.mlp for block in engine.model.layers if isinstance(block.mlp, SparseMoE)]
            experts = [mixture.experts for mixture in mixtures]
            assert experts and all(isinstance(e, BlockExperts) for e in experts)
            shared = [mixture.shared for mixture in mixtures if mixture.shared is not None]
            assert all(isinstance(m, BlockLinear) for s in shared for m in (getattr(s, "gate_up", s.down), s.down))
            assert experts_format is None or all(set(e.formats.values()) == {experts_format} for e in experts)
            assert engine.model.decoder_layers is not None
            if not native_layers:
                engine.model.decoder_layers = None
            handles = [engine.launch_response_tokens(p, config) for p in prompts]
            answers.append([list(engine.stream_response_tokens(h, timeout=60)) for h in handles])
    assert answers[0] == answers[1]
    return answers[0]


def gpt_oss_of_file_values(hf, path):
    """``hf`` with the weights of its GGUF file ``path`` as gguf-py reads them (float32), in gpt-oss's
    layout: the experts' gate and up rows interleaved into gate_up_proj [experts, hidden, 2 x inner]."""
    values = gguf_reader.read(path).tensors
    state = {}
    for name, tensor in values.items():
        base, _, kind = name.rpartition(".")
        if ".mlp.experts." not in name:
            state[name.replace("mlp.gate.", "mlp.router.")] = tensor.double()
            continue
        prefix, part = base.rsplit(".mlp.experts.", 1)
        stack = lambda n: values[f"{prefix}.mlp.experts.{n}_proj.{kind}"].double()
        suffix = "" if kind == "weight" else "_bias"
        if part == "down_proj":
            state[f"{prefix}.mlp.experts.down_proj{suffix}"] = stack("down").transpose(1, 2) if suffix == "" else stack("down")
        elif part == "gate_proj":
            gate, up = stack("gate"), stack("up")
            both = torch.stack([gate, up], dim=2).flatten(1, 2)  # rows gate 0, up 0, gate 1, ...
            state[f"{prefix}.mlp.experts.gate_up_proj{suffix}"] = both.transpose(1, 2) if suffix == "" else both
    hf.load_state_dict(state)
    return hf


@needs_kernels
def test_a_gpt_oss_file_with_mxfp4_experts_runs_them_in_its_blocks(tmp_path):
    """gpt-oss's files keep its experts in MXFP4: Loom multiplies them in the file's blocks (sixteen rows
    side by side where the build multiplies them so, with memory to spare for the copy), on the native
    layers and the torch ones alike, and its greedy tokens equal transformers' over the file's values but
    where their two best logits lie within a near tie."""
    hf, path = mixture_file(tmp_path / "gpt-oss-mxfp4.gguf", "gpt_oss", matrices=Q.MXFP4)
    reference = gpt_oss_of_file_values(hf, path)
    prompts = [random_prompt(random.Random(9), 3, 30) for _ in range(6)]
    kept = GGUF_MXFP4_ROWS16 if multiplies_rows16(GGUF_MXFP4_ROWS16) else GGUF_MXFP4
    assert_greedy_but_near_ties(reference, prompts, native_and_torch_answers(path, prompts, kept))



@needs_kernels
def test_stacks_are_laid_out_side_by_side_while_their_copies_fit_half_the_memory(tmp_path, monkeypatch):
    """A mixture's expert stacks are laid out sixteen rows side by side in the file's order while their
    copies fit in half of the memory available, the rest multiplied where the file keeps them; every
    layout gives the same products, so the same greedy tokens."""
    if not multiplies_rows16(GGUF_MXFP4_ROWS16):
        pytest.skip("this build multiplies MXFP4 in the file's layout only")
    _, path = mixture_file(tmp_path / "gpt-oss-mxfp4.gguf", "gpt_oss", matrices=Q.MXFP4)
    stacks = [info for info in GGUFFile(path).tensors.values() if info.name.endswith("_exps.weight")]
    kept = lambda model: [set(block.mlp.experts.formats.values()) for block in model.layers]

    with monkeypatch.context() as patched:
        patched.setattr(gguf_reader, "available_memory", lambda: 10_001)
        assert gguf_reader._stack_copy_room() == 5_000

    def load_with(room: int):
        monkeypatch.setattr(gguf_reader, "_stack_copy_room", lambda: room)
        return models.load(path).model

    first, everything = sum(info.data.nbytes for info in stacks[:3]), sum(info.data.nbytes for info in stacks)
    layers = len(stacks) // 3
    assert kept(load_with(first + 1)) == [{GGUF_MXFP4_ROWS16}] + [{GGUF_MXFP4}] * (layers - 1)  # the first layer's
    assert kept(load_with(0)) == [{GGUF_MXFP4}] * layers
    assert kept(load_with(everything)) == [{GGUF_MXFP4_ROWS16}] * layers
    if native.library().loom_k_quant_super_blocks_exact():  # (the file layout's products end blocks in integers)
        prompts = [random_prompt(random.Random(i), 3, 30) for i in range(3)]
        monkeypatch.setattr(gguf_reader, "_stack_copy_room", lambda: first + 1)
        partly = greedy(path, prompts)
        monkeypatch.setattr(gguf_reader, "_stack_copy_room", lambda: 0)
        assert partly == greedy(path, prompts)

def test_a_float_load_of_a_gpt_oss_file_with_mxfp4_experts_equals_transformers_over_its_values(tmp_path):
    """weights="float32" widens the MXFP4 stacks (and their biases) into the float experts: in float64 its
    greedy tokens equal transformers' over the file's values exactly."""
    hf, path = mixture_file(tmp_path / "gpt-oss-mxfp4.gguf", "gpt_oss", matrices=Q.MXFP4)
    reference = gpt_oss_of_file_values(hf, path)
    prompts = [random_prompt(random.Random(i), 3, 30) for i in range(4)]
    config = GenerationConfig(max_new_tokens=10, ignore_eos=True)
    with Engine.from_pretrained(path, weights="float32", dtype=torch.float64) as engine:
        assert not isinstance(engine.model.layers[0].mlp.experts, BlockExperts)
        answers = [list(engine.stream_response_tokens(engine.launch_response_tokens(p, config), timeout=60))
                   for p in prompts]
    assert answers == [reference_tokens(reference, p, 10, eos_token_id=None) for p in prompts]


def test_a_float_load_of_a_mixture_widens_its_stacks_into_transformers_layout(tmp_path):
    """weights="float32": the stacks widened, each expert's gate and up rows together, as a Hugging Face
    checkpoint's experts load."""
    hf, path = mixture_file(tmp_path / "mixtral-q8.gguf", "mixtral", matrices=Q.Q8_0)
    model = models.load(path, weights="float32").model
    experts = model.layers[0].mlp.experts
    assert not isinstance(experts, BlockExperts) and experts.gate_up.dtype == torch.float32
    values = gguf_reader.read(path).tensors
    gate = values["model.layers.0.mlp.experts.gate_proj.weight"]
    assert torch.equal(experts.gate_up[:, :gate.shape[1]], gate)
    assert np.isclose(experts.gate_up.detach().abs().max().item(), hf.model.layers[0].mlp.experts.gate_up_proj.abs().max().item(),
                      rtol=0.02)
