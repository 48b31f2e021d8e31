"""A GGUF file's formats on Loom's block kernels (models/kernels/block_formats.py): the K-quants (Q2_K to
Q6_K) and MXFP4 read as the file has them, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL and IQ4_XS rearranged to the very
numbers of the file; a file mixing formats loads in them (weights="stored", the default) and its
greedy tokens equal a float64 forward over the file's dequantized weights whose block products take
their input rounded to 8-bit blocks, as Loom's do."""

import numpy as np
import pytest
import torch
import transformers
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize

import models
from models.kernels import block_formats, native
from models.kernels.block_formats import block_format, to_blocks, to_rows16
from models.kernels.block_linear import (BFLOAT16, FLOAT16, FLOAT32, FLOAT32_PADDED, GGUF_Q2_K, GGUF_Q3_K, GGUF_Q4_K, GGUF_Q4_K_ROWS16,
                                         GGUF_Q4_1_ROWS16, GGUF_Q5_0_ROWS16, GGUF_Q5_K, GGUF_Q5_K_ROWS16, GGUF_Q6_K, GGUF_Q6_K_ROWS16, GGUF_Q8_0_ROWS16, GGUF_IQ4_ROWS16, GGUF_MXFP4,
                                         GGUF_MXFP4_ROWS16,
                                         FORMAT_NAMES, GROUP, LOOM_4BIT, LOOM_5BIT, LOOM_8BIT, LOOM_IQ4, SUPER_BLOCKS, WIDEN_ARGTYPES, BlockEmbedding, BlockLinear, dequantize,
                                         multiplies_rows16, padded_rows, pads_rows, round_activations, rounding,
                                         rounds_input_to_bfloat16, row_bytes, stored_format)
from models.kernels.cpu_linear import KERNEL_ROWS
from runtime import Engine, GenerationConfig


needs_kernels = pytest.mark.skipif(native.library() is None, reason="no C++ compiler: the kernels are not built")

NATIVE = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4]
EXACT = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.IQ4_XS]
FLOATS = [Q.F32, Q.F16, Q.BF16]  # kept as the file has them, not blocks
# where each K-quant keeps its float16 super-block scales (d, and dmin where it has one)
HALF_FIELDS = {Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.IQ4_NL: [0],
               Q.IQ4_XS: [0]}
# where MXFP4 keeps each block's exponent byte (E8M0: the scale 2^(e - 127), which the tests keep to trained
# weights' magnitudes)
EXPONENT_FIELDS = {Q.MXFP4: (0, (118, 126))}


