"""Mixture-of-experts feed-forward (Mixtral, Qwen3-MoE, Granite MoE, OLMoE): a router picks each token's top-k experts;
the step's tokens are grouped by expert so that every expert runs one matrix product per step on
all the tokens routed to it, however many requests the flat batch holds."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int
    normalize: bool                 # renormalise the top-k weights to sum to 1
    dense_layers: frozenset[int]    # layers that keep a plain MLP
    sparse_step: int                # every sparse_step-th layer routes (Qwen3-MoE's decoder_sparse_step)

    @classmethod
    def from_hf(cls, c: dict) -> "MoESpec | None":
        kind = c["model_type"]
        if kind in ("mixtral", "granitemoe"):  # (Granite's softmax over the top-k logits: the same weights)
            return cls(c["num_local_experts"], c["num_experts_per_tok"], c["intermediate_size"], True, frozenset(), 1)
        if kind == "olmoe":
            return cls(c["num_experts"], c["num_experts_per_tok"], c["intermediate_size"],
                       bool(c.get("norm_topk_prob", False)), frozenset(), 1)
        if kind == "qwen3_moe":
            experts = c.get("num_experts") or c["num_local_experts"]  # the hub's name, transformers 5's
            return cls(experts, c["num_experts_per_tok"], c["moe_intermediate_size"],
                       bool(c.get("norm_topk_prob", False)), frozenset(c.get("mlp_only_layers") or ()),
                       c.get("decoder_sparse_step") or 1)
        return None

    def routes(self, layer: int) -> bool:
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0


class Experts(nn.Module):
    """The experts' SwiGLU weights in float, a stack per product: gate_up [experts, 2 x inner, hidden]
    (each expert's gate rows, then its up rows), down [experts, hidden, inner]. A GGUF file's quantized
    stacks run on kernels/block_experts.py's BlockExperts instead, which answers the same call."""

    def __init__(self, count: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(count, 2 * intermediate_size, hidden_size))
        self.down = nn.Parameter(torch.empty(count, hidden_size, intermediate_size))

    def forward(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``index``'s SwiGLU over all the step's tokens routed to it."""
        gate, up = F.linear(x, self.gate_up[index]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down[index])


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, s: MoESpec):
        super().__init__()
        self.spec = s
        self.router = nn.Linear(hidden_size, s.num_experts, bias=False)
        self.experts = Experts(s.num_experts, hidden_size, s.intermediate_size)

    def forward(self, x):
        # Routing in float32, as transformers does: its top-k and weights then match exactly.
        probs = self.router(x).float().softmax(-1)
        weights, experts = probs.topk(self.spec.top_k, dim=-1)
        if self.spec.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        weights, experts = weights.to(x.dtype).flatten(), experts.flatten()
        order = experts.argsort(stable=True)  # (token, choice) pairs grouped by expert
        counts = torch.bincount(experts, minlength=self.spec.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                pairs = order[start:start + count]
                tokens = pairs // self.spec.top_k
                out.index_add_(0, tokens, self.experts(expert, x[tokens]) * weights[pairs, None])
                start += count
        return out

    @staticmethod
    def convert(hf: dict, prefix: str, out_prefix: str, s: MoESpec) -> dict:
        """The router and experts under ``prefix`` in any of the six layouts: transformers 5's
        fused tensors (mlp.experts.gate_up_proj; Granite MoE's under block_sparse_moe), Granite MoE's
        files (block_sparse_moe.input_linear, output_linear: already stacks), Mixtral's files
        (block_sparse_moe.experts.E.w1/w3/w2), Qwen3-MoE's files (mlp.experts.E.gate_proj/up_proj/
        down_proj), and a GGUF file's stacks (mlp.experts.gate_proj/up_proj/down_proj.weight: float
        [experts, rows, width], or blocks of experts x rows rows, which stay three,
        kernels/block_experts.py's)."""
        experts = out_prefix + "experts."
        for base, router in (("mlp.", "mlp.gate.weight"), ("block_sparse_moe.", "block_sparse_moe.router.weight")):
            if prefix + base + "experts.gate_up_proj" in hf:
                return {out_prefix + "router.weight": hf[prefix + router],
                        experts + "gate_up": hf[prefix + base + "experts.gate_up_proj"],
                        experts + "down": hf[prefix + base + "experts.down_proj"]}
        if prefix + "block_sparse_moe.input_linear.weight" in hf:
            return {out_prefix + "router.weight": hf[prefix + "block_sparse_moe.router.layer.weight"],
                    experts + "gate_up": hf[prefix + "block_sparse_moe.input_linear.weight"],
                    experts + "down": hf[prefix + "block_sparse_moe.output_linear.weight"]}
        if prefix + "mlp.experts.gate_proj.weight" in hf:
            gate, up, down = (hf.pop(f"{prefix}mlp.experts.{n}_proj.weight") for n in ("gate", "up", "down"))
            floats = gate.dim() == 3  # (else blocks [experts x rows, bytes a row])
            return {out_prefix + "router.weight": hf[prefix + "mlp.gate.weight"],
                    experts + "gate_up": torch.cat([gate, up], dim=1) if floats else [gate, up],
                    experts + "down": down}
        if prefix + "block_sparse_moe.gate.weight" in hf:
            base, names = prefix + "block_sparse_moe.", ("w1", "w3", "w2")
        else:
            base, names = prefix + "mlp.", ("gate_proj", "up_proj", "down_proj")
        expert = lambda e, n: hf[f"{base}experts.{e}.{n}.weight"]
        gate, up, down = names
        return {out_prefix + "router.weight": hf[base + "gate.weight"],
                experts + "gate_up": torch.stack([torch.cat([expert(e, gate), expert(e, up)])
                                                  for e in range(s.num_experts)]),
                experts + "down": torch.stack([expert(e, down) for e in range(s.num_experts)])}
