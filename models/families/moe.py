"""Mixture-of-experts feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE, Granite MoE and MoE Shared, OLMoE, ERNIE 4.5,
gpt-oss, LFM2-MoE, DeepSeek's, GLM-4.5's, Nemotron 3's, dots.llm1's, Hunyuan-A13B's, MiniMax-M2's, AFMoE's, DBRX's,
EXAONE-MoE's, Llama 4's, Cohere2-MoE's): a router picks each token's top-k experts; the step's tokens are grouped by
expert so that every expert runs one matrix product per step on all the tokens routed to it, however many requests the
flat batch holds. Some mixtures add a shared expert every token takes (Qwen2-MoE's weighted by a router of its own)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .layers import SquaredReLU, SwiGLU, fused

# a shared expert's fused gate and up rows, or its two products (layers.fused's)
SHARED_GATE_UP = ("mlp.shared_expert.gate_up_proj", ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"))
# where a selection bias lies: ERNIE 4.5's in transformers 5's layout, in its checkpoints' (and a GGUF
# file's); LFM2-MoE's (its feed_forward named mlp here: lfm2.py); DeepSeek-V3's
SELECTION_BIASES = ("mlp.gate.moe_statics.e_score_correction_bias", "mlp.moe_statics.e_score_correction_bias",
                    "mlp.expert_bias", "mlp.gate.e_score_correction_bias",
                    # MiniMax-M2's, in transformers 5's layout and in its checkpoints'
                    "mlp.e_score_correction_bias", "block_sparse_moe.e_score_correction_bias")


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int
    normalize: bool                 # renormalise the top-k weights to sum to 1
    dense_layers: frozenset[int]    # layers that keep a plain MLP
    sparse_step: int                # every sparse_step-th layer routes (Qwen3-MoE's decoder_sparse_step)
    biases: bool = False            # the router and the experts' products add biases (gpt-oss)
    # gpt-oss's clamped SwiGLU, (alpha, limit): min(gate, limit) sigmoid(alpha min(gate, limit)) x
    # (clamp(up, -limit, limit) + 1); None: silu(gate) x up
    clamped_swiglu: tuple[float, float] | None = None
    shared_intermediate_size: int = 0  # the width of an expert every token takes (0: none)
    shared_gate: bool = False  # the shared expert's output weighted by sigmoid(a one-row router's logit) (Qwen2-MoE)
    # a bias an expert added to its probability to choose the top-k, not to weigh them (ERNIE 4.5's
    # e_score_correction_bias, LFM2-MoE's expert_bias, a GGUF file's exp_probs_b)
    selection_bias: bool = False
    # each expert's probability the sigmoid of its logit, not the softmax over the experts (LFM2-MoE's)
    sigmoid: bool = False
    routed_scale: float = 1.0  # the chosen experts' weights times this (after any renormalising)
    # DeepSeek's group-limited routing, (groups, groups chosen, experts a group is scored by): the experts in
    # consecutive groups, a token's top-k taken from the groups whose best few experts' scores sum highest
    # (V2's best one, V3's best two); None: every expert open to every token
    groups: tuple[int, int, int] | None = None
    # each expert, the shared one too, relu(up)^2 then its down product, no gate (Nemotron 3's); else a SwiGLU
    squared_relu: bool = False
    gelu: bool = False  # each expert gelu_tanh(gate) x up, not silu (Gemma 4's)
    # the routed experts' own width (0: the hidden size): the hidden state projected down to it before them and
    # their weighted sum back up after (Nemotron 3 Super's latent mixtures; the router and the shared expert read
    # the hidden state itself)
    latent_size: int = 0
    # each chosen expert reads the token times its weight, and its output is added as it is (Llama 4's); else its
    # output is weighted
    weights_inputs: bool = False
    shared_scale: float = 1.0  # the shared expert's output times this (Cohere2-MoE's average: 0.5, routed_scale too)

    @classmethod
    def from_hf(cls, c: dict) -> "MoESpec | None":
        kind = c["model_type"]
        if kind in ("mixtral", "granitemoe"):  # (Granite's softmax over the top-k logits: the same weights)
            return cls(c["num_local_experts"], c["num_experts_per_tok"], c["intermediate_size"], True, frozenset(), 1)
        if kind == "dbrx":
            return cls(c["num_local_experts"], c["num_experts_per_tok"], c["intermediate_size"],
                       bool(c.get("norm_topk_prob", True)), frozenset(), 1)
        if kind == "olmoe":
            return cls(c["num_experts"], c["num_experts_per_tok"], c["intermediate_size"],
                       bool(c.get("norm_topk_prob", False)), frozenset(), 1)
        if kind == "gpt_oss":  # (the softmax over the top-k logits: the chosen probabilities renormalised)
            return cls(c["num_local_experts"], c["num_experts_per_tok"], c["intermediate_size"], True, frozenset(), 1,
                       biases=True, clamped_swiglu=(float(c.get("swiglu_alpha", 1.702)),
                                                    float(c.get("swiglu_limit", 7.0))))
        if kind in ("granitemoeshared", "granitemoehybrid", "granitemoe_swa"):
            if kind == "granitemoehybrid" and not c.get("num_local_experts"):  # (a dense one: its shared MLP alone)
                return None
            return cls(c["num_local_experts"], c["num_experts_per_tok"], c["intermediate_size"], True, frozenset(), 1,
                       shared_intermediate_size=c.get("shared_intermediate_size") or 0)
        if kind == "ernie4_5_moe":  # (its weights over max(their sum, 1e-12): renormalised)
            layers, inner = c["num_hidden_layers"], c["moe_intermediate_size"]
            start, end = c.get("moe_layer_start_index", 1), c.get("moe_layer_end_index", -1)
            end = layers - 1 if end in (None, -1) else end
            return cls(c.get("moe_num_experts") or c["num_experts"], c.get("moe_k") or c["num_experts_per_tok"], inner,
                       True, frozenset(i for i in range(layers) if not start <= i <= end),
                       c.get("moe_layer_interval") or 1,
                       shared_intermediate_size=inner * (c.get("moe_num_shared_experts") or 0), selection_bias=True)
        if kind == "lfm2_moe":  # (its weights over their sum plus 1e-6 in transformers, over their sum here)
            return cls(c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"],
                       bool(c.get("norm_topk_prob", True)), frozenset(range(c.get("num_dense_layers", 2))), 1,
                       selection_bias=bool(c.get("use_expert_bias", True)), sigmoid=True,
                       routed_scale=float(c.get("routed_scaling_factor") or 1.0))
        if kind in ("qwen3_5_moe", "qwen3_5_moe_text"):  # (its chosen weights renormalised always)
            shared = c.get("shared_expert_intermediate_size") or 0
            return cls(c.get("num_experts") or c["num_local_experts"], c["num_experts_per_tok"],
                       c["moe_intermediate_size"], True, frozenset(), 1, shared_intermediate_size=shared,
                       shared_gate=bool(shared))
        if kind in DEEPSEEK_KINDS or kind in ("glm4_moe", "dots1", "exaone_moe"):  # (GLM-4.5's, dots.llm1's,
            # EXAONE-MoE's: V3's)
            return _deepseek(c)
        if kind == "hunyuan_v1_moe":  # (its experts and shared MLP intermediate_size wide, the chosen renormalised)
            inner = c["intermediate_size"]
            experts = c.get("num_experts") or c["num_local_experts"]  # (the hub's name, transformers 5's)
            return cls(_one_per_model(kind, "num_experts", experts),
                       _one_per_model(kind, "moe_topk", c.get("moe_topk") or c["num_experts_per_tok"]), inner, True,
                       frozenset(), 1,
                       shared_intermediate_size=c.get("shared_expert_intermediate_size") or inner)
        if kind == "afmoe":  # (sigmoid scores and a bias each, the chosen renormalised and scaled, shared experts)
            inner = c["moe_intermediate_size"]
            return cls(c["num_experts"], c["num_experts_per_tok"], inner, bool(c.get("norm_topk_prob", True)),
                       frozenset(range(c.get("num_dense_layers") or 0)), 1,
                       shared_intermediate_size=inner * (c.get("num_shared_experts") or 0), selection_bias=True,
                       sigmoid=True, routed_scale=float(c.get("route_scale") or 1.0))
        if kind == "llama4_text":  # (sigmoid scores of the top-k logits, not renormalised, weighing the inputs)
            inner, layers = c["moe_intermediate_size"], c["num_hidden_layers"]
            if not c.get("num_local_experts") or not c["moe_layers"]:  # (MobileLLM-R1's: every layer dense)
                return None
            return cls(c["num_local_experts"], c["num_experts_per_tok"], inner, False,
                       frozenset(range(layers)) - frozenset(c["moe_layers"]), 1, shared_intermediate_size=inner,
                       sigmoid=True, weights_inputs=True)
        if kind == "cohere2_moe":  # (the top-k logits' softmax, or their sigmoid renormalised where norm_topk_prob
            # says, beside shared experts summed or averaged with them; its dense prefix's layers: mlp_layer_types)
            inner, shared = c["moe_intermediate_size"], c.get("num_shared_experts") or 0
            sigmoid = c.get("expert_selection_fn", "softmax") == "sigmoid"
            strategy = c.get("shared_expert_combination_strategy", "average")
            if strategy not in ("sum", "average"):
                raise ValueError("cohere2_moe's shared_expert_combination_strategy is sum or average; the config says "
                                 f"{strategy!r}")
            average = bool(shared) and strategy == "average"
            return cls(c["num_experts"], c["num_experts_per_tok"], inner, not sigmoid or bool(c.get("norm_topk_prob")),
                       frozenset(i for i, t in enumerate(c["mlp_layer_types"]) if t == "dense"), 1,
                       shared_intermediate_size=inner * shared, sigmoid=sigmoid,
                       # (a file's expert_weights_scale too, as llama.cpp runs it: routed_scaling_factor)
                       routed_scale=(0.5 if average else 1.0) * float(c.get("routed_scaling_factor") or 1.0),
                       shared_scale=0.5 if average else 1.0)
        if kind == "jamba":  # (the top-k softmax probabilities as they are; its layers' expert counts: jamba.py's)
            counts = c["layers_num_experts"]
            if all(n <= 1 for n in counts):
                return None
            return cls(_one_per_model(kind, "layers_num_experts", [n for n in counts if n > 1]),
                       c["num_experts_per_tok"], c["intermediate_size"], False,
                       frozenset(i for i, n in enumerate(counts) if n <= 1), 1)
        if kind == "minimax_m2":  # (sigmoid scores, a bias each to choose by, the chosen renormalised)
            return cls(c["num_local_experts"], c["num_experts_per_tok"], c["intermediate_size"], True, frozenset(), 1,
                       selection_bias=True, sigmoid=True)
        if kind in ("qwen3_moe", "qwen2_moe", "qwen3_next"):  # (Qwen3-Next's: Qwen2-MoE's, renormalised by default)
            experts = c.get("num_experts") or c.get("num_local_experts")  # the hub's name, transformers 5's
            if not experts and kind == "qwen3_next":  # (transformers' Qwen3-Next without experts: dense MLPs)
                return None
            if not experts:
                raise ValueError(f"a {kind} config names no experts (num_experts)")
            shared = (c.get("shared_expert_intermediate_size") or 0) if kind != "qwen3_moe" else 0
            return cls(experts, c["num_experts_per_tok"], c["moe_intermediate_size"],
                       bool(c.get("norm_topk_prob", kind == "qwen3_next")), frozenset(c.get("mlp_only_layers") or ()),
                       c.get("decoder_sparse_step") or 1, shared_intermediate_size=shared, shared_gate=bool(shared))
        return None

    def routes(self, layer: int) -> bool:
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0


# DeepSeek's mixtures (deepseek.py's): V2's softmax, V3's (GLM-4.7-Flash's) sigmoid with selection biases, Mistral 4's
# softmax renormalised
DEEPSEEK_KINDS = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "mistral4")


def _one_per_model(kind: str, name: str, value) -> int:
    """A size a config may list a layer at a time (Hunyuan-A13B's num_experts, moe_topk), one for every layer; a
    ValueError where the layers differ."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"{kind} with {name} differing by layer ({value}) is not supported")
        value = value[0]
    return int(value)


def _deepseek(c: dict) -> MoESpec | None:
    """DeepSeek-V2's, V3's, GLM-4.7-Flash's, Mistral 4's (and GLM-4.5's, dots.llm1's, EXAONE-MoE's) experts as
    transformers runs them: V2's softmax, its group-limited greedy routing over each group's best expert; V3's sigmoid
    (or the scoring_func a GGUF file's config says: gguf_config's _deepseek2), its selection biases, its groups
    scored by their best two; Mistral 4's softmax with V3's groups and no selection bias; some leading layers dense
    (V2's and V3's first_k_dense_replace, GLM's and EXAONE-MoE's mlp_layer_types), shared experts beside the routed
    ones, the chosen weights renormalised where the config says (V2's never are in transformers, whose configs say
    not to), then scaled. dots.llm1's scored by sigmoid whatever its scoring_func ("noaux_tc" in some), as
    transformers scores them. None for a dense model."""
    kind, layers = c["model_type"], c["num_hidden_layers"]
    experts = c.get("n_routed_experts") or c.get("num_local_experts") or c.get("num_experts")
    if not experts:
        return None
    if c.get("mlp_layer_types") or kind == "glm4_moe_lite":  # (GLM-4.7-Flash's first dense where it does not say)
        types = c.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
        dense = frozenset(i for i, t in enumerate(types) if t == "dense")
    else:
        step = c.get("moe_layer_freq") or 1
        dense = frozenset(i for i in range(layers) if i < (c.get("first_k_dense_replace") or 0) or i % step)
    v2, softmax = kind == "deepseek_v2", kind in ("deepseek_v2", "mistral4")
    group_limited = not v2 or c.get("topk_method") == "group_limited_greedy"
    groups = c.get("n_group") or 1
    return MoESpec(experts, c["num_experts_per_tok"], c["moe_intermediate_size"],
                   bool(c.get("norm_topk_prob")) and not v2, dense, 1,
                   shared_intermediate_size=c["moe_intermediate_size"] * (
                       c.get("n_shared_experts") or c.get("num_shared_experts") or 0),
                   selection_bias=not softmax,
                   sigmoid=kind == "dots1" or c.get("scoring_func", "softmax" if softmax else "sigmoid") == "sigmoid",
                   routed_scale=float(c.get("routed_scaling_factor") or 1.0),
                   groups=(groups, c.get("topk_group") or 1, 1 if v2 else 2) if group_limited and groups > 1 else None)


def within_chosen_groups(scores: torch.Tensor, groups: int, chosen: int, best: int) -> torch.Tensor:
    """``scores`` [tokens, experts] with every expert outside each token's ``chosen`` groups at -inf: the
    groups (consecutive experts, ``groups`` of them) ranked by the sum of their ``best`` scores."""
    grouped = scores.unflatten(-1, (groups, -1))
    ranks = grouped.topk(best, dim=-1).values.sum(-1)
    kept = torch.zeros_like(ranks, dtype=torch.bool).scatter_(-1, ranks.topk(chosen, dim=-1).indices, True)
    return grouped.masked_fill(~kept[..., None], float("-inf")).flatten(-2)


def activated(first: torch.Tensor, clamped: tuple[float, float] | None, squared_relu: bool,
              gelu: bool = False) -> torch.Tensor:
    """An expert's activation of its first product's outputs: relu(up)^2 (MoESpec.squared_relu), or of [gate | up]
    silu(gate) x up (gelu_tanh(gate) x up: MoESpec.gelu), or gpt-oss's clamped SwiGLU (MoESpec.clamped_swiglu)."""
    if squared_relu:
        return F.relu(first).square()
    gate, up = first.chunk(2, dim=-1)
    if gelu:
        return F.gelu(gate, approximate="tanh") * up
    if clamped is None:
        return F.silu(gate) * up
    alpha, limit = clamped
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


class Experts(nn.Module):
    """The experts' weights in float, a stack per product: gate_up [experts, 2 x inner, hidden] (each expert's
    gate rows, then its up rows; its up rows alone where they are ``squared_relu``), down [experts, hidden,
    inner], and with ``biases`` theirs (gate_up_bias [experts, 2 x inner], down_bias [experts, hidden]). A GGUF
    file's quantized stacks run on kernels/block_experts.py's BlockExperts instead, which answers the same call."""

    def __init__(self, count: int, hidden_size: int, intermediate_size: int, biases: bool = False,
                 clamped_swiglu: tuple[float, float] | None = None, squared_relu: bool = False, gelu: bool = False):
        super().__init__()
        first = intermediate_size if squared_relu else 2 * intermediate_size
        self.gate_up = nn.Parameter(torch.empty(count, first, hidden_size))
        self.down = nn.Parameter(torch.empty(count, hidden_size, intermediate_size))
        self.gate_up_bias = nn.Parameter(torch.empty(count, first)) if biases else None
        self.down_bias = nn.Parameter(torch.empty(count, hidden_size)) if biases else None
        self.clamped_swiglu, self.squared_relu, self.gelu = clamped_swiglu, squared_relu, gelu

    def forward(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``index`` over all the step's tokens routed to it."""
        bias = lambda b: None if b is None else b[index]
        first = F.linear(x, self.gate_up[index], bias(self.gate_up_bias))
        return F.linear(activated(first, self.clamped_swiglu, self.squared_relu, self.gelu), self.down[index],
                        bias(self.down_bias))


class SharedExpert(SwiGLU):
    """An expert every token takes (a SwiGLU beside the routed ones), its output weighted by
    sigmoid(``gate``'s one logit) where the model has that router (Qwen2-MoE's; Granite MoE Shared's
    and ERNIE 4.5's add it as it is)."""

    def __init__(self, hidden_size: int, intermediate_size: int, gated: bool):
        super().__init__(hidden_size, intermediate_size)
        self.gate = nn.Linear(hidden_size, 1, bias=False) if gated else None

    def forward(self, x):
        y = super().forward(x)
        return y * torch.sigmoid(self.gate(x)) if self.gate is not None else y


def run_experts(experts: nn.Module, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, count: int,
                weights_inputs: bool = False):
    """Each token's chosen experts' outputs (``chosen``, ``weights``: [tokens, top_k]) weighted and summed (their
    inputs weighted where ``weights_inputs``: Llama 4's): each expert of ``experts`` (Experts or BlockExperts) once
    over all the step's tokens routed to it."""
    top_k = chosen.shape[-1]
    weights, chosen = weights.flatten(), chosen.flatten()
    order = chosen.argsort(stable=True)  # (token, choice) pairs grouped by expert
    out = torch.zeros_like(x)
    start = 0
    for expert, routed in enumerate(torch.bincount(chosen, minlength=count).tolist()):
        if routed:
            pairs = order[start:start + routed]
            tokens = pairs // top_k
            if weights_inputs:
                out.index_add_(0, tokens, experts(expert, x[tokens] * weights[pairs, None]).to(x.dtype))
            else:
                out.index_add_(0, tokens, experts(expert, x[tokens]).to(x.dtype) * weights[pairs, None])
            start += routed
    return out


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, s: MoESpec):
        super().__init__()
        self.spec = s
        self.router = nn.Linear(hidden_size, s.num_experts, bias=s.biases)
        width = s.latent_size or hidden_size  # (the experts' own: MoESpec.latent_size)
        self.latent_down = nn.Linear(hidden_size, width, bias=False) if s.latent_size else None
        self.latent_up = nn.Linear(width, hidden_size, bias=False) if s.latent_size else None
        self.experts = Experts(s.num_experts, width, s.intermediate_size, s.biases, s.clamped_swiglu, s.squared_relu)
        self.shared = None
        if s.shared_intermediate_size:
            self.shared = SquaredReLU(hidden_size, s.shared_intermediate_size) if s.squared_relu else \
                SharedExpert(hidden_size, s.shared_intermediate_size, s.shared_gate)
        self.selection_bias = nn.Parameter(torch.zeros(s.num_experts)) if s.selection_bias else None

    def forward(self, x):
        # Routing in float32, as transformers does: its top-k and weights then match exactly.
        logits = self.router(x).float()
        probs = logits.sigmoid() if self.spec.sigmoid else logits.softmax(-1)
        scores = probs if self.selection_bias is None else probs + self.selection_bias.float()
        if self.spec.groups is not None:
            scores = within_chosen_groups(scores, *self.spec.groups)
        experts = scores.topk(self.spec.top_k, dim=-1).indices
        weights = probs.gather(-1, experts)
        if self.spec.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.spec.routed_scale != 1.0:
            weights = weights * self.spec.routed_scale
        routed = x if self.latent_down is None else self.latent_down(x)
        out = run_experts(self.experts, routed, weights.to(x.dtype), experts, self.spec.num_experts,
                          self.spec.weights_inputs)
        if self.latent_up is not None:
            out = self.latent_up(out)
        if self.shared is None:
            return out
        shared = self.shared(x)
        return out + (shared * self.spec.shared_scale if self.spec.shared_scale != 1.0 else shared)

    @staticmethod
    def convert(hf: dict, prefix: str, out_prefix: str, s: MoESpec) -> dict:
        """The router, the experts (_routed_experts), the shared expert, the selection bias (ERNIE
        4.5's: [1, experts] under its router in transformers 5's layout, beside it in its checkpoints',
        a vector in a GGUF file, which gguf.py names as the checkpoints do, and which a file may leave
        out) and a latent mixture's projections (Nemotron 3 Super's mlp.fc1_latent_proj, fc2_latent_proj)
        under ``prefix``."""
        out = (_ungated_experts if s.squared_relu else _routed_experts)(hf, prefix, out_prefix, s)
        if s.latent_size:
            out |= {out_prefix + f"latent_{way}.weight": hf.pop(f"{prefix}mlp.fc{n}_latent_proj.weight")
                    for way, n in (("down", 1), ("up", 2))}
        if s.shared_intermediate_size:
            out |= _shared_expert(hf, prefix, out_prefix + "shared.", s)
        if s.selection_bias:  # (none in a file: zeros, as llama.cpp takes it)
            name = next((prefix + n for n in SELECTION_BIASES if prefix + n in hf), None)
            out[out_prefix + "selection_bias"] = hf.pop(name).reshape(-1) if name else torch.zeros(s.num_experts)
        return out


def _shared_expert(hf: dict, prefix: str, out_prefix: str, s: MoESpec) -> dict:
    """The shared expert under ``prefix`` in SharedExpert's layout (a squared ReLU's in its own), from Nemotron 3's
    (mlp.shared_experts' up and down products), Granite MoE Shared's files
    (shared_mlp.input_linear: its gate and up rows, output_linear), ERNIE 4.5's (mlp.shared_experts'
    three products) or Qwen2-MoE's (mlp.shared_expert's, and mlp.shared_expert_gate, which a GGUF file
    keeps as one vector; a GGUF file's shared expert under these names, its gate and up blocks as
    gguf.py fuses them)."""
    if s.squared_relu:  # (its up and down: Nemotron 3's mlp.shared_experts, a GGUF file's as Qwen2-MoE's)
        base = next(prefix + n for n in ("mlp.shared_experts.", "mlp.shared_expert.")
                    if prefix + n + "up_proj.weight" in hf)
        return {out_prefix + f"{n}.weight": hf.pop(f"{base}{n}_proj.weight") for n in ("up", "down")}
    if prefix + "shared_mlp.input_linear.weight" in hf:
        return {out_prefix + "gate_up.weight": hf.pop(prefix + "shared_mlp.input_linear.weight"),
                out_prefix + "down.weight": hf.pop(prefix + "shared_mlp.output_linear.weight")}
    name, (gate, up) = SHARED_GATE_UP
    if prefix + "mlp.shared_experts.down_proj.weight" in hf:  # (ERNIE 4.5's plural)
        name, gate, up = (n.replace(".shared_expert.", ".shared_experts.") for n in (name, gate, up))
    out = {out_prefix + "gate_up.weight": fused(hf, prefix, (name, (gate, up))),
           out_prefix + "down.weight": hf.pop(prefix + name.replace("gate_up_proj", "down_proj.weight"))}
    if s.shared_gate:
        out[out_prefix + "gate.weight"] = hf.pop(prefix + "mlp.shared_expert_gate.weight").reshape(1, -1)
    return out


def _routed_experts(hf: dict, prefix: str, out_prefix: str, s: MoESpec) -> dict:
    """The router and experts under ``prefix`` in any of the ten layouts: Llama 4's (feed_forward.experts.gate_up_proj
    [experts, hidden, 2 x inner], each expert's gate columns then its up columns, down_proj [experts, inner, hidden]:
    bmm's stacks, the router as llama.py renames it), gpt-oss's (mlp.router;
    mlp.experts.gate_up_proj [experts, hidden, 2 x inner], each expert's gate and up columns interleaved, down_proj
    [experts, inner, hidden], their biases), transformers 5's fused tensors (mlp.experts.gate_up_proj; Granite MoE's
    under block_sparse_moe), Granite MoE's files (block_sparse_moe.input_linear, output_linear: already stacks),
    Mixtral's files (block_sparse_moe.experts.E.w1/w3/w2), LFM2-MoE's (mlp.experts.E.w1/w3/w2), Qwen3-MoE's files
    (mlp.experts.E.gate_proj/up_proj/down_proj), DBRX's (mlp.experts.w1/v1/w2 as llama.py renames them: [experts x
    inner, hidden] each, w2 the down product's transpose), and a GGUF file's stacks
    (mlp.experts.gate_proj/up_proj/down_proj.weight, or gate_up_proj.weight where it keeps the two as one, each
    expert's gate rows then its up rows: float [experts, rows, width], or blocks of experts x rows rows, which stay
    three, kernels/block_experts.py's)."""
    experts = out_prefix + "experts."
    if prefix + "feed_forward.experts.gate_up_proj" in hf:  # (Llama 4's: bmm's stacks, [experts, in, out])
        stack = lambda name: hf.pop(prefix + "feed_forward.experts." + name).transpose(1, 2).contiguous()
        return {out_prefix + "router.weight": hf[prefix + "mlp.gate.weight"],
                experts + "gate_up": stack("gate_up_proj"), experts + "down": stack("down_proj")}
    if prefix + "mlp.router.weight" in hf:
        return _gpt_oss_experts(hf, prefix, out_prefix)
    if prefix + "mlp.experts.w1" in hf:  # (DBRX's: every expert's rows one matrix a product, the down's transposed)
        stack = lambda name: hf.pop(prefix + "mlp.experts." + name).unflatten(0, (s.num_experts, -1))
        return {out_prefix + "router.weight": hf[prefix + "mlp.gate.weight"],
                experts + "gate_up": torch.cat([stack("w1"), stack("v1")], dim=1),
                experts + "down": stack("w2").transpose(1, 2).contiguous()}
    for base, router in (("mlp.", "mlp.gate.weight"), ("block_sparse_moe.", "block_sparse_moe.router.weight")):
        if prefix + base + "experts.gate_up_proj" in hf:
            return {out_prefix + "router.weight": hf[prefix + router],
                    experts + "gate_up": hf[prefix + base + "experts.gate_up_proj"],
                    experts + "down": hf[prefix + base + "experts.down_proj"]}
    if prefix + "block_sparse_moe.input_linear.weight" in hf:
        return {out_prefix + "router.weight": hf[prefix + "block_sparse_moe.router.layer.weight"],
                experts + "gate_up": hf[prefix + "block_sparse_moe.input_linear.weight"],
                experts + "down": hf[prefix + "block_sparse_moe.output_linear.weight"]}
    if prefix + "mlp.experts.gate_proj.weight" in hf or prefix + "mlp.experts.gate_up_proj.weight" in hf:
        down = hf.pop(prefix + "mlp.experts.down_proj.weight")
        floats = down.dim() == 3  # (else blocks [experts x rows, bytes a row])
        if prefix + "mlp.experts.gate_up_proj.weight" in hf:  # (a file that keeps the two as one stack)
            gate_up = hf.pop(prefix + "mlp.experts.gate_up_proj.weight")
            gate_up = gate_up if floats else [gate_up]
        else:
            gate, up = (hf.pop(f"{prefix}mlp.experts.{n}_proj.weight") for n in ("gate", "up"))
            gate_up = torch.cat([gate, up], dim=1) if floats else [gate, up]
        out = {out_prefix + "router.weight": hf[prefix + "mlp.gate.weight"], experts + "gate_up": gate_up,
               experts + "down": down}
        if s.biases:  # (gpt-oss's files: [experts, rows] each)
            bias = lambda n: hf.pop(f"{prefix}mlp.experts.{n}_proj.bias")
            out |= {out_prefix + "router.bias": hf[prefix + "mlp.gate.bias"],
                    experts + "gate_up_bias": torch.cat([bias("gate"), bias("up")], dim=1),
                    experts + "down_bias": bias("down")}
        return out
    if prefix + "block_sparse_moe.gate.weight" in hf:
        base, names = prefix + "block_sparse_moe.", ("w1", "w3", "w2")
    elif prefix + "mlp.experts.0.w1.weight" in hf:  # (LFM2-MoE's files, their feed_forward named mlp: lfm2.py)
        base, names = prefix + "mlp.", ("w1", "w3", "w2")
    else:
        base, names = prefix + "mlp.", ("gate_proj", "up_proj", "down_proj")
    expert = lambda e, n: hf[f"{base}experts.{e}.{n}.weight"]
    gate, up, down = names
    return {out_prefix + "router.weight": hf[base + "gate.weight"],
            experts + "gate_up": torch.stack([torch.cat([expert(e, gate), expert(e, up)])
                                              for e in range(s.num_experts)]),
            experts + "down": torch.stack([expert(e, down) for e in range(s.num_experts)])}


def _ungated_experts(hf: dict, prefix: str, out_prefix: str, s: MoESpec) -> dict:
    """Experts with an up and a down product each (Nemotron 3's) under ``prefix``: transformers 5's stacks
    (mlp.experts.up_proj [experts, inner, hidden], down_proj), the hub's matrices an expert
    (mlp.experts.E.up_proj.weight), or a GGUF file's stacks (float, or blocks of experts x rows rows, which
    stay themselves: up_proj.weight's a list of one, BlockExperts'); the router, mlp.gate."""
    experts, base = out_prefix + "experts.", prefix + "mlp.experts."
    if base + "up_proj.weight" in hf:
        up, down = hf.pop(base + "up_proj.weight"), hf.pop(base + "down_proj.weight")
        up = up if down.dim() == 3 else [up]
    elif base + "up_proj" in hf:
        up, down = hf.pop(base + "up_proj"), hf.pop(base + "down_proj")
    else:
        up, down = (torch.stack([hf.pop(f"{base}{e}.{n}_proj.weight") for e in range(s.num_experts)])
                    for n in ("up", "down"))
    return {out_prefix + "router.weight": hf[prefix + "mlp.gate.weight"], experts + "gate_up": up,
            experts + "down": down}


def _gpt_oss_experts(hf: dict, prefix: str, out_prefix: str) -> dict:
    """gpt-oss's router and experts (its checkpoints' layout: SparseMoE.convert) in Experts' layout."""
    base = prefix + "mlp.experts."
    if base + "gate_up_proj_blocks" in hf:
        raise ValueError("this gpt-oss checkpoint keeps its experts in MXFP4 blocks (gate_up_proj_blocks), which Loom "
                         "reads from GGUF files only: load its GGUF file, or a checkpoint with float experts (BF16)")
    # the interleaved gate and up rows (0, 2, 4, ... and 1, 3, 5, ...) as the gate's, then the up's
    gate_then_up = lambda t: torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)
    return {out_prefix + "router.weight": hf[prefix + "mlp.router.weight"],
            out_prefix + "router.bias": hf[prefix + "mlp.router.bias"],
            out_prefix + "experts.gate_up": gate_then_up(hf.pop(base + "gate_up_proj").transpose(1, 2)),
            out_prefix + "experts.gate_up_bias": gate_then_up(hf.pop(base + "gate_up_proj_bias")),
            out_prefix + "experts.down": hf.pop(base + "down_proj").transpose(1, 2).contiguous(),  # (the kernels read rows)
            out_prefix + "experts.down_bias": hf.pop(base + "down_proj_bias")}
