"""Gemma 3n's text: AltUp's streams, Laurel, sparse MLP gates, layers reading an earlier layer's K/V, per-layer
embeddings from a table shorter than the vocabulary; the checkpoint, the multimodal checkpoint's language model
and GGUF files against transformers' models; the configs and files Loom refuses. (The engine's threaded,
prefix-caching and saved-directory tests run it among the other families.)"""

import random

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from models.checkpoints.gguf import read
from models.families.gemma3n import Gemma3nSpec
from runtime import Engine

from ..conftest import CONFIGS, greedy_with_logprobs, random_prompt, tiny_model
from .test_falcon_h1 import alone_and_together, answers
from .test_gemma4 import (GLOBAL_NAMES, LAYER_NAMES as GEMMA4_LAYER_NAMES, add_fields, add_unread_kv,
                          assert_a_file_as_written_answers_as, sized_writer)
from .test_gguf import assert_same_answers, finished, rewritten
from .test_qwen35 import float32_weights

# transformers' names a layer -> llama.cpp's: Gemma 4's (both converters keep their norms as they are, not 1 +
# weight), AltUp's and Laurel's
LAYER_NAMES = {**GEMMA4_LAYER_NAMES, "altup.correction_coefs": "altup_correct_coef",
               "altup.prediction_coefs": "altup_predict_coef", "altup.modality_router": "altup_router",
               "altup.router_norm": "altup_router_norm", "laurel.linear_left": "laurel_l",
               "laurel.linear_right": "laurel_r", "laurel.post_laurel_norm": "laurel_post_norm"}
UNQUANTIZED = ("altup", "laurel", "per_layer_model_proj")  # (llama-quantize leaves them as they are)


def write_gemma3n_gguf(hf, path, matrices: Q | None = None, metadata: dict | None = None):
    """``hf``'s weights in a GGUF file as llama.cpp's Gemma 3n converter writes them: the embedding tables padded
    with zeros to the whole vocabulary, the AltUp projections stacked, each layer's gate cutoff in standard
    deviations, the layers' kinds as a pattern; the shared layers' K/V products (add_unread_kv: llama.cpp's Gemma 3n
    requires them and reads none). Matrices in float32, or in
    ``matrices``' type (AltUp's, Laurel's and the per-layer projection's left in float32, as llama-quantize
    leaves them); ``metadata`` (under gemma3n.) added, a None value leaving a key out. No tokenizer."""
    import gguf
    c = hf.config
    s = Gemma3nSpec.from_hf(c.to_dict())
    writer = sized_writer(c, path, "gemma3n")
    writer.add_feed_forward_length(list(c.intermediate_size))
    writer.add_head_count_kv(c.num_key_value_heads)
    stds = [float(torch.distributions.Normal(0, 1).icdf(torch.tensor(p, dtype=torch.float32)))
            for p in c.activation_sparsity_pattern]
    fields = {"attention.key_length": c.head_dim, "attention.value_length": c.head_dim,
              "rope.freq_base": s.global_rope["rope_theta"], "attention.layer_norm_rms_epsilon": c.rms_norm_eps,
              "attention.sliding_window": c.sliding_window,
              "attention.sliding_window_pattern": [t == "sliding_attention" for t in c.layer_types],
              "attention.shared_kv_layers": c.num_kv_shared_layers, "activation_sparsity_scale": stds,
              "altup.active_idx": c.altup_active_idx, "altup.num_inputs": c.altup_num_inputs,
              "embedding_length_per_layer_input": c.hidden_size_per_layer_input,
              "final_logit_softcapping": c.final_logit_softcapping, **(metadata or {})}
    add_fields(writer, "gemma3n", fields, c.vocab_size)

    def add(name, values):
        if matrices is None or values.ndim != 2 or values.shape[-1] % 32 or any(n in name for n in UNQUANTIZED):
            return writer.add_tensor(name, np.ascontiguousarray(values))
        writer.add_tensor(name, gguf.quants.quantize(values, matrices), raw_dtype=matrices)

    state = {k.removeprefix("model.").removeprefix("language_model."): v.float().numpy()
             for k, v in hf.state_dict().items()}
    for name in ("altup_projections", "altup_unembed_projections"):
        add(f"{'altup_proj' if name == 'altup_projections' else 'altup_unembd_proj'}.weight",
            np.stack([state.pop(f"{name}.{i}.weight") for i in range(c.altup_num_inputs - 1)]))
    for name, values in state.items():
        if name == "lm_head.weight":
            if not c.tie_word_embeddings:
                add("output.weight", values)
            continue
        if not name.startswith("layers."):
            if name.startswith("embed_tokens"):  # (padded to the whole vocabulary, as the converter does)
                values = np.concatenate([values, np.zeros((c.vocab_size - len(values), values.shape[1]), np.float32)])
            add(GLOBAL_NAMES[name.rpartition(".")[0]] + ".weight", values)
            continue
        _, layer, rest = name.split(".", 2)
        if rest == "altup.correct_output_scale":
            add(f"blk.{layer}.altup_correct_scale.weight", values)
            continue
        part, _, kind = rest.rpartition(".")
        add(f"blk.{layer}.{LAYER_NAMES[part]}.{kind}", values)
        if int(layer) >= s.first_shared and part == "self_attn.q_proj":
            add_unread_kv(add, int(layer), s, c.hidden_size)
    return finished(writer, path)


