// Weights with sixteen rows side by side (block_codes.h's GGUF_Q4_K_ROWS16, GGUF_Q5_K_ROWS16,
// GGUF_Q8_0_ROWS16, GGUF_Q4_1_ROWS16, GGUF_Q5_0_ROWS16, GGUF_Q6_K_ROWS16 and GGUF_IQ4_ROWS16), as
// llama.cpp's CPU backend repacks its own (q4_K_8x8): a
// vector holds a few codes of each of sixteen (or eight) weight rows, so one multiply instruction
// meets them all with codes of an input row broadcast, the rows' scales come in one vector, and
// nothing is added across lanes: a lane is a weight row from the first instruction to the stored
// output.
//
// Q4_K (AVX-512, or AVX2): a 512-bit vector holds four codes of each of sixteen weight rows, one
// vpdpbusd multiplies them all by four input codes, a vpmulld takes sixteen rows' sub-block scales.
// Over the file's own layout a one-row product did the opposite (a pair of blocks of one row a
// vector, its lanes added up every super-block, its scales decoded a row at a time) and read 27-31
// GB/s of weights on two Zen 5 threads, arithmetic-bound; over these rows a prototype read 43-47,
// the memory's rate. With AVX2 a 256-bit vector holds half the rows, and maddubs's 16-bit pairs are
// summed over a sub-block before one madd by the scales. Q5_K (AVX-512, or AVX2) as Q4_K, its fifth
// bits added to the codes as Q5_0's are (below): over the file's layout a one-row product read 22 GB/s
// from L3, 63 over this one.
//
// Q8_0 with AVX2: a 256-bit vector holds two codes of each of eight rows as 16-bit words, and one
// madd meets them with two input codes; over Loom's 8-bit blocks a block of one row at a time took a
// sign, a maddubs and a madd per 32 products and each block's float step per row (int8_rows). With
// AVX-512's VNNI: four codes of sixteen rows a vector, kept unsigned, one vpdpbusd against four input
// codes (2560 x 960, 1 / 16 / 64 rows: 24.9 GB/s / 228 / 279 Gvalue-rows/s against Loom's 8-bit blocks'
// 20.7 / 137 / 224). IQ4_NL and IQ4_XS (AVX-512 with VNNI, or AVX2) as Q8_0, their codes looked up from
// nibbles laid out as Q4_1's (below). Q4_0, Q4_1 and Q5_0
// (AVX-512, or AVX2) as Q4_K: four codes of sixteen rows a 512-bit vector (AVX2: of eight, maddubs's
// pairs summed in 16 bits before one madd), Q5_0's fifth bits added to the codes as they are loaded.
// Over Loom's 4- and 5-bit blocks the AVX-512 build took a pair of blocks of one row a vector, its
// codes shuffled into order and its lanes added up every pair: a one-row product from L3 read 26-29
// GB/s, the machine's memory rate; over this layout 55-69 (6912 x 1152, two Zen 4 threads), so that
// from memory it reads fewer bytes at the same rate (Q5_0: 23 a row's block against 28). Q6_K (AVX2
// without AVX-512) as Q4_K, its codes put together from nibbles and
// bit pairs, a group of 16 values summed in 16 bits before one madd: 8192 x 2048, two Zen 4 threads,
// 16 / 64 / 1024 rows 143-145 / 152-159 / 135-141 Gvalue-rows/s against int8_rows' 114 / 115 / 107
// over the file's layout.
//
// The layouts are made once, at load (repack_rows16, an overload a layout), from the file's rows
// (the same numbers; Q4_K's packed 6-bit scales and minimums kept as bytes). A row's product ends
// each super-block (Q8_0, Q4_1, Q5_0, IQ4: each block) in exact integers, as the AVX-512 build's
// products over the other layouts do, taken into the row's sum by the same float steps, so a row's
// numbers are the same at every row count, and the same in the AVX2 build as in the AVX-512 one (the
// AVX2 build's int8_rows, over the file's layouts, add a super-block's blocks in float lanes
// instead).

#pragma once

#include <cstdint>
#include <cstring>

namespace {

// A code's fifth bit as 16 or 0, from its row's byte of fifth bits of a quad (GGUF_Q5_K_ROWS16's and
// GGUF_Q5_0_ROWS16's: bit b for value b of the quad's low nibbles, with ``high`` bit 4 + b for the high ones')
inline int fifth_of(uint8_t fifths, bool high, int b) { return (fifths >> (4 * high + b) & 1) << 4; }

#if LOOM_ROWS16
// The layouts' codes are sixteen rows' 4-byte words side by side, which a load makes from each row's
// words in turn: eight rows' eight words a step, transposed in registers. A 4-byte copy a word took
// most of a load: one Zen 3 thread laid out Q4_K at 2.33 GB/s so, 3.08 this way; Q6_K, whose words
// were or-ed together a quad at a time, 1.02 against 4.68 (docs/bench/rows16_layout.cpp).
// words[r] (r < 8) holds eight words of row r; word w of the eight rows goes side by side to out + w * stride.
inline void store_words_transposed(const __m256i words[8], uint8_t* out, int64_t stride) {
    __m256i pairs[8], quads[8];
    for (int i = 0; i < 4; ++i) {  // rows 2i, 2i + 1: words 0, 1 and 4, 5 interleaved (lo), 2, 3 and 6, 7 (hi)
        pairs[2 * i] = _mm256_unpacklo_epi32(words[2 * i], words[2 * i + 1]);
        pairs[2 * i + 1] = _mm256_unpackhi_epi32(words[2 * i], words[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i)  // rows 4i to 4i + 3: words 0 and 4 (quads[4i]), 1 and 5, 2 and 6, 3 and 7
        for (int h = 0; h < 2; ++h) {
            quads[4 * i + 2 * h] = _mm256_unpacklo_epi64(pairs[4 * i + h], pairs[4 * i + 2 + h]);
            quads[4 * i + 2 * h + 1] = _mm256_unpackhi_epi64(pairs[4 * i + h], pairs[4 * i + 2 + h]);
        }
    for (int w = 0; w < 4; ++w) {  // each 128-bit lane a word of four rows: rows 0-3 beside rows 4-7
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + w * stride),
                            _mm256_permute2x128_si256(quads[w], quads[4 + w], 0x20));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (w + 4) * stride),
                            _mm256_permute2x128_si256(quads[w], quads[4 + w], 0x31));
    }
}

// Sixteen rows' code words side by side, [word][row]: word w of row r (from rows r * row_bytes apart)
// as make(row pointer, group g) returns it, words 8 g to 8 g + 7 a vector, ``groups`` vectors a row.
template <typename Make>
inline void lay_out_words(const uint8_t* first, int64_t row_bytes, int groups, uint8_t* out, Make&& make) {
    for (int half = 0; half < 2; ++half)
        for (int g = 0; g < groups; ++g) {
            __m256i words[8];
            for (int r = 0; r < 8; ++r) words[r] = make(first + (8 * half + r) * row_bytes, g);
            store_words_transposed(words, out + (8 * g * 16 + 8 * half) * 4, 16 * 4);
        }
}

template <typename V>
inline __m256i load_bytes(const V* at) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)); }

// Rows [16 k, 16 k + 16) of a Q4_K (HIGH: Q5_K) matrix of rows of ``in`` values (the file's layout)
// into ``dst``, the same rows' bytes in GGUF_Q4_K_ROWS16 (GGUF_Q5_K_ROWS16).
template <bool HIGH>
inline void repack_rows16(KRows16<HIGH>, const uint8_t* src, int64_t in, uint8_t* dst) {
    using L = KRows16<HIGH>;
    const int64_t row_bytes = L::From::row_bytes(in);
    for (int64_t s = 0; s < in / L::VALUES; ++s) {
        uint8_t* block = dst + s * L::BLOCK_BYTES;
        const uint8_t* first = src + s * L::From::BYTES;
        // the nibbles' 32 words (value pairs c of 64, quads q of them) as the file has them: word 8 c + q
        lay_out_words(first + (HIGH ? 48 : 16), row_bytes, 4, block,
                      [](const uint8_t* qs, int g) { return load_bytes(qs + 32 * g); });
        for (int r = 0; r < L::ROWS; ++r) {
            const uint8_t* row = first + r * row_bytes;
            const typename L::From::Super super(src + r * row_bytes, in, s);  // its 6-bit scales and minimums decoded
            if constexpr (HIGH)  // bit j of the file's byte l: value l of sub-block j's
                for (int c = 0; c < 4; ++c)
                    for (int q = 0; q < 8; ++q) {
                        uint8_t fifths = 0;
                        for (int b = 0; b < 4; ++b)
                            for (int h = 0; h < 2; ++h) fifths |= (super.qh[4 * q + b] >> (2 * c + h) & 1) << (4 * h + b);
                        block[L::FIFTHS_AT + (c * 8 + q) * L::ROWS + r] = fifths;
                    }
            for (int j = 0; j < 8; ++j) {
                block[L::SCALES + j * L::ROWS + r] = uint8_t(super.sc[j]);
                block[L::min_at(j, r)] = uint8_t(super.min_codes >> (8 * j));
            }
            std::memcpy(block + L::D + 2 * r, row, 2);  // d and dmin, the file's float16s as they are
            std::memcpy(block + L::DMIN + 2 * r, row + 2, 2);
        }
    }
}

