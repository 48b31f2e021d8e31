// GGUF's 32-value block formats rearranged into Loom's blocks (block_codes.h), at load: the bytes
// moved and the float16 scales widened in one pass over the file, rows shared among threads. The
// same numbers as block_formats.py's numpy rearrangement (its fallback), which made three or four
// temporaries a tensor: 0.56 s of a Qwen2.5-0.5B Q4_K_M file's load (its Q5_0 and Q8_0 matrices).
//
// A Loom row: every block's codes (8-bit: 32 bytes; 4-bit: 16 bytes of nibbles, byte j holding
// values j and j + 16; 5-bit: those nibbles, then every block's four bytes of fifth bits), then a
// float32 scale a block, then (4- and 5-bit) a float32 minimum a block. IQ4_NL's and IQ4_XS's codes
// stay 4-bit indices (LOOM_IQ4: the nibbles, then a float32 scale and a multiplier a block).
//
// Where the kernels multiply a format with sixteen rows side by side (block_interleaved.h's layouts),
// a tensor is laid out so straight from the file (loom_lay_out_gguf_rows16): sixteen rows at a time put
// in the layout's source format (Loom's blocks, or a K-quant's rows as they are) in a buffer that stays
// in the thread's L2 cache, then repacked. Rearranging the whole tensor first made a second copy of
// it in fresh pages: a Gemma-3-1B-shape file's tensors took 0.52 s against 0.20 (1.8-3.2 s against
// 1.1-1.4 for its whole load in a fresh process, a Zen 4 guest).

#include <atomic>
#include <vector>

#include "block_weights.h"

namespace {

// GGML's type numbers (gguf.constants.GGMLQuantizationType) of the formats rearranged here.
enum GGMLType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, IQ4_NL = 20, IQ4_XS = 23 };

// Bytes a block of 32 values (IQ4_XS: a super-block of 256) takes in the file.
int64_t file_block_bytes(int64_t type) {
    switch (type) {
        case Q4_0: case IQ4_NL: return 18;
        case Q4_1: return 20;
        case Q5_0: return 22;
        case Q5_1: return 24;
        case Q8_0: return 34;
        case IQ4_XS: return 136;
        default: return 0;
    }
}

// Bytes a row of ``width`` values of ``type`` (one of file_block_bytes's) takes in the file.
int64_t file_row_bytes(int64_t type, int64_t width) {
    return width / (type == IQ4_XS ? 256 : 32) * file_block_bytes(type);
}

// The Loom format a type is rearranged into (block_linear.py's block_formats.EXACT says the same).
int64_t loom_format(int64_t type) {
    switch (type) {
        case Q4_0: case Q4_1: return LOOM_4BIT;
        case Q5_0: case Q5_1: return LOOM_5BIT;
        case IQ4_NL: case IQ4_XS: return LOOM_IQ4;
        default: return LOOM_8BIT;  // Q8_0's codes
    }
}

// IQ4_NL (per 32 values: float16 d, sixteen bytes of codes) and IQ4_XS (per 256: d, the two high
// bits of eight 6-bit sub-scales, their four low bits, then the codes) as LOOM_IQ4: the codes as
// they are, each block's d widened, and its multiplier (IQ4_XS's sub-scale less 32).
void rearrange_iq4_row(int64_t type, const uint8_t* src, int64_t groups, uint8_t* dst) {
    uint8_t *codes = dst, *scales = dst + groups * 16;  // (stored as bytes: LoomIQ4's rows need not align a float)
    int8_t* multipliers = reinterpret_cast<int8_t*>(scales + groups * 4);
    if (type == IQ4_NL) {
        for (int64_t g = 0; g < groups; ++g, src += 18) {
            store(scales + 4 * g, half_to_float(src));
            multipliers[g] = 1;
            std::memcpy(codes + 16 * g, src + 2, 16);
        }
        return;
    }
    for (int64_t s = 0; s < groups / 8; ++s, src += 136) {
        const float d = half_to_float(src);
        const uint16_t high = uint16_t(src[2] | src[3] << 8);
        for (int j = 0; j < 8; ++j) {
            const int low = (src[4 + j / 2] >> (4 * (j % 2))) & 0x0F;
            store(scales + 4 * (8 * s + j), d);
            multipliers[8 * s + j] = int8_t((low | ((high >> (2 * j)) & 3) << 4) - 32);
        }
        std::memcpy(codes + 128 * s, src + 8, 128);
    }
}

// One row of ``groups`` blocks of 32 values from ``src`` (the file's) into ``dst`` (Loom's).
void rearrange_row(int64_t type, const uint8_t* src, int64_t groups, uint8_t* dst) {
    if (type == IQ4_NL || type == IQ4_XS) return rearrange_iq4_row(type, src, groups, dst);
    const int64_t code_bytes = 4 * loom_format(type);  // (its number is its bits a value)
    uint8_t* codes = dst;
    float* scales = reinterpret_cast<float*>(dst + groups * code_bytes);  // (rows of whole blocks: aligned to 4)
    float* minimums = scales + groups;
    uint8_t* fifth_bits = codes + groups * 16;  // (5-bit: after every block's nibbles)
    const int64_t step = file_block_bytes(type);
    for (int64_t g = 0; g < groups; ++g, src += step) {
        const float d = half_to_float(src);
        scales[g] = d;
        switch (type) {
            case Q8_0: std::memcpy(codes + 32 * g, src + 2, 32); break;
            case Q4_0:  // w = d (q - 8): a minimum of -8 d, exact in float32
                minimums[g] = -8 * d;
                std::memcpy(codes + 16 * g, src + 2, 16);
                break;
            case Q4_1:
                minimums[g] = half_to_float(src + 2);
                std::memcpy(codes + 16 * g, src + 4, 16);
                break;
            case Q5_0:  // w = d (q - 16): a minimum of -16 d
                minimums[g] = -16 * d;
                std::memcpy(fifth_bits + 4 * g, src + 2, 4);
                std::memcpy(codes + 16 * g, src + 6, 16);
                break;
            case Q5_1:
                minimums[g] = half_to_float(src + 2);
                std::memcpy(fifth_bits + 4 * g, src + 4, 4);
                std::memcpy(codes + 16 * g, src + 8, 16);
                break;
        }
    }
}

