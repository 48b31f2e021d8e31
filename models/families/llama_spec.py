"""How each family's config reads as the Llama module's options (llama.py): LlamaSpec, from transformers' configs
(their hub names too, in Llama's terms first: llama_kin.py) and from GGUF files' configs made like them
(gguf_config.py), with each family's defaults where its config says nothing: which layers slide, which rotate."""

from __future__ import annotations

from dataclasses import dataclass

from .layers import Chunked, DecoderShape
from .llama_kin import AFMOE_NAMES, LLAMA4_NAMES, in_llama_terms
from .moe import MoESpec
from .rope import rope_type, temperature_of

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "ministral3", "ernie4_5", "phi3", "smollm3", "granite", "glm",
            "glm4", "exaone", "arcee", "seed_oss", "hunyuan_v1_dense", "starcoder2", "stablelm", "phi", "cohere",
            "cohere2", "olmo", "nemotron", "gpt_neox", "falcon", "mixtral", "qwen2_moe", "qwen3_moe", "granitemoe",
            "granitemoeshared", "olmoe", "ernie4_5_moe", "gpt_oss", "glm4_moe", "dots1", "hunyuan_v1_moe", "minimax_m2",
            "afmoe", "apertus", "dbrx", "exaone_moe", "jais2", "granite_swa", "granitemoe_swa", "bloom", "mpt",
            "llama4_text", "cohere2_moe")
# Granite's with sliding-window layers (one global in four by default) and a sink a head, dense or with experts
GRANITE_SWA = ("granite_swa", "granitemoe_swa")
# HunYuan's: each head's q/k norm after the rotation, NTK by a fixed alpha (a larger base)
HUNYUAN = ("hunyuan_v1_dense", "hunyuan_v1_moe")
# each family's MLP activation (its config's hidden_act) where it is not SwiGLU's silu (llama.py's MLPS makes its MLP):
# Arcee's, Nemotron's and Jais-2's relu(up)^2, StarCoder2's, Phi-2's and BLOOM's gelu_tanh(up), GPT-NeoX's, Falcon's and
# MPT's gelu(up) by erf (no gate), Apertus's xIELU(up)
ACTIVATIONS = {"arcee": "relu2", "nemotron": "relu2", "jais2": "relu2", "bloom": "gelu_pytorch_tanh",
               "starcoder2": "gelu_pytorch_tanh", "phi": "gelu_new", "gpt_neox": "gelu", "falcon": "gelu",
               "apertus": "xielu", "mpt": "gelu"}
# the families whose configs name their GELU, exact or by tanh (GPT-NeoX-20B's gelu_fast; llama.cpp's files tanh's)
NAMED_GELUS = ("gpt_neox", "falcon", "mpt")
# the families whose norms are LayerNorms (the mean removed; with biases but Cohere's and OLMo 1's; OLMo 1's
# without a weight either, which its checkpoints do not hold: ones here)
LAYER_NORMS = ("starcoder2", "stablelm", "phi", "cohere", "cohere2", "olmo", "nemotron", "gpt_neox", "falcon", "dbrx",
               "jais2", "bloom", "mpt")