// f(block, row, b, r) for each block b of sixteen rows of layout L's source format (rows of ``in``
// values from ``src``) and each row r of them: ``block`` the layout's bytes of block b in ``dst``, ``row``
// the source row (a layout of 32-value blocks' repack_rows16).
template <typename L, typename F>
inline void for_row_blocks(const uint8_t* src, int64_t in, uint8_t* dst, F&& f) {
    const int64_t row_bytes = L::From::row_bytes(in);
    for (int64_t b = 0; b < in / L::VALUES; ++b)
        for (int r = 0; r < L::ROWS; ++r) f(dst + b * L::BLOCK_BYTES, src + r * row_bytes, b, r);
}

// A float32 scale or minimum (of a Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1 file, a float16's value) as the
// float16 it was, at ``to``
inline void put_half(uint8_t* to, float value) {
    const uint16_t half = _cvtss_sh(value, _MM_FROUND_TO_NEAREST_INT);
    std::memcpy(to, &half, 2);
}

// Rows [16 k, 16 k + 16) of a matrix of Loom's 4- or 5-bit blocks (rows of ``in`` values) into
// ``dst``, the same rows in GGUF_Q4_1_ROWS16 or GGUF_Q5_0_ROWS16 (whose minimums are -16 times the
// scales: gguf_blocks.cpp's holds checks): each block's code bytes four at a time, four of each row in
// turn, the fifth bits of a quad's eight values a byte a row, then each row's scale (and 4-bit
// blocks' minimum) as float16s.
template <bool HIGH>
inline void repack_rows16(NibbleRows16<HIGH>, const uint8_t* src, int64_t in, uint8_t* dst) {
    using L = NibbleRows16<HIGH>;
    for_row_blocks<L>(src, in, dst, [&](uint8_t* block, const uint8_t* row, int64_t b, int r) {
        const uint32_t bits = HIGH ? load<uint32_t>(row + in / 2 + 4 * b) : 0;  // bit j: value j's fifth
        for (int q = 0; q < 4; ++q) {
            std::memcpy(block + (q * L::ROWS + r) * 4, row + b * GROUP / 2 + 4 * q, 4);
            if constexpr (HIGH)
                block[L::FIFTHS_AT + q * L::ROWS + r] = uint8_t((bits >> 4 * q & 15) | (bits >> (16 + 4 * q) & 15) << 4);
        }
        const float* scales = L::From::scales_of(row, in);
        put_half(block + L::D + 2 * r, scales[b]);
        if constexpr (!HIGH) put_half(block + L::M + 2 * r, scales[in / GROUP + b]);  // (Q5_0's: -16 d)
    });
}
#endif

#if LOOM_BLOCKS_ROWS16 || LOOM_Q8_0_QUADS
// Rows [16 k, 16 k + 16) of a matrix of Loom's 8-bit blocks (rows of ``in`` values) into ``dst``, the
// same rows in GGUF_Q8_0_ROWS16: a block's code bytes UNIT at a time, UNIT of each row in turn, then
// each row's scale as a float16.
inline void repack_rows16(Q80Rows16, const uint8_t* src, int64_t in, uint8_t* dst) {
    using L = Q80Rows16;
    for_row_blocks<L>(src, in, dst, [&](uint8_t* block, const uint8_t* row, int64_t b, int r) {
        for (int u = 0; u < GROUP / L::UNIT; ++u)
            for (int v = 0; v < L::UNIT; ++v) block[(u * L::ROWS + r) * L::UNIT + v] = row[b * GROUP + u * L::UNIT + v] ^ L::OFFSET;
        put_half(block + L::D + 2 * r, reinterpret_cast<const float*>(row + in)[b]);
    });
}

// Rows [16 k, 16 k + 16) of a matrix of LOOM_IQ4 blocks (rows of ``in`` values) into ``dst``, the same
// rows in GGUF_IQ4_ROWS16: each block's code bytes four at a time, four of each row in turn, then each
// row's d (a float16's value: the file's) and multiplier k.
inline void repack_rows16(IQ4Rows16, const uint8_t* src, int64_t in, uint8_t* dst) {
    using L = IQ4Rows16;
    for_row_blocks<L>(src, in, dst, [&](uint8_t* block, const uint8_t* row, int64_t b, int r) {
        for (int q = 0; q < 4; ++q) std::memcpy(block + (q * L::ROWS + r) * 4, row + b * GROUP / 2 + 4 * q, 4);
        put_half(block + L::D + 2 * r, L::From::d_of(row, in, b));
        block[L::K + r] = uint8_t(L::From::multipliers(row, in)[b]);
    });
}

// Rows [16 k, 16 k + 16) of an MXFP4 matrix (the file's layout) into ``dst``, the same rows in
// GGUF_MXFP4_ROWS16: each block's code bytes four at a time, four of each row in turn, then each row's
// exponent byte (the sixteen rows' spare bytes, past their blocks, left as they are: zeros).
inline void repack_rows16(MXFP4Rows16, const uint8_t* src, int64_t in, uint8_t* dst) {
    using L = MXFP4Rows16;
    for_row_blocks<L>(src, in, dst, [&](uint8_t* block, const uint8_t* row, int64_t b, int r) {
        const uint8_t* from = row + b * L::BYTES;  // the exponent, then the codes
        for (int q = 0; q < 4; ++q) std::memcpy(block + (q * L::ROWS + r) * 4, from + 1 + 4 * q, 4);
        block[L::E + r] = from[0];
    });
}
#endif

#if LOOM_BLOCKS_ROWS16
// Rows [16 k, 16 k + 16) of a Q6_K matrix (the file's layout) into ``dst``, the same rows' bytes in
// GGUF_Q6_K_ROWS16. A row's 256 codes are 128 bytes of low nibbles (ql) and 64 of bit pairs (qh) in
// the file: code 128 n + 32 k + l has the low (k < 2) or high nibble of ql[64 n + 32 (k % 2) + l] and
// bits 2 k, 2 k + 1 of qh[32 n + l]. The layout's low word m holds codes 4 m to 4 m + 3 (low nibbles)
// and 128 more (high: groups G and G + 8), its high word m' codes 4 m' to 4 m' + 3 and 64, 128 and
// 192 more (bits 0-1 to 6-7: groups G, G + 4, G + 8, G + 12), so each is a few shifts and masks of
// 32 of the file's bytes.
inline void repack_rows16(Q6KRows16, const uint8_t* src, int64_t in, uint8_t* dst) {
    using L = Q6KRows16;
    const int64_t row_bytes = L::From::row_bytes(in);
    const __m256i low4 = _mm256_set1_epi8(0x0F), high4 = _mm256_set1_epi8(char(0xF0));
    const auto bits = [](__m256i v, int shift, int at) {  // v's bit pairs at ``shift`` moved to bits ``at``, at + 1
        const __m256i moved = shift > at ? _mm256_srli_epi16(v, shift - at) : _mm256_slli_epi16(v, at - shift);
        return _mm256_and_si256(moved, _mm256_set1_epi8(char(3 << at)));
    };
    for (int64_t s = 0; s < in / L::VALUES; ++s) {
        uint8_t* block = dst + s * L::BLOCK_BYTES;
        const uint8_t* first = src + s * Q6K::BYTES;
        // low words 0-15 (codes 0-63 and 128-191), then 16-31 (codes 64-127 and 192-255)
        lay_out_words(first, row_bytes, 4, block + L::low_at(0, 0, 0), [&](const uint8_t* ql, int g) {
            const __m256i a = load_bytes(ql + 32 * (g % 2)), b = load_bytes(ql + 64 + 32 * (g % 2));
            return g < 2 ? _mm256_or_si256(_mm256_and_si256(a, low4), _mm256_and_si256(_mm256_slli_epi16(b, 4), high4))
                         : _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low4), _mm256_and_si256(b, high4));
        });
        // high words 0-7 (codes 0-31, 64-95, 128-159, 192-223: qh's bits 0-1 and 4-5 of either half), then 8-15
        lay_out_words(first, row_bytes, 2, block + L::high_at(0, 0, 0), [&](const uint8_t* row, int g) {
            const __m256i h0 = load_bytes(row + 128), h1 = load_bytes(row + 160);
            return _mm256_or_si256(_mm256_or_si256(bits(h0, 2 * g, 0), bits(h0, 2 * g + 4, 2)),
                                   _mm256_or_si256(bits(h1, 2 * g, 4), bits(h1, 2 * g + 4, 6)));
        });
        for (int r = 0; r < L::ROWS; ++r) {
            const uint8_t* from = first + r * row_bytes;
            for (int G = 0; G < 16; ++G) block[L::SCALES + G * L::ROWS + r] = from[192 + G];
            const float d = half_to_float(from + 208);
            std::memcpy(block + L::D + 4 * r, &d, 4);
        }
    }
}
#endif

