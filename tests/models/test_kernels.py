"""Loom's CPU kernels against the torch paths they replace: decode attention (gather + masked
SDPA; soft-capped scores), the small-batch linear product (F.linear); and the fallback when the build fails. (The
engine on both paths: test_correctness.)"""

import os
import threading

import pytest
import torch
import torch.nn.functional as F

from models.kernels import cpu_linear, native, paged_decode
from models.kernels.decoder_layer import SPLIT_ROWS_PER_THREAD

needs_kernel = pytest.mark.skipif(native.library() is None, reason="no C++ compiler: the kernels are not built")


def reference_attention(q, k_cache, v_cache, tables, lens, scale, window, softcap=None):
    n, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    keys = k_cache[tables].flatten(1, 2).transpose(1, 2)  # [n, kv_heads, blocks * block_size, dim]
    values = v_cache[tables].flatten(1, 2).transpose(1, 2)
    positions = torch.arange(keys.shape[2])
    mask = positions < lens[:, None]
    if window:
        mask &= positions >= lens[:, None] - window
    if softcap is None:
        return F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask[:, None, None], scale=scale,
                                              enable_gqa=heads != kv_heads)[:, :, 0]
    keys, values = keys.repeat_interleave(heads // kv_heads, 1), values.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("nhd,nhkd->nhk", q, keys) * scale
    scores = (softcap * torch.tanh(scores / softcap)).masked_fill(~mask[:, None], float("-inf"))
    return torch.einsum("nhk,nhkd->nhd", scores.softmax(-1), values)


# (the model's dtype, the pool's): a float32 model's pool may keep float16 or bfloat16
POOLS = [(torch.float32, torch.float32), (torch.float64, torch.float64), (torch.float32, torch.float16),
         (torch.float32, torch.bfloat16)]

POOL_IDS = ["float32", "float64", "float32-kv-float16", "float32-kv-bfloat16"]


@needs_kernel
@pytest.mark.parametrize("dtype,cache_dtype", POOLS, ids=POOL_IDS)
@pytest.mark.parametrize("num_seqs", [1, 3, 40])  # few: heads split across threads; many: whole sequences
# (32 K/V heads of 40 or more: a token's keys span a page, and scores go a block of tokens at a time)
@pytest.mark.parametrize("heads,kv_heads,window", [(4, 4, None), (8, 2, None), (9, 3, None), (6, 1, None), (4, 2, 7),
                                                   (32, 32, None), (64, 32, 7)])
@pytest.mark.parametrize("dim", [16, 40, 64])  # 40: whole vectors and a tail (one vector or none with AVX-512)
def test_kernel_matches_gather_and_sdpa(dtype, cache_dtype, num_seqs, heads, kv_heads, window, dim):
    gen = torch.Generator().manual_seed(num_seqs * 100 + heads + dim)
    block_size, num_blocks, max_blocks = 4, 400, 9
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen, dtype=dtype).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen, dtype=dtype).to(cache_dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:num_seqs * max_blocks].view(num_seqs, max_blocks)
    lens = torch.randint(1, max_blocks * block_size + 1, (num_seqs,), generator=gen)
    # q as a view into a fused qkv output, as the models pass it: rows are not contiguous.
    q = torch.randn(num_seqs, 3, heads, dim, generator=gen, dtype=dtype)[:, 0]
    out = torch.full_like(q, float("nan"))
    paged_decode.decode_attention(q, k_cache, v_cache, tables, lens, out, dim ** -0.5, window)
    expected = reference_attention(q, k_cache.to(dtype), v_cache.to(dtype), tables, lens, dim ** -0.5, window)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


@needs_kernel
@pytest.mark.parametrize("dtype,cache_dtype", POOLS[:3], ids=POOL_IDS[:3])
@pytest.mark.parametrize("num_seqs,heads,kv_heads,window", [(1, 8, 2, None), (40, 8, 2, None), (3, 4, 2, 7),
                                                            (40, 32, 32, None)])
def test_kernel_soft_caps_scores_as_tanh_does(dtype, cache_dtype, num_seqs, heads, kv_heads, window):
    """Gemma 2's soft cap (cap tanh(score / cap) before the softmax): scores near 0, around the cap
    and far past it (saturated), over contexts of whole vectors and a tail."""
    gen = torch.Generator().manual_seed(num_seqs + heads)
    block_size, num_blocks, max_blocks, dim, cap = 4, 400, 9, 40, 1.5
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen, dtype=dtype).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen, dtype=dtype).to(cache_dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:num_seqs * max_blocks].view(num_seqs, max_blocks)
    lens = torch.randint(1, max_blocks * block_size + 1, (num_seqs,), generator=gen)
    q = torch.randn(num_seqs, heads, dim, generator=gen, dtype=dtype) * torch.tensor([0.05, 1.0, 6.0], dtype=dtype)[
        torch.arange(heads) % 3, None]  # each head's scores small, near the cap, or saturated
    out = torch.full_like(q, float("nan"))
    paged_decode.decode_attention(q, k_cache, v_cache, tables, lens, out, dim ** -0.5, window, softcap=cap)
    expected = reference_attention(q, k_cache.to(dtype), v_cache.to(dtype), tables, lens, dim ** -0.5, window, cap)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)
    uncapped = reference_attention(q, k_cache.to(dtype), v_cache.to(dtype), tables, lens, dim ** -0.5, window)
    assert not torch.allclose(out, uncapped, atol=1e-3)


