"""Linear layers and embeddings whose weights are kept in blocks (block_codes.h's formats): Loom's 4-,
5- and 8-bit blocks of 32 values with a scale each, as llama.cpp's Q4_1, Q5_1 and Q8_0 files keep
them (weights="int4" and "int8", and GGUF files' Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/IQ4 rearranged), and GGUF's
K-quant super-blocks (Q2_K to Q6_K) as the file has them; multiplied by Loom's own kernel (block_weights.h), which
rounds the input to 8 bits first (round_activations: a scale per 32 values, per 256 for the
K-quants), as llama.cpp does. ("int8" keeps
every linear layer in the 8-bit blocks described below for the output layer.)

A layer's weights take 4-bit codes with a scale and a minimum per block (0.75 bytes a value against
float32's 4; w = scale q + min), the output layer 8-bit codes with a scale (1.125 bytes), as
llama.cpp's Q4 files keep theirs: the logits are what sampling reads, and a vocabulary-wide product
is where 4 bits lose the most. The token embeddings take 8-bit blocks too (the output layer's, where
the two are tied). A layer whose input width is not a multiple of 32 keeps float32 weights (a
CpuLinear).

Quantizing (weights="int4"/"int8") is round-to-nearest from the float weights. A GGUF file's blocks
come in as they are instead (weights="stored", block_formats.py: BlockLinear.of_blocks).
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from ..pages import fresh_zeros
from . import native
from .cpu_linear import KERNEL_ROWS, CpuLinear, large_product

GROUP = 32  # values per block (block_codes.h)
# block_codes.h's formats; Loom's own are named by their bits
LOOM_4BIT, LOOM_5BIT, LOOM_8BIT = 4, 5, 8
# IQ4_NL's and IQ4_XS's numbers: LOOM_4BIT's nibbles, indices into IQ4's sixteen values, then a float32
# scale and a signed byte multiplying it a block (21 bytes a block: block_codes.h's LoomIQ4)
LOOM_IQ4 = 25
GGUF_Q2_K, GGUF_Q3_K, GGUF_Q4_K, GGUF_Q5_K, GGUF_Q6_K = 10, 11, 12, 13, 14
# Q4_K's, Q8_0's, Q4_1's (Q4_0's), Q5_0's, Q5_K's, Q6_K's and IQ4's numbers with sixteen rows side by
# side (block_interleaved.h; MXFP4's below), made at load where the build multiplies them (block_formats.to_rows16)
GGUF_Q4_K_ROWS16, GGUF_Q8_0_ROWS16, GGUF_Q4_1_ROWS16, GGUF_Q6_K_ROWS16 = 18, 19, 20, 21
GGUF_Q5_0_ROWS16, GGUF_Q5_K_ROWS16, GGUF_IQ4_ROWS16 = 23, 24, 26
# MXFP4 as the file lays it out (gpt-oss's experts): an exponent byte and sixteen bytes of 4-bit codes a
# block of 32 values (block_codes.h's MXFP4); and with sixteen rows side by side, its 17 bytes a row's block
# and a spare byte a row (a row's bytes tell it from the file's layout, and from Q4_K's 18 a block)
GGUF_MXFP4, GGUF_MXFP4_ROWS16 = 27, 28
# a row's bytes of a block of 32 values in GGUF_Q8_0_ROWS16, GGUF_Q4_1_ROWS16, GGUF_Q5_0_ROWS16 (the
# files' own: the codes, a float16 scale, and for Q4_1 a float16 minimum; Q5_0's a spare byte besides,
# its rows told apart from Q5_K's by their size: stored_format), GGUF_IQ4_ROWS16 (the codes, d, and
# IQ4_XS's sub-scale a block) and GGUF_MXFP4 (the file's)
BLOCK_BYTES = {GGUF_Q8_0_ROWS16: 34, GGUF_Q4_1_ROWS16: 20, GGUF_Q5_0_ROWS16: 23, GGUF_IQ4_ROWS16: 19, GGUF_MXFP4: 17}
# not blocks: a GGUF file's float matrices (F32, F16, BF16) as it keeps them, the 16-bit ones widened
# as the products read them
FLOAT32, FLOAT16, BFLOAT16 = 0, 16, 17
# a file's float32 rows a multiple of 4 KiB long, laid out at load ROW_PAD values longer where the
# build's panels take them so (padded_rows)
FLOAT32_PADDED, ROW_PAD = 22, 16
FLOAT_FORMATS = {torch.float32: FLOAT32, torch.float16: FLOAT16, torch.bfloat16: BFLOAT16}  # told by the dtype
# values and bytes of a K-quant's super-block (a row's share of one, for the K-quants side by side)
SUPER_BLOCKS = {GGUF_Q2_K: (256, 84), GGUF_Q3_K: (256, 110), GGUF_Q4_K: (256, 144), GGUF_Q5_K: (256, 176),
                GGUF_Q6_K: (256, 210), GGUF_Q4_K_ROWS16: (256, 148), GGUF_Q5_K_ROWS16: (256, 180),
                GGUF_Q6_K_ROWS16: (256, 212)}
FORMAT_NAMES = {LOOM_4BIT: "4-bit blocks", LOOM_5BIT: "5-bit blocks", LOOM_8BIT: "8-bit blocks",
                LOOM_IQ4: "IQ4 blocks", GGUF_Q2_K: "Q2_K",
                GGUF_Q3_K: "Q3_K", GGUF_Q4_K: "Q4_K", GGUF_Q5_K: "Q5_K", GGUF_Q6_K: "Q6_K",
                GGUF_Q4_K_ROWS16: "Q4_K (16 rows side by side)", GGUF_Q5_K_ROWS16: "Q5_K (16 rows side by side)",
                GGUF_Q8_0_ROWS16: "Q8_0 (16 rows side by side)",
                GGUF_Q4_1_ROWS16: "Q4_0/Q4_1 (16 rows side by side)",
                GGUF_Q5_0_ROWS16: "Q5_0 (16 rows side by side)", GGUF_Q6_K_ROWS16: "Q6_K (16 rows side by side)",
                GGUF_IQ4_ROWS16: "IQ4_NL/IQ4_XS (16 rows side by side)", GGUF_MXFP4: "MXFP4",
                GGUF_MXFP4_ROWS16: "MXFP4 (16 rows side by side)",
                FLOAT32: "float32", FLOAT16: "float16", BFLOAT16: "bfloat16",
                FLOAT32_PADDED: f"float32 ({ROW_PAD} values padded)"}
WITH_MINIMUMS = (LOOM_4BIT, LOOM_5BIT)  # Loom's blocks that keep a float32 minimum beside each scale
OUTPUT_BITS = LOOM_8BIT  # the output layer's and the token embeddings' (the layers': quantized.BLOCK_WEIGHTS)

_int64, _pointer = ctypes.c_int64, ctypes.c_void_p
ARGTYPES = [_pointer, _int64, _int64, _pointer, _int64, _pointer, _int64, _int64, _pointer, _int64]
WIDEN_ARGTYPES = [_pointer, _int64, _int64, _int64, _int64, _int64, _pointer]
LOOKUP_ARGTYPES = [_pointer, _int64, _int64, _int64, _pointer, _int64, _pointer]
ROUND_ARGTYPES = [_pointer, _int64, _int64, _int64, _pointer, _int64]


def row_bytes(width: int, format: int) -> int:
    """Bytes of one row of ``width`` values in ``format``: for Loom's blocks its codes, its float32
    scales and, for 4 and 5 bits, its float32 minimums (LOOM_IQ4: its nibbles, then a float32 and a
    byte a block); for a K-quant its super-blocks (block_codes.h), for MXFP4 its blocks (GGUF_MXFP4_ROWS16:
    and a spare byte); for float rows their values (FLOAT32_PADDED: and ROW_PAD more)."""
    if format == FLOAT32_PADDED:
        return torch.float32.itemsize * (width + ROW_PAD)
    for dtype, kept in FLOAT_FORMATS.items():
        if format == kept:
            return dtype.itemsize * width
    if format in SUPER_BLOCKS:
        values, size = SUPER_BLOCKS[format]
        return width // values * size
    if format in BLOCK_BYTES:
        return width // GROUP * BLOCK_BYTES[format]
    if format == GGUF_MXFP4_ROWS16:
        return width // GROUP * BLOCK_BYTES[GGUF_MXFP4] + 1
    if format == LOOM_IQ4:
        return width // 2 + width // GROUP * 5
    return width * format // 8 + width // GROUP * (8 if format in WITH_MINIMUMS else 4)


ROWS16 = 16  # the weight rows the ROWS16 layouts lay side by side
# each layout with rows side by side: the format it is made from, its name in the kernels' symbols,
# and the processors it is built for
ROWS16_LAYOUTS = {GGUF_Q4_K_ROWS16: (GGUF_Q4_K, "q4_k", "AVX-512, or AVX2 with FMA and F16C"),
                  GGUF_Q5_K_ROWS16: (GGUF_Q5_K, "q5_k", "AVX-512, or AVX2 with FMA and F16C"),
                  GGUF_Q8_0_ROWS16: (LOOM_8BIT, "q8_0", "AVX-512 with VNNI, or AVX2 with FMA and F16C"),
                  GGUF_Q4_1_ROWS16: (LOOM_4BIT, "q4_1", "AVX-512, or AVX2 with FMA and F16C"),
                  GGUF_Q5_0_ROWS16: (LOOM_5BIT, "q5_0", "AVX-512, or AVX2 with FMA and F16C"),
                  GGUF_Q6_K_ROWS16: (GGUF_Q6_K, "q6_k", "AVX2 with FMA and F16C, without AVX-512"),
                  GGUF_IQ4_ROWS16: (LOOM_IQ4, "iq4", "AVX-512 with VNNI, or AVX2 with FMA and F16C"),
                  GGUF_MXFP4_ROWS16: (GGUF_MXFP4, "mxfp4", "AVX-512 with VNNI, or AVX2 with FMA and F16C")}
ROWS16_LAYOUT_OF = {source: layout for layout, (source, _, _) in ROWS16_LAYOUTS.items()}  # by source format


def multiplies_rows16(layout: int) -> bool:
    """Whether the kernels are built for ``layout`` (Q4_K's, Q5_K's, Q4_1's and Q5_0's: AVX-512, or AVX2 with
    FMA and F16C; Q8_0's, IQ4's and MXFP4's: AVX-512 with VNNI, or AVX2 with FMA and F16C; Q6_K's: AVX2 without AVX-512,
    whose products over Q6_K take pairs of blocks and the tiles)."""
    library = native.library()
    return library is not None and bool(getattr(library, f"loom_multiplies_{ROWS16_LAYOUTS[layout][1]}_rows16")())


def pads_rows(weight: torch.Tensor) -> bool:
    """Whether this build multiplies ``weight`` faster as FLOAT32_PADDED (padded_rows): a float32
    matrix whose rows are a multiple of 4 KiB long, on AVX2 or AVX-512 (cpu_linear.h's
    StoredWeights says why, PADS_FLOAT_ROWS where)."""
    library = native.library()
    return (library is not None and library.loom_pads_float_rows() and weight.dtype == torch.float32
            and weight.dim() == 2 and weight.shape[1] * weight.element_size() % 4096 == 0)


def padded_rows(weight: torch.Tensor) -> torch.Tensor:
    """A float32 matrix [rows, width] as FLOAT32_PADDED: bytes [rows, row_bytes(width,
    FLOAT32_PADDED)], each row's values then ROW_PAD zeros (a copy, the same numbers)."""
    rows, width = weight.shape
    out = fresh_zeros(rows * row_bytes(width, FLOAT32_PADDED)).view(rows, -1)
    out.view(torch.float32)[:, :width].copy_(weight)
    return out