// f(block, r, b) for each block (or super-block) b of weight row ``row`` of layout L: ``block`` the
// bytes of the row's sixteen, r its place among them.
template <typename L, typename F>
inline void each_block_of_row(const BlockWeights& w, int64_t row, F&& f) {
    const uint8_t* first = w.base + row / L::ROWS * L::ROWS * w.stride;  // the row's block
    for (int64_t b = 0; b < w.in / L::VALUES; ++b) f(first + b * L::BLOCK_BYTES, int(row % L::ROWS), b);
}

// Weight row ``row`` as floats (widen_row's, for these layouts)
inline void widen_row16(Q80Rows16, const BlockWeights& w, int64_t row, float* dst) {
    using L = Q80Rows16;
    each_block_of_row<L>(w, row, [&](const uint8_t* block, int r, int64_t b) {
        const float d = half_to_float(block + L::D + 2 * r);
        for (int v = 0; v < L::VALUES; ++v) dst[b * L::VALUES + v] = d * float(int8_t(block[L::code_at(v, r)] ^ L::OFFSET));
    });
}
template <bool HIGH>
inline void widen_row16(NibbleRows16<HIGH>, const BlockWeights& w, int64_t row, float* dst) {
    using L = NibbleRows16<HIGH>;
    each_block_of_row<L>(w, row, [&](const uint8_t* block, int r, int64_t b) {
        const float d = half_to_float(block + L::D + 2 * r), m = L::minimum(block, r, d);
        for (int v = 0; v < L::VALUES / 2; ++v) {
            const uint8_t byte = block[(v / 4 * L::ROWS + r) * 4 + v % 4];
            const uint8_t fifths = HIGH ? block[L::FIFTHS_AT + v / 4 * L::ROWS + r] : 0;
            dst[b * L::VALUES + v] = d * float((byte & 15) | fifth_of(fifths, false, v % 4)) + m;
            dst[b * L::VALUES + v + 16] = d * float((byte >> 4) | fifth_of(fifths, true, v % 4)) + m;
        }
    });
}
// Row r's scale of a block of the layouts whose codes index a table: IQ4's d k, MXFP4's 2^(e - 128).
inline float block_scale(IQ4Rows16, const uint8_t* block, int r) {
    return half_to_float(block + IQ4Rows16::D + 2 * r) * float(int8_t(block[IQ4Rows16::K + r]));
}
inline float block_scale(MXFP4Rows16, const uint8_t* block, int r) {
    return MXFP4::exponent_scale(block[MXFP4Rows16::E + r]);
}
template <typename L, std::enable_if_t<looks_up_codes<L>(), int> = 0>
inline void widen_row16(L, const BlockWeights& w, int64_t row, float* dst) {
    each_block_of_row<L>(w, row, [&](const uint8_t* block, int r, int64_t b) {
        const float scale = block_scale(L{}, block, r);
        for (int v = 0; v < L::VALUES / 2; ++v) {
            const uint8_t byte = block[(v / 4 * L::ROWS + r) * 4 + v % 4];
            dst[b * L::VALUES + v] = scale * float(L::TABLE[byte & 15]);
            dst[b * L::VALUES + v + 16] = scale * float(L::TABLE[byte >> 4]);
        }
    });
}
template <bool HIGH>
inline void widen_row16(KRows16<HIGH>, const BlockWeights& w, int64_t row, float* dst) {
    using L = KRows16<HIGH>;
    each_block_of_row<L>(w, row, [&](const uint8_t* block, int r, int64_t s) {
        const float d = half_to_float(block + L::D + 2 * r), dmin = half_to_float(block + L::DMIN + 2 * r);
        for (int c = 0; c < 4; ++c)
            for (int q = 0; q < 8; ++q)
                for (int b = 0; b < 4; ++b) {
                    const uint8_t byte = block[((c * 8 + q) * L::ROWS + r) * 4 + b];
                    const uint8_t fifths = HIGH ? block[L::FIFTHS_AT + (c * 8 + q) * L::ROWS + r] : 0;
                    for (int h = 0; h < 2; ++h) {
                        const int j = 2 * c + h;  // the sub-block
                        const float scale = d * float(block[L::SCALES + j * L::ROWS + r]);
                        const float low = dmin * float(block[L::min_at(j, r)]);
                        const int code = (h ? byte >> 4 : byte & 15) | fifth_of(fifths, h, b);
                        dst[s * L::VALUES + 32 * j + 4 * q + b] = scale * float(code) - low;
                    }
                }
    });
}

inline void widen_row16(Q6KRows16, const BlockWeights& w, int64_t row, float* dst) {
    using L = Q6KRows16;
    each_block_of_row<L>(w, row, [&](const uint8_t* block, int r, int64_t s) {
        const float d = load<float>(block + L::D + 4 * r);
        for (int G = 0; G < 16; ++G) {
            const float scale = float(int8_t(block[L::SCALES + G * L::ROWS + r])) * d;  // (Q6K::Super's)
            for (int v = 0; v < 16; ++v) {
                const int low = block[L::low_at(G, v / 4, 0) + 4 * r + v % 4] >> 4 * (G / 8) & 15;
                const int high = block[L::high_at(G, v / 4, 0) + 4 * r + v % 4] >> 2 * (G / 4) & 3;
                dst[s * L::VALUES + 16 * G + v] = scale * (float(low | high << 4) - 32.0f);
            }
        }
    });
}

#if LOOM_ROWS16
// How far ahead of the block it reads a product fetches the weights, into L2: four Q4_K
// super-blocks of sixteen rows (9.3 KB; the blocks lie one after another). A one-row prototype read
// 43 GB/s at 4 KB ahead, 47 at 9.3 KB, 37 at 18.5 KB (8192 x 2048, two Zen 5 threads).
constexpr int64_t ROWS16_AHEAD = 4 * Q4KRows16::BLOCK_BYTES;

// Where a quad's fifth bits lie in each of sixteen rows' four code bytes: byte 4 r + b of a 128-bit
// lane takes the lane's row r's byte of fifth bits (rows 4 L to 4 L + 3 in lane L), so that bit b (a
// low nibble's value's) or 4 + b (a high one's) of it stands beside code byte b.
alignas(64) constexpr uint8_t FIFTHS_SPREAD[64] = {
    0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7,
    8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11, 12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15};
// bit b of byte b (a low nibble's fifth bit), or with HIGH bit 4 + b (a high nibble's)
template <bool HIGH>
constexpr int32_t FIFTH_BITS = HIGH ? int32_t(0x80402010u) : 0x08040201;

// The AVX2 Q4_K and Q6_K products of a few rows fetch the block ahead a line at a time through a
// block's products, where the others fetch a block's lines all at once as it begins: the block's
// lines in SHARES shares, one for each call of the kernel's inner loop in a block (rows16_sub_block:
// 8, rows16_group: 32), each call fetching its share a line per step of its STEPS. (Rounded up, the
// last shares run 3 / 11 lines into the next block, which its own block fetches again.) A Q4_K
// block is 37 lines, a Q6_K one 53; fetched at once as the block began, they stalled the product on
// a Zen 3 (8192 x 2048 from memory, two threads, three alternations: Q4_K at 1 / 4 rows 20.4-22.0
// GB/s / 99-114 Gvalue-rows/s -> 22.0-26.0 / 116-139, Q6_K 18.0-20.0 / 59-65 -> 20.6-22.7 / 81-100,
// measured at 1 and 4 rows; the Q4_K product alone, its weights in L3, reads 40 GB/s). A share at
// once before each call read 21.6-25.1 against a line a step's 23.5-26.6. Only where a chunk is its
// group's only one (a few rows, bound by reading the weights): spread over the first of several
// chunks, a 16-row Q4_K product ran at 93-128 against 119-130 Gvalue-rows/s. Q8_0's and Q4_1's
// blocks (9 and 5 lines) read level or slower so (Q8_0 at one row 24.8-26.2 -> 22.4-24.2 GB/s).
template <typename L, int SHARES, int STEPS>
struct FetchShares {
    static constexpr int LINES = int((L::BLOCK_BYTES + CACHE_LINE * SHARES - 1) / (CACHE_LINE * SHARES));  // a share's
    static_assert(LINES <= STEPS, "a call's steps fetch all of its share");
    const uint8_t* ahead;  // the block ROWS16_AHEAD on (prefetches never fault past the end), or null