UNBIASED_LAYER_NORMS, WEIGHTLESS_LAYER_NORMS = ("cohere", "cohere2", "olmo", "dbrx", "mpt"), ("olmo",)
@dataclass
class LlamaSpec(DecoderShape):
    rope_theta: float
    rope_scaling: dict | None
    partial_rotary_factor: float
    max_position: int          # the longest context Loom runs
    rope_max_position: int     # the checkpoint's max_position_embeddings, which rope scalings refer to
    tie_word_embeddings: bool
    qkv_bias: bool
    out_bias: bool
    mlp_bias: bool
    qk_norm: bool
    qk_norm_across_heads: bool  # the q/k norms over all heads at once (OLMoE's), not a head at a time
    layer_windows: tuple[int | Chunked | None, ...]  # each layer's sliding window (or chunks), None for full attention
    layer_rotates: tuple[bool, ...]  # whether each layer rotates its queries and keys (SmolLM3: 3 in 4)
    moe: MoESpec | None
    qk_norm_after_rotation: bool = False  # each head's q/k norm after the rotation (HunYuan's), not before
    # each head's q/k norm a LayerNorm with weights of its own a head, no bias (StableLM 2 12B's, Command R+'s)
    qk_head_layer_norms: bool = False
    # the MLP's activation, its config's hidden_act (MLPS: silu a SwiGLU's, the others an ungated MLP's)
    mlp_activation: str = "silu"
    # LayerNorms (the mean removed) for RMSNorms, with biases where norm_bias (StarCoder2's, StableLM's, Phi-2's;
    # Cohere's without)
    layer_norm: bool = False
    norm_bias: bool = False
    norm_weight: bool = True  # the checkpoint holds the norms' weights (OLMo 1's norms have none: ones)
    norm_plus_one: bool = False  # the norms multiply by 1 + the checkpoint's weight (Nemotron's LayerNorm1P)
    # the attention and the MLP beside each other on the one norm's output, both added (Phi-2's, Cohere's,
    # StableLM's use_parallel_residual): no norm before the MLP; or, with parallel_norm, the MLP on a norm of its own
    # of the layer's input (GPT-NeoX's, Falcon 40B's)
    parallel: bool = False
    parallel_norm: bool = False
    # how a checkpoint's fused q/k/v rows run where they are not every query's, every key's, every value's: a head's
    # query, key and value rows together ("heads": GPT-NeoX's), or a K/V group's queries, key and value ("groups":
    # Falcon 40B's); reordered at load
    qkv_layout: str | None = None
    lm_head_bias: bool = False  # (Phi-2's)
    # Ministral 3's and Llama 4's attention temperature: rope.query_temperature's (beta, the original context, offset)
    query_temperature: tuple[float, int, int] | None = None
    temperature_where_unrotated: bool = False  # that temperature in the unrotated layers alone (Llama 4's)
    # Llama 4's q/k norms: each head's query and key RMS-normed without a weight (none in its checkpoints: ones) after
    # the rotation, in its rotating layers alone
    l2_qk_norms: bool = False
    # ERNIE 4.5's and GLM-4's checkpoints keep each head's rotary pairs side by side (GLM's rotation): their
    # query and key rows are reordered at load into the halves apply_rotary takes
    interleaved_rotary: bool = False
    # GLM-4's norms of the attention's and the MLP's outputs, before each is added
    output_norms: bool = False
    # the attention's output times the sigmoid of a gate a query value, a product of its own (AFMoE's gate_proj),
    # before the output product
    gated_attention: bool = False
    renames: tuple[tuple[str, str], ...] = ()  # the family's checkpoint names by Llama's (AFMOE_NAMES)
    clip_qkv: float | None = None  # the queries, keys and values clamped to [-clip_qkv, clip_qkv] (OLMo 1.7's)
    # ALiBi in the rotary's place (BLOOM's): each score plus a head's slope times the key's distance back, the slopes
    # from this maximum bias (layers.alibi_slopes)
    alibi_max_bias: float | None = None
    embedding_norm: bool = False  # the embeddings LayerNormed before the first layer (BLOOM's)
    final_norm_bias: bool = False  # the final LayerNorm's bias where the others have none (MPT's)
    # gpt-oss's attention sinks: a learned logit a head, in each softmax's denominator and no value's weight
    attention_sinks: bool = False
    # Granite's multipliers: of the embeddings, of each attention's and MLP's output before it is
    # added, the attention's scale (None: 1 / sqrt(head_dim)), and the logits' divisor
    embedding_scale: float = 1.0
    residual_scale: float = 1.0
    attention_scale: float | None = None
    logits_divisor: float = 1.0

    @property
    def sliding_window(self) -> int | None:
        return next((w for w in self.layer_windows if isinstance(w, int)), None)

    @classmethod
    def from_hf(cls, c: dict) -> "LlamaSpec":
        kind = c["model_type"]
        c = in_llama_terms(kind, c)
        heads = c["num_attention_heads"]
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        theta = _one_theta(kind, c) or c.get("rope_theta") or rope.get("rope_theta") or 10000.0
        activation = ACTIVATIONS.get(kind, "silu")
        if kind in NAMED_GELUS and c.get("hidden_act") in ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh"):
            activation = c["hidden_act"]
        if c.get("hidden_act", activation) != activation:
            raise ValueError(f"unsupported hidden_act {c['hidden_act']!r} for {kind}; supported: {activation}")
        if kind == "phi" and c.get("qk_layernorm"):
            raise ValueError("phi with its queries and keys LayerNormed (qk_layernorm) is not supported")
        # (StableLM 2 12B's and Command R+'s: each head's q/k LayerNorm with weights of its own)
        head_layer_norms = kind in ("stablelm", "cohere", "cohere2") and bool(
            c.get("qk_layernorm") or c.get("use_qk_norm"))
        if kind in HUNYUAN and rope.get("alpha"):  # (NTK by a fixed alpha: a larger base, nothing dynamic)
            head = c.get("head_dim") or c["hidden_size"] // heads
            theta = float(theta) * float(rope["alpha"]) ** (head / (head - 2))
            rope = {}
        trained = c.get("max_position_embeddings", 2048)
        # Dynamic NTK scaling exists to run past the trained context: up to factor times it.
        context = int(trained * rope["factor"]) if rope_type(rope) == "dynamic" else trained
        # (ERNIE 4.5's use_bias: every product's; GLM's and GLM-4's attention_bias its q/k/v's, True unless said)
        bias = bool(c.get("attention_bias", c.get("use_bias", kind in ("glm", "glm4", "phi"))))
        layers = c["num_hidden_layers"]
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            # (the LayerNorms' epsilon by its names: StarCoder2's, StableLM's, Phi-2's and Cohere's)
            rms_norm_eps=c.get("rms_norm_eps") or c.get("norm_epsilon") or c.get("layer_norm_eps") or c.get(
                "norm_eps") or c.get("layer_norm_epsilon") or (
                1e-5 if kind in ("olmo", "dbrx") else 1e-6),  # (OLMo 1's fixed, DBRX's nn.LayerNorm's)
            rope_theta=float(theta),
            rope_scaling=rope if rope_type(rope) != "default" else None,
            # (Nemotron's half a head where its config says nothing, as transformers reads it)
            # (MiniMax-M2's hub configs say rotary_dim)
            partial_rotary_factor=float(c.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or (
                c["rotary_dim"] / (c.get("head_dim") or c["hidden_size"] // heads) if c.get("rotary_dim") else
                0.5 if kind == "nemotron" else 1.0)),
            max_position=context,
            rope_max_position=trained,
            # (transformers' default where a config saved with it leaves the key out)
            tie_word_embeddings=bool(c.get("tie_word_embeddings", kind in (
                "smollm3", "ernie4_5", "ernie4_5_moe", "starcoder2", "cohere", "cohere2", "cohere2_moe", "falcon"))),
            qkv_bias=kind == "qwen2" or (kind == "qwen2_moe" and c.get("qkv_bias", True)) or bias or
            bool(c.get("use_qkv_bias")),  # (StableLM's)
            # (GLM-4's output product has none; Seed-OSS's says whether it has)
            out_bias=bool(c.get("attention_out_bias", bias and kind not in ("glm", "glm4", "glm4_moe"))),
            mlp_bias=bool(c.get("mlp_bias", c.get("use_bias", kind == "phi"))),
            qk_norm=kind in ("qwen3", "qwen3_moe", "olmoe", "dots1", "minimax_m2", "afmoe", "apertus", "exaone_moe",
                             *HUNYUAN) or (
                kind in ("glm4_moe", "llama4_text") and bool(c.get("use_qk_norm", kind == "llama4_text"))) or
            head_layer_norms,
            qk_head_layer_norms=head_layer_norms,
            qk_norm_across_heads=kind in ("olmoe", "minimax_m2"),
            qk_norm_after_rotation=kind in (*HUNYUAN, "llama4_text"),
            l2_qk_norms=kind == "llama4_text" and bool(c.get("use_qk_norm", True)),
            layer_windows=_layer_windows(kind, c, layers),
            layer_rotates=_layer_rotates(kind, c, layers),
            moe=MoESpec.from_hf(c),
            mlp_activation=activation,
            # (Cohere2-MoE's RMSNorms where its config names rms_norm_eps, else Cohere's LayerNorms)
            layer_norm=kind in LAYER_NORMS or (kind == "cohere2_moe" and c.get("rms_norm_eps") is None),
            norm_bias=kind in LAYER_NORMS and kind not in UNBIASED_LAYER_NORMS,
            norm_weight=kind not in WEIGHTLESS_LAYER_NORMS,
            norm_plus_one=kind == "nemotron",
            parallel=kind in ("phi", "cohere", "cohere2", "cohere2_moe", "falcon") or bool(
                c.get("use_parallel_residual")),
            parallel_norm=bool(c.get("parallel_mlp_norm")),
            qkv_layout=c.get("qkv_layout"),
            lm_head_bias=kind == "phi",
            query_temperature=c.get("query_temperature") if kind == "llama4_text" else temperature_of(rope),
            temperature_where_unrotated=kind == "llama4_text",
            # (a GGUF file's rows are put in halves as they are read: gguf_config says so)
            # (Cohere's too)
            interleaved_rotary=kind in ("ernie4_5", "ernie4_5_moe", "glm", "glm4", "cohere", "cohere2", "cohere2_moe",
                                        "llama4_text") and not c.get("rotary_rows_in_halves", False),
            output_norms=kind in ("glm4", "afmoe"),
            gated_attention=kind == "afmoe",
            renames=AFMOE_NAMES if kind == "afmoe" else LLAMA4_NAMES if kind == "llama4_text" else (),
            clip_qkv=c.get("clip_qkv"),
            alibi_max_bias=c.get("alibi_max_bias"),
            embedding_norm=bool(c.get("embedding_norm")),
            final_norm_bias=bool(c.get("final_norm_bias")),
            attention_sinks=kind in ("gpt_oss", *GRANITE_SWA),
            # (AFMoE's muP: its embeddings times sqrt(hidden))
            embedding_scale=float(c.get("embedding_multiplier",
                                        c["hidden_size"] ** 0.5 if c.get("mup_enabled") else 1.0)),
            residual_scale=float(c.get("residual_multiplier", 1.0)),
            attention_scale=c.get("attention_multiplier", 1.0 if kind.startswith("granite") else None),  # (transformers')
            # (Cohere's logits times its logit_scale)
            logits_divisor=float(c.get("logits_scaling", 1.0)) / float(c.get("logit_scale", 1.0)),
        )


