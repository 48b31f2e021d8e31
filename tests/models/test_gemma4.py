"""Gemma 4's text: layers whose K/V differ in shape (the pool keeps each its own), global layers whose values are
their keys, layers reading an earlier layer's K/V, per-layer embeddings; checkpoints, the multimodal checkpoint's
language model, and GGUF files against transformers' models; the configs and files Loom refuses. (The engine's
threaded, prefix-caching and saved-directory tests run it among the other families.)"""

import random

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from models.checkpoints.gguf import read
from models.families.gemma4 import Gemma4Spec
from runtime import Engine

from ..conftest import CONFIGS, greedy_with_logprobs, random_prompt, tiny_model
from .test_falcon_h1 import alone_and_together, answers, tensor_kinds
from .test_gguf import assert_same_answers, finished, greedy
from .test_qwen35 import float32_weights

# transformers' names a layer -> llama.cpp's (Gemma 4's converter: its norms as they are, not 1 + weight)
LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "post_feedforward_layernorm": "post_ffw_norm",
               "per_layer_input_gate": "inp_gate", "per_layer_projection": "proj",
               "post_per_layer_input_norm": "post_norm", "layer_scalar": "layer_output_scale",
               # the 26B-A4B's experts: their router (its scale a kind of the router's name), stacks and norms
               "router.proj": "ffn_gate_inp", "pre_feedforward_layernorm_2": "pre_ffw_norm_2",
               "post_feedforward_layernorm_1": "post_ffw_norm_1", "post_feedforward_layernorm_2": "post_ffw_norm_2"}
# names without a kind: llama.cpp's tensor and kind
BARE = {"layer_scalar": ("layer_output_scale", "weight"), "router.scale": ("ffn_gate_inp", "scale"),
        "router.per_expert_scale": ("ffn_down_exps", "scale"), "experts.gate_up_proj": ("ffn_gate_up_exps", "weight"),
        "experts.down_proj": ("ffn_down_exps", "weight")}
GLOBAL_NAMES = {"embed_tokens": "token_embd", "embed_tokens_per_layer": "per_layer_token_embd",
                "per_layer_model_projection": "per_layer_model_proj", "per_layer_projection_norm": "per_layer_proj_norm",
                "norm": "output_norm"}


def sized_writer(c, path, arch: str):
    """A GGUFWriter for ``arch`` at ``path`` holding ``c``'s layer count, context, hidden size and query heads."""
    import gguf
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_head_count(c.num_attention_heads)
    return writer


def add_fields(writer, arch: str, fields: dict, vocab: int) -> None:
    """``fields`` (a uint32, float32 or list value a key, None: left out) under ``arch``'s prefix, and the vocabulary's
    size."""
    adds = {int: writer.add_uint32, float: writer.add_float32, list: writer.add_array}
    for key, value in fields.items():
        if value is not None:
            adds[type(value)](f"{arch}.{key}", value)
    writer.add_vocab_size(vocab)