    // What chunk m0 (of CHUNK rows) of a group of ROWS input rows fetches as it reads ``block``:
    // the first chunk spreads the block ahead over its steps where it is the group's only one, and
    // fetches it all at once where more follow; the later chunks nothing.
    template <int ROWS, int CHUNK>
    static FetchShares for_chunk(const uint8_t* block, int m0) {
        if (m0 != 0) return {nullptr};
        if constexpr (ROWS <= CHUNK) {
            return {block + ROWS16_AHEAD};
        } else {
            fetch_lines(block + ROWS16_AHEAD, L::BLOCK_BYTES);
            return {nullptr};
        }
    }
    // where share ``index``'s lines are (null where there is nothing to fetch)
    const uint8_t* share(int index) const {
        return ahead == nullptr ? nullptr : ahead + index * LINES * CACHE_LINE;
    }
    // step ``step`` of a call fetches line ``step`` of its share, where the share has it
    static void fetch_line(const uint8_t* share, int step) {
        if (share != nullptr && step < LINES) __builtin_prefetch(share + step * CACHE_LINE, 0, 2);
    }
};

// An input row's code sums over each sub-block of a super-block (from its sums over each 16), two
// to a 32-bit word as the minimums lie: word k of a 128-bit lane holds sub-block 2 k's in its low 16
// bits, 2 k + 1's in its high (32 codes sum to at most 4064 in magnitude). One 16-bit multiply-add
// then meets two sub-blocks' minimums, where each sub-block's two sums over 16 took one: a chunk's
// minimums were a fifth of the AVX2 kernel's time (without them, 64 rows ran at 237 Gvalue-rows/s
// against 192).
inline __m256i sub_block_sums(const int16_t* sixteens) {
    const __m256i sixteen = load<__m256i>(sixteens);
    const __m256i sums = _mm256_hadd_epi16(sixteen, sixteen);  // a 128-bit lane's four sub-blocks, twice
    return _mm256_permute4x64_epi64(sums, 0x88);  // all four words in each 128-bit lane
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Sixteen bytes as 32-bit lanes
inline __m512i widen_bytes(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Sixteen rows' bytes of a quad's fifth bits (at ``fifths``), each beside its row's four code bytes
inline __m512i spread_fifths(const uint8_t* fifths) {
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(load<__m128i>(fifths)), load<__m512i>(FIFTHS_SPREAD));
}
// The code bytes whose fifth bit is set, of the low nibbles' values, or with HIGH the high ones'
template <bool HIGH>
inline __mmask64 fifth_bits(__m512i spread) { return _mm512_test_epi8_mask(spread, _mm512_set1_epi32(FIFTH_BITS<HIGH>)); }

// Sixteen rows' codes of a quad, from their 64 bytes at ``codes``: the low nibbles' (``low``) and the
// high ones' (``high``), with FIFTHS each 16 more where its fifth bit (at ``fifths``, a byte a row) is set
template <bool FIFTHS>
inline void quad_codes(const uint8_t* codes, const uint8_t* fifths, __m512i& low, __m512i& high) {
    const __m512i bytes = _mm512_loadu_si512(codes), nibble = _mm512_set1_epi8(15);
    low = _mm512_and_si512(bytes, nibble);
    high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
    if constexpr (FIFTHS) {
        const __m512i spread = spread_fifths(fifths), sixteen = _mm512_set1_epi8(16);
        low = _mm512_mask_add_epi8(low, fifth_bits<false>(spread), low, sixteen);
        high = _mm512_mask_add_epi8(high, fifth_bits<true>(spread), high, sixteen);
    }
}

// y[m][o] = x[m] . w[o] for input rows [m0, m0 + CHUNK) of the group and the sixteen weight rows of
// ``blocks`` (GGUF_Q4_K_ROWS16, or with FIFTHS GGUF_Q5_K_ROWS16, whose fifth bits are added to the codes
// as 16 where set; their sums in registers: two sub-blocks' products, the codes' and the minimums'
// integers and the float sum, each CHUNK vectors; CHUNK a constant, for them to stay there).
constexpr int ROWS16_CHUNK = 4;
template <int CHUNK, int ROWS, bool FIFTHS>
inline void rows16_chunk(const RoundedGroup<KRows16<FIFTHS>, ROWS>& x, int m0, const uint8_t* blocks, int64_t supers,
                         float* y, int64_t y_stride) {
    using L = KRows16<FIFTHS>;
    __m512 sums[CHUNK];
    for (auto& sum : sums) sum = _mm512_setzero_ps();
    for (int64_t s = 0; s < supers; ++s) {
        const uint8_t* block = blocks + s * L::BLOCK_BYTES;
        if (m0 == 0) fetch_lines(block + ROWS16_AHEAD, L::BLOCK_BYTES);  // (never faults past the end)
        const int8_t* xq[CHUNK];  // the super-block's codes, in order
        for (int i = 0; i < CHUNK; ++i) xq[i] = x.codes(m0 + i, s, 0);
        __m512i a[CHUNK], b[CHUNK];
        for (int i = 0; i < CHUNK; ++i) a[i] = b[i] = _mm512_setzero_si512();
        for (int c = 0; c < 4; ++c) {  // sub-blocks 2 c and 2 c + 1
            __m512i first_sums[CHUNK], second_sums[CHUNK];
            for (int i = 0; i < CHUNK; ++i) first_sums[i] = second_sums[i] = _mm512_setzero_si512();
            for (int q = 0; q < 8; ++q) {
                __m512i first_codes, second_codes;
                quad_codes<FIFTHS>(block + (c * 8 + q) * 64, block + L::FIFTHS_AT + (c * 8 + q) * L::ROWS, first_codes,
                                   second_codes);
                for (int i = 0; i < CHUNK; ++i) {
                    first_sums[i] = dot_quads(first_sums[i], first_codes,
                                              _mm512_set1_epi32(load<int32_t>(xq[i] + 64 * c + 4 * q)));
                    second_sums[i] = dot_quads(second_sums[i], second_codes,
                                               _mm512_set1_epi32(load<int32_t>(xq[i] + 64 * c + 32 + 4 * q)));
                }
            }
            const __m512i first_scale = widen_bytes(block + L::SCALES + 2 * c * L::ROWS);
            const __m512i second_scale = widen_bytes(block + L::SCALES + (2 * c + 1) * L::ROWS);
            for (int i = 0; i < CHUNK; ++i)
                a[i] = _mm512_add_epi32(a[i], _mm512_add_epi32(_mm512_mullo_epi32(first_sums[i], first_scale),
                                                               _mm512_mullo_epi32(second_sums[i], second_scale)));
        }
        int32_t sub_sums[CHUNK][4];
        for (int i = 0; i < CHUNK; ++i)
            store(sub_sums[i], _mm256_castsi256_si128(sub_block_sums(x.sixteens(m0 + i, s))));
        for (int k = 0; k < 4; ++k) {  // the minimums of sub-blocks 2 k and 2 k + 1 against their input sums
            const __m512i m = _mm512_cvtepu8_epi16(load<__m256i>(block + L::min_at(2 * k, 0)));
            for (int i = 0; i < CHUNK; ++i) b[i] = dot_halves(b[i], m, _mm512_set1_epi32(sub_sums[i][k]));
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + L::D)));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + L::DMIN)));
        const float* dx = x.super_block_scales(s) + m0;
        for (int i = 0; i < CHUNK; ++i) {
            const __m512 scale = _mm512_set1_ps(dx[i]);
            sums[i] = super_block_step<true>(sums[i], a[i], b[i], _mm512_mul_ps(d, scale), _mm512_mul_ps(dmin, scale));
        }
    }
    for (int i = 0; i < CHUNK; ++i) _mm512_storeu_ps(y + (m0 + i) * y_stride, sums[i]);
}

// y[m][o] = x[m] . w[o] for input rows [m0, m0 + CHUNK) of the group and the sixteen weight rows of
// ``blocks`` of a layout L of 32-value blocks side by side (Q4_1's, Q5_0's, Q8_0's, IQ4's):
// add_products(block, xb, a) adds the block's quads of the sixteen rows' codes, each met by four input
// codes broadcast from the rounded rows as they lie (xb[i]: input row m0 + i's codes of the block) in one
// dot_quads for all sixteen rows, into a[i], which starts at zero, or where the layout keeps its codes 128
// more (takes_code_sums) at -128 times the input row's code sum. Each block's exact integer then joins
// the row's sum as the products over Loom's blocks take theirs (block_term: the same float steps in the
// same order), by the rows' scales scales_of(block) and, where the layout has minimums (L::MINS), their
// minimums_of(block, scales) against the input block's sum.
template <int CHUNK, int ROWS, typename L, typename Products, typename Scales, typename Minimums>
inline void rows16_block_chunk(const RoundedGroup<L, ROWS>& x, int m0, const uint8_t* blocks, int64_t count,
                               float* y, int64_t y_stride, Products add_products, Scales scales_of,
                               Minimums minimums_of) {
    const __m512 none = _mm512_setzero_ps();
    __m512 sums[CHUNK];
    for (auto& sum : sums) sum = none;
    for (int64_t b = 0; b < count; ++b) {
        const uint8_t* block = blocks + b * L::BLOCK_BYTES;
        if (m0 == 0) fetch_lines(block + ROWS16_AHEAD, L::BLOCK_BYTES);  // (never faults past the end)
        const int8_t* xb[CHUNK];  // the block's codes
        __m512i a[CHUNK];
        for (int i = 0; i < CHUNK; ++i) {
            xb[i] = x.codes(m0 + i, b, 0);
            if constexpr (takes_code_sums<L>()) a[i] = _mm512_set1_epi32(-128 * x.code_sum(m0 + i, b));
            else a[i] = _mm512_setzero_si512();
        }
        add_products(block, xb, a);
        const __m512 d = scales_of(block);
        __m512 m = none;
        if constexpr (L::MINS) m = minimums_of(block, d);
        for (int i = 0; i < CHUNK; ++i) {
            const __m512 d_dx = _mm512_mul_ps(d, _mm512_set1_ps(x.scale(m0 + i, b)));
            const __m512 xs = L::MINS ? _mm512_set1_ps(x.sums(m0 + i, b)[0]) : none;
            sums[i] = _mm512_add_ps(sums[i], block_term<L::MINS>(_mm512_cvtepi32_ps(a[i]), d_dx, m, xs));
        }
    }
    for (int i = 0; i < CHUNK; ++i) _mm512_storeu_ps(y + (m0 + i) * y_stride, sums[i]);
}