def random_tensor(kind: Q, rows: int, width: int, seed: int = 0, half_range=(0.001, 0.01)) -> np.ndarray:
    """A tensor's raw bytes [rows, bytes per row]: quantized by gguf-py where it can, else random
    bytes (any codes are valid) with the float16 scale fields set to small finite values."""
    rng = np.random.default_rng(seed)
    if kind not in HALF_FIELDS and kind not in EXPONENT_FIELDS:
        return gguf_quantize(rng.standard_normal((rows, width)).astype(np.float32), kind)
    block, block_bytes = GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, (rows, width // block, block_bytes), dtype=np.uint8)
    if kind in EXPONENT_FIELDS:
        at, exponents = EXPONENT_FIELDS[kind]
        data[..., at] = rng.integers(*exponents, (rows, width // block))
        return data.reshape(rows, -1)
    for at in HALF_FIELDS[kind]:
        scales = rng.uniform(*half_range, (rows, width // block)).astype(np.float16)
        data[..., at:at + 2] = scales.view(np.uint8).reshape(rows, width // block, 2)
    return data.reshape(rows, -1)


def file_values(data: np.ndarray, kind: Q, width: int) -> torch.Tensor:
    return torch.from_numpy(np.asarray(gguf_dequantize(data, kind), dtype=np.float64).reshape(data.shape[0], width))


@pytest.mark.parametrize("kind", NATIVE, ids=lambda k: k.name)
def test_k_quants_and_mxfp4_are_kept_as_the_file_lays_them_out(kind):
    data = random_tensor(kind, rows=6, width=512)
    blocks = to_blocks(data, kind, 512)
    assert torch.equal(blocks, torch.from_numpy(data))
    assert block_format(kind) in SUPER_BLOCKS or stored_format(blocks, 512) == block_format(kind) == GGUF_MXFP4


@pytest.mark.parametrize("kind", EXACT, ids=lambda k: k.name)
def test_formats_whose_numbers_blocks_hold_keep_the_files_numbers(kind):
    width = 512
    data = random_tensor(kind, rows=6, width=width)
    blocks = to_blocks(data, kind, width)
    assert torch.equal(dequantize(blocks.flatten(), block_format(kind), 6, width).double(), file_values(data, kind, width))


@pytest.mark.parametrize("width", [256, 512, 1152, 2048, 8960])
def test_every_block_format_has_rows_of_its_own_size(width):
    """A buffer's format is told by its rows' bytes (stored_format), so no two block formats may give
    a row of the same width the same size (Q5_0's rows side by side keep a spare byte a block so as
    not to be Q5_K's)."""
    sizes = {}
    for format in FORMAT_NAMES:
        if format in (FLOAT32, FLOAT16, BFLOAT16) or (format in SUPER_BLOCKS and width % 256):
            continue
        size = row_bytes(width, format)
        assert size not in sizes, f"{FORMAT_NAMES[format]} and {FORMAT_NAMES[sizes[size]]}: {size} bytes"
        sizes[size] = format
        assert stored_format(torch.zeros(2, size, dtype=torch.uint8), width) == format


@needs_kernels
@pytest.mark.parametrize("kind", EXACT, ids=lambda k: k.name)
def test_the_kernels_rearrange_a_files_blocks_into_the_bytes_numpy_does(kind):
    """gguf_blocks.cpp's one pass and block_formats.py's numpy fallback: the same bytes, scales and
    minimums included (a row of several super-blocks, rows shared among threads)."""
    width = 768
    data = random_tensor(kind, rows=37, width=width, seed=3)
    assert hasattr(native.library(), "loom_rearrange_gguf_blocks")  # to_blocks's native path for every such kind
    native_blocks = to_blocks(data, kind, width)
    assert torch.equal(native_blocks, torch.from_numpy(block_formats._rearranged(data, kind, width)))


@needs_kernels
@pytest.mark.parametrize("kind", NATIVE + EXACT, ids=lambda k: k.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 40, 200])
def test_the_kernels_product_over_a_files_blocks_equals_float64(kind, rows):
    """Decode-sized, panel-sized and widened (past 128 rows) products over the file's blocks, against
    a float64 product of the input rounded to 8-bit blocks and the file's values (gguf-py's)."""
    width, out = 512, 96
    data = random_tensor(kind, rows=out, width=width, seed=2)
    layer = BlockLinear.of_blocks(to_blocks(data, kind, width), width)
    assert layer.formats == (block_format(kind),)
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows))
    expected = expected_product(x, data, kind, width)
    assert torch.allclose(layer(x).double(), expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@needs_kernels
@pytest.mark.parametrize("kind, width", [(k, 512) for k in NATIVE + EXACT] + [(k, 320) for k in EXACT if k != Q.IQ4_XS],
                         ids=lambda v: v.name if isinstance(v, Q) else str(v))
def test_a_rows_product_is_the_same_whatever_rows_share_it(kind, width):
    """A block product's rows are bitwise the same alone, a few at a time (pair_rows) and in bands
    of sixteen (the tiled products: 40 rows in two full bands and one of eight, 17 in one band and a
    row left to pair_rows), so that a request's numbers do not depend on its batch-mates; weight rows
    not a whole tile included, and (Loom's blocks) rows whose pairs of blocks are not a whole number
    of block_pair_rows's groups (IQ4_XS, in super-blocks of 256, aside)."""
    out = 100
    layer = BlockLinear.of_blocks(to_blocks(random_tensor(kind, rows=out, width=width, seed=5), kind, width), width)
    x = torch.randn(40, width, generator=torch.Generator().manual_seed(6))
    together = layer(x)
    for size in (1, 3, 8, 17):
        parts = torch.cat([layer(x[i:i + size]) for i in range(0, len(x), size)])
        assert torch.equal(parts, together), f"{size} rows at a time"


@needs_kernels
@pytest.mark.parametrize("kind, layout", [(Q.Q4_K, None), (Q.Q4_K, GGUF_Q4_K_ROWS16), (Q.Q5_K, GGUF_Q5_K_ROWS16),
                                          (Q.Q6_K, None), (Q.Q6_K, GGUF_Q6_K_ROWS16), (Q.Q8_0, None),
                                          (Q.IQ4_XS, None), (Q.IQ4_XS, GGUF_IQ4_ROWS16), (Q.MXFP4, None),
                                          (Q.MXFP4, GGUF_MXFP4_ROWS16)],
                         ids=["Q4_K", "Q4_K-rows16", "Q5_K-rows16", "Q6_K", "Q6_K-rows16", "Q8_0", "IQ4_XS",
                              "IQ4_XS-rows16", "MXFP4", "MXFP4-rows16"])
def test_a_long_prompts_rows_in_bands_are_each_the_rows_product_alone(kind, layout):
    """A product of many input rows over a wide matrix takes them in bands whose rounded input stays
    cached (block_weights.h's input_band_rows: 40 rows at 8192 wide, so 100 rows are three bands,
    the last part full); every row's product is bitwise its product alone, and the bias is added
    to every band's rows once."""
    width, out, rows = 8192, 32, 100
    data = random_tensor(kind, rows=out, width=width, seed=8)
    blocks = to_blocks(data, kind, width)
    if layout is not None:
        blocks = to_rows16(data, kind, width)
        if blocks is None:
            pytest.skip(f"this build multiplies {kind.name} in its own layout only")
        assert stored_format(blocks, width) == layout
    layer = BlockLinear.of_blocks(blocks, width, torch.randn(out, generator=torch.Generator().manual_seed(9)))
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(10))
    together = layer(x)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(rows)])
    assert torch.equal(together, alone)


@needs_kernels
@pytest.mark.parametrize("kind, layout", [(Q.Q4_K, GGUF_Q4_K_ROWS16), (Q.Q5_K, GGUF_Q5_K_ROWS16),
                                          (Q.Q6_K, GGUF_Q6_K_ROWS16), (Q.Q8_0, GGUF_Q8_0_ROWS16),
                                          (Q.Q4_0, GGUF_Q4_1_ROWS16), (Q.Q4_1, GGUF_Q4_1_ROWS16),
                                          (Q.Q5_0, GGUF_Q5_0_ROWS16), (Q.IQ4_NL, GGUF_IQ4_ROWS16),
                                          (Q.IQ4_XS, GGUF_IQ4_ROWS16), (Q.MXFP4, GGUF_MXFP4_ROWS16)],
                         ids=["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "IQ4_NL", "IQ4_XS", "MXFP4"])
def test_rows_side_by_side_hold_the_files_numbers_and_give_its_very_products(kind, layout):
    """Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0, IQ4_NL, IQ4_XS and MXFP4 with sixteen rows side by side (the ROWS16 layouts,
    made at load where the build multiplies them): their rows widen to gguf-py's values, looked up as
    an embedding's too, a row's product is bitwise the same at every row count and within float32's
    rounding of float64's over the file's values, and where the build's products over the file's
    own layout end each super-block (or block) in exact integers too (AVX-512: one row, the few-row
    products and from 13 rows the tiles; Q8_0's over Loom's 8-bit blocks, IQ4's over Loom's IQ4
    blocks and MXFP4's over the file's likewise) bitwise theirs,
    so a model's numbers do not depend on which layout it takes. The layout is made straight from the
    file's bytes, rows in a given order too (Llama's Q/K rows are read so). Rows not a multiple of
    sixteen, a Q4_0 minimum (-8 d) no float16 holds, and 5-bit blocks with minimums of their own
    (Q5_1's) keep Loom's blocks, and a part of such rows is refused."""
    width, out = 512, 96
    data = random_tensor(kind, rows=out, width=width, seed=7)
    blocks = to_blocks(data, kind, width)
    laid_out = to_rows16(data, kind, width)
    if not multiplies_rows16(layout):
        assert laid_out is None
        pytest.skip(f"this build multiplies {kind.name} in its own layout only")
    assert stored_format(laid_out, width) == layout
    assert to_rows16(data[:out - 8], kind, width) is None
    with pytest.raises(ValueError, match="whole blocks of 16 rows"):
        BlockLinear.of_blocks(laid_out[:out - 8], width)
    layer, as_filed = BlockLinear.of_blocks(laid_out, width), BlockLinear.of_blocks(blocks, width)
    assert layer.formats == (layout,) and as_filed.formats == (block_format(kind),)
    exact = kind in (Q.Q4_K, Q.Q5_K, Q.Q8_0, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4) and bool(native.library().loom_k_quant_super_blocks_exact())
    together = torch.randn(40, width, generator=torch.Generator().manual_seed(3))
    for count in (1, 2, 3, 4, 5, 8, 9, 13, 17, 40):
        x = together[:count]
        assert torch.equal(layer(x), layer(together)[:count]), f"{count} rows"
        if exact:
            assert torch.equal(layer(x), as_filed(x)), f"{count} rows"
        else:  # (float32's rounding of two orders of a sum, to the row's magnitude)
            filed = as_filed(x)
            torch.testing.assert_close(layer(x), filed, rtol=1e-5, atol=1e-5 * filed.abs().max().item())
    expected = expected_product(together, data, kind, width)
    assert torch.allclose(layer(together).double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    widen = native.function("loom_block_widen", torch.float32, WIDEN_ARGTYPES)
    values = torch.empty(out, width)
    widen(laid_out.data_ptr(), layout, width, out, 0, out, values.data_ptr())
    assert torch.equal(values.double(), file_values(data, kind, width))
    table, ids = BlockEmbedding(laid_out, out, width, layout), torch.tensor([[17, 0], [95, 17]])
    assert torch.equal(table(ids).double(), file_values(data, kind, width)[ids])
    with pytest.raises(IndexError, match=r"token ids must lie in \[0, 96\); got 0 to 96"):
        table(torch.tensor([0, 96]))
    order = torch.randperm(out, generator=torch.Generator().manual_seed(4))  # (as Llama's Q/K rows are read)
    reordered = to_rows16(data, kind, width, order)
    widen(reordered.data_ptr(), layout, width, out, 0, out, values.data_ptr())
    assert torch.equal(values.double(), file_values(data, kind, width)[order])
    if kind == Q.Q4_0:  # a minimum, -8 d, beyond float16's range: Loom's blocks, which hold it, stay
        huge = data.copy()
        huge[5, 0:2] = np.array([10000], np.float16).view(np.uint8)
        assert to_rows16(huge, kind, width) is None
    if kind == Q.Q5_0:  # minimums of their own (Q5_1's), which the layout has no room for
        assert to_rows16(random_tensor(Q.Q5_1, rows=out, width=width, seed=7), Q.Q5_1, width) is None



@needs_kernels
def test_mxfp4_exponents_at_their_ends_keep_the_files_values_in_either_layout():
    """MXFP4's exponent bytes 0 and 1 make subnormal scales (2^-128, 2^-127), which the side-by-side
    products make sixteen at a time and the products over the file's layout one at a time: rows with
    them and with large exponents widen to gguf-py's values in both layouts, and their products are
    bitwise the same in both where the build's products end each block in exact integers."""
    if not multiplies_rows16(GGUF_MXFP4_ROWS16):
        pytest.skip("this build multiplies MXFP4 in the file's layout only")
    rows, width = 32, 256
    data = random_tensor(Q.MXFP4, rows=rows, width=width, seed=11)
    data.reshape(rows, -1, 17)[..., 0] = np.random.default_rng(12).choice([0, 1, 2, 3, 120, 126, 160], (rows, width // 32))
    widen = native.function("loom_block_widen", torch.float32, WIDEN_ARGTYPES)
    layouts = {GGUF_MXFP4: to_blocks(data, Q.MXFP4, width), GGUF_MXFP4_ROWS16: to_rows16(data, Q.MXFP4, width)}
    for layout, blocks in layouts.items():
        values = torch.empty(rows, width)
        widen(blocks.data_ptr(), layout, width, rows, 0, rows, values.data_ptr())
        assert torch.equal(values.double(), file_values(data, Q.MXFP4, width)), FORMAT_NAMES[layout]
    if native.library().loom_k_quant_super_blocks_exact():
        x = torch.randn(9, width, generator=torch.Generator().manual_seed(13))
        products = [BlockLinear.of_blocks(blocks, width)(x) for blocks in layouts.values()]
        assert torch.equal(*products)

def expected_product(x: torch.Tensor, data: np.ndarray, kind: Q, width: int) -> torch.Tensor:
    """float64's product over a tensor's values: of the input rounded to 8-bit blocks for a block
    format, of the input itself for a float matrix (rounded to bfloat16 for BF16 where the kernels
    take bfloat16 dot products)."""
    if kind not in FLOATS:
        x = round_activations(x, rounding(block_format(kind)))
    elif kind == Q.BF16 and rounds_input_to_bfloat16():
        x = x.to(torch.bfloat16)
    return x.double() @ file_values(data, kind, width).T


@needs_kernels
@pytest.mark.parametrize("kind", NATIVE + EXACT + FLOATS, ids=lambda k: k.name)
def test_an_embedding_lookup_widens_the_files_values(kind):
    """A table kept in a file's format (a GGUF's token_embd) widens the rows it looks up to the very
    values gguf-py reads from the file."""
    width, rows = 512, 20
    data = random_tensor(kind, rows=rows, width=width, seed=4)
    table = BlockEmbedding(to_blocks(data, kind, width), rows, width, block_format(kind))
    ids = torch.tensor([[3, 0], [19, 3]])
    assert torch.equal(table(ids).double(), file_values(data, kind, width)[ids])


@needs_kernels
@pytest.mark.parametrize("kind", FLOATS, ids=lambda k: k.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 18, 34, 40, 200])
def test_float_matrices_are_kept_and_their_products_take_the_input_as_it_is(kind, rows):
    """A float matrix (F32, F16, BF16) is a view of the file, and its products (a few rows at a time, and the
    panels) equal float64's over its values, the input as it is (BF16: rounded to bfloat16 where the kernels take
    bfloat16 dot products)."""
    width, out = 512, 93  # a partial tile of the panels; an odd weight row a few rows at a time
    rng = np.random.default_rng(rows)
    data = gguf_quantize(rng.standard_normal((out, width)).astype(np.float32), kind).reshape(out, -1)
    blocks = to_blocks(data, kind, width)
    assert blocks.data_ptr() == data.ctypes.data and blocks.shape == (out, width)
    layer = BlockLinear.of_blocks(blocks, width)
    assert layer.formats == (block_format(kind),) == ({Q.F32: FLOAT32, Q.F16: FLOAT16, Q.BF16: BFLOAT16}[kind],)
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows))
    expected = expected_product(x, data, kind, width)
    assert torch.allclose(layer(x).double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 18, 40, 200])
def test_float32_rows_padded_multiply_and_widen_as_the_files_own(rows):
    """A float32 matrix whose rows are 4 KiB long laid out with its rows padded (FLOAT32_PADDED): the
    same values, zeros past them, and its products (a few rows at a time, the panels, two spread tasks
    and a partial one) and lookups equal the file's matrix's, to the bit where both run on Loom's kernel."""
    width, out = 1024, 2 * 96 + 11
    data = np.random.default_rng(rows).standard_normal((out, width)).astype(np.float32)
    blocks = to_blocks(data, Q.F32, width)
    assert pads_rows(blocks) == bool(native.library().loom_pads_float_rows())
    assert not pads_rows(blocks[:, :width - GROUP].contiguous())  # rows not a multiple of 4 KiB
    padded = padded_rows(blocks)
    values = padded.view(torch.float32)
    assert torch.equal(values[:, :width], blocks) and not values[:, width:].any()
    layer, plain = BlockLinear.of_blocks(padded, width), BlockLinear.of_blocks(blocks, width)
    assert layer.formats == (FLOAT32_PADDED,)
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows))
    if rows <= KERNEL_ROWS:  # both on Loom's kernel
        assert torch.equal(layer(x), plain(x))
    else:  # the file's rows on oneDNN, whose order of sums is its own; the padded ones on the panels
        assert torch.allclose(layer(x), plain(x), rtol=1e-5, atol=1e-4)
    ids = torch.tensor([[17, 0], [out - 1, 17]])
    assert torch.equal(BlockEmbedding(padded, out, width, FLOAT32_PADDED)(ids), blocks[ids])


