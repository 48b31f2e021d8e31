"""weights="int4" / "int8": linear layers in blocks of 4- or 8-bit codes (8-bit in the output layer
and the embeddings), on Loom's own kernel (models/kernels/block_linear.py, block_weights.h), which
multiplies the input rounded to 8 bits, a scale per 32 values (round_activations)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import models
from models.kernels import native
from models.kernels.block_linear import (GROUP, ROUND_ARGTYPES, BlockEmbedding, BlockLinear, dequantize, quantize,
                                         round_activations)
from models.kernels.cpu_linear import KERNEL_ROWS, CpuLinear
from models.step import KVCache, Sequence, StepInput
from ..conftest import tiny_model

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C++ compiler: the kernels are not built")


def linear(out, width, bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(width, out, bias=bias).requires_grad_(False)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("out,width", [(7, 32), (40, 96), (100, 160), (13, 1088)])  # 1088: two chunks of k
# integer products up to 32 rows (a block at a time for an odd count of blocks, else a pair), in groups of
# 8 rows from 9; the panels over widened weights from 33; oneDNN on widened weights past 128 (forward)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16, 17, 40, 71])
def test_kernel_computes_the_dequantized_product(bits, out, width, rows):
    layer = linear(out, width, bias=rows % 2 == 1, seed=rows)
    blocks = BlockLinear(layer, bits)
    # x as a view of every other row of a larger tensor: the rows need not be adjacent
    x = torch.randn(2 * rows, width, generator=torch.Generator().manual_seed(out))[::2]
    weight = dequantize(blocks.blocks, bits, out, width).double()
    bias = None if layer.bias is None else layer.bias.double()
    expected = F.linear(round_activations(x).double(), weight, bias).float()
    torch.testing.assert_close(blocks(x), expected, atol=2e-5 * width ** 0.5, rtol=1e-5)


@pytest.mark.parametrize("bits", [4, 8])
def test_prefill_chunks_run_on_the_kernel_too(bits):
    """Past KERNEL_ROWS rows (prefill chunks; the native layers' limit) the same kernel, its panels
    over weights widened a tile at a time: the same result."""
    layer = linear(23, 96)
    blocks = BlockLinear(layer, bits)
    x = torch.randn(2, KERNEL_ROWS + 3, 96)  # a 3-D input, as a model may pass
    weight = dequantize(blocks.blocks, bits, 23, 96).double()
    expected = F.linear(round_activations(x).double(), weight, layer.bias.double()).float()
    torch.testing.assert_close(blocks(x), expected, atol=1e-4, rtol=1e-5)


def test_the_kernel_rounds_its_input_as_round_activations_does():
    """Bit for bit, ties included (half to even): the float64 references of the block tests multiply
    round_activations(x), so the kernel must round to the same codes."""
    kernel = native.function("loom_round_activations", torch.float32, ROUND_ARGTYPES)
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 64)[:, None]
    x[0, :32] = torch.arange(32) - 15.5  # a step of exactly 1 (the block's largest value is 127): ties at every half
    x[0, 0] = 127
    x[1, :32] = 0  # a block of zeros
    out = torch.empty_like(x)
    kernel(x.data_ptr(), 512, 64, 512, out.data_ptr(), 32)
    assert torch.equal(out, round_activations(x))
    wide = torch.empty_like(x)
    kernel(x.data_ptr(), 512, 64, 512, wide.data_ptr(), 256)  # a K-quant's: one scale per 256
    assert torch.equal(wide, round_activations(x, 256))
    blocks = x.view(64, -1, GROUP)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    assert ((out.view(64, -1, GROUP) - blocks).abs() <= step / 2 * 1.0001).all()  # within half a step


@pytest.mark.parametrize("bits,limit", [(4, 0.5 / 15), (8, 0.5 / 127)])
def test_quantize_rounds_each_value_to_its_blocks_nearest_step(bits, limit):
    weight = torch.randn(20, 128) * torch.linspace(0.01, 10, 20)[:, None]  # rows of very different scales
    restored = dequantize(quantize(weight, bits), bits, 20, 128)
    blocks = weight.reshape(20, -1, GROUP)
    span = blocks.amax(-1) - blocks.amin(-1) if bits == 4 else 2 * blocks.abs().amax(-1)
    error = (restored - weight).abs().reshape(20, -1, GROUP).amax(-1)
    assert (error <= span * limit * 1.0001 + 1e-7).all()


def test_constant_and_zero_blocks_are_exact():
    weight = torch.zeros(3, 64)
    weight[1] = 2.5
    weight[2, :32] = -1.0
    for bits in (4, 8):
        assert torch.equal(dequantize(quantize(weight, bits), bits, 3, 64), weight)


@pytest.mark.parametrize("kind,bits", [("Q4_1", 4), ("Q8_0", 8)])
def test_a_gguf_files_blocks_quantize_back_to_its_own_codes(kind, bits):
    """The claim block_linear.py makes for GGUF checkpoints: their dequantized Q4_1 / Q8_0 values
    quantize to the file's codes, with the file's scales and minimums (float16 there)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize

    kind = GGMLQuantizationType[kind]
    weight = np.random.default_rng(0).standard_normal((24, 256)).astype(np.float32)
    raw = gguf_quantize(weight, kind).reshape(24, 8, -1)  # [rows, blocks, bytes of a block]
    ours = quantize(torch.from_numpy(gguf_dequantize(gguf_quantize(weight, kind), kind)), bits).view(24, -1)
    code_bytes = 256 * bits // 8
    codes, scales = ours[:, :code_bytes].reshape(24, 8, -1), ours[:, code_bytes:code_bytes + 32].view(torch.float32)
    scale_bytes = torch.from_numpy(raw[..., :2].copy()).view(torch.float16).float()[..., 0]
    if bits == 4:  # d, m, then 16 bytes of codes (value j low, j + 16 high), as ours
        assert torch.equal(codes, torch.from_numpy(raw[..., 4:].copy()))
        mins = ours[:, code_bytes + 32:].view(torch.float32)
        file_mins = torch.from_numpy(raw[..., 2:4].copy()).view(torch.float16).float()[..., 0]
        torch.testing.assert_close(mins, file_mins, rtol=1e-5, atol=1e-6)
    else:  # d, then 32 signed codes
        assert torch.equal(codes, torch.from_numpy(raw[..., 2:].copy()))
    torch.testing.assert_close(scales, scale_bytes, rtol=1e-5, atol=1e-7)


def test_widths_that_are_not_whole_blocks_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        BlockLinear(linear(8, 40), 4)


@pytest.mark.parametrize("weights,bits", [("int4", 4), ("int8", 8)])
@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True), ("gpt2", True)])
def test_block_models_keep_their_layers_in_blocks_and_the_output_and_embeddings_in_8_bits(arch, tied, weights, bits):
    source = tiny_model(arch)
    model = models.load(source, dtype=torch.float32, weights=weights).model
    blocks = [m for m in model.modules() if isinstance(m, BlockLinear)]
    assert not any(isinstance(m, (nn.Linear, CpuLinear)) for m in model.modules())
    assert {m.formats for m in blocks if m is not model.lm_head} == {(bits,)} and model.lm_head.formats == (8,)
    assert model.decoder_layers is not None  # decode steps in one native call
    embedding = model.wte if arch == "gpt2" else model.embed
    assert isinstance(embedding, BlockEmbedding)
    assert (embedding.blocks.data_ptr() == model.lm_head.blocks.data_ptr()) == tied  # one copy where tied
    table = source.get_input_embeddings().weight.float()
    ids = torch.tensor([[0, 7], [table.shape[0] - 1, 7]])
    expected = dequantize(quantize(table, 8), 8, *table.shape)[ids]
    assert torch.equal(embedding(ids), expected)
    assert (embedding(ids) - table[ids]).abs().max() <= table.abs().max() / 127  # within half a step of 8 bits