def test_a_gemma3n_model_answers_as_transformers_does():
    """Gemma 3n in memory, in float64, prompts long and short, chunked and decoded beside each other: transformers'
    greedy tokens and their log-probabilities. The pool keeps the layers that keep K/V."""
    hf = tiny_model("gemma3n", seed=3)
    prompts = [random_prompt(random.Random(14), 1, 4), random_prompt(random.Random(15), 30, 60)]
    with Engine.from_pretrained(hf, dtype=torch.float64, max_batch_size=4, max_batch_tokens=16) as engine:
        got = answers(engine, prompts)
        assert engine.kv_cache.num_layers == hf.config.num_hidden_layers - hf.config.num_kv_shared_layers == 3
    assert_same_answers(got, [greedy_with_logprobs(hf, p, 16) for p in prompts])


def test_a_gemma3n_with_uneven_mlps_and_no_shared_layers_answers_as_transformers_does():
    """MLPs of different widths a layer, every gate sparse, every layer keeping its own K/V: transformers'
    answers in float64."""
    hf = tiny_model("gemma3n", seed=4, intermediate_size=[96, 64, 128, 96, 32], num_kv_shared_layers=0,
                    activation_sparsity_pattern=[0.95, 0.8, 0.6, 0.9, 0.95])
    prompts = [random_prompt(random.Random(16), 5, 40) for _ in range(2)]
    with Engine.from_pretrained(hf, dtype=torch.float64, max_batch_size=4, max_batch_tokens=16) as engine:
        got = answers(engine, prompts)
    assert_same_answers(got, [greedy_with_logprobs(hf, p, 16) for p in prompts])


def test_the_multimodal_checkpoints_language_model_answers_as_its_text_model_does(tmp_path):
    """A Gemma3nForConditionalGeneration checkpoint (its config, the language model's weights under its prefix,
    its towers' and their projections' beside them): read for its text, its text model's answers. (The towers'
    tensors are stand-ins: building transformers' vision tower takes timm, which Loom does not need.)"""
    import transformers
    from safetensors.torch import save_file
    config = transformers.Gemma3nConfig(text_config=CONFIGS["gemma3n"]().to_dict())
    hf = tiny_model("gemma3n", seed=9)
    state = {f"model.language_model.{k.removeprefix('model.')}": v.contiguous() for k, v in hf.state_dict().items()
             if k != "lm_head.weight"}
    state |= {f"model.{tower}.layer.weight": torch.ones(4, 4, dtype=torch.float64)
              for tower in ("audio_tower", "vision_tower", "embed_audio", "embed_vision")}
    save_file(state, tmp_path / "model.safetensors")
    config.save_pretrained(tmp_path)
    prompts = [random_prompt(random.Random(18), 5, 40) for _ in range(2)]
    with Engine.from_pretrained(tmp_path, dtype=torch.float64) as engine:
        got = answers(engine, prompts)
    assert_same_answers(got, [greedy_with_logprobs(hf, p, 16) for p in prompts])