def rounding(format: int) -> int:
    """How many input values a product over ``format`` rounds under one scale: 32, or a K-quant's
    256-value super-block (as llama.cpp's Q8_K, which lets the kernel keep a super-block's sums in
    integers)."""
    return SUPER_BLOCKS[format][0] if format in SUPER_BLOCKS else GROUP


def rounds_input_to_bfloat16() -> bool:
    """Whether the kernels' products over bfloat16 weights (a GGUF file's BF16 tensors) round their
    input to bfloat16, as llama.cpp's do: where the processor has AVX-512's bfloat16 dot products
    (cpu_linear.h's bfloat16_linear_rows). Elsewhere they widen the weights and take the input as it is."""
    library = native.library()
    return library is not None and bool(library.loom_bfloat16_dots())


def round_activations(x: torch.Tensor, span: int = GROUP) -> torch.Tensor:
    """x [..., in] as the values of its 8-bit rounding, which block products multiply: per ``span``
    values (rounding(format)) a scale d = max |x| / 127 and codes round(x / d), half to even
    (block_weights.h's round_span: the same float32 arithmetic)."""
    spans = x.float().reshape(*x.shape[:-1], -1, span)
    top = spans.abs().amax(-1, keepdim=True)
    inverse = torch.where(top > 0, torch.full_like(top, 127) / top, 0)  # (127 / top is 127 times 1 / top)
    return (torch.round(spans * inverse) * (top / 127)).reshape(x.shape)