def narrow_llama():
    """A Llama whose hidden width (48) is not whole blocks: only its down product (64 wide) takes
    blocks, the rest stays float32, in the same native layers."""
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("arch", ["llama", "gpt2", "narrow"])
def test_native_layers_on_blocks_match_the_torch_path(arch):
    """A decode step through decoder_layer.cpp (block products inside one region) against the torch
    layers calling each BlockLinear: the same products, so the logits agree closely."""
    source = narrow_llama() if arch == "narrow" else tiny_model(arch)
    model = models.load(source, dtype=torch.float32, weights="int4").model
    if arch == "narrow":
        kinds = [type(m) for b in model.layers for m in (b.attn.qkv, b.attn.out, b.mlp.gate_up, b.mlp.down)]
        assert kinds == [CpuLinear, CpuLinear, CpuLinear, BlockLinear] * 2 and isinstance(model.embed, nn.Embedding)
    for rows in (1, 3, 12):  # the one-row kernel, the tiles, the panels
        kv = KVCache.for_model(model, 4 * rows, 16, torch.float32, "cpu")
        kv.data.normal_(generator=torch.Generator().manual_seed(rows))
        tables = [list(range(4 * i, 4 * i + 4)) for i in range(rows)]
        step = StepInput.flatten([Sequence([i + 5], 40 - i, table, True) for i, table in enumerate(tables)], 16,
                                 torch.device("cpu"))
        with torch.inference_mode():
            native_logits = model(step, kv)
            layers, model.decoder_layers = model.decoder_layers, None
            torch_logits = model(step, kv)
            model.decoder_layers = layers
        torch.testing.assert_close(native_logits, torch_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("weights", ["float32", "int4"])
def test_a_decode_step_with_no_row_sampled_gives_no_logits(weights):
    """Every row a prompt's one-token chunk (none sampled): the native layers still write the pool
    as the torch layers do, and the output layer gives an empty [0, vocab] (nothing is written past it)."""
    model = models.load(tiny_model("llama"), dtype=torch.float32, weights=weights).model
    kv = KVCache.for_model(model, 12, 16, torch.float32, "cpu")
    step = StepInput.flatten([Sequence([i + 5], 20 - i, [3 * i, 3 * i + 1], False) for i in range(3)], 16,
                             torch.device("cpu"))
    with torch.inference_mode():
        logits = model(step, kv)
        native_pool = kv.data.clone()
        kv.data.zero_()
        layers, model.decoder_layers = model.decoder_layers, None
        assert model(step, kv).shape == logits.shape == (0, model.vocab_size)
        model.decoder_layers = layers
    torch.testing.assert_close(native_pool, kv.data, atol=1e-4, rtol=1e-4)
