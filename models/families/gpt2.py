"""GPT-2 over the paged KV cache: learned positions, LayerNorm, fused QKV, GELU (tanh) MLP; and StarCoder's
(gpt_bigcode: one K/V head, nn.Linear's matrices); from Hugging Face checkpoints (GPT-2's Conv1D matrices, [in, out])
and GGUF files (gguf.py's names, nn.Linear's [out, in], in their blocks; an output layer of their own where a file
has one)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .layers import AttentionMasks, NativeDecoding, embedding, paged_attention


@dataclass
class GPT2Spec:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    inner_size: int
    max_position: int
    eps: float
    tie_word_embeddings: bool = True
    conv1d: bool = True  # the checkpoint's matrices [in, out], as Conv1D keeps them (a GGUF file's: [out, in])
    num_kv_heads: int = 0  # K/V heads (StarCoder's one; 0: as many as the query heads)

    @classmethod
    def from_hf(cls, c: dict) -> "GPT2Spec":
        bigcode = c["model_type"] == "gpt_bigcode"
        if bigcode and not c.get("multi_query", True):
            raise ValueError("gpt_bigcode without multi_query (a head's query, key and value rows together) is not "
                             "supported; StarCoder's and SantaCoder's are multi-query")
        if not c.get("scale_attn_weights", True):
            raise ValueError(f"{c['model_type']} without scale_attn_weights is not supported")
        if c.get("scale_attn_by_inverse_layer_idx"):
            raise ValueError("gpt2 checkpoints with scale_attn_by_inverse_layer_idx are not supported")
        act = c.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported activation_function {act!r} for gpt2; supported: gelu_new")
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["n_embd"], num_layers=c["n_layer"],
            num_heads=c["n_head"], inner_size=c.get("n_inner") or 4 * c["n_embd"],
            max_position=c["n_positions"], eps=c.get("layer_norm_epsilon", 1e-5),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", True)),
            conv1d=not (bigcode or c.get("linear_layout", False)), num_kv_heads=1 if bigcode else 0,
        )


class Block(nn.Module):
    def __init__(self, s: GPT2Spec):
        super().__init__()
        self.heads, self.dim = s.num_heads, s.hidden_size // s.num_heads
        self.kv_heads = s.num_kv_heads or s.num_heads
        self.ln1 = nn.LayerNorm(s.hidden_size, eps=s.eps)
        self.qkv = nn.Linear(s.hidden_size, s.hidden_size + 2 * self.kv_heads * self.dim)
        self.attn_out = nn.Linear(s.hidden_size, s.hidden_size)
        self.ln2 = nn.LayerNorm(s.hidden_size, eps=s.eps)
        self.fc = nn.Linear(s.hidden_size, s.inner_size)
        self.proj = nn.Linear(s.inner_size, s.hidden_size)

    def forward(self, x, kv_cache, layer, step, masks):
        keys = self.kv_heads * self.dim
        q, k, v = self.qkv(self.ln1(x)).split([self.heads * self.dim, keys, keys], -1)
        o = paged_attention(q.view(-1, self.heads, self.dim), k.view(-1, self.kv_heads, self.dim),
                            v.view(-1, self.kv_heads, self.dim), kv_cache, layer, step, masks, self.dim ** -0.5)
        x = x + self.attn_out(o.flatten(1))
        return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT2(NativeDecoding, nn.Module):
    def __init__(self, s: GPT2Spec):
        super().__init__()
        self.spec = s
        self.num_layers, self.head_dim = s.num_layers, s.hidden_size // s.num_heads
        self.num_kv_heads = s.num_kv_heads or s.num_heads
        self.vocab_size, self.max_position = s.vocab_size, s.max_position
        self.wte = embedding(s.vocab_size, s.hidden_size)
        self.wpe = embedding(s.max_position, s.hidden_size)
        self.layers = nn.ModuleList(Block(s) for _ in range(s.num_layers))
        self.ln_f = nn.LayerNorm(s.hidden_size, eps=s.eps)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        self.tie_embeddings()

    def tie_embeddings(self):
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight

    def forward(self, step, kv_cache) -> torch.Tensor:
        """Logits [S, vocab] for the step's sampled positions only."""
        x = self.wte(step.input_ids) + self.wpe(step.positions)
        if (logits := self.native_decode(x, None, None, step, kv_cache)) is not None:
            return logits
        masks = AttentionMasks(step, x.dtype, kv_cache)
        for i, layer in enumerate(self.layers):
            x = layer(x, kv_cache, i, step, masks)
        return self.lm_head(self.ln_f(x[step.sample_indices]))

    @staticmethod
    def convert(hf: dict[str, torch.Tensor], s: GPT2Spec) -> dict[str, torch.Tensor]:
        """Transformers' names (a GGUF file's as gguf.py names them: GGUF_NAMES) -> this module's. GPT-2's
        checkpoints store Conv1D weights as [in, out], its files as nn.Linear does."""
        renamed = {}
        for name, tensor in hf.items():
            name = name.removeprefix("transformer.")
            for old, new in GGUF_NAMES:
                name = name.replace(old, new, 1) if name.startswith(old) else name
            renamed[name] = tensor
        hf = renamed
        out = {name: hf[name] for name in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")}
        out["lm_head.weight"] = hf["wte.weight"] if s.tie_word_embeddings else hf["lm_head.weight"]
        names = {"ln_1": "ln1", "ln_2": "ln2", "attn.c_attn": "qkv", "attn.c_proj": "attn_out",
                 "mlp.c_fc": "fc", "mlp.c_proj": "proj"}
        for i in range(s.num_layers):
            for theirs, ours in names.items():
                weight = hf[f"h.{i}.{theirs}.weight"]
                out[f"layers.{i}.{ours}.weight"] = weight.t() if s.conv1d and not theirs.startswith("ln") else weight
                out[f"layers.{i}.{ours}.bias"] = hf[f"h.{i}.{theirs}.bias"]
        return out


# a GGUF file's names as gguf.py gives them (its layers' products by GPT-2's own: ARCH_LAYER_NAMES) -> GPT-2's
GGUF_NAMES = (("model.embed_tokens.", "wte."), ("model.norm.", "ln_f."), ("position_embd.", "wpe."),
              ("model.layers.", "h."))