#if LOOM_ROWS16
// Whether a float32 is a float16's value: the layouts keep Loom's blocks' scales and minimums as float16s.
inline bool is_half(float v) { return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT)) == v; }

// Whether layout L holds the numbers of a row of its source format (L::From) of ``in`` values: the
// K-quants' always (their bytes are kept); Loom's blocks' where every scale and minimum is a float16's
// value (a Q4_0 file's -8 d may lie beyond float16's range),
// and the 5-bit blocks' minimums are -16 times their scales (Q5_0's; Q5_1's are their own).
template <typename L>
bool holds(L, const uint8_t*, int64_t) { return true; }
inline bool holds(Q80Rows16, const uint8_t* row, int64_t in) {
    const float* scales = reinterpret_cast<const float*>(row + in);
    return std::all_of(scales, scales + in / GROUP, is_half);
}
template <bool HIGH>
bool holds(NibbleRows16<HIGH>, const uint8_t* row, int64_t in) {
    using L = NibbleRows16<HIGH>;
    const float* scales = L::From::scales_of(row, in);
    const float* minimums = scales + in / GROUP;
    for (int64_t b = 0; b < in / GROUP; ++b)
        if (!is_half(scales[b]) || (HIGH ? minimums[b] != L::IMPLIED_MINIMUM * scales[b] : !is_half(minimums[b])))
            return false;
    return true;
}
#endif

// ``rows`` rows of ``width`` values of GGML type ``type`` from the file's bytes ``src`` into ``dst`` in
// layout To (``rows`` a multiple of sixteen), row i being the file's row order[i] (order null: row i):
// false, with ``dst`` unfinished, where a row's numbers do not fit the layout (holds).
template <typename To>
bool lay_out_rows16(const uint8_t* src, int64_t type, int64_t width, int64_t rows, const int64_t* order,
                    uint8_t* dst) {
    if constexpr (rows16_built<To>()) {
        const bool rearranged = file_block_bytes(type) != 0;  // else a K-quant or MXFP4, whose rows are To::From's
        const int64_t from = rearranged ? file_row_bytes(type, width) : To::From::row_bytes(width);
        const int64_t source_bytes = To::From::row_bytes(width), to = To::ROWS * To::row_bytes(width);
        std::atomic<bool> fits{true};
#pragma omp parallel for schedule(static)
        for (int64_t k = 0; k < rows / To::ROWS; ++k) {
            const int64_t first = k * To::ROWS;
            if (!rearranged && order == nullptr) {  // the file's rows are the source's, in order
                repack_rows16(To{}, src + first * from, width, dst + k * to);
                continue;
            }
            thread_local std::vector<uint8_t> buffer;  // (each thread's own, reused tensor after tensor)
            buffer.resize(size_t(To::ROWS * source_bytes));
            for (int64_t r = 0; r < To::ROWS; ++r) {
                const uint8_t* row = src + (order ? order[first + r] : first + r) * from;
                uint8_t* into = buffer.data() + r * source_bytes;
                if (!rearranged) {
                    std::memcpy(into, row, size_t(from));
                    continue;
                }
                rearrange_row(type, row, width / GROUP, into);
                if (!holds(To{}, into, width)) fits = false;
            }
            repack_rows16(To{}, buffer.data(), width, dst + k * to);
        }
        return fits;
    } else {
        (void)src, (void)type, (void)width, (void)rows, (void)order, (void)dst;
        __builtin_trap();
    }
}

}  // namespace

// ``rows`` rows of ``width`` values of GGML type ``type`` (one of GGMLType's), from the file's bytes
// ``src`` into Loom's blocks ``dst`` (rows of format_row_bytes(loom_format(type), width)).
extern "C" void loom_rearrange_gguf_blocks(const uint8_t* src, int64_t type, int64_t width, int64_t rows,
                                           uint8_t* dst) {
    if (file_block_bytes(type) == 0) __builtin_trap();  // block_formats.py passes its EXACT types only
    const int64_t from = file_row_bytes(type, width);
    const int64_t to = format_row_bytes(loom_format(type), width);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) rearrange_row(type, src + r * from, width / 32, dst + r * to);
}

// ``rows`` rows (a multiple of sixteen) of ``width`` values of GGML type ``type`` from the file's bytes
// ``src`` into ``dst``, laid out sixteen side by side in ``layout`` (a ROWS16 layout this build
// multiplies, whose source format is ``type``'s: block_formats.py's to_rows16 asks), row i being the
// file's row order[i] (order null: row i). 0 where a row's numbers do not fit the layout (holds).
extern "C" int64_t loom_lay_out_gguf_rows16(const uint8_t* src, int64_t type, int64_t width, int64_t rows,
                                            const int64_t* order, int64_t layout, uint8_t* dst) {
    bool fits = false;
    with_format(layout, width, [&](auto f) {
        using To = decltype(f);
        if constexpr (rows_side_by_side<To>()) fits = lay_out_rows16<To>(src, type, width, rows, order, dst);
        else __builtin_trap();
    });
    return fits;
}