// y[m][o] = x[m] . w[o] for input rows [m0, m0 + CHUNK) of the group and the sixteen weight rows of
// ``blocks`` (GGUF_Q4_1_ROWS16, or with FIFTHS GGUF_Q5_0_ROWS16, its minimums -16 d): each block's four
// quads of codes, the low nibbles and the high (values 4 q + b and 16 on), their fifth bits added as 16 where set,
// met by four input codes broadcast in one vpdpbusd for all sixteen rows; each block ends in an exact
// integer a row, taken into the row's sum as block_pair_rows takes a block of Loom's: block_term, the
// same float steps in the same order, so that a row's numbers are those of Loom's blocks.
template <int CHUNK, int ROWS, bool FIFTHS>
inline void rows16_chunk(const RoundedGroup<NibbleRows16<FIFTHS>, ROWS>& x, int m0, const uint8_t* blocks,
                         int64_t count, float* y, int64_t y_stride) {
    using L = NibbleRows16<FIFTHS>;
    const auto add_products = [](const uint8_t* block, const int8_t* const (&xb)[CHUNK], __m512i (&a)[CHUNK]) {
        for (int q = 0; q < 4; ++q) {
            __m512i low, high;
            quad_codes<FIFTHS>(block + 64 * q, block + L::FIFTHS_AT + q * L::ROWS, low, high);
            for (int i = 0; i < CHUNK; ++i) {
                a[i] = dot_quads(a[i], low, _mm512_set1_epi32(load<int32_t>(xb[i] + 4 * q)));
                a[i] = dot_quads(a[i], high, _mm512_set1_epi32(load<int32_t>(xb[i] + 16 + 4 * q)));
            }
        }
    };
    const auto minimums_of = [](const uint8_t* block, __m512 d) {
        return FIFTHS ? _mm512_mul_ps(d, _mm512_set1_ps(L::IMPLIED_MINIMUM)) : _mm512_cvtph_ps(load<__m256i>(block + L::M));
    };
    rows16_block_chunk<CHUNK>(x, m0, blocks, count, y, y_stride, add_products,
                              [](const uint8_t* block) { return _mm512_cvtph_ps(load<__m256i>(block + L::D)); }, minimums_of);
}

#if LOOM_Q8_0_QUADS
// rows16_chunk over GGUF_Q8_0_ROWS16 (its codes in quads, kept 128 more: their sign bits flipped at
// load). The input's sign bits flipped instead, into a buffer each block, and each row's block integer
// taken back by 128 times its code sum (a vpdpbusd by ones a quad), 64 rows of 2560 x 960 and 8192 x 2048
// ran 270 and 289 Gvalue-rows/s against 286 and 317 so, 16 rows level and 272 against 284 (two Zen 4
// threads, taking turns; fewer rows read at the memory's rate either way).
template <int CHUNK, int ROWS>
inline void rows16_chunk(const RoundedGroup<Q80Rows16, ROWS>& x, int m0, const uint8_t* blocks, int64_t count,
                         float* y, int64_t y_stride) {
    using L = Q80Rows16;
    const auto add_products = [](const uint8_t* block, const int8_t* const (&xb)[CHUNK], __m512i (&a)[CHUNK]) {
        for (int q = 0; q < L::VALUES / L::UNIT; ++q) {
            const __m512i codes = _mm512_loadu_si512(block + 64 * q);
            for (int i = 0; i < CHUNK; ++i) a[i] = dot_quads(a[i], codes, _mm512_set1_epi32(load<int32_t>(xb[i] + 4 * q)));
        }
    };
    rows16_block_chunk<CHUNK>(x, m0, blocks, count, y, y_stride, add_products,
                              [](const uint8_t* block) { return _mm512_cvtph_ps(load<__m256i>(block + L::D)); }, nullptr);
}

// rows16_chunk over the layouts whose codes index a table (GGUF_IQ4_ROWS16, GGUF_MXFP4_ROWS16): a quad's
// codes the values of L::TABLE (each 128 more) that its sixteen rows' nibbles index, a byte shuffle (a
// load's low nibbles values 4 q on, its high ones 16 + 4 q on), each row's scale its block_scale: the exact
// integers and float steps of the products over LOOM_IQ4's (MXFP4's) pairs of blocks (IQ4, 8192 x 2048, two
// Zen 4 threads, 1 / 4 / 16 / 64 rows: 195 / 261 / 274 Gvalue-rows/s with the input flipped as Q8_0's was,
// 215 / 305 / 322 so, as Q4_K side by side's 216 / 295 / 322; one row at the memory's rate either way).
inline __m512 block_scales(IQ4Rows16, const uint8_t* block) {
    const __m512 k = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load<__m128i>(block + IQ4Rows16::K)));
    return _mm512_mul_ps(_mm512_cvtph_ps(load<__m256i>(block + IQ4Rows16::D)), k);
}
inline __m512 block_scales(MXFP4Rows16, const uint8_t* block) {
    return (__m512)exponent_scale_bits((PairSums)_mm512_cvtepu8_epi32(load<__m128i>(block + MXFP4Rows16::E)));
}
template <int CHUNK, int ROWS, typename L, std::enable_if_t<looks_up_codes<L>(), int> = 0>
inline void rows16_chunk(const RoundedGroup<L, ROWS>& x, int m0, const uint8_t* blocks, int64_t count, float* y,
                         int64_t y_stride) {
    const __m512i nibble = _mm512_set1_epi8(15);
    const __m512i table = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(L::TABLE))),
                                           _mm512_set1_epi8(-128));  // each value 128 more
    const auto add_products = [&](const uint8_t* block, const int8_t* const (&xb)[CHUNK], __m512i (&a)[CHUNK]) {
        for (int q = 0; q < 4; ++q) {
            const __m512i bytes = _mm512_loadu_si512(block + 64 * q);
            const __m512i low = _mm512_shuffle_epi8(table, _mm512_and_si512(bytes, nibble));
            const __m512i high = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble));
            for (int i = 0; i < CHUNK; ++i) {
                a[i] = dot_quads(a[i], low, _mm512_set1_epi32(load<int32_t>(xb[i] + 4 * q)));
                a[i] = dot_quads(a[i], high, _mm512_set1_epi32(load<int32_t>(xb[i] + 16 + 4 * q)));
            }
        }
    };
    rows16_block_chunk<CHUNK>(x, m0, blocks, count, y, y_stride, add_products,
                              [](const uint8_t* block) { return block_scales(L{}, block); }, nullptr);
}
#endif
#else
// Eight bytes as 32-bit lanes, each in both of its 16-bit halves (for madd: a row's scale against
// both of its lane's shorts)
inline __m256i eight_scales(const uint8_t* p) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_or_si256(v, _mm256_slli_epi32(v, 16));
}

// rows16 with AVX2: the block's sixteen rows as two halves of eight (a 256-bit vector four codes of
// each), one sub-block at a time for CHUNK input rows, each four input codes broadcast once for both
// halves. Without VNNI, maddubs leaves each row's products in pairs of 16 bits, and those are added
// up in 16 bits over the sub-block's eight steps (a pair is at most 2 x 15 x 127, eight of them
// 30480, under 32767), then take the rows' sub-block scales in one madd: the AVX-512 kernel's very
// integers, for about one multiply instruction per 32 products where a block at a time over the
// file's layout (int8_rows) took two. The empty asm keeps each 16-bit sum a chain of adds: GCC
// otherwise reassociated the eight steps into a tree whose partial products spilled to the stack
// (8192 x 2048, two Zen 5 threads, 64 rows: 166-168 Gvalue-rows/s, 188-191 without the spills,
// 203-214 with the minimums two sub-blocks a multiply, below; 16 rows 157-160 -> 187-198).
constexpr int ROWS16_CHUNK = 4;