def test_a_gemma3n_file_equals_its_transformers_model(tmp_path):
    """A gemma3n file as llama.cpp's converter writes it, in float64: transformers' answers; its tensors all among
    those llama.cpp's gemma3n reads."""
    hf = float32_weights(tiny_model("gemma3n", seed=5))
    config = assert_a_file_as_written_answers_as(hf, write_gemma3n_gguf(hf, tmp_path / "gemma3n.gguf"), "gemma3n", {
        "altup_proj", "altup_unembd_proj", "blk.{bid}.laurel_l", "blk.{bid}.altup_router"})
    assert config["num_kv_shared_layers"] == 2 and config["laurel_rank"] == 8 and config["altup_num_inputs"] == 4


def test_a_quantized_gemma3n_file_runs_in_its_blocks(tmp_path):
    """A Q8_0 file: its products, the per-layer table included, in their blocks; a request's tokens the same alone
    as beside others. A file without the sparsity cutoffs runs llama.cpp's (the first ten layers')."""
    hf = tiny_model("gemma3n", seed=6, hidden_size_per_layer_input=32)  # (a table row of whole blocks)
    path = write_gemma3n_gguf(hf, tmp_path / "q8.gguf", Q.Q8_0)
    prompts = [random_prompt(random.Random(20 + i), 3, 30) for i in range(3)]
    with Engine.from_pretrained(path) as engine:
        kinds = {type(m).__name__ for m in engine.model.modules()}
        assert {"BlockLinear", "BlockEmbedding"} <= kinds
        assert type(engine.model.per_layer_embed).__name__ == "BlockEmbedding"
        assert type(engine.model.layers[0].gate_up).__name__ == "BlockLinear"
        assert type(engine.model.altup_spread).__name__ == "BlockLinear"  # (the AltUp stacks kept, a matrix a stream)
        assert type(engine.model.altup_unembed[2]).__name__ == "BlockLinear"
        alone, together = alone_and_together(engine, prompts)
    assert alone == together
    unsaid = write_gemma3n_gguf(hf, tmp_path / "unsaid.gguf", metadata={"activation_sparsity_scale": None})
    assert Gemma3nSpec.from_hf(read(unsaid).config).sparsity_stds == (1.6448533535003662,) * 5


@pytest.mark.parametrize("settings,message", [
    ({"altup_active_idx": 1}, "altup_active_idx"),
    ({"hidden_activation": "silu"}, "hidden_activation"),
    ({"hidden_size_per_layer_input": 0}, "hidden_size_per_layer_input"),
    ({"activation_sparsity_pattern": [0.95, 0.0]}, "one value a layer"),
])
def test_gemma3n_configs_loom_does_not_run_are_refused(settings, message):
    config = CONFIGS["gemma3n"]().to_dict() | settings
    with pytest.raises(ValueError, match=message):
        Gemma3nSpec.from_hf(config)


def test_a_gemma3n_file_without_its_altup_projections_is_refused(tmp_path):
    path = write_gemma3n_gguf(tiny_model("gemma3n", seed=7), tmp_path / "whole.gguf")
    cut = rewritten(path, tmp_path / "cut.gguf", lambda tensors: (
        (t.name, np.asarray(t.data), t.tensor_type) for t in tensors if t.name != "altup_proj.weight"))
    with pytest.raises(ValueError, match="altup_proj"):
        Engine.from_pretrained(cut)