def _one_theta(kind: str, c: dict) -> float | None:
    """Granite SWA's rotary base where its config gives one a layer (layer_rope_theta, 0 for a layer without rotary):
    the one base its rotating layers share; a ValueError where they differ."""
    thetas = {float(theta) for theta in c.get("layer_rope_theta") or () if theta} if kind in GRANITE_SWA else set()
    if len(thetas) > 1:
        raise ValueError(f"{kind} with layers rotating by different bases (layer_rope_theta {sorted(thetas)}) is not "
                         "supported")
    return thetas.pop() if thetas else None


def _layer_rotates(kind: str, c: dict, layers: int) -> tuple[bool, ...]:
    """Whether each layer rotates its queries and keys: SmolLM3's no_rope_layers (1: it does), or all
    but every no_rope_layer_interval-th where the config lists none, as transformers derives them; Command R7B's,
    AFMoE's and EXAONE-MoE's sliding-window layers alone (EXAONE-MoE's all where it has no window)."""
    if kind in GLOBAL_EVERY and c.get("no_rope_layers") is None:  # (AFMoE's config may list them)
        if kind == "exaone_moe" and c.get("sliding_window") is None:  # (every layer global, and rotating)
            return (True,) * layers
        return tuple(t == "sliding_attention" for t in _types_by_pattern(kind, c, layers))
    if kind in GRANITE_SWA and c.get("layer_rope_theta"):  # (a layer of theta 0 without rotary)
        return tuple(bool(theta) for theta in c["layer_rope_theta"])
    rotates = c.get("no_rope_layers")
    if rotates is None:
        interval = c.get("no_rope_layer_interval", 4) if kind == "smollm3" else 0
        rotates = [not interval or (i + 1) % interval != 0 for i in range(layers)]
    if len(rotates) != layers:
        raise ValueError(f"no_rope_layers lists {len(rotates)} layers of {layers}")
    return tuple(bool(r) for r in rotates)