// The fifth bits of eight rows' quad (``fifths``: the rows' bytes of the quad) as 16 or 0 in each
// code byte, for the low nibbles' values, or with HIGH the high ones'.
template <bool HIGH>
inline __m256i fifth_bits(const uint8_t* fifths) {
    const __m256i bytes = _mm256_broadcastq_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(fifths)));
    const __m256i spread = _mm256_shuffle_epi8(bytes, load<__m256i>(FIFTHS_SPREAD));
    const __m256i bit = _mm256_set1_epi32(FIFTH_BITS<HIGH>);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

// products[h][i] += the 16-bit pair sums of four codes of each of the sixteen weight rows in the
// 64 bytes at ``codes`` (rows 8 h to 8 h + 7 in bytes 32 h on; their low nibbles, or with HIGH the
// high, and with FIFTHS the fifth bits at ``fifths``, a byte a row) and four codes of input row i at
// xs[i] + at, broadcast; the adds kept a chain (the empty asm) unless ``last``, the step whose sums a
// madd reads next.
template <bool HIGH, int CHUNK, bool FIFTHS = false>
inline void add_nibble_products(__m256i (&products)[2][CHUNK], const uint8_t* codes, const int8_t* const (&xs)[CHUNK],
                                int64_t at, __m256i nibble, bool last, const uint8_t* fifths = nullptr) {
    __m256i these[2];
    for (int h = 0; h < 2; ++h) {
        const __m256i bytes = load<__m256i>(codes + 32 * h);
        these[h] = _mm256_and_si256(HIGH ? _mm256_srli_epi16(bytes, 4) : bytes, nibble);
        if constexpr (FIFTHS) these[h] = _mm256_or_si256(these[h], fifth_bits<HIGH>(fifths + 8 * h));
    }
    for (int i = 0; i < CHUNK; ++i) {
        const __m256i x4 = _mm256_set1_epi32(load<int32_t>(xs[i] + at));
        for (int h = 0; h < 2; ++h) {
            products[h][i] = _mm256_add_epi16(products[h][i], _mm256_maddubs_epi16(these[h], x4));
            if (!last) asm("" : "+x"(products[h][i]));
        }
    }
}

template <bool FIFTHS>
using KShares = FetchShares<KRows16<FIFTHS>, 8, 8>;  // (a share for each sub-block's eight steps)

// a[h][i] += sub-block 2 c + HIGH's products of the sixteen weight rows of ``block`` (their codes
// the low nibbles of pair c's bytes, or the high; with FIFTHS, Q5_K's, their fifth bits added) and
// input row i's codes of the super-block ``xq[i]``, times the rows' sub-block scales (the block
// ahead's share j of its lines fetched meanwhile: FetchShares). 5-bit codes' 16-bit sums take the
// scales every four steps (eight could pass 32767: 8 x 2 x 31 x 127).
template <bool HIGH, int CHUNK, bool FIFTHS>
inline void rows16_sub_block(__m256i (&a)[2][CHUNK], const uint8_t* block, int c, const int8_t* const (&xq)[CHUNK],
                             __m256i nibble, KShares<FIFTHS> fetch) {
    using L = KRows16<FIFTHS>;
    const int j = 2 * c + HIGH;  // the sub-block
    const uint8_t* share = fetch.share(j);
    __m256i products[2][CHUNK];  // 16-bit
    const auto take_products = [&] {  // (the scales loaded here, where no product's sum holds a register)
        for (int h = 0; h < 2; ++h) {
            const __m256i scale = eight_scales(block + L::SCALES + j * L::ROWS + 8 * h);
            for (int i = 0; i < CHUNK; ++i) {
                a[h][i] = _mm256_add_epi32(a[h][i], _mm256_madd_epi16(products[h][i], scale));
                products[h][i] = _mm256_setzero_si256();
            }
        }
    };
    for (auto& half : products)
        for (auto& p : half) p = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int q = 0; q < 8; ++q) {
        KShares<FIFTHS>::fetch_line(share, q);
        const bool last = q == 7 || (FIFTHS && q == 3);
        add_nibble_products<HIGH, CHUNK, FIFTHS>(products, block + c * 512 + 64 * q, xq, 32 * j + 4 * q, nibble, last,
                                                 block + L::FIFTHS_AT + (c * 8 + q) * L::ROWS);
        if (FIFTHS && q == 3) take_products();
    }
    take_products();
}

template <int CHUNK, int ROWS, bool FIFTHS>
inline void rows16_chunk(const RoundedGroup<KRows16<FIFTHS>, ROWS>& x, int m0, const uint8_t* blocks, int64_t supers,
                         float* y, int64_t y_stride) {
    using L = KRows16<FIFTHS>;
    const __m256i nibble = _mm256_set1_epi8(15);
    Lanes sums[2][CHUNK] = {};
    for (int64_t s = 0; s < supers; ++s) {
        const uint8_t* block = blocks + s * L::BLOCK_BYTES;
        const auto fetch = KShares<FIFTHS>::template for_chunk<ROWS, CHUNK>(block, m0);
        __m256i a[2][CHUNK];
        for (auto& half : a)
            for (auto& v : half) v = _mm256_setzero_si256();
        const int8_t* xq[CHUNK];  // the super-block's codes, in order
        for (int i = 0; i < CHUNK; ++i) xq[i] = x.codes(m0 + i, s, 0);
        for (int c = 0; c < 4; ++c) {  // sub-blocks 2 c (the low nibbles of pair c's codes) and 2 c + 1
            rows16_sub_block<false, CHUNK, FIFTHS>(a, block, c, xq, nibble, fetch);
            rows16_sub_block<true, CHUNK, FIFTHS>(a, block, c, xq, nibble, fetch);
        }
        __m256i sub_sums[CHUNK];
        for (int i = 0; i < CHUNK; ++i) sub_sums[i] = sub_block_sums(x.sixteens(m0 + i, s));
        for (int h = 0; h < 2; ++h) {  // rows 8 h to 8 h + 7
            __m256i b[CHUNK];
            for (int i = 0; i < CHUNK; ++i) b[i] = _mm256_setzero_si256();
            for_each_index<4>([&](auto pair) {  // the minimums of sub-blocks 2 k and 2 k + 1 against their input sums
                constexpr int k = decltype(pair)::value;
                const __m256i m = _mm256_cvtepu8_epi16(load<__m128i>(block + L::min_at(2 * k, 8 * h)));
                for (int i = 0; i < CHUNK; ++i)
                    b[i] = _mm256_add_epi32(b[i], _mm256_madd_epi16(m, _mm256_shuffle_epi32(sub_sums[i], 0x55 * k)));
            });
            const Lanes d = (Lanes)_mm256_cvtph_ps(load<__m128i>(block + L::D + 16 * h));
            const Lanes dmin = (Lanes)_mm256_cvtph_ps(load<__m128i>(block + L::DMIN + 16 * h));
            const float* dx = x.super_block_scales(s) + m0;
            for (int i = 0; i < CHUNK; ++i)
                sums[h][i] = super_block_step<true>(sums[h][i], (Sums)a[h][i], (Sums)b[i], d * dx[i], dmin * dx[i]);
        }
    }
    for (int h = 0; h < 2; ++h)
        for (int i = 0; i < CHUNK; ++i) store(y + (m0 + i) * y_stride + 8 * h, sums[h][i]);
}

// block_weights.h's block_term for eight weight rows' blocks (AVX2, which has no multiply with an
// explicit rounding: an empty asm keeps the product from being fused into the add that follows):
// the block's exact integer sums a times d dx, with MINS plus the rows' minimums m times xs.
template <bool MINS>
inline Lanes block_term(Sums a, Lanes d_dx, Lanes m, float xs) {
    Lanes c = __builtin_convertvector(a, Lanes) * d_dx;
    asm("" : "+x"(c));
    if constexpr (!MINS) return c;
    return (Lanes)_mm256_fmadd_ps((__m256)m, _mm256_set1_ps(xs), (__m256)c);
}