def write_gemma4_gguf(hf, path, matrices: Q | None = None, metadata: dict | None = None):
    """``hf``'s weights in a GGUF file as llama.cpp's Gemma 4 converter writes them: its sizes a layer at a time
    (K/V heads, MLP widths), the sliding-window layers' head size as *_swa keys, the layers' kinds as a pattern, the
    shared layers' count, rope_freqs for the global layers' proportional rope (1 for the pairs that turn, 1e30 for
    the others), the shared layers' K/V products (add_unread_kv), no values in global layers whose values are their
    keys.
    Matrices in float32, or in ``matrices``' type; ``metadata`` (under gemma4.) added, a None value leaving a key
    out. The file carries no tokenizer."""
    import gguf
    c = hf.config
    s = Gemma4Spec.from_hf(c.to_dict())
    writer, layers = sized_writer(c, path, "gemma4"), c.num_hidden_layers
    writer.add_feed_forward_length([c.intermediate_size * (2 if s.double_wide_mlp and i >= s.first_shared else 1)
                                    for i in range(layers)])
    writer.add_head_count_kv([s.kv_shape(i)[0] for i in range(layers)])
    fields = {"attention.key_length": s.global_head_dim, "attention.value_length": s.global_head_dim,
              "attention.key_length_swa": s.head_dim, "attention.value_length_swa": s.head_dim,
              "rope.dimension_count": s.global_head_dim, "rope.dimension_count_swa": s.head_dim,
              "rope.freq_base": s.global_rope["rope_theta"], "rope.freq_base_swa": s.sliding_theta,
              "attention.layer_norm_rms_epsilon": c.rms_norm_eps, "attention.sliding_window": c.sliding_window,
              "attention.sliding_window_pattern": [t == "sliding_attention" for t in c.layer_types],
              "attention.shared_kv_layers": c.num_kv_shared_layers,
              "embedding_length_per_layer_input": c.hidden_size_per_layer_input,
              "final_logit_softcapping": c.final_logit_softcapping,
              **({"expert_count": c.num_experts, "expert_used_count": c.top_k_experts,
                  "expert_feed_forward_length": c.moe_intermediate_size} if c.enable_moe_block else {}),
              **(metadata or {})}
    add_fields(writer, "gemma4", fields, c.vocab_size)

    def add(name, values):
        if matrices is None or values.ndim < 2 or values.shape[-1] % 32 or name.endswith("ffn_gate_inp.weight"):
            return writer.add_tensor(name, values)  # (routers stay F32, as llama-quantize leaves them)
        writer.add_tensor(name, gguf.quants.quantize(values, matrices), raw_dtype=matrices)

    rotated = int(s.global_rope["partial_rotary_factor"] * s.global_head_dim // 2)
    add("rope_freqs.weight", np.array([1.0] * rotated + [1e30] * (s.global_head_dim // 2 - rotated), np.float32))
    for name, tensor in hf.state_dict().items():
        name = name.removeprefix("model.").removeprefix("language_model.")
        values = tensor.float().numpy()
        if name == "lm_head.weight":
            if not c.tie_word_embeddings:
                add("output.weight", values)
            continue
        if not name.startswith("layers."):
            add(GLOBAL_NAMES[name.rpartition(".")[0]] + ".weight", values)
            continue
        _, layer, rest = name.split(".", 2)
        if rest in BARE:
            name, kind = BARE[rest]
            add(f"blk.{layer}.{name}.{kind}", np.ascontiguousarray(values))
            continue
        part, _, kind = rest.rpartition(".")
        add(f"blk.{layer}.{LAYER_NAMES[part]}.{kind}", np.ascontiguousarray(values))
        if int(layer) >= s.first_shared and part == "self_attn.q_proj":
            add_unread_kv(add, int(layer), s, c.hidden_size)
    return finished(writer, path)


def add_unread_kv(add, layer: int, s: Gemma4Spec, hidden: int) -> None:
    """A layer that reads an earlier layer's K/V given K/V products and a key norm of its own all the same, as the
    converters write a checkpoint's (llama.cpp's loader takes them and reads none); random here, transformers'
    models having none. ``add(name, values)``: the writer's."""
    kv, dim = s.kv_shape(layer)
    rng = np.random.default_rng(layer)
    for name in ("attn_k",) + (() if s.values_are_keys and s.is_global(layer) else ("attn_v",)):
        add(f"blk.{layer}.{name}.weight", rng.normal(size=(kv * dim, hidden)).astype(np.float32))
    add(f"blk.{layer}.attn_k_norm.weight", np.ones(dim, np.float32))


def test_a_gemma4_model_answers_as_transformers_does():
    """Gemma 4 in memory, in float64, prompts long and short, chunked and decoded beside each other: transformers'
    greedy tokens and their log-probabilities. The pool keeps the layers that keep K/V, each in its own shape."""
    hf = tiny_model("gemma4", seed=3)
    prompts = [random_prompt(random.Random(14), 1, 4), random_prompt(random.Random(15), 30, 60)]
    with Engine.from_pretrained(hf, dtype=torch.float64, max_batch_size=4, max_batch_tokens=16) as engine:
        got = answers(engine, prompts)
        pool, c = engine.kv_cache, hf.config
        assert pool.num_layers == c.num_hidden_layers - c.num_kv_shared_layers == 3
        assert [pool.layer(i)[1].shape[2:] for i in range(3)] == [(2, 16), (1, 32), (2, 16)]
        assert pool.block_bytes == 2 * pool.block_size * (2 * 16 + 32 + 2 * 16) * 8
    assert_same_answers(got, [greedy_with_logprobs(hf, p, 16) for p in prompts])


@pytest.mark.parametrize("arch,settings", [("gemma4", {"attention_k_eq_v": False}),
                                           ("gemma4", {"hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0}),
                                           ("gemma4_moe", {})], ids=["values-of-their-own", "31b-like", "26b-a4b-like"])
def test_gemma4_variants_answer_as_transformers_does(arch, settings):
    """Global layers with values of their own (and the sliding layers' heads), a Gemma 4 without per-layer
    embeddings or shared K/V (the 31B's kind), and one with experts beside each MLP (the 26B-A4B's):
    transformers' answers in float64."""
    hf = tiny_model(arch, seed=4, **settings)
    prompts = [random_prompt(random.Random(16), 5, 40) for _ in range(2)]
    with Engine.from_pretrained(hf, dtype=torch.float64, max_batch_size=4, max_batch_tokens=16) as engine:
        got = answers(engine, prompts)
    assert_same_answers(got, [greedy_with_logprobs(hf, p, 16) for p in prompts])


def test_the_multimodal_checkpoints_language_model_answers_as_its_text_model_does(tmp_path):
    """Gemma4ForConditionalGeneration saved with its vision tower: read for its text, transformers' answers."""
    import transformers
    text = CONFIGS["gemma4"]()
    vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(2)
    hf = transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None)).double().eval()
    for name, buffer in hf.named_buffers():
        if name.endswith("layer_scalar"):
            buffer.uniform_(0.6, 1.4)
    hf.save_pretrained(tmp_path)
    prompts = [random_prompt(random.Random(18), 5, 40) for _ in range(2)]
    with Engine.from_pretrained(tmp_path, dtype=torch.float64) as engine:
        got = answers(engine, prompts)
    assert_same_answers(got, [greedy_with_logprobs(hf, p, 16) for p in prompts])


def assert_a_file_as_written_answers_as(hf, path, arch: str, named: set[str]) -> dict:
    """``path``'s tensors all among those llama.cpp's ``arch`` reads (gguf-py's), ``named`` among them; in float64,
    transformers' answers to a short and a long prompt. Its config as Loom reads it."""
    from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES
    names = tensor_kinds(path)
    assert names <= {TENSOR_NAMES[t] for t in MODEL_TENSORS[MODEL_ARCH[arch.upper()]]} and named <= names
    prompts = [random_prompt(random.Random(16), 1, 4), random_prompt(random.Random(17), 30, 60)]
    assert_same_answers(greedy(path, prompts), [greedy_with_logprobs(hf, p, 16) for p in prompts])
    return read(path).config


def test_a_gemma4_file_equals_its_transformers_model(tmp_path):
    """A gemma4 file as llama.cpp's converter writes it, in float64: transformers' answers; its tensors all among
    those llama.cpp's gemma4 reads, its global layers' rope by rope_freqs."""
    hf = float32_weights(tiny_model("gemma4", seed=5))
    config = assert_a_file_as_written_answers_as(hf, write_gemma4_gguf(hf, tmp_path / "gemma4.gguf"), "gemma4", {
        "rope_freqs", "per_layer_token_embd", "blk.{bid}.layer_output_scale", "blk.{bid}.inp_gate"})
    assert config["attention_k_eq_v"] and config["use_double_wide_mlp"] and config["num_kv_shared_layers"] == 2


def test_a_gemma4_file_with_experts_equals_its_transformers_model(tmp_path):
    """The 26B-A4B's kind of file: a router and its scale, the experts' gate and up as one stack, their scales
    (ffn_down_exps.scale) and norms; F32, in float64: transformers' answers. Q8_0: the experts in their blocks."""
    from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES
    hf = float32_weights(tiny_model("gemma4_moe", seed=8))
    path = write_gemma4_gguf(hf, tmp_path / "moe.gguf")
    assert tensor_kinds(path) <= {TENSOR_NAMES[t] for t in MODEL_TENSORS[MODEL_ARCH.GEMMA4]}
    prompts = [random_prompt(random.Random(21), 1, 4), random_prompt(random.Random(22), 30, 60)]
    assert_same_answers(greedy(path, prompts), [greedy_with_logprobs(hf, p, 16) for p in prompts])
    quantized = write_gemma4_gguf(hf, tmp_path / "q8.gguf", Q.Q8_0)
    with Engine.from_pretrained(quantized) as engine:
        assert type(engine.model.layers[0].moe.experts).__name__ == "BlockExperts"
        alone, together = alone_and_together(engine, prompts)
    assert alone == together


def test_a_quantized_gemma4_file_runs_in_its_blocks(tmp_path):
    """A Q8_0 file: its products, the per-layer table included, in their blocks; a request's tokens the same alone
    as beside others."""
    hf = tiny_model("gemma4", seed=6, hidden_size_per_layer_input=32)  # (a table row of whole blocks)
    path = write_gemma4_gguf(hf, tmp_path / "q8.gguf", Q.Q8_0)
    prompts = [random_prompt(random.Random(20 + i), 3, 30) for i in range(3)]
    with Engine.from_pretrained(path) as engine:
        kinds = {type(m).__name__ for m in engine.model.modules()}
        assert {"BlockLinear", "BlockEmbedding"} <= kinds and "Linear" not in kinds
        assert type(engine.model.per_layer_embed).__name__ == "BlockEmbedding"
        alone, together = alone_and_together(engine, prompts)
    assert alone == together


@pytest.mark.parametrize("settings,message", [
    ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": None, "moe_intermediate_size": 32},
     "top_k_experts"),
    ({"use_bidirectional_attention": "all"}, "bidirectional"),
    ({"hidden_activation": "silu"}, "hidden_activation"),
])
def test_gemma4_configs_loom_does_not_run_are_refused(settings, message):
    config = CONFIGS["gemma4"]().to_dict() | settings
    with pytest.raises(ValueError, match=message):
        Gemma4Spec.from_hf(config)


def test_a_gemma4_file_without_its_layer_pattern_is_refused(tmp_path):
    hf = tiny_model("gemma4", seed=7)
    path = write_gemma4_gguf(hf, tmp_path / "nopattern.gguf", metadata={"attention.sliding_window_pattern": None})
    with pytest.raises(ValueError, match="sliding_window_pattern"):
        Engine.from_pretrained(path)


def test_a_gemma4_files_own_tokenizer_reads_under_its_stand_in(tmp_path, monkeypatch):
    """A gemma4 file's tokenizer as its converter writes it (tokenizer.ggml.model "gemma4": SentencePiece-style
    BPE over "\u2581"-spelled spaces, with merges), read under the llama stand-in (transformers' GGUF config reader
    takes no per-layer widths): merged by the merges' ranks, no BOS added (the chat template writes it, as
    transformers reads these files), the text back."""
    import gguf
    from models.checkpoints.gguf import read_tokenizer
    monkeypatch.setenv("LOOM_CACHE", str(tmp_path / "cache"))
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "\u2581", "a", "b", "c", "\u2581a", "ab", "\u2581ab", "\u2581b", "bc"]
    writer = gguf.GGUFWriter(str(tmp_path / "tokenizer.gguf"), "gemma4")
    writer.add_tokenizer_model("gemma4")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([3, 3, 3, 2] + [1] * (len(tokens) - 4))  # (control, control, control, unknown, normal)
    writer.add_token_merges(["\u2581 a", "a b", "\u2581a b", "\u2581 b", "b c"])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_add_bos_token(True)
    writer.add_tensor("unused", np.zeros(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tokenizer = read_tokenizer(tmp_path / "tokenizer.gguf", "gemma4")
    ids = tokenizer.encode("ab bc a")
    assert [tokens[i] for i in ids] == ["ab", "\u2581b", "c", "\u2581a"]  # ("\u2581b c": no such merge)
    assert tokenizer.decode(ids) == "ab bc a"