def _layer_windows(kind: str, c: dict, layers: int) -> tuple[int | Chunked | None, ...]:
    """Which layers attend through a sliding window (or in chunks: Llama 4's), as transformers decides it for each
    family."""
    window = c.get("sliding_window")
    if kind in ("cohere2_moe", "llama4_text"):  # (their layer_types, as llama_kin reads them: Llama 4's chunked)
        types = c["layer_types"]
        if "chunked_attention" in types and not c.get("attention_chunk_size"):
            raise ValueError(f"{kind} with chunked_attention layers needs attention_chunk_size")
    elif kind in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "smollm3"):
        if not c.get("use_sliding_window"):
            return (None,) * layers
        types = c.get("layer_types") or ["sliding_attention" if i >= c.get("max_window_layers", layers)
                                         else "full_attention" for i in range(layers)]
    elif kind in GRANITE_SWA:  # (its config lists them: every fourth layer global, the first included)
        types = c.get("layer_types") or ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(layers)]
    elif kind == "gpt_oss":  # (its config lists them: every other layer through the window, the first included)
        types = c.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    elif kind in GLOBAL_EVERY:
        if kind == "exaone_moe" and window is None:
            return (None,) * layers
        types = _types_by_pattern(kind, c, layers)
    elif kind == "dots1":  # (the layers from max_window_layers on, where it names a window)
        first = c.get("max_window_layers") or layers
        types = c.get("layer_types") or ["sliding_attention" if window is not None and i >= first
                                         else "full_attention" for i in range(layers)]
    else:
        return (window,) * layers  # llama, granite (None), mistral, mixtral, phi3: one window for every layer
    if len(types) != layers:
        raise ValueError(f"layer_types lists {len(types)} layers of {layers}")
    return tuple(window if t == "sliding_attention" else Chunked(c["attention_chunk_size"]) if t == "chunked_attention"
                 else None for t in types)


# the families whose configs may name a layer global every n-th layer (its fourth where they do not say), the others
# sliding: by the config's name for n (Command R7B's, AFMoE's, EXAONE-MoE's)
GLOBAL_EVERY = {"cohere2": "sliding_window_pattern", "afmoe": "global_attn_every_n_layers",
                "exaone_moe": "sliding_window_pattern"}


def _types_by_pattern(kind: str, c: dict, layers: int) -> list[str]:
    """A GLOBAL_EVERY family's layer types: its config's, else every n-th layer global."""
    every = c.get(GLOBAL_EVERY[kind]) or 4
    return list(c.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                                         for i in range(layers)])