@needs_kernel
def test_kernel_refuses_rows_it_cannot_walk():
    q = torch.randn(2, 4, 8).transpose(1, 2)  # heads not contiguous
    cache = torch.zeros(4, 4, 8, 4)
    with pytest.raises(ValueError, match="contiguous"):
        paged_decode.decode_attention(q, cache, cache, torch.zeros(2, 1, dtype=torch.int64), torch.ones(2),
                                      torch.empty(2, 8, 4), 1.0, None)


def test_a_failed_build_falls_back_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOM_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    with pytest.warns(UserWarning, match="torch path"):
        assert native._load() is None
    assert not list(tmp_path.rglob("*.so")), "a failed build must leave nothing behind in the cache"


@pytest.fixture(params=[3, 9, 72], ids=["panels-from-3", "panels-from-9", "panels-from-72"])
def panels_from(request):
    """Products take the panels from this many rows (as measure_panel_rows may choose)."""
    return request.param


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
# 1-8 rows one weight row at a time, more in groups of 8 (panels from 72); whole, partial, several
# panels; the wide panels (AVX-512) from 32 rows; rows left after whole panels (17, 20, 36, 40)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 20, 36, 40, 71])
@pytest.mark.parametrize("width,out,bias", [(64, 96, False), (61, 29, True), (576, 8 * 3 * 7 + 5, True),
                                            (1100, 48 + 6 + 5, True),  # past 1024: chunks of k
                                            # rows a multiple of 4 KiB: with AVX2 each whole task's
                                            # tiles spread across it, then a partial task
                                            (1024, 2 * 96 + 6 + 5, False),
                                            (5, 13, True)])  # narrower than a vector
def test_linear_kernel_matches_f_linear(dtype, rows, width, out, bias, panels_from):
    """Widths that are not a multiple of the vector width, output counts that leave a partial
    block of weight rows (and tile of a panel task), with and without bias; the input a view whose
    rows are strided."""
    gen = torch.Generator().manual_seed(rows * 1000 + width)
    x = torch.randn(rows, 2 * width, generator=gen, dtype=dtype)[:, :width]
    weight = torch.randn(out, width, generator=gen, dtype=dtype)
    b = torch.randn(out, generator=gen, dtype=dtype) if bias else None
    tolerance = 1e-4 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(cpu_linear.linear(x, weight, b, panels_from), F.linear(x, weight, b), atol=tolerance,
                               rtol=tolerance)


class FakeKernels:
    """What measure_panel_rows sees of the library and the clock: a product on the panels takes
    panel_ms[rows] ms (3 where not given), on the tiles 2 ms. It records the widths it is given."""

    def __init__(self, default: int, panel_ms: dict):
        self.default, self.panel_ms, self.clock = default, panel_ms, 0.0
        self.products = []  # (rows, width, weight rows) of each product timed

    def loom_default_panel_min_rows(self) -> int:
        return self.default

    def product(self, kernel, x, weight, bias, panel_rows):
        rows = x.shape[0]
        self.products.append((rows, x.shape[1], weight.shape[0]))
        self.clock += (self.panel_ms.get(rows, 3) if rows >= panel_rows else 2) * 1e-3


@pytest.mark.parametrize("default,panel_ms,chosen", [
    (3, dict.fromkeys(range(3, 9), 1), 3),              # panels ahead at every count timed (Zen 5)
    (3, dict.fromkeys(range(5, 9), 1), 5),              # the tiles ahead at 3 and 4 rows
    (3, {4: 1}, 9),                                     # a lone win below losses does not pay
    (3, {}, 9),                                         # the tiles ahead throughout (an Emerald Rapids Xeon)
    (3, {**dict.fromkeys(range(3, 8), 1), 8: 2.1}, 3),  # a near tie at one count does not undo the rest
    (8, {8: 1}, 8),                                     # AVX2: 8 rows alone timed, the panels ahead
    (8, {}, 9),                                         # ... or the tiles
    (9, dict.fromkeys(range(3, 9), 1), 9),              # a default past the counts timed: nothing is
])
def test_panels_start_where_the_counts_timed_take_least(monkeypatch, default, panel_ms, chosen):
    fake = FakeKernels(default, panel_ms)
    monkeypatch.setattr(cpu_linear.native, "library", lambda: fake)
    monkeypatch.setattr(cpu_linear.native, "function", lambda *args: None)
    monkeypatch.setattr(cpu_linear, "_product", fake.product)
    monkeypatch.setattr(cpu_linear.time, "perf_counter", lambda: fake.clock)
    weights = [torch.zeros(7, 5), torch.zeros(3, 11)]  # a model's, in the order a step takes them
    assert cpu_linear.measure_panel_rows(weights) == chosen
    if default <= cpu_linear.LAST_TIMED_ROWS:
        assert fake.products[:4] == [(default, 5, 7), (default, 11, 3)] * 2  # each weight, at its width, both ways
    else:
        assert not fake.products