// rows16_chunk over GGUF_Q4_1_ROWS16 (or with FIFTHS GGUF_Q5_0_ROWS16): each block's four quads of
// codes, the low nibbles then the high (values 4 q + b, then 16 on; their fifth bits added as 16
// where set), maddubs by the input codes broadcast, the pairs summed in 16 bits (4-bit codes over
// the block's eight steps, at most 2 x 15 x 127 each: 30480; 5-bit ones over four, 2 x 31 x 127:
// 31496) before a madd into exact integers a row; each block's term is the AVX-512 build's over Loom's
// 4- and 5-bit blocks (block_term: a (d dx) rounded, then m xs added by one multiply-add, xs the
// input block's scale times its code sum).
template <int CHUNK, int ROWS, bool FIFTHS>
inline void rows16_chunk(const RoundedGroup<NibbleRows16<FIFTHS>, ROWS>& x, int m0, const uint8_t* blocks,
                         int64_t count, float* y, int64_t y_stride) {
    using L = NibbleRows16<FIFTHS>;
    const __m256i nibble = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    Lanes sums[2][CHUNK] = {};
    for (int64_t b = 0; b < count; ++b) {
        const uint8_t* block = blocks + b * L::BLOCK_BYTES;
        if (m0 == 0) fetch_lines(block + ROWS16_AHEAD, L::BLOCK_BYTES);  // (never faults past the end)
        __m256i products[2][CHUNK], a[2][CHUNK];  // 16-bit; 32-bit
        for (int h = 0; h < 2; ++h)
            for (int i = 0; i < CHUNK; ++i) products[h][i] = a[h][i] = _mm256_setzero_si256();
        const int8_t* xb[CHUNK];  // the block's codes
        for (int i = 0; i < CHUNK; ++i) xb[i] = x.codes(m0 + i, b, 0);
        const auto take_sums = [&] {  // the 16-bit sums so far into a, and begun again
            for (int h = 0; h < 2; ++h)
                for (int i = 0; i < CHUNK; ++i) {
                    a[h][i] = _mm256_add_epi32(a[h][i], _mm256_madd_epi16(products[h][i], ones));
                    products[h][i] = _mm256_setzero_si256();
                }
        };
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q)  // the low nibbles (values 0-15)
            add_nibble_products<false, CHUNK, FIFTHS>(products, block + 64 * q, xb, 4 * q, nibble, FIFTHS && q == 3,
                                                      block + L::FIFTHS_AT + q * L::ROWS);
        if constexpr (FIFTHS) take_sums();
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q)  // then the high
            add_nibble_products<true, CHUNK, FIFTHS>(products, block + 64 * q, xb, 16 + 4 * q, nibble, q == 3,
                                                     block + L::FIFTHS_AT + q * L::ROWS);
        take_sums();
        for (int h = 0; h < 2; ++h) {
            const Lanes d = (Lanes)_mm256_cvtph_ps(load<__m128i>(block + L::D + 16 * h));
            const Lanes m = FIFTHS ? d * L::IMPLIED_MINIMUM : (Lanes)_mm256_cvtph_ps(load<__m128i>(block + L::M + 16 * h));
            for (int i = 0; i < CHUNK; ++i)
                sums[h][i] += block_term<true>((Sums)a[h][i], d * x.scale(m0 + i, b), m, x.sums(m0 + i, b)[0]);
        }
    }
    for (int h = 0; h < 2; ++h)
        for (int i = 0; i < CHUNK; ++i) store(y + (m0 + i) * y_stride + 8 * h, sums[h][i]);
}
#endif

#if LOOM_BLOCKS_ROWS16
// y[m][o] = x[m] . w[o] for input rows [m0, m0 + CHUNK) of the group and the sixteen weight rows of
// ``blocks`` (GGUF_Q8_0_ROWS16), each block's products ending in an exact integer a row, taken into
// the row's sum as the AVX-512 build's products over Loom's 8-bit blocks take theirs (block_term:
// rounded once by the multiply, then added). Two codes of eight rows, widened to 16-bit words, meet
// two input codes in one madd: two multiply instructions per 32 products, as a sign, a maddubs and a
// madd took three (8192 x 2048, two Zen 5 threads, 64 rows: 126 against 134 Gvalue-rows/s over
// this layout; int8_rows over Loom's blocks 72).
template <int CHUNK, int ROWS>
inline void rows16_chunk(const RoundedGroup<Q80Rows16, ROWS>& x, int m0, const uint8_t* blocks, int64_t count,
                         float* y, int64_t y_stride) {
    using L = Q80Rows16;
    Lanes sums[2][CHUNK] = {};
    for (int64_t b = 0; b < count; ++b) {
        const uint8_t* block = blocks + b * L::BLOCK_BYTES;
        if (m0 == 0) fetch_lines(block + ROWS16_AHEAD, L::BLOCK_BYTES);  // (never faults past the end)
        alignas(32) int16_t words[CHUNK][GROUP];  // the input rows' codes of the block
        for (int i = 0; i < CHUNK; ++i) {
            const __m256i codes = load<__m256i>(x.codes(m0 + i, b, 0));
            store(words[i], _mm256_cvtepi8_epi16(_mm256_castsi256_si128(codes)));
            store(words[i] + 16, _mm256_cvtepi8_epi16(_mm256_extracti128_si256(codes, 1)));
        }
        // (hidden from GCC, which otherwise kept the words in registers and took each pair out with
        // shifts and moves: 98 against 134 Gvalue-rows/s)
        const int16_t* input = &words[0][0];
        asm("" : "+r"(input) : : "memory");
        __m256i a[2][CHUNK];
        for (auto& half : a)
            for (auto& v : half) v = _mm256_setzero_si256();
#pragma GCC unroll 16
        for (int p = 0; p < L::VALUES / 2; ++p) {
            __m256i codes[2];  // rows 8 h to 8 h + 7
            for (int h = 0; h < 2; ++h) codes[h] = _mm256_cvtepi8_epi16(load<__m128i>(block + 32 * p + 16 * h));
            for (int i = 0; i < CHUNK; ++i) {
                const __m256i pair = _mm256_set1_epi32(load<int32_t>(input + GROUP * i + 2 * p));
                for (int h = 0; h < 2; ++h) {
                    a[h][i] = _mm256_add_epi32(a[h][i], _mm256_madd_epi16(codes[h], pair));
                    if (p < L::VALUES / 2 - 1) asm("" : "+x"(a[h][i]));  // a chain of adds (rows16_sub_block's)
                }
            }
        }
        for (int h = 0; h < 2; ++h) {
            const Lanes d = (Lanes)_mm256_cvtph_ps(load<__m128i>(block + L::D + 16 * h));
            for (int i = 0; i < CHUNK; ++i) sums[h][i] += block_term<false>((Sums)a[h][i], d * x.scale(m0 + i, b), Lanes{}, 0.0f);
        }
    }
    for (int h = 0; h < 2; ++h)
        for (int i = 0; i < CHUNK; ++i) store(y + (m0 + i) * y_stride + 8 * h, sums[h][i]);
}

// rows16_chunk over the layouts whose codes index a table with AVX2: each block's four quads of the sixteen rows' codes, the
// low nibbles' then the high ones', looked up (a byte shuffle for eight rows' four codes), their
// magnitudes met by four input codes broadcast with the values' signs (maddubs, whose 16-bit pairs the
// AVX-512 kernel's unsigned codes, up to 241, would saturate), each step's pairs taken into 32 bits by a
// madd (two steps' could pass 32767: 2 x 127 x 127 each); each block's term as the AVX-512 kernel's.
inline Lanes block_scales(IQ4Rows16, const uint8_t* block, int h) {  // rows 8 h to 8 h + 7
    const Lanes k = (Lanes)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
        reinterpret_cast<const __m128i*>(block + IQ4Rows16::K + 8 * h))));
    return (Lanes)_mm256_cvtph_ps(load<__m128i>(block + IQ4Rows16::D + 16 * h)) * k;
}
inline Lanes block_scales(MXFP4Rows16, const uint8_t* block, int h) {
    return (Lanes)exponent_scale_bits((Sums)_mm256_cvtepu8_epi32(_mm_loadl_epi64(
        reinterpret_cast<const __m128i*>(block + MXFP4Rows16::E + 8 * h))));
}
template <int CHUNK, int ROWS, typename L, std::enable_if_t<looks_up_codes<L>(), int> = 0>
inline void rows16_chunk(const RoundedGroup<L, ROWS>& x, int m0, const uint8_t* blocks, int64_t count, float* y,
                         int64_t y_stride) {
    const __m256i nibble = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(L::TABLE)));
    Lanes sums[2][CHUNK] = {};
    for (int64_t b = 0; b < count; ++b) {
        const uint8_t* block = blocks + b * L::BLOCK_BYTES;
        if (m0 == 0) fetch_lines(block + ROWS16_AHEAD, L::BLOCK_BYTES);  // (never faults past the end)
        const int8_t* xb[CHUNK];  // the block's codes
        for (int i = 0; i < CHUNK; ++i) xb[i] = x.codes(m0 + i, b, 0);
        __m256i a[2][CHUNK];
        for (auto& half : a)
            for (auto& v : half) v = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int step = 0; step < 8; ++step) {  // quad step % 4, its low nibbles (values 4 q on), then the high
            const int q = step % 4, high = step / 4;
            __m256i values[2], magnitudes[2];  // rows 8 h to 8 h + 7
            for (int h = 0; h < 2; ++h) {
                const __m256i bytes = load<__m256i>(block + 64 * q + 32 * h);
                values[h] = _mm256_shuffle_epi8(table, _mm256_and_si256(high ? _mm256_srli_epi16(bytes, 4) : bytes, nibble));
                magnitudes[h] = _mm256_abs_epi8(values[h]);
            }
            for (int i = 0; i < CHUNK; ++i) {
                const __m256i x4 = _mm256_set1_epi32(load<int32_t>(xb[i] + 16 * high + 4 * q));
                for (int h = 0; h < 2; ++h) {
                    const __m256i pairs = _mm256_maddubs_epi16(magnitudes[h], _mm256_sign_epi8(x4, values[h]));
                    a[h][i] = _mm256_add_epi32(a[h][i], _mm256_madd_epi16(pairs, ones));
                }
            }
        }
        for (int h = 0; h < 2; ++h) {
            const Lanes d = block_scales(L{}, block, h);
            for (int i = 0; i < CHUNK; ++i) sums[h][i] += block_term<false>((Sums)a[h][i], d * x.scale(m0 + i, b), Lanes{}, 0.0f);
        }
    }
    for (int h = 0; h < 2; ++h)
        for (int i = 0; i < CHUNK; ++i) store(y + (m0 + i) * y_stride + 8 * h, sums[h][i]);
}

