"""Vision-language checkpoints read for their text: the language model's config and tensors, the vision
tower's and projector's left out. Loom takes token prompts, and on text alone these models are their text
families' (Gemma 3's, Mistral 3's, Ministral 3's and Llama 4's outright): Qwen2-VL's and Qwen3-VL's multimodal
rotary gives every text token three equal positions (time, height, width), which rotate as the text model's rope,
and Qwen3-VL's deepstack adds image features to image tokens only. (llama.cpp's Qwen3-VL leaves two of a head's 64
rotary pairs, the slowest, unrotated for text: about 4e-7 radians a position; Loom rotates them, as transformers
does.)"""

from __future__ import annotations

import torch


# a vision-language model_type -> the text family its language model is (None: as its text_config says)
TEXT_MODELS = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe",
               "gemma3": None, "gemma4": None, "gemma3n": None, "mistral3": None, "llama4": None}
# what transformers' vision-language model does whatever its text config says: Qwen3-VL-MoE renormalises its
# chosen experts' weights always (its config has no norm_topk_prob); Gemma 3's caps no logits (its text model
# would, by final_logit_softcapping)
FIXED = {"qwen3_vl_moe": {"norm_topk_prob": True}, "gemma3": {"final_logit_softcapping": None}}
VISION_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                   "multi_modal_projector.",
                   # (Gemma 4's and Gemma 3n's towers and their projections, the audio's too)
                   "model.embed_vision.", "model.audio_tower.", "model.embed_audio.",
                   "vision_model.", "model.vision_model.")  # (Llama 4's)
# where checkpoints keep the language model -> its text family's names: transformers 5's, and the hub's older
# Gemma 3 and Mistral 3 files' (the hub's Qwen2-VL files keep it under model already)
LANGUAGE_MODEL_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                           "language_model.lm_head.": "lm_head."}


def text_config(config: dict) -> dict:
    """A vision-language config's text model (its text_config, or the top-level keys of an older config
    that keeps them there) under its text family's model_type; any other config as it is."""
    kind = config.get("model_type")
    if kind not in TEXT_MODELS:
        return config
    config = _completed(config)
    outer = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
    inner = config.get("text_config") or {}
    text = {**outer, **inner, "model_type": TEXT_MODELS[kind] or inner.get("model_type"),
            "vision_language_model": kind, **FIXED.get(kind, {})}
    text["tie_word_embeddings"] = outer["tie_word_embeddings"]  # (the whole model's, which transformers ties by)
    return text


def _completed(config: dict) -> dict:
    """The config as transformers reads it: the defaults a hub config leaves out (Gemma 3's text_config names
    a few sizes alone), an older config's layout and rules (Qwen2-VL's text keys at the top, its tie taken
    from either level, its "mrope" rope_scaling a default rope) put as transformers 5 keeps them."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[config["model_type"]](**{k: v for k, v in config.items() if k != "model_type"}).to_dict()


def text_tensors(tensors: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """The language model's tensors of a vision-language checkpoint (``config``: text_config's answer)
    under its text family's names (LANGUAGE_MODEL_PREFIXES), the vision tower's and projector's dropped; Qwen3-VL-MoE's hub files keep their
    expert stacks transposed ([experts, hidden, 2 x inner]), which are put in transformers' layout. Any
    other checkpoint's tensors as they are."""
    if "vision_language_model" not in config:
        return tensors
    text = {}
    for name in list(tensors):
        tensor = tensors.pop(name)
        if name.startswith(VISION_PREFIXES):
            continue
        prefix = next((p for p in LANGUAGE_MODEL_PREFIXES if name.startswith(p)), None)
        text[LANGUAGE_MODEL_PREFIXES[prefix] + name[len(prefix):] if prefix else name] = tensor
    if config["vision_language_model"] == "qwen3_vl_moe":
        _experts_in_transformers_layout(text, config)
    return text


def _experts_in_transformers_layout(tensors: dict, config: dict) -> None:
    """Qwen3-VL-MoE's expert stacks as transformers holds them (gate_up [experts, 2 x inner, hidden], down
    [experts, hidden, inner]), from the hub's layout (each transposed) where that is the one the shapes fit
    (they cannot fit both: that would need 2 x inner = hidden = inner)."""
    hidden, inner = config["hidden_size"], config["moe_intermediate_size"]
    for name in [n for n in tensors if n.endswith("mlp.experts.gate_up_proj")]:
        down = name.replace("gate_up_proj", "down_proj")
        if tensors[name].shape[-2:] == (hidden, 2 * inner) and tensors[down].shape[-2:] == (inner, hidden):
            tensors[name], tensors[down] = (tensors[n].transpose(1, 2).contiguous() for n in (name, down))