@needs_kernels
def test_a_float32_files_4_kib_rows_are_padded_where_the_build_takes_them_so(tmp_path, monkeypatch):
    """The layers' F32 matrices whose rows are 4 KiB long (1024 values) are laid out padded on AVX2
    builds (kept as they lie on AVX-512), the narrower ones and the tied table as they lie, and the
    greedy tokens equal the file widened to float32. Where the copies would take more than half of
    the memory available, every matrix stays where it lies."""
    path = float_file(tmp_path / "wide.gguf", Q.F32, hidden=1024)
    model = models.load(path).model
    wide = FLOAT32_PADDED if native.library().loom_pads_float_rows() else FLOAT32
    assert model.layers[0].attn.qkv.formats == (wide,) * 3 and model.layers[1].mlp.gate_up.formats == (wide,) * 2
    assert model.layers[0].mlp.down.formats == (FLOAT32,) and model.lm_head.formats == (FLOAT32,)
    assert greedy_tokens(path, "stored", [12, 9, 6, 3]) == greedy_tokens(path, "float32", [12, 9, 6, 3])
    copies = 2 * (1024 + 512 + 512 + 1024 + 2 * 256) * (1024 + 16) * 4  # q, k, v, o, gate, up of two layers
    monkeypatch.setattr(models.checkpoints.gguf, "available_memory", lambda: 2 * copies - 1)
    tight = models.load(path).model
    assert tight.layers[0].attn.qkv.formats == (FLOAT32,) * 3 and tight.layers[1].mlp.gate_up.formats == (FLOAT32,) * 2
    monkeypatch.setattr(models.checkpoints.gguf, "available_memory", lambda: 2 * copies)
    assert models.load(path).model.layers[0].attn.qkv.formats == (wide,) * 3