// Q6_K side by side (GGUF_Q6_K_ROWS16): each group of 16 values (four quads t) of the sixteen rows, its
// codes put together from their nibbles and bit pairs (shifts and masks, on other ports than the
// multiplies, and shared by the chunk's input rows), maddubs by four input codes broadcast, the four
// quads' pairs summed in 16 bits; the input row's group_offset_word then taken off, so that each
// 16-bit sum stands for the codes less 32 (the sums wrap past 32767, but their differences, at most
// 8 x 32 x 127 in magnitude, do not: 16-bit adds are exact modulo 65536), and one madd by the rows'
// scales of the group. A row's super-block ends in the exact integer that the AVX-512 build's
// pair_rows reaches over the file's layout, and takes the same float step. Per 32 products, 1.25
// multiply instructions (int8_rows over the file's layout: maddubs, then madd by the scales, 2).

using Q6KShares = FetchShares<Q6KRows16, 32, 4>;  // (a share for each group's four steps)

// a[i] += group G = 4 P + k's products (P a constant: where its bits lie) of weight rows 8 h to
// 8 h + 7 of ``block`` and input row i's codes of the super-block (``xq`` on, a record a row: each row
// a constant past the first, where pointers of their own took a register each and spilled), less
// its offsets (``offsets`` on, likewise), times the rows' scales of the group (the block ahead's
// share 16 h + 4 k + P of its lines fetched meanwhile: FetchShares).
template <int P, int CHUNK>
inline void rows16_group(__m256i (&a)[CHUNK], const uint8_t* block, int k, int h, const int8_t* xq,
                         const int32_t* offsets, Q6KShares fetch) {
    using L = Q6KRows16;
    const uint8_t* share = fetch.share(16 * h + 4 * k + P);
    constexpr int64_t CODES = L::VALUES, WORDS = L::VALUES / 16;  // a row's record
    const int G = 4 * P + k;
    const __m256i nibble = _mm256_set1_epi8(15), top_bits = _mm256_set1_epi8(0x30);
    __m256i products[CHUNK];  // 16-bit
    for (auto& p : products) p = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
        Q6KShares::fetch_line(share, t);
        const __m256i low = load<__m256i>(block + L::low_at(G, t, h));
        const __m256i high = load<__m256i>(block + L::high_at(G, t, h));
        constexpr int up = 4 - 2 * P;  // the group's bit pair to bits 4 and 5
        const __m256i placed = up > 0 ? _mm256_slli_epi16(high, up) : up < 0 ? _mm256_srli_epi16(high, -up) : high;
        const __m256i codes = _mm256_or_si256(_mm256_and_si256(P < 2 ? low : _mm256_srli_epi16(low, 4), nibble),
                                              _mm256_and_si256(placed, top_bits));
        for (int i = 0; i < CHUNK; ++i) {
            const __m256i x4 = _mm256_set1_epi32(load<int32_t>(xq + CODES * i + 16 * G + 4 * t));
            products[i] = _mm256_add_epi16(products[i], _mm256_maddubs_epi16(codes, x4));
            if (t < 3) asm("" : "+x"(products[i]));  // a chain of adds (rows16_sub_block's)
        }
    }
    // the rows' scales of the group, each in both 16-bit halves of its lane
    const __m256i scale = _mm256_cvtepi8_epi32(_mm_loadl_epi64(
        reinterpret_cast<const __m128i*>(block + L::SCALES + G * L::ROWS + 8 * h)));
    const __m256i both = _mm256_blend_epi16(scale, _mm256_slli_epi32(scale, 16), 0xAA);
    for (int i = 0; i < CHUNK; ++i) {
        const __m256i less_32 = _mm256_sub_epi16(products[i], _mm256_set1_epi32(offsets[WORDS * i + G]));
        a[i] = _mm256_add_epi32(a[i], _mm256_madd_epi16(less_32, both));
    }
}

// rows16_chunk over GGUF_Q6_K_ROWS16: the sixteen groups of each super-block, one half of the weight
// rows at a time, then the super-block's float step a row.
template <int CHUNK, int ROWS>
inline void rows16_chunk(const RoundedGroup<Q6KRows16, ROWS>& x, int m0, const uint8_t* blocks, int64_t supers,
                         float* y, int64_t y_stride) {
    using L = Q6KRows16;
    Lanes sums[2][CHUNK] = {};
    for (int64_t s = 0; s < supers; ++s) {
        const uint8_t* block = blocks + s * L::BLOCK_BYTES;
        const auto fetch = Q6KShares::for_chunk<ROWS, CHUNK>(block, m0);
        const int8_t* xq = x.codes(m0, s, 0);  // the super-block's codes, in order
        const int32_t* offsets = x.group_offsets(m0, s);
        const float* dx = x.super_block_scales(s) + m0;
        for (int h = 0; h < 2; ++h) {  // rows 8 h to 8 h + 7
            __m256i a[CHUNK];
            for (auto& v : a) v = _mm256_setzero_si256();
            for (int k = 0; k < 4; ++k) {  // groups k, 4 + k, 8 + k and 12 + k
                rows16_group<0>(a, block, k, h, xq, offsets, fetch);
                rows16_group<1>(a, block, k, h, xq, offsets, fetch);
                rows16_group<2>(a, block, k, h, xq, offsets, fetch);
                rows16_group<3>(a, block, k, h, xq, offsets, fetch);
            }
            const Lanes d = load<Lanes>(block + L::D + 32 * h);
            for (int i = 0; i < CHUNK; ++i)
                sums[h][i] = super_block_step<false>(sums[h][i], (Sums)a[i], Sums{}, d * dx[i], Lanes{});
        }
    }
    for (int h = 0; h < 2; ++h)
        for (int i = 0; i < CHUNK; ++i) store(y + (m0 + i) * y_stride + 8 * h, sums[h][i]);
}
#endif

// Input rows a rows16_chunk takes: Q6_K's one half of the weight rows at a time, so that its codes,
// put together with more instructions than Q4_K's, serve eight input rows; and with AVX-512's 32
// registers Q5_K's, whose fifth bits cost their own (8192 x 2048, two Zen 4 threads, 16 / 64 rows:
// 183 / 185 Gvalue-rows/s four rows at a time, 225 / 233 eight), and Q8_0's, whose code sums and
// flipped input do (2560 x 960: 200 / 249 four at a time, 221 / 265 eight).
template <typename L>
constexpr int rows16_chunk_rows() {
    constexpr bool wide = VECTOR_BYTES == 64;
    return std::is_same_v<L, Q6KRows16> || (wide && (std::is_same_v<L, Q5KRows16> || std::is_same_v<L, Q80Rows16> ||
                                                     looks_up_codes<L>()))
               ? 8 : ROWS16_CHUNK;
}

// y[m][o] = x[m] . w[o] for the group's ROWS input rows and the sixteen weight rows from ``first``
// (a block of layout L), rows16_chunk_rows<L>() input rows at a time, the block's bytes of a super-block
// read from L1 again for each later chunk.
template <int ROWS, typename L>
inline void rows16(const RoundedGroup<L, ROWS>& x, const BlockWeights& w, int64_t first, int64_t count, float* y,
                   int64_t y_stride) {
    static_assert(TASK_ROWS == L::ROWS, "a task is one block of sixteen rows");
    if (count != L::ROWS || first % L::ROWS != 0) __builtin_trap();  // (block_linear.py allows no other)
    constexpr int CHUNK = std::min(ROWS, rows16_chunk_rows<L>()), WHOLE = ROWS / CHUNK * CHUNK;
    const int64_t blocks = w.in / L::VALUES;
    for (int m0 = 0; m0 < WHOLE; m0 += CHUNK) rows16_chunk<CHUNK>(x, m0, w.row(first), blocks, y + first, y_stride);
    if constexpr (WHOLE < ROWS) rows16_chunk<ROWS - WHOLE>(x, WHOLE, w.row(first), blocks, y + first, y_stride);
}
#endif

}  // namespace