@needs_kernel
def test_each_model_keeps_its_own_panel_threshold(monkeypatch):
    """Two models loaded in one process: the second's measurement leaves the first's layers, and
    its native decoder layers, with the first's threshold (one threshold for the library was the
    last-loaded model's for every engine)."""
    import models

    from ..conftest import tiny_model
    measured = iter([4, 7])
    monkeypatch.setattr(cpu_linear, "remembered_panel_rows", lambda weights: next(measured))
    first = models.load(tiny_model("llama"), dtype=torch.float32).model
    second = models.load(tiny_model("llama"), dtype=torch.float32).model
    for model, rows in ((first, 4), (second, 7)):
        assert {m.panel_rows for m in model.modules() if isinstance(m, cpu_linear.CpuLinear)} == {rows}
        assert model.decoder_layers.panel_rows == rows


@needs_kernel
def test_a_panel_threshold_is_measured_once_per_set_of_shapes(monkeypatch, tmp_path):
    """The measurement (a second of a load) is remembered in the cache directory, per build of the
    kernels, thread count and weight shapes: a model of other shapes measures its own."""
    measured = []
    monkeypatch.setattr(cpu_linear, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(cpu_linear, "measure_panel_rows", lambda weights: measured.append(weights) or 3 + len(measured))
    small, large = [torch.zeros(8, 16)], [torch.zeros(8, 16), torch.zeros(16, 8)]
    assert [cpu_linear.remembered_panel_rows(w) for w in (small, small, large, small, large)] == [4, 4, 5, 4, 5]
    assert measured == [small, large] and len(list((tmp_path / "panel_rows").iterdir())) == 2


@needs_kernel
def test_cpu_linear_takes_any_leading_shape_and_large_batches_to_torch():
    layer = torch.nn.Linear(24, 40)
    swapped = cpu_linear.CpuLinear(layer)
    for shape in [(3, 24), (2, 5, 24), (0, 24), (cpu_linear.KERNEL_ROWS + 1, 24)]:  # kernel, torch, torch, torch
        x = torch.randn(*shape)
        torch.testing.assert_close(swapped(x), layer(x), atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype,cache_dtype", POOLS, ids=POOL_IDS)
@pytest.mark.parametrize("rotary_dim", [16, 8, None])  # whole head, partial rotary, none (GPT-2)
@pytest.mark.parametrize("tokens", [1, 20])  # one decode row; enough rows for threads
def test_rotate_and_store_matches_apply_rotary_and_index_copy(dtype, cache_dtype, rotary_dim, tokens):
    """The pool holds the rotated keys and the values as .to(pool dtype) rounds them: the torch path
    and the kernels keep the same bits."""
    from models.families.rope import apply_rotary

    gen = torch.Generator().manual_seed(tokens + (rotary_dim or 0))
    heads, kv_heads, dim, block_size = 6, 2, 16, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen, dtype=dtype)
    q, k, v = (t.view(tokens, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1))
    angles = torch.rand(tokens, 1, rotary_dim or 2, generator=gen, dtype=dtype) * 6
    cos, sin = (angles.cos(), angles.sin()) if rotary_dim else (None, None)
    slots = torch.randperm(10 * block_size, generator=gen)[:tokens]
    k_cache, v_cache = (torch.zeros(10, block_size, kv_heads, dim, dtype=cache_dtype) for _ in range(2))
    rotated = paged_decode.rotate_and_store(q, k, v, cos, sin, slots, k_cache, v_cache)
    if rotary_dim:
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-14
    torch.testing.assert_close(rotated, q, atol=tolerance, rtol=tolerance)
    stored = k_cache.view(-1, kv_heads, dim)[slots]
    if cache_dtype == dtype:
        torch.testing.assert_close(stored, k, atol=tolerance, rtol=tolerance)
    else:  # the kernel's rotation may differ from torch's in the last float bit, which can round either way
        step = 2 ** -7 if cache_dtype == torch.bfloat16 else 2 ** -10
        torch.testing.assert_close(stored.to(dtype), k, atol=1e-6, rtol=step)
        assert (stored == k.to(cache_dtype)).float().mean() > 0.97
    assert torch.equal(v_cache.view(-1, kv_heads, dim)[slots], v.to(cache_dtype))
    assert k_cache.view(-1, kv_heads, dim).abs().sum(dim=(1, 2)).count_nonzero() == tokens  # nothing else written


@pytest.fixture
def two_threads():
    """This thread's OpenMP threads at two, whatever the machine has (a team of two runs on one core too)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def with_random_norms(hf):
    """``hf`` with every norm's weights drawn around 1 (a new model's are ones, under which a norm
    read from the wrong place, Qwen3's q_norm for its k_norm say, would go unseen). A norm by its module's name
    (DBRX's products lie under norm_attn_norm)."""
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, weight in hf.named_parameters():
            module = name.split(".")[-2]
            if "norm" in module or "ln" in module:
                weight.copy_(0.5 + torch.rand(weight.shape, generator=gen, dtype=weight.dtype))
    return hf


# rope, qkv bias, windows, queries scaled by position, partial rotary, q/k norms per head and across heads,
# no norms before the attention and MLP, layers without rotary, scaled residuals,
# routed experts (Qwen3-MoE's beside a dense layer; gpt-oss's with biases and a clamped SwiGLU beside
# attention sinks), soft-capped scores, short convolutions in the attention's place (LFM2's), delta rules in it and
# gated attention (Qwen3.5's), Mamba2 in it (Granite 4's; Nemotron-H's, with squared-ReLU MLPs and a layer
# without one; Mamba2's own models, with no attention at all; Nemotron 3's, with squared-ReLU experts and a shared one), GLM-4.5's half-rotated heads and
# DeepSeek-V3's routing, DeepSeek's latent attention in it (full-rank queries and softmax routing; low-rank queries and
# sigmoid routing with selection biases); LayerNorm and GELU (GPT-2's; Phi-2's MLP beside its attention, Command R7B's
# global layers unrotated); HunYuan's q/k norms after the rotation (Hunyuan-A13B's beside experts and a shared MLP);
# Nemotron-4's LayerNorms of 1 + their weights; dots.llm1's and MiniMax-M2's mixtures; GPT-NeoX's and Falcon's MLPs
# beside the attention on norms of their own, their exact GELU; AFMoE's gated attention; Apertus's xIELU; DBRX's
# clamped q/k/v beside experts; EXAONE-MoE's window layers alone rotating beside DeepSeek-V3's routing; StableLM 2
# 12B's and Command R+'s q/k LayerNorms a head; Mistral 4's latent attention with its queries' temperature; Granite
# SWA's windows beside sinks, its global layers unrotated; BLOOM's and MPT's ALiBi
NATIVE_FAMILIES = ["llama", "qwen2", "qwen2_sliding", "mistral", "ministral3", "phi3", "qwen3", "smollm3", "granite",
                   "mixtral", "qwen3_moe", "granitemoe", "olmoe", "gpt_oss", "gemma", "gemma2", "gemma3", "olmo2", "olmo3",
                   "exaone4", "lfm2", "lfm2_moe", "qwen3_5", "qwen3_next", "granitemoehybrid", "nemotron_h",
                   "nemotron_h_moe", "glm", "glm4", "glm4_moe", "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "falcon_h1", "mamba2",
                   "mamba", "falcon_mamba", "gemma4", "gemma4_moe", "gemma3n", "gpt2", "phi", "cohere2", "hunyuan_v1_dense",
                   "olmo", "nemotron", "dots1", "hunyuan_v1_moe", "minimax_m2", "gpt_neox", "falcon", "afmoe",
                   "apertus", "gpt_bigcode", "dbrx", "exaone_moe", "jais2", "stablelm", "cohere", "mistral4",
                   "granite_swa", "granitemoe_swa", "bloom", "mpt", "llama4_text", "cohere2_moe", "jamba", "minicpm3"]
# the families whose native layers take short prefill chunks (the others' steps with prefill chunks are the torch
# layers')
CHUNKED_FAMILIES = ["llama", "qwen2_sliding", "mistral", "ministral3", "qwen3", "smollm3", "granite", "gemma", "gemma2",
                    "gemma3", "olmo3", "exaone4", "lfm2", "qwen3_5", "qwen3_next", "granitemoehybrid", "nemotron_h",
                    "falcon_h1", "mamba2", "mamba", "falcon_mamba", "gemma4", "gemma3n", "gpt2", "hunyuan_v1_dense",
                    "bloom", "llama4_text", "jamba"]


def pytest_generate_tests(metafunc):
    """The native layers' matrices of families x pools x row counts: in full for conftest's MATRIX_FAMILIES (every
    family with --all-families), their first case alone for the others (conftest.family_cases)."""
    from ..conftest import family_cases

    test = metafunc.function.__name__
    if test == "test_native_decoder_layers_match_the_torch_layers":  # (rows at a time; panels; split rows)
        cases = [(*pool, streams) for streams in (21, 2, 5, "split") for pool in POOLS]
        chosen = family_cases(metafunc.config, NATIVE_FAMILIES, cases)
        ids = [f"{arch}-{POOL_IDS[POOLS.index((dtype, cache))]}-{streams}" for arch, dtype, cache, streams in chosen]
        metafunc.parametrize("arch,dtype,cache_dtype,streams", chosen, ids=ids)
    if test == "test_native_decoder_layers_take_short_prefill_chunks":
        cases = [(*pool, *passes) for passes in ((5, 2), (128, 1), (128, 2), (7, 1)) for pool in POOLS[:3]]
        chosen = family_cases(metafunc.config, CHUNKED_FAMILIES, cases)
        ids = [f"{arch}-{POOL_IDS[POOLS.index((dtype, cache))]}-{rows}-{threads}"
               for arch, dtype, cache, rows, threads in chosen]
        metafunc.parametrize("arch,dtype,cache_dtype,pass_rows,threads", chosen, ids=ids)


@needs_kernel
def test_native_decoder_layers_match_the_torch_layers(arch, dtype, cache_dtype, streams, two_threads):
    """A decode-only step through decoder_layer.cpp (and its output layer) equals the same step
    through the family's torch Blocks, final norm and lm_head: sequences of different lengths (several
    decode groups), some past a sliding window, one row not sampled (a prompt's one-token chunk); from
    2 x the layers' split_rows on two threads ("split"), each thread carries its own rows. The same with
    a 16-bit pool, where the two paths may round a key apart by one step of its last bit. Gemma
    (four norms a layer, GELU gates, a final soft cap; Gemma 3's local layers' own rotation, Gemma
    2's soft-capped attention scores) runs them in float32 only: its torch norms round to float32
    whatever the model's dtype. Gemma 4 (a global layer's wider heads and values that are its keys, layers
    reading others' K/V, per-layer inputs, scaled outputs; the 26B-A4B's experts beside each MLP) in any, and
    Gemma 3n (AltUp's streams, Laurel, sparse gates) too."""
    import models
    from models.kernels import decoder_layer

    from ..conftest import tiny_model

    model = models.load(with_random_norms(tiny_model(arch, **NATIVE_SETTINGS.get(arch, {}))), dtype=dtype).model
    if arch.startswith(("gemma", "qwen3_5", "qwen3_next")) and not arch.startswith(("gemma4", "gemma3n")) and dtype == torch.float64:
        assert model.decoder_layers is None
        return
    assert model.decoder_layers is not None
    if streams == "split":
        if model.decoder_layers.split_rows == decoder_layer.EXPERT_SPLIT_ROWS_PER_THREAD:
            pytest.skip("a model with routed experts keeps its rows on the team")
        streams = 2 * model.decoder_layers.split_rows + 3
    native_logits, native_cache, torch_logits, torch_cache = decode_both_ways(model, streams, cache_dtype)
    tolerance = {torch.float32: 1e-4, torch.float64: 1e-10, torch.float16: 1e-3, torch.bfloat16: 1e-2}[cache_dtype]
    # (experts weighted in float32 whatever the dtype, as transformers does)
    if arch in ("mixtral", "qwen3_moe", "granitemoe", "olmoe", "gpt_oss", "lfm2_moe", "granitemoehybrid", "deepseek_v2",
                "deepseek_v3", "glm4_moe_lite", "nemotron_h_moe", "glm4_moe", "gemma4_moe", "dots1", "hunyuan_v1_moe",
                "minimax_m2", "afmoe", "dbrx", "exaone_moe", "mistral4", "granitemoe_swa", "llama4_text",
                "cohere2_moe", "jamba"):
        tolerance = max(tolerance, 1e-5)
    torch.testing.assert_close(native_logits, torch_logits, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(native_cache, torch_cache, atol=tolerance, rtol=tolerance)


# DeepSeek's tiny models routed without their groups (group-limited routing is the torch layers' alone); StableLM 2
# 12B's and Command R+'s q/k LayerNorms a head
NATIVE_SETTINGS = {"deepseek_v2": {"topk_method": "greedy"}, "deepseek_v3": {"n_group": 1, "topk_group": 1},
                   "stablelm": {"qk_layernorm": True, "use_parallel_residual": True}, "cohere": {"use_qk_norm": True}}


def decode_both_ways(model, streams, cache_dtype):
    """One decode step of ``streams`` sequences of different lengths (several decode groups, some
    past a sliding window, one row not sampled: a prompt's one-token chunk) after their prefill,
    through decoder_layer.cpp and then through the torch layers from the same pool: (native logits,
    native pool, torch logits, torch pool)."""
    from models.step import Sequence, StepInput

    gen = torch.Generator().manual_seed(3)
    lengths = ([70, 9, 33, 2, 17] + torch.randint(2, 80, (max(0, streams - 5),), generator=gen).tolist())[:streams]
    kv = pool_of(model, 10 * streams, cache_dtype)
    tables = [list(range(10 * i, 10 * i + 10)) for i in range(len(lengths))]
    prompts = [torch.randint(4, 90, (n,), generator=gen).tolist() for n in lengths]
    with torch.no_grad():
        prefill = sorted((Sequence(p[:-1], 0, t, False, state_slot=i) for i, (p, t) in enumerate(zip(prompts, tables))),
                         key=lambda s: len(s.token_ids) != 1)  # one-token entries first, as the contract asks
        model(StepInput.flatten(prefill, 8, torch.device("cpu")), kv)
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # decodes longest first, as the scheduler does
        decode = StepInput.flatten([Sequence(prompts[i][-1:], lengths[i] - 1, tables[i], i != order[1], state_slot=i)
                                    for i in order], 8, torch.device("cpu"))
        assert len(decode.decode_groups) > 1 and decode.sample_indices.tolist() == [0] + list(range(2, streams))
        saved = pool_contents(kv)
        native_logits = model(decode, kv)
        native_cache = pool_contents(kv)
        restore(kv, saved)
        layers, model.decoder_layers = model.decoder_layers, None
        torch_logits = model(decode, kv)
        model.decoder_layers = layers
    return native_logits, native_cache, torch_logits, pool_contents(kv)


def pool_of(model, blocks: int, cache_dtype: torch.dtype):
    """A pool of ``blocks`` blocks of 8 tokens for ``model``: its K/V, its convolution layers' rows (LFM2's), and
    a state slot for every 8 blocks (Qwen3.5's delta-rule states; the tests' sequence i takes slot i)."""
    from models.step import KVCache
    return KVCache.for_model(model, blocks, 8, cache_dtype, "cpu", state_slots=blocks // 8)


def pool_contents(kv) -> torch.Tensor:
    """Every element of a pool, K/V, convolution rows and states, as one vector of float64 (a copy, exact
    whatever each part's type)."""
    return torch.cat([pool.flatten().double() for pool in (kv.data, kv.conv, *kv.states)])


def restore(kv, contents: torch.Tensor) -> None:
    """A pool's elements back as pool_contents gave them."""
    for pool in (kv.data, kv.conv, *kv.states):
        pool.view(-1).copy_(contents[:pool.numel()])
        contents = contents[pool.numel():]


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # SiLU gates; GELU
def test_native_activations_are_zero_where_torch_underflows(arch, two_threads):
    """Every activation's input near -400 (a bias), far past where exp(-x) overflows: the activations
    are 0 as torch's are, not x / e^88 (values near 1e-36, whose rounding scales came out subnormal
    and slowed the next product 1.7x on an Intel Xeon). Down weights of 1e34 make that difference
    show in the logits."""
    import models

    from ..conftest import tiny_model

    hf = tiny_model("llama", mlp_bias=True) if arch == "llama" else tiny_model(arch)  # (GPT-2's MLP has biases)
    with torch.no_grad():
        for block in (hf.model.layers if arch == "llama" else hf.transformer.h):
            gated, down = ((block.mlp.gate_proj, block.mlp.down_proj) if arch == "llama"
                           else (block.mlp.c_fc, block.mlp.c_proj))
            gated.weight.zero_()
            gated.bias.fill_(-400.0)
            down.weight.mul_(1e34)
    model = models.load(hf, dtype=torch.float32).model
    native_logits, _, torch_logits, _ = decode_both_ways(model, 5, torch.float32)
    torch.testing.assert_close(native_logits, torch_logits, atol=1e-4, rtol=1e-4)


@needs_kernel
def test_native_decoder_layers_take_short_prefill_chunks(arch, dtype, cache_dtype, pass_rows, threads, monkeypatch):
    """A step of decode rows and short prefill chunks (from position 0, after a cached prefix, one
    that does not end its prompt and so is not sampled) through decoder_layer.cpp equals the same
    step through the torch layers: in one pass or in passes of a few rows (a pass reading the K/V
    an earlier one wrote for the same sequence), on one thread or two that carry their own rows
    (shares ending where a sequence starts). A step with a chunk past PREFILL_KEYS is the torch
    layers'."""
    import models
    from models.kernels import decoder_layer
    from models.step import Sequence, StepInput

    from ..conftest import tiny_model

    if arch.startswith(("gemma", "qwen3_5", "qwen3_next")) and not arch.startswith(("gemma4", "gemma3n")) and dtype == torch.float64:
        pytest.skip("Gemma's, Qwen3.5's and Qwen3-Next's native layers run in float32 only")
    # (Granite 4's dense hybrid: a model with routed experts keeps its rows on the team, and weighs them in float32)
    # (Qwen3-Next's every layer dense: mlp_only_layers; Llama 4's: moe_layers; Jamba's: one expert a layer)
    dense = {"granitemoehybrid": {"num_local_experts": 0}, "qwen3_next": {"mlp_only_layers": [0, 1, 2, 3]},
             "llama4_text": {"moe_layers": []}, "jamba": {"num_experts": 1}}
    model = models.load(with_random_norms(tiny_model(arch, **dense.get(arch, {}))), dtype=dtype).model
    layers = model.decoder_layers
    gen = torch.Generator().manual_seed(7)
    tokens = lambda n: torch.randint(4, 90, (n,), generator=gen).tolist()
    kv = pool_of(model, 80, cache_dtype)
    table = lambda i: list(range(12 * i, 12 * i + 12))
    cpu = torch.device("cpu")
    decodes, prefix = [tokens(70), tokens(10)], tokens(25)
    cached = [Sequence(decodes[0][:-1], 0, table(0), False, state_slot=0), Sequence(decodes[1][:-1], 0, table(1), False, state_slot=1),
              Sequence(prefix, 0, table(2), False, state_slot=2)]
    # the bound set between the chunks below (at most 30 x 55 keys) and a 69-token prompt's 69 x 69
    monkeypatch.setattr(decoder_layer, "PREFILL_KEYS", 1700)
    with torch.no_grad():  # the decodes' prompts and the prefix, cached (a 69-token chunk: the torch layers)
        first = StepInput.flatten(cached, 8, cpu)
        assert not layers.serves(first, kv)
        model(first, kv)
    step = StepInput.flatten([Sequence(decodes[0][-1:], 69, table(0), True, state_slot=0),
                              Sequence(decodes[1][-1:], 9, table(1), True, state_slot=1),
                              Sequence(tokens(12), 0, table(3), True, state_slot=3), Sequence(tokens(30), 25, table(2), True, state_slot=2),
                              Sequence(tokens(20), 0, table(4), False, state_slot=4), Sequence(tokens(5), 0, table(5), True, state_slot=5)], 8, cpu)
    assert layers.serves(step, kv) and len(step.sample_indices) == 5
    # this 69-row step splits on two threads whatever the model reads (float32 with AVX2 weighs
    # panels: its shares of 44 and 25 rows would not split)
    monkeypatch.setattr(layers, "weighs_panels", False)
    decode_rows = [Sequence(decodes[1][-1:], 9, table(1), True, state_slot=1)] * 30
    lopsided = StepInput.flatten(decode_rows + [Sequence(tokens(60), 0, table(3), True, state_slot=3)], 8, cpu)
    assert not layers.splits(lopsided, 2, kv)  # the 60-token chunk would be one thread's, beside 30 rows
    monkeypatch.setattr(decoder_layer, "PASS_ROWS", pass_rows)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert layers.splits(step, torch.get_num_threads(), kv) == (threads == 2)
        saved = pool_contents(kv)
        with torch.no_grad():
            native_logits = model(step, kv)
            native_cache = pool_contents(kv)
            restore(kv, saved)
            model.decoder_layers = None
            torch_logits = model(step, kv)
    finally:
        torch.set_num_threads(before)
        model.decoder_layers = layers
    tolerance = {torch.float32: 1e-4, torch.float64: 1e-10, torch.float16: 1e-3}[cache_dtype]
    if arch.startswith(("gemma", "llama4")) and cache_dtype == torch.float16:
        # a key the two paths round apart by its last bit moves the next layers' keys, and Gemma's four
        # norms a layer (factors up to 2.5 here) carry that further: 3 float16 steps at most seen (Llama 4's keys
        # normed after the rotation, through four layers: 1.8e-3 in one logit of 1,280; its float32 pool within 1e-4)
        tolerance = 2e-3
    if arch in ("qwen3_5", "qwen3_next") and cache_dtype == torch.float32:
        # the delta rule's state carries a rounding from each of a prompt's tokens to the next: one logit of 1,280
        # 1.6e-4 apart (4.7e-4 of it) since 27a4da6, 4.3e-5 before (the same sources with mamba_scan.cpp built
        # into the library beside them gave 1.6e-4 too); both paths within 1e-4 of a float64 reference
        tolerance = 5e-4
    torch.testing.assert_close(native_logits, torch_logits, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(native_cache, pool_contents(kv), atol=tolerance, rtol=tolerance)


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2_sliding", "mistral", "gpt2"])
@pytest.mark.parametrize("dtype,cache_dtype", POOLS[:3], ids=POOL_IDS[:3])
def test_short_prefill_chunks_on_the_decode_kernel_match_sdpa(arch, dtype, cache_dtype, monkeypatch):
    """Short prefill chunks attend as decode rows, a row per token: from position 0, after a cached
    prefix, past a sliding window, in two runs around a long chunk that keeps SDPA. Logits and
    the pool equal those of every chunk on SDPA."""
    import models
    from models.families import layers
    from models.step import Sequence, StepInput

    from ..conftest import tiny_model

    model = models.load(tiny_model(arch), dtype=dtype).model
    gen = torch.Generator().manual_seed(5)
    tokens = lambda n: torch.randint(4, 90, (n,), generator=gen).tolist()
    kv = pool_of(model, 80, cache_dtype)
    table = lambda i: list(range(12 * i, 12 * i + 12))
    cpu = torch.device("cpu")
    decodes = [tokens(34), tokens(10)]
    prefix = tokens(25)
    cached = [Sequence(decodes[0][:-1], 0, table(0), False, state_slot=0), Sequence(decodes[1][:-1], 0, table(1), False, state_slot=1),
              Sequence(prefix, 0, table(2), False, state_slot=2)]
    with torch.no_grad():  # the decodes' prompts and the prefix, cached
        model(StepInput.flatten(cached, 8, cpu), kv)
    step = StepInput.flatten([Sequence(decodes[0][-1:], 33, table(0), True, state_slot=0),
                              Sequence(decodes[1][-1:], 9, table(1), True, state_slot=1),
                              Sequence(tokens(12), 0, table(3), True, state_slot=3), Sequence(tokens(30), 25, table(2), True, state_slot=2),
                              Sequence(tokens(70), 0, table(4), True, state_slot=4), Sequence(tokens(5), 0, table(5), True, state_slot=5)], 8, cpu)
    runs = layers.AttentionMasks(step, dtype, kv).prefill_rows
    assert [(run.start, run.end) for run in runs] == [(2, 44), (114, 119)]  # the 70-token chunk keeps SDPA
    saved = kv.data.clone()
    with torch.no_grad():
        rows_logits = model(step, kv)
        rows_cache = kv.data.clone()
        kv.data.copy_(saved)
        monkeypatch.setattr(layers, "SHORT_PREFILL_KEYS", 0)
        assert not layers.AttentionMasks(step, dtype, kv).prefill_rows
        sdpa_logits = model(step, kv)
    tolerance = {torch.float32: 1e-4, torch.float64: 1e-10, torch.float16: 1e-3}[cache_dtype]
    torch.testing.assert_close(rows_logits, sdpa_logits, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(rows_cache, kv.data, atol=tolerance, rtol=tolerance)


@needs_kernel
def test_float32_models_on_avx2_split_rows_only_into_whole_panels(two_threads):
    """Threads carry their own rows from SPLIT_ROWS_PER_THREAD rows each. Where the products read
    float32 weights on an AVX2 build, only if the threads' rows compute at most PANEL_SLACK times
    the panel rows of an even share of the team's: 48 rows would be two shares of 24, each a panel
    and a half that computes two, where the team's 48 fill three panels; a prefill step whose shares
    end where its prompts start computes a little more split, and splits. A model in blocks (or any
    with AVX-512) splits them all."""
    import models
    from models.kernels.decoder_layer import computed_rows
    from models.step import KVCache, Sequence, StepInput

    from ..conftest import tiny_model

    avx2 = native.library().loom_vector_bytes() == 32
    float32 = models.load(tiny_model("llama"), dtype=torch.float32).model
    blocks = models.load(tiny_model("llama"), dtype=torch.float32, weights="int4").model
    assert float32.decoder_layers.weighs_panels == avx2 and not blocks.decoder_layers.weighs_panels
    if avx2:
        assert [computed_rows(rows) for rows in (12, 20, 24, 32, 48, 200)] == [16, 20, 32, 32, 48, 128 + 80]
    kv = KVCache.for_model(float32, 64, 8, torch.float32, "cpu")
    cpu = torch.device("cpu")

    def step(streams):
        return StepInput.flatten([Sequence([5], 3, [i], True) for i in range(streams)], 8, cpu)

    for streams in (2 * SPLIT_ROWS_PER_THREAD - 1, 2 * SPLIT_ROWS_PER_THREAD + 3, 48, 64):
        enough = streams >= 2 * SPLIT_ROWS_PER_THREAD
        assert blocks.decoder_layers.splits(step(streams), 2, kv) == enough
        assert float32.decoder_layers.splits(step(streams), 2, kv) == (enough and not (avx2 and streams == 48))
    # 63 prompts of 22 tokens: the shares end at a prompt's start, 704 and 682 rows
    prefill = StepInput.flatten([Sequence(list(range(4, 26)), 0, [3 * i, 3 * i + 1, 3 * i + 2], True)
                                 for i in range(63)], 8, cpu)
    if avx2:
        assert computed_rows(704) > computed_rows(63 * 22) / 2
    assert float32.decoder_layers.splits(prefill, 2, kv)


@needs_kernel
@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="thread affinity is Linux's")
def test_a_split_step_leaves_every_thread_free_to_move(two_threads):
    """The threads that carry their own rows stay on their cores for the step only: afterwards every
    thread of the process (the caller and the OpenMP workers) may run where it could before."""
    import models
    from models.step import KVCache, Sequence, StepInput

    from ..conftest import tiny_model

    model = models.load(tiny_model("llama"), dtype=torch.float32).model
    streams = 2 * model.decoder_layers.split_rows + 3
    kv = KVCache.for_model(model, streams, 8, torch.float32, "cpu")
    step = StepInput.flatten([Sequence([5], 3, [i], True) for i in range(streams)], 8, torch.device("cpu"))
    assert model.decoder_layers.splits(step, 2, kv)

    def masks():
        found = {}
        for tid in map(int, os.listdir("/proc/self/task")):
            try:
                found[tid] = os.sched_getaffinity(tid)
            except ProcessLookupError:  # a thread that ended meanwhile
                pass
        return found

    before = os.sched_getaffinity(0)
    with torch.no_grad():
        for _ in range(3):
            model(step, kv)
    after = masks()
    assert after[threading.get_native_id()] == before
    assert all(mask == before for mask in after.values()), after


@needs_kernel
def test_a_thread_done_early_takes_rows_another_carries(two_threads, monkeypatch):
    """Where threads carry their own rows, one that is done takes the later rows of another's last
    pass (from a sequence's start) for the layers after the one in flight: the step's logits and
    K/V equal the torch layers' whether or not rows were taken, and rows are taken (a busy thread
    of this process holds up one of the two, as a busy neighbour or the server's own threads would)."""
    import models
    from models.kernels import decoder_layer
    from models.step import KVCache, Sequence, StepInput

    from ..conftest import CONFIGS, MODEL_CLASSES

    torch.manual_seed(0)
    config = CONFIGS["llama"]()
    config.num_hidden_layers = 8  # layers enough that one thread is often done while another has some left
    model = models.load(MODEL_CLASSES["llama"](config).to(torch.float64).eval(), dtype=torch.float64).model
    layers = model.decoder_layers
    monkeypatch.setattr(decoder_layer, "TAKE_ROWS", 2)
    gen = torch.Generator().manual_seed(5)
    tokens = lambda n: torch.randint(4, 90, (n,), generator=gen).tolist()
    lengths = sorted(torch.randint(3, 60, (40,), generator=gen).tolist(), reverse=True)
    chunks = [3, 7, 2, 5, 4, 6]  # prompts' rows after the decode rows: cuts only where one starts
    blocks = 8
    kv = KVCache.for_model(model, blocks * (len(lengths) + len(chunks)), 8, torch.float64, "cpu")
    table = lambda i: list(range(blocks * i, blocks * i + blocks))
    cpu = torch.device("cpu")
    prompts = [tokens(n) for n in lengths]
    with torch.no_grad():
        model(StepInput.flatten([Sequence(p[:-1], 0, table(i), False) for i, p in enumerate(prompts)], 8, cpu), kv)
    step = StepInput.flatten([Sequence(p[-1:], n - 1, table(i), True) for i, (p, n) in enumerate(zip(prompts, lengths))]
                             + [Sequence(tokens(n), 0, table(len(prompts) + i), True) for i, n in enumerate(chunks)],
                             8, cpu)
    assert layers.splits(step, 2, kv)
    assert step.sequence_starts() == list(range(40)) + [40, 43, 50, 52, 57, 61]
    saved = kv.data.clone()
    with torch.no_grad():
        model.decoder_layers = None
        torch_logits, torch_cache = model(step, kv), kv.data.clone()
        model.decoder_layers = layers
        busy = threading.Event()

        def spin():
            while not busy.is_set():
                pass

        spinner = threading.Thread(target=spin)
        spinner.start()
        try:
            for _ in range(200):
                kv.data.copy_(saved)
                logits = model(step, kv)
                torch.testing.assert_close(logits, torch_logits, atol=1e-10, rtol=1e-10)
                torch.testing.assert_close(kv.data, torch_cache, atol=1e-10, rtol=1e-10)
                if layers.taken_rows > 0:
                    break
        finally:
            busy.set()
            spinner.join()
    assert layers.taken_rows > 0