# each layer's formats, and the output layer's and embeddings' (attn_output is F16 or BF16: a float product)
MIXED_LAYERS = [{"attn_q": Q.Q4_0, "attn_k": Q.Q4_K, "attn_v": Q.Q4_1, "attn_output": Q.F16, "ffn_gate": Q.IQ4_NL,
                 "ffn_up": Q.Q8_0, "ffn_down": Q.Q5_K},
                {"attn_q": Q.Q3_K, "attn_k": Q.Q5_1, "attn_v": Q.Q2_K, "attn_output": Q.BF16, "ffn_gate": Q.Q5_0,
                 "ffn_up": Q.Q6_K, "ffn_down": Q.Q4_K}]
MIXED_GLOBAL = {"token_embd.weight": Q.Q8_0, "output.weight": Q.IQ4_XS}
# transformers' names of llama.cpp's
MIXED_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
# random codes: scales for weights of about +-0.2
MIXED_HALF_RANGE = {Q.Q2_K: (3e-3, 6e-3), Q.Q3_K: (1e-3, 2e-3), Q.Q4_K: (4e-4, 1.2e-3), Q.Q5_K: (2e-4, 6e-4),
                    Q.Q6_K: (3e-5, 6e-5), Q.IQ4_NL: (1e-3, 2e-3), Q.IQ4_XS: (3e-5, 6e-5)}


