"""Vision-language checkpoints run for their text: Qwen2-VL's, Qwen2.5-VL's, Qwen3-VL's, Qwen3-VL-MoE's, Gemma 3's
and Mistral 3's (Ministral 3's) language models in memory, saved (transformers' layout; the hub's older ones: a Qwen2-VL config without
text_config, Qwen3-VL-MoE's transposed experts) and as the GGUF files llama.cpp's converter writes
(qwen2vl, qwen3vl, qwen3vlmoe), against transformers' vision-language models on text prompts, in float64."""

import json
import random

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from models.checkpoints.vision_language import text_config
from models.families.rope import rope_type
from runtime import Engine, GenerationConfig

from ..conftest import CONFIGS, EOS, VOCAB, greedy_with_logprobs, random_prompt, write_gguf_of
from .test_gguf import assert_same_answers, greedy

TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
            pad_token_id=0, initializer_range=0.1)
# each head's 8 rotary pairs by time, height and width: on text the three positions are equal
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
QWEN3_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                    num_position_embeddings=16, deepstack_visual_indexes=[0])
MODELS = {
    "qwen2_vl": (transformers.Qwen2VLConfig, dict(TEXT, rope_parameters=ROPE),
                 dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2)),
    "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, dict(TEXT, rope_parameters=ROPE),
                   dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                        fullatt_block_indexes=[0])),
    "qwen3_vl": (transformers.Qwen3VLConfig, dict(TEXT, rope_parameters={**ROPE, "mrope_interleaved": True}),
                 QWEN3_VISION),
    "qwen3_vl_moe": (transformers.Qwen3VLMoeConfig,
                     dict(TEXT, rope_parameters={**ROPE, "mrope_interleaved": True}, num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1),
                     QWEN3_VISION),
    # the families' own text configs (conftest's), a vision tower of one layer over 28-pixel images
    # (Gemma 3's with conftest's final soft cap, which transformers' vision-language Gemma 3 does not apply)
    "gemma3": (transformers.Gemma3Config, lambda: CONFIGS["gemma3"]().to_dict(),
               dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                    patch_size=14)),
    "mistral3": (transformers.Mistral3Config, lambda: CONFIGS["ministral3"]().to_dict(),
                 dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, head_dim=16, image_size=28, patch_size=14)),
    "llama4": (transformers.Llama4Config, lambda: CONFIGS["llama4_text"]().to_dict(),
               dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                    patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=64)),
}
GGUF_ARCHITECTURES = {"qwen2_vl": "qwen2vl", "qwen3_vl": "qwen3vl", "qwen3_vl_moe": "qwen3vlmoe"}


def tiny_vision_language_model(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    config_type, text, vision = MODELS[kind]
    extra = {"mm_tokens_per_image": 4} if kind == "gemma3" else {}
    config = config_type(text_config=text() if callable(text) else text, vision_config=vision,
                         experts_implementation="eager", **extra)
    return transformers.AutoModelForImageTextToText.from_config(config).to(torch.float64).eval()


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_prompt(rng, 1, 4), random_prompt(rng, 30, 60)]


def loom_greedy(source, prompt_list, new_tokens=16):
    with Engine.from_pretrained(source, dtype=torch.float64) as engine:
        handles = [engine.launch_response_tokens(p, GenerationConfig(max_new_tokens=new_tokens, logprobs=0))
                   for p in prompt_list]
        return [(list(engine.stream_response_tokens(h, timeout=60)), [t.logprob for t in h.logprobs]) for h in handles]


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_vision_language_model_answers_text_as_transformers_does(kind):
    """The model in memory (its language model under model.language_model, its vision tower left out):
    transformers' greedy tokens and their log-probabilities for text prompts, short and long."""
    hf = tiny_vision_language_model(kind, seed=1)
    asked = prompts(2)
    assert_same_answers(loom_greedy(hf, asked), [greedy_with_logprobs(hf, p, 16) for p in asked])


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_saved_vision_language_checkpoint_loads_its_language_model(kind, tmp_path):
    """A directory save_pretrained wrote (its config's text model under text_config; Qwen2-VL's tensors under
    model and visual, the others' under model.language_model and model.visual): transformers' answers."""
    hf = tiny_vision_language_model(kind, seed=3)
    hf.save_pretrained(tmp_path)
    asked = prompts(4)
    assert_same_answers(loom_greedy(tmp_path, asked), [greedy_with_logprobs(hf, p, 16) for p in asked])