def quantize(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """A [out, in] float weight (in a multiple of GROUP) as block_weights.h's one byte buffer: row by
    row, the row's codes, its scales, and for 4 bits its minimums."""
    out, width = weight.shape
    blocks = weight.detach().float().reshape(out, width // GROUP, GROUP)
    if bits == 4:
        low, high = blocks.amin(-1), blocks.amax(-1)
        scales = (high - low) / 15
        inverse = torch.where(scales > 0, 1 / scales, 0)
        codes = ((blocks - low[..., None]) * inverse[..., None]).round().clamp(0, 15).to(torch.uint8)
        codes = codes[..., :GROUP // 2] | (codes[..., GROUP // 2:] << 4)  # byte j: values j and j + 16
        parts = [codes, scales, low]
    elif bits == 8:
        scales = blocks.abs().amax(-1) / 127
        inverse = torch.where(scales > 0, 1 / scales, 0)
        codes = (blocks * inverse[..., None]).round().clamp(-127, 127).to(torch.int8)
        parts = [codes, scales]
    else:
        raise ValueError(f"blocks hold 4- or 8-bit codes, not {bits}")
    return torch.cat([part.contiguous().view(torch.uint8).reshape(out, -1) for part in parts], dim=1).flatten()


def dequantize(blocks: torch.Tensor, bits: int, out: int, width: int) -> torch.Tensor:
    """The float32 [out, in] weight a buffer of Loom's blocks stands for (the reference the tests check
    the kernel, quantize and block_formats' rearrangements against)."""
    rows = blocks.view(out, -1)
    if bits == LOOM_IQ4:
        return _iq4_values(rows, out, width)
    code_bytes, groups = width * bits // 8, width // GROUP
    codes = rows[:, :code_bytes]
    scales = rows[:, code_bytes:code_bytes + 4 * groups].contiguous().view(torch.float32)[..., None]
    if bits in WITH_MINIMUMS:
        nibbles = codes[:, :width // 2].reshape(out, groups, GROUP // 2)
        values = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).int()
        if bits == LOOM_5BIT:  # each block's 32 fifth bits after the nibbles, bit j for value j
            high = codes[:, width // 2:].contiguous().view(torch.int32).reshape(out, groups, 1)
            values |= ((high >> torch.arange(GROUP, dtype=torch.int32)) & 1) << 4
        mins = rows[:, code_bytes + 4 * groups:].contiguous().view(torch.float32)[..., None]
        return (values.float() * scales + mins).reshape(out, width)
    return (codes.contiguous().view(torch.int8).view(out, groups, GROUP).float() * scales).reshape(out, width)


IQ4_VALUES = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])


def _iq4_values(rows: torch.Tensor, out: int, width: int) -> torch.Tensor:
    """dequantize for LOOM_IQ4: each nibble's value of IQ4_VALUES times its block's d k."""
    groups = width // GROUP
    nibbles = rows[:, :width // 2].reshape(out, groups, GROUP // 2).long()
    values = IQ4_VALUES[torch.cat([nibbles & 15, nibbles >> 4], dim=-1)].float()
    scales = rows[:, width // 2:width // 2 + 4 * groups].contiguous().view(torch.float32)
    multipliers = rows[:, width // 2 + 4 * groups:].contiguous().view(torch.int8).float()
    return (values * (scales * multipliers)[..., None]).reshape(out, width)


class BlockLinear(nn.Module):
    """nn.Linear with its weight in blocks (float32 activations, on the CPU): one format, or up to
    three parts stacked by output rows, each in its own (a fused q/k/v whose parts a GGUF file keeps
    in different formats: Q4_K_M's Q6_K values beside Q4_K queries and keys). Every product runs on
    Loom's kernel, prefill chunks too: at 256 and 512 rows its panels over weights widened a tile at
    a time ran 1.1-1.3x faster than widening whole weights for oneDNN (one Zen 5 thread, 4096 x 2048,
    each format). The input is rounded to 8-bit blocks first, whatever the row count. A GGUF file's
    float32, float16 and bfloat16 matrices are parts too, kept as the file has them: their products
    take the input as it is (cpu_linear.h's, each 16-bit weight widened as it is read); past
    KERNEL_ROWS rows a float32 part takes oneDNN's product, as a CpuLinear does (1.7B shapes on two
    Zen 5 threads, 512 / 2048 rows: 205-216 / 202-217 GFLOP/s against the panels' 181-200 / 145-179).
    A FLOAT32_PADDED part stays on the panels at every count: oneDNN copied a strided weight view at
    every call, and on the AVX2 machines that pad (a Zen 3) the panels led it at 512 rows anyway."""

    def __init__(self, linear: nn.Linear, bits: int):
        super().__init__()
        if linear.in_features % GROUP:
            raise ValueError(f"block weights need an input width that is a multiple of {GROUP}, not {linear.in_features}")
        self._hold([quantize(linear.weight, bits).view(linear.out_features, -1)], [bits], linear.in_features,
                   linear.bias)

    @classmethod
    def of_blocks(cls, blocks: torch.Tensor | list[torch.Tensor], width: int,
                  bias: torch.Tensor | None = None) -> "BlockLinear":
        """A layer over blocks already in a kernel format, [out, bytes per row] (a GGUF file's,
        block_formats.py; the format is told by the row's bytes), or a list of such parts stacked by
        output rows, taken as they are."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        parts = blocks if isinstance(blocks, (list, tuple)) else [blocks]
        layer._hold(parts, [stored_format(part, width) for part in parts], width, bias)
        return layer

    def _hold(self, parts: list[torch.Tensor], formats: list[int], width: int, bias: torch.Tensor | None) -> None:
        for part, format in zip(parts, formats):
            if format in ROWS16_LAYOUTS and not multiplies_rows16(format):
                raise ValueError(f"{FORMAT_NAMES[format]} needs the kernels built for {ROWS16_LAYOUTS[format][2]}; "
                                 f"this build multiplies {FORMAT_NAMES[ROWS16_LAYOUTS[format][0]]} as they are")
            if format in ROWS16_LAYOUTS and part.shape[0] % ROWS16:
                raise ValueError(f"{FORMAT_NAMES[format]} comes in whole blocks of {ROWS16} rows, "
                                 f"not {part.shape[0]}")
        self.formats, self.rows = tuple(formats), tuple(part.shape[0] for part in parts)
        self.out_features, self.in_features = sum(self.rows), width
        for i, part in enumerate(parts):
            self.register_buffer(part_name(i), as_bytes(part).reshape(-1))
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)
        self.kernel = native.function("loom_block_linear", torch.float32, ARGTYPES)
        self.large = large_product(torch.float32)

    def parts(self) -> list[tuple[torch.Tensor, int, int]]:
        """(blocks, format, rows) of each part, in the order of their output rows."""
        return [(getattr(self, part_name(i)), f, rows) for i, (f, rows) in enumerate(zip(self.formats, self.rows))]

    @property
    def blocks(self) -> torch.Tensor:
        """The block buffer of a layer of one part."""
        if len(self.formats) != 1:
            raise AttributeError(f"a layer of {len(self.formats)} parts has no single block buffer; see parts()")
        return self.blocks_0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1 or rows.dtype != torch.float32:
            rows = rows.float().contiguous()
        y = torch.empty(rows.shape[0], self.out_features)
        if rows.shape[0]:
            first = 0
            for blocks, format, count in self.parts():
                if format == FLOAT32 and rows.shape[0] > KERNEL_ROWS:  # a long prefill chunk: as CpuLinear's
                    bias = None if self.bias is None else self.bias[first:first + count]
                    y[:, first:first + count] = self.large(rows, blocks.view(torch.float32).view(count, -1), bias)
                else:
                    bias = None if self.bias is None else self.bias[first:].data_ptr()
                    self.kernel(rows.data_ptr(), rows.stride(0), rows.shape[0], blocks.data_ptr(), format, bias,
                                self.in_features, count, y[:, first:].data_ptr(), self.out_features)
                first += count
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kinds = " | ".join(f"{rows} rows of {FORMAT_NAMES[f]}" for f, rows in zip(self.formats, self.rows))
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {kinds}"


def part_name(i: int) -> str:
    return f"blocks_{i}"


class BlockEmbedding(nn.Module):
    """nn.Embedding over a table of blocks (8-bit, or a GGUF file's own, sixteen rows side by side
    included): a lookup widens only the rows it reads. A tied table shares the output layer's blocks,
    so the model keeps one copy of it."""

    def __init__(self, blocks: torch.Tensor, num_embeddings: int, embedding_dim: int, format: int = OUTPUT_BITS):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.format = num_embeddings, embedding_dim, format
        self.register_buffer("blocks", as_bytes(blocks).reshape(-1))
        self.lookup = native.function("loom_block_lookup", torch.float32, LOOKUP_ARGTYPES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.flatten().long().contiguous()
        out = torch.empty(flat.shape[0], self.embedding_dim)
        if flat.shape[0]:
            low, high = (int(v) for v in torch.aminmax(flat))
            if low < 0 or high >= self.num_embeddings:
                raise IndexError(f"token ids must lie in [0, {self.num_embeddings}); got {low} to {high}")
            self.lookup(self.blocks.data_ptr(), self.format, self.embedding_dim, self.num_embeddings, flat.data_ptr(),
                        flat.shape[0], out.data_ptr())
        return out.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {FORMAT_NAMES[self.format]}"


def use_block_linears(model: nn.Module, layer_bits: int) -> None:
    """Swap every nn.Linear inside ``model`` for a BlockLinear: ``layer_bits``-bit codes in the layers
    (4 for weights="int4", 8 for "int8"), 8-bit in the output layer (``model.lm_head``); float32
    (CpuLinear) where the width is not a multiple of 32.
    The token embeddings (an nn.Embedding as wide as the vocabulary) take 8-bit blocks too, the
    output layer's own where the two are tied: a float32 table would otherwise be the largest thing
    a 4-bit model keeps (113 MB of the default model's 586 MiB)."""
    output = getattr(model, "lm_head", None)
    swapped = {}  # id of an original weight -> its BlockLinear

    def swap(module: nn.Module) -> None:
        for name, child in module.named_children():
            if isinstance(child, nn.Linear) and child.in_features % GROUP == 0:
                layer = BlockLinear(child, OUTPUT_BITS if child is output else layer_bits)
                swapped[id(child.weight)] = layer
                setattr(module, name, layer)
            elif isinstance(child, nn.Linear):
                setattr(module, name, CpuLinear(child))
            else:
                swap(child)

    def swap_embeddings(module: nn.Module) -> None:
        for name, child in module.named_children():
            if (isinstance(child, nn.Embedding) and output is not None and child.embedding_dim % GROUP == 0
                    and child.num_embeddings == output.out_features):
                tied = swapped.get(id(child.weight))
                blocks = tied.blocks if tied is not None and tied.formats == (OUTPUT_BITS,) else quantize(
                    child.weight, OUTPUT_BITS)
                setattr(module, name, BlockEmbedding(blocks, child.num_embeddings, child.embedding_dim))
            else:
                swap_embeddings(child)

    swap(model)
    swap_embeddings(model)


def use_stored_blocks(model: nn.Module, state: dict, float_rows: bool = False) -> None:
    """Swap each nn.Linear and nn.Embedding of ``model`` whose weight ``state`` holds as blocks (a
    uint8 [rows, bytes per row] tensor in a kernel format, or a list of such parts stacked by output
    rows: a checkpoint kept in its own formats) for a BlockLinear or BlockEmbedding over those very
    blocks. With ``float_rows`` (a GGUF file's, read to keep its formats), float32, float16 and
    bfloat16 matrices are kept as they are too (views of the mapped file, or FLOAT32_PADDED copies of
    it). ``state`` then names the blocks as the new modules do (as bytes), for load_state_dict. Tied
    tables stay one tensor."""
    for prefix, module in list(model.named_modules()):
        blocks = state.get(f"{prefix}.weight")
        if not isinstance(module, (nn.Linear, nn.Embedding)) or not (
                isinstance(blocks, list) or blocks is not None and runs_as_stored(blocks, float_rows)):
            continue
        parent_name, _, name = prefix.rpartition(".")
        parent = model.get_submodule(parent_name)
        state.pop(f"{prefix}.weight")
        if isinstance(module, nn.Linear):
            layer = BlockLinear.of_blocks(blocks, module.in_features, state.get(f"{prefix}.bias"))  # Qwen2's q/k/v
            for i, (part, _, _) in enumerate(layer.parts()):
                state[f"{prefix}.{part_name(i)}"] = part
        else:
            layer = BlockEmbedding(blocks, module.num_embeddings, module.embedding_dim,
                                   stored_format(blocks, module.embedding_dim))
            state[f"{prefix}.blocks"] = layer.blocks
        setattr(parent, name, layer)


def runs_as_stored(tensor: torch.Tensor, float_rows: bool = True) -> bool:
    """Whether a weight can be a part as it is: blocks (uint8), or with ``float_rows`` a float matrix
    of rows of whole blocks of values, as the kernels widen an embedding's rows GROUP values at a time
    (a narrower matrix stays a float32 copy)."""
    if tensor.dtype == torch.uint8:
        return True
    return float_rows and tensor.dtype in FLOAT_FORMATS and tensor.dim() == 2 and tensor.shape[1] % GROUP == 0


def stored_format(blocks: torch.Tensor, width: int) -> int:
    """Which kernel format a [rows, bytes per row] buffer holds for rows of ``width`` values (the
    block formats' rows differ in size for any width), or a float matrix [rows, width]."""
    if blocks.dtype in FLOAT_FORMATS:
        return FLOAT_FORMATS[blocks.dtype]
    for format in FORMAT_NAMES:
        if (format not in FLOAT_FORMATS.values() and blocks.shape[-1] == row_bytes(width, format)
                and (format not in SUPER_BLOCKS or width % 256 == 0)):
            return format
    raise ValueError(f"a block buffer of {blocks.shape[-1]} bytes per row holds no rows of {width} values")


def as_bytes(blocks: torch.Tensor) -> torch.Tensor:
    """A buffer of blocks as the kernels and the state dict hold it: bytes (a float matrix viewed
    so, [rows, element bytes x width])."""
    return blocks.view(torch.uint8) if blocks.dtype in FLOAT_FORMATS else blocks