def mixed_products(layers=2) -> dict[str, Q]:
    """The block products of the file mixed_gguf writes, by the reference's module names."""
    products = {"lm_head": MIXED_GLOBAL["output.weight"]}
    for i in range(layers):
        for part, kind in MIXED_LAYERS[i % len(MIXED_LAYERS)].items():
            if kind not in (Q.F16, Q.BF16):
                products[f"model.layers.{i}.{MIXED_NAMES[part]}"] = kind
    return products


def llama_writer(path, layers, hidden, inner, heads, kv_heads, vocab, arch="llama"):
    """A GGUF writer for a Llama (or ``arch``: Qwen2's) of these sizes, its metadata written, its
    tensors to add."""
    import gguf
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in [("block_count", layers), ("context_length", 256), ("embedding_length", hidden),
                       ("feed_forward_length", inner), ("attention.head_count", heads),
                       ("attention.head_count_kv", kv_heads), ("vocab_size", vocab)]:
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 0)
    return writer


def finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def mixed_gguf(path, layers=2, hidden=256, inner=512, heads=4, kv_heads=2, vocab=320):
    """A random Llama in a GGUF file whose tensors take the formats of MIXED_LAYERS and MIXED_GLOBAL
    (norms in F32), and the float64 weights (transformers' names and layout) the file's values stand for."""
    writer = llama_writer(path, layers, hidden, inner, heads, kv_heads, vocab)
    shapes = {"token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden), "attn_q": (hidden, hidden),
              "attn_k": (hidden // heads * kv_heads, hidden), "attn_v": (hidden // heads * kv_heads, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (inner, hidden), "ffn_up": (inner, hidden),
              "ffn_down": (hidden, inner)}
    rng = np.random.default_rng(0)
    state = {}

    def add(name, ours, kind, shape, scale=0.2):
        values = (rng.standard_normal(shape) * scale).astype(np.float32)
        if kind in (Q.F32, Q.F16):
            raw = values.astype(np.float16 if kind == Q.F16 else np.float32)
            writer.add_tensor(name, raw)
            state[ours] = torch.from_numpy(raw.astype(np.float64))
            return
        if kind in MIXED_HALF_RANGE:
            raw = random_tensor(kind, *shape, seed=len(state), half_range=MIXED_HALF_RANGE[kind])
        else:
            raw = gguf_quantize(values, kind)
        writer.add_tensor(name, raw, raw_dtype=kind)
        state[ours] = file_values(raw, kind, shape[1])

    for name, kind in MIXED_GLOBAL.items():
        add(name, MIXED_NAMES[name], kind, shapes[name])
    add("output_norm.weight", "model.norm.weight", Q.F32, (hidden,))
    for i in range(layers):
        for part, kind in MIXED_LAYERS[i % len(MIXED_LAYERS)].items():
            add(f"blk.{i}.{part}.weight", f"model.layers.{i}.{MIXED_NAMES[part]}.weight", kind, shapes[part])
        add(f"blk.{i}.attn_norm.weight", f"model.layers.{i}.input_layernorm.weight", Q.F32, (hidden,))
        add(f"blk.{i}.ffn_norm.weight", f"model.layers.{i}.post_attention_layernorm.weight", Q.F32, (hidden,))
    finish(writer)
    for i in range(layers):  # llama.cpp's converter interleaves Q/K rows for its rotary: undone for transformers
        for part, count in (("q_proj", heads), ("k_proj", kv_heads)):
            name = f"model.layers.{i}.self_attn.{part}.weight"
            rows, cols = state[name].shape
            state[name] = state[name].reshape(count, rows // count // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inner,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                      max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
    reference = transformers.LlamaForCausalLM(config).to(torch.float64).eval()
    reference.load_state_dict(state)
    return reference


def rounding_inputs(reference, spans: dict[str, int]):
    """Hooks on ``reference``'s linear layers that round their input to 8 bits as Loom's block
    products do, ``spans[name]`` values under a scale (in float64: a value may rarely round to the
    other side of a tie than in Loom's float32, a difference of one step of one value); layers
    spans does not name stay float."""
    def round64(span):
        def hook(module, args):
            x = args[0]
            spans_of_x = x.reshape(*x.shape[:-1], -1, span)
            step = spans_of_x.abs().amax(-1, keepdim=True) / 127
            return (torch.round(spans_of_x / torch.where(step > 0, step, 1)) * step).reshape(x.shape),
        return hook

    for name, module in reference.named_modules():
        span = next((span for suffix, span in spans.items() if name.endswith(suffix)), None)
        if isinstance(module, torch.nn.Linear) and span is not None:
            module.register_forward_pre_hook(round64(span))


NEAR_TIE = 5e-3


@needs_kernels
def test_a_file_of_mixed_formats_runs_in_them_and_equals_float64_over_its_values(tmp_path):
    reference = mixed_gguf(tmp_path / "mixed.gguf")
    rounding_inputs(reference, {name: rounding(block_format(kind)) for name, kind in mixed_products().items()})
    model = models.load(tmp_path / "mixed.gguf").model
    kinds = {name: type(module).__name__ for name, module in model.named_modules()}
    assert kinds["embed"] == "BlockEmbedding" and kinds["lm_head"] == "BlockLinear"
    assert kinds["layers.0.attn.qkv"] == "BlockLinear" and kinds["layers.0.attn.out"] == "BlockLinear"
    # the float matrices as the file has them: its float16 and bfloat16 numbers
    assert model.layers[0].attn.out.formats == (FLOAT16,) and model.layers[1].attn.out.formats == (BFLOAT16,)
    # fused products keep their parts (no copy), each in its own format: the Q4_K ones with sixteen
    # rows side by side where the build multiplies them so, else read from the file
    # (Q4_0, Q4_1 and Q5_0 likewise; Q6_K with AVX2 alone; Q8_0 with AVX2 or VNNI; IQ4_NL and IQ4_XS, the gate and
    # this file's output layer, with VNNI, else Loom's IQ4 blocks)
    q4_k = GGUF_Q4_K_ROWS16 if multiplies_rows16(GGUF_Q4_K_ROWS16) else GGUF_Q4_K
    q8_0 = GGUF_Q8_0_ROWS16 if multiplies_rows16(GGUF_Q8_0_ROWS16) else LOOM_8BIT
    q4_1 = GGUF_Q4_1_ROWS16 if multiplies_rows16(GGUF_Q4_1_ROWS16) else LOOM_4BIT
    q6_k = GGUF_Q6_K_ROWS16 if multiplies_rows16(GGUF_Q6_K_ROWS16) else GGUF_Q6_K
    q5_0 = GGUF_Q5_0_ROWS16 if multiplies_rows16(GGUF_Q5_0_ROWS16) else LOOM_5BIT
    assert model.layers[0].attn.qkv.formats == (q4_1, q4_k, q4_1)
    iq4 = GGUF_IQ4_ROWS16 if multiplies_rows16(GGUF_IQ4_ROWS16) else LOOM_IQ4
    assert model.layers[0].mlp.gate_up.formats == (iq4, q8_0) and model.lm_head.formats == (iq4,)
    assert model.embed.format == q8_0
    q5_k = GGUF_Q5_K_ROWS16 if multiplies_rows16(GGUF_Q5_K_ROWS16) else GGUF_Q5_K
    assert model.layers[0].mlp.down.formats == (q5_k,)
    assert model.layers[1].attn.qkv.formats == (GGUF_Q3_K, LOOM_5BIT, GGUF_Q2_K)
    assert model.layers[1].mlp.gate_up.formats == (q5_0, q6_k) and model.layers[1].mlp.down.formats == (q4_k,)
    assert model.decoder_layers is not None  # decode steps on the fused native layers
    prompts = [[5 + i, 17, 200 - i, 33, 8] for i in range(6)]
    with Engine.from_pretrained(tmp_path / "mixed.gguf") as engine:
        handles = [engine.launch_response_tokens(p, GenerationConfig(max_new_tokens=16, ignore_eos=True))
                   for p in prompts]
        ours = [list(engine.stream_response_tokens(h, timeout=60)) for h in handles]
    # (with Q5_K in the file, one prompt's 16th token: 0.0024 apart)
    assert_greedy_but_near_ties(reference, prompts, ours)


def assert_greedy_but_near_ties(reference, prompts, ours, near_tie: float = NEAR_TIE) -> None:
    """Loom's greedy answers ``ours`` equal ``reference``'s generate() up to a near tie of the
    reference: Loom sums in float32, and where the two best logits of a random model lie within
    ``near_tie`` either may win; all but one answer exact."""
    exact = 0
    for prompt, tokens in zip(prompts, ours):
        with torch.no_grad():
            theirs = reference.generate(torch.tensor([prompt]), max_new_tokens=len(tokens), do_sample=False,
                                        eos_token_id=None, pad_token_id=0, output_scores=True,
                                        return_dict_in_generate=True)
        expected = theirs.sequences[0, len(prompt):].tolist()
        differs = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
        if differs is None:
            exact += 1
            continue
        best = theirs.scores[differs][0].topk(2).values
        assert best[0] - best[1] < near_tie, (prompt, differs, tokens, expected)
    assert exact >= len(prompts) - 1


@needs_kernels
@pytest.mark.parametrize("kind", FLOATS, ids=lambda k: k.name)
def test_a_float_file_keeps_one_tied_table_and_float32s_tokens(tmp_path, kind):
    """Every matrix of the file in one float type and no output.weight (the output layer tied to the
    embeddings, as SmolLM2's files are): one table serves both, the fused products keep their parts
    (the values' a view of the file), and greedy tokens equal the file widened to float32, whose
    values are the same."""
    path = float_file(tmp_path / "tied.gguf", kind, hidden=128)
    model = models.load(path).model
    assert model.lm_head.formats == (block_format(kind),) and model.embed.format == block_format(kind)
    assert model.lm_head.blocks.data_ptr() == model.embed.blocks.data_ptr()
    assert model.layers[0].attn.qkv.formats == (block_format(kind),) * 3
    assert model.layers[0].mlp.gate_up.formats == (block_format(kind),) * 2
    # answers of 12, 9, 6 and 3 tokens: steps of 4 rows down to 1, on the panels and a few rows at a time
    assert greedy_tokens(path, "stored", [12, 9, 6, 3]) == greedy_tokens(path, "float32", [12, 9, 6, 3])


def greedy_tokens(path, weights: str, lengths: list[int]) -> list[list[int]]:
    """The file's greedy answers to a few short prompts, one of each length, run together."""
    with Engine.from_pretrained(path, weights=weights) as engine:
        handles = [engine.launch_response_tokens([3 + i, 40, 7 * i], GenerationConfig(max_new_tokens=n, ignore_eos=True))
                   for i, n in enumerate(lengths)]
        return [list(engine.stream_response_tokens(h, timeout=60)) for h in handles]


def float_file(path, kind: Q, hidden: int, inner: int = 256, vocab: int = 300, arch: str = "llama",
               biases: bool = False):
    """A random two-layer Llama (or Qwen2) whose every matrix is ``kind``, tied embeddings; with
    ``biases``, its attention's products have biases (in the file's layout)."""
    writer = llama_writer(path, 2, hidden, inner, 4, 2, vocab, arch)
    rng = np.random.default_rng(5)
    shapes = {"attn_q": (hidden, hidden), "attn_k": (hidden // 2, hidden), "attn_v": (hidden // 2, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (inner, hidden), "ffn_up": (inner, hidden),
              "ffn_down": (hidden, inner)}

    def add(name, shape):
        writer.add_tensor(name, gguf_quantize((rng.standard_normal(shape) * 0.1).astype(np.float32), kind),
                          raw_dtype=kind)

    add("token_embd.weight", (vocab, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(2):
        for part, shape in shapes.items():
            add(f"blk.{i}.{part}.weight", shape)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, np.float32))
        if biases:  # Qwen2's on q, k and v; a Llama's attention_bias on its output product too
            parts = ("attn_q", "attn_k", "attn_v") + (("attn_output",) if arch == "llama" else ())
            for part, (rows, _) in [(p, shapes[p]) for p in parts]:
                writer.add_tensor(f"blk.{i}.{part}.bias", (rng.standard_normal(rows) * 0.5).astype(np.float32))
    finish(writer)
    return path


@needs_kernels
@pytest.mark.parametrize("kind", [Q.F32, Q.Q8_0], ids=lambda k: k.name)
def test_a_qwen2_file_keeps_its_query_key_and_value_biases(tmp_path, kind):
    """Qwen2's q/k/v products carry biases (Qwen2.5's GGUF files): the fused product over the file's
    parts adds the file's (a zero input gives them back), and an F32 file's greedy tokens equal
    weights="float32"'s, which widens every tensor (a block format's rounded input may part from it at
    a near tie)."""
    path = float_file(tmp_path / "qwen2.gguf", kind, hidden=128, arch="qwen2", biases=True)
    qkv = models.load(path).model.layers[0].attn.qkv
    q8_0 = GGUF_Q8_0_ROWS16 if multiplies_rows16(GGUF_Q8_0_ROWS16) else LOOM_8BIT  # (sixteen rows side by side)
    assert qkv.formats == ({Q.F32: FLOAT32, Q.Q8_0: q8_0}[kind],) * 3
    from models.checkpoints.gguf_file import GGUFFile
    tensors = GGUFFile(path).tensors
    biases = np.concatenate([tensors[f"blk.0.{part}.bias"].data.view(np.float32).ravel()
                             for part in ("attn_q", "attn_k", "attn_v")])
    assert torch.equal(qkv(torch.zeros(2, 128)), torch.from_numpy(biases).expand(2, -1))
    if kind != Q.F32:
        return
    assert greedy_tokens(path, "stored", [8] * 3) == greedy_tokens(path, "float32", [8] * 3)


@needs_kernels
def test_float_rows_of_part_blocks_stay_float32_copies(tmp_path):
    """An F32 file 48 values wide: the matrices whose rows are not whole blocks of 32 (embeddings, q/k/v,
    gate/up) are float32 copies on the float layers, the 256-wide down product a part as the file has
    it, and greedy tokens equal weights="float32"'s."""
    path = float_file(tmp_path / "narrow.gguf", Q.F32, hidden=48)
    model = models.load(path).model
    assert type(model.embed).__name__ == "Embedding" and type(model.layers[0].attn.qkv).__name__ == "CpuLinear"
    assert model.layers[0].mlp.down.formats == (FLOAT32,)
    assert greedy_tokens(path, "stored", [8] * 3) == greedy_tokens(path, "float32", [8] * 3)


@needs_kernels
def test_a_llama_files_query_and_key_biases_are_unpermuted_with_their_rows(tmp_path):
    """llama.cpp's converter permutes a Llama's query and key rows for its rotary, biases too: the
    products Loom reads back equal the un-permuted weights' and biases' (transformers' layout)."""
    path = float_file(tmp_path / "biases.gguf", Q.F32, hidden=128, biases=True)
    qkv = models.load(path).model.layers[0].attn.qkv
    from models.checkpoints.gguf_file import GGUFFile
    tensors = GGUFFile(path).tensors

    def unpermuted(name, heads=None):  # None: as the file has it (the values)
        values = tensors[name].data.view(np.float32).reshape(tensors[name].shape).astype(np.float64)
        if heads is not None:
            rows = values.shape[0]
            values = values.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(values.shape)
        return torch.from_numpy(np.ascontiguousarray(values))

    weight = torch.cat([unpermuted("blk.0.attn_q.weight", 4), unpermuted("blk.0.attn_k.weight", 2),
                        unpermuted("blk.0.attn_v.weight")])
    bias = torch.cat([unpermuted("blk.0.attn_q.bias", 4), unpermuted("blk.0.attn_k.bias", 2),
                      unpermuted("blk.0.attn_v.bias")])
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(qkv(x).double(), x.double() @ weight.T + bias, atol=1e-5)


def test_weights_float32_still_widens_every_tensor(tmp_path):
    mixed_gguf(tmp_path / "mixed.gguf", layers=1)
    model = models.load(tmp_path / "mixed.gguf", weights="float32").model
    assert not any(b.dtype == torch.uint8 for b in model.buffers()) and type(model.embed).__name__ == "Embedding"


def _has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " avx2 " in next(line for line in f if line.startswith("flags")) + " "
    except (OSError, StopIteration):
        return False


@needs_kernels
@pytest.mark.skipif(not _has_avx2(), reason="an x86 processor with AVX2 runs the AVX2 build")
def test_an_avx2_build_computes_the_same_products(monkeypatch):
    """The kernels as a machine without AVX-512 builds them (-march=x86-64-v3: a block at a time,
    AVX2's byte products), whatever this machine has: every format's product against float64, in the
    file's layout and with sixteen rows side by side where that build lays the format out so."""
    native_build = native.build_name()
    monkeypatch.setenv(native.MARCH, "x86-64-v3")
    for loaded in ("_library", "_build_name"):  # built and loaded anew; the old one comes back after
        monkeypatch.setattr(native, loaded, False if loaded == "_library" else None)
    assert native.library() is not None and native.build_name() not in (None, native_build)
    for kind in NATIVE + [Q.Q4_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL] + FLOATS:
        data = random_tensor(kind, rows=48, width=512, seed=3)
        for blocks in (to_blocks(data, kind, 512), to_rows16(data, kind, 512)):
            if blocks is None:  # (no such layout in this build)
                continue
            layer = BlockLinear.of_blocks(blocks, 512)
            for rows in (1, 5, 12, 40):
                x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
                expected = expected_product(x, data, kind, 512)
                assert torch.allclose(layer(x).double(), expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