def test_an_older_qwen2_vl_config_keeps_its_text_model_at_the_top(tmp_path):
    """Qwen2-VL's hub configs predate text_config: the text model's keys at the top level beside
    vision_config, the rotary an "mrope" rope_scaling, rope_theta beside it."""
    hf = tiny_vision_language_model("qwen2_vl", seed=5)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    config |= {**text, "model_type": "qwen2_vl", "rope_theta": rope["rope_theta"],
               "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    text = text_config(config)
    rope = text.get("rope_parameters") or text["rope_scaling"]
    assert (rope_type(rope), rope["mrope_section"], text["model_type"]) == ("default", [2, 3, 3], "qwen2")
    asked = prompts(6)
    assert_same_answers(loom_greedy(tmp_path, asked), [greedy_with_logprobs(hf, p, 16) for p in asked])


@pytest.mark.parametrize("kind", ["gemma3", "mistral3"])
def test_gemma_3_and_mistral_3_directories_in_either_layout(kind, tmp_path):
    """save_pretrained writes Gemma 3's and Mistral 3's files in the hub's layout (the language model under
    language_model.model, the vision tower and projector at the top: the saved-directory test reads it); a
    directory may hold transformers 5's names too (model.language_model, model.vision_tower): the same answers."""
    hf = tiny_vision_language_model(kind, seed=11)
    hf.save_pretrained(tmp_path)
    assert any(name.startswith("language_model.model.") for name in load_file(tmp_path / "model.safetensors"))
    save_file({name: t.contiguous() for name, t in hf.state_dict().items() if name != "lm_head.weight"
               or not hf.config.tie_word_embeddings}, tmp_path / "model.safetensors")
    asked = prompts(12)
    assert_same_answers(loom_greedy(tmp_path, asked), [greedy_with_logprobs(hf, p, 16) for p in asked])


def test_a_hub_gemma_3_config_names_a_few_sizes_and_takes_the_rest_as_transformers_does():
    """google/gemma-3-4b-it's config.json names five of its text model's fields; transformers' Gemma3TextConfig
    gives the others (heads, K/V heads, head size, vocabulary), and so does Loom's reading."""
    config = {"model_type": "gemma3", "text_config": {
        "model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}, "vision_config": {
        "model_type": "siglip_vision_model", "hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
        "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14}, "mm_tokens_per_image": 256}
    text = text_config(config)
    expected = transformers.Gemma3Config(**{k: v for k, v in config.items() if k != "model_type"}).text_config
    assert text["model_type"] == "gemma3_text"
    for name in ("num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "hidden_size",
                 "query_pre_attn_scalar", "sliding_window"):
        assert text[name] == getattr(expected, name), name
    assert text["tie_word_embeddings"] and text["final_logit_softcapping"] is None


@pytest.mark.parametrize("kind, outer, inner, tied", [
    ("qwen2_5_vl", False, True, True),  # (an older save's tie inside text_config: transformers moves it out)
    ("mistral3", None, False, True),    # (Mistral 3's class ties unless its top level says not)
    ("qwen3_vl_moe", None, True, False),  # (Qwen3-VL-MoE's does not, whatever text_config says)
])
def test_the_output_layer_is_tied_as_transformers_ties_it(kind, outer, inner, tied):
    """transformers ties a vision-language model's output layer by its top-level config (and its class's
    default), not by text_config's."""
    config_type, text, vision = MODELS[kind]
    text = dict(text() if callable(text) else text, tie_word_embeddings=inner)
    config = {"model_type": kind, "text_config": text, "vision_config": vision}
    if outer is not None:
        config["tie_word_embeddings"] = outer
    assert text_config(config)["tie_word_embeddings"] is tied
    assert config_type(**{k: v for k, v in config.items() if k != "model_type"}).tie_word_embeddings is tied


def test_qwen3_vl_moe_hub_files_keep_their_experts_transposed(tmp_path):
    """Qwen3-VL-MoE's hub files hold each layer's expert stacks as [experts, hidden, 2 x inner] and [experts,
    inner, hidden] (transformers transposes them as it loads): read either way, transformers' answers."""
    hf = tiny_vision_language_model("qwen3_vl_moe", seed=7)
    hf.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    experts = [name for name in weights if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert experts
    save_file({name: t.transpose(1, 2).contiguous() if name in experts else t for name, t in weights.items()},
              tmp_path / "model.safetensors")
    asked = prompts(8)
    assert_same_answers(loom_greedy(tmp_path, asked), [greedy_with_logprobs(hf, p, 16) for p in asked])


@pytest.mark.parametrize("kind", sorted(GGUF_ARCHITECTURES))
def test_a_vision_language_gguf_file_answers_as_its_transformers_model(kind, tmp_path):
    """The text GGUF llama.cpp's converter writes of a vision-language model (its own architecture, the
    rotary's sections and Qwen3-VL's deepstack count in the metadata, which text leaves unused):
    transformers' answers."""
    hf = tiny_vision_language_model(kind, seed=9)
    metadata = {"rope.dimension_sections": [2, 3, 3, 0]}
    if kind != "qwen2_vl":
        metadata["n_deepstack_layers"] = 1
    if kind == "qwen3_vl_moe":
        text = hf.config.text_config
        metadata |= {"expert_count": text.num_experts, "expert_used_count": text.num_experts_per_tok,
                     "expert_feed_forward_length": text.moe_intermediate_size}
    written = write_gguf_of(hf, tmp_path / "vl.gguf", GGUF_ARCHITECTURES[kind], metadata)
    asked = prompts(10)
    assert_same_answers(greedy(written, asked), [greedy_with_logprobs(hf, p, 16) for p in asked])
