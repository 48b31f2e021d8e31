// How each block format keeps a weight row, and what the products (block_weights.h) read of it: a
// 32-value block's codes as unsigned bytes, the scale each lane of their integer sums takes, the
// term a format's minimums or offsets add, and the row's values widened to floats.
//
// Loom's own layouts (block_linear.py; GGUF's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and IQ4 are rearranged
// into them at load, exactly) keep a row as its codes, then its float32 scales, then (4 and 5 bits)
// its float32 minimums (LOOM_IQ4: its scales in two parts):
// - LOOM_4BIT: w = d q + m, q in 0..15; byte j of a block holds value j (low nibble) and j + 16.
// - LOOM_5BIT: LOOM_4BIT's nibbles, then each block's 32 fifth bits (bit j: value j's, 16 times it):
//   w = d q + m, q in 0..31.
// - LOOM_8BIT: w = d q, q in -127..127.
// - LOOM_IQ4 (IQ4_NL's and IQ4_XS's numbers): LOOM_4BIT's nibbles, indices into a table of sixteen
//   8-bit codes, then a float32 scale and a signed byte multiplying it a block (LoomIQ4 below).
// GGUF's K-quants are read as the file lays them out (memory-mapped, not copied; but with AVX-512 or
// AVX2 a linear layer's Q4_K and Q5_K are laid out anew at load, GGUF_Q4_K_ROWS16 below), in super-blocks
// of 256 values (the layouts: llama.cpp's dequantize_row_q*_K, which each Super's codes follow):
// - GGUF_Q2_K (84 bytes): sixteen bytes of 4-bit scales sc and minimums m, 64 bytes of 2-bit codes,
//   float16 d and dmin: w = d sc_g q - dmin m_g for group g of 16.
// - GGUF_Q3_K (110 bytes): 32 bytes of third bits, 64 bytes of 2-bit codes, twelve bytes of sixteen
//   6-bit scales, float16 d: w = d (sc_g - 32) (q - 4), q in 0..7.
// - GGUF_Q4_K (144 bytes): float16 d and dmin, twelve bytes of eight 6-bit scales sc and minimums
//   m, 128 bytes of codes: w = d sc_j q - dmin m_j for sub-block j of 32. Bytes [32 c, 32 c + 32)
//   hold sub-block 2 c in their low nibbles and 2 c + 1 in their high ones.
// - GGUF_Q5_K (176 bytes): Q4_K's d, dmin and scales, then 32 bytes of high bits, then Q4_K's 128
//   bytes of low nibbles: code q = nibble + 16 (bit j of high byte l), value l of sub-block j.
// - GGUF_Q6_K (210 bytes): 128 bytes of low nibbles, 64 of high bit pairs, sixteen int8 scales, a
//   float16 d: w = d sc_g (q - 32) for group g of 16, q in 0..63.
// And layouts of Loom's own over a file's numbers (block_interleaved.h, made at load):
// - GGUF_Q4_K_ROWS16 (148 bytes a row's super-block; AVX-512 or AVX2): Q4_K's codes, scales,
//   minimums, d and dmin of sixteen rows side by side, so that a 512-bit vector holds four codes of
//   each of the sixteen (a 256-bit one, of eight).
// - GGUF_Q5_K_ROWS16 (180 bytes a row's super-block; AVX-512 or AVX2): the same with each code's
//   fifth bit, for Q5_K.
// - GGUF_Q8_0_ROWS16 (34 bytes a row's block, as Q8_0's; AVX2, or AVX-512 with VNNI): Q8_0's codes
//   and float16 scales of sixteen rows side by side, two codes of each row in turn (AVX-512: four).
// - GGUF_Q4_1_ROWS16 (20 bytes a row's block, as Q4_1's; AVX-512 or AVX2): Q4_1's (and Q4_0's, whose
//   minimum is -8 d) codes, float16 scales and minimums of sixteen rows side by side.
// - GGUF_Q5_0_ROWS16 (23 bytes a row's block, Q5_0's 22 and a spare; AVX-512 or AVX2): the same
//   with each code's fifth bit, and no minimum (Q5_0's: -16 d).
// - GGUF_IQ4_ROWS16 (19 bytes a row's block; AVX2, or AVX-512 with VNNI): IQ4_NL's and IQ4_XS's codes, d and
//   multipliers of sixteen rows side by side, four codes of each row in turn.
// - GGUF_MXFP4_ROWS16 (17 bytes a row's block, as the file's, and a spare byte a row; AVX2, or AVX-512
//   with VNNI): MXFP4's codes and exponents of sixteen rows side by side, as GGUF_IQ4_ROWS16's.
// - GGUF_Q6_K_ROWS16 (212 bytes a row's super-block; AVX2 builds without AVX-512): Q6_K's low
//   nibbles, high bit pairs, scales and d of sixteen rows side by side.
// And one over a file's float32 matrices (block_linear.py's padded_rows, made at load): FLOAT_PADDED,
// float32 rows ROW_PAD values longer than their width (the padding zero), for rows a multiple of
// 4 KiB long (AVX2 builds without AVX-512; cpu_linear.h's StoredWeights says why).

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "kv_element.h"

namespace {

constexpr int64_t GROUP = 32;  // values per block: the unit of the activations' 8-bit blocks too

enum Format : int64_t {
    FLOAT = 0, LOOM_4BIT = 4, LOOM_5BIT = 5, LOOM_8BIT = 8,
    GGUF_Q2_K = 10, GGUF_Q3_K = 11, GGUF_Q4_K = 12, GGUF_Q5_K = 13, GGUF_Q6_K = 14,
    FLOAT16 = 16, BFLOAT16 = 17, GGUF_Q4_K_ROWS16 = 18, GGUF_Q8_0_ROWS16 = 19,
    GGUF_Q4_1_ROWS16 = 20, GGUF_Q6_K_ROWS16 = 21, FLOAT_PADDED = 22,
    GGUF_Q5_0_ROWS16 = 23, GGUF_Q5_K_ROWS16 = 24, LOOM_IQ4 = 25, GGUF_IQ4_ROWS16 = 26, GGUF_MXFP4 = 27,
    GGUF_MXFP4_ROWS16 = 28
};
constexpr int64_t ROW_PAD = 16;  // values a FLOAT_PADDED row has past its width

typedef uint8_t Bytes __attribute__((vector_size(32)));
typedef int8_t SignedBytes __attribute__((vector_size(32)));
typedef uint8_t HalfBytes __attribute__((vector_size(16)));
typedef uint8_t EightBytes __attribute__((vector_size(8)));
typedef int8_t EightSigned __attribute__((vector_size(8)));
typedef int8_t SixteenSigned __attribute__((vector_size(16)));
typedef uint32_t FourWords __attribute__((vector_size(16)));
typedef int32_t Sums __attribute__((vector_size(32)));
typedef int16_t Shorts __attribute__((vector_size(32)));  // one per two bytes of a block
typedef float Lanes __attribute__((vector_size(32)));  // one lane per four bytes of a block
// Two blocks side by side: with AVX-512 the products take a pair at a time, one 512-bit instruction
// (block_weights.h's pair_rows and block_pair_rows). Elsewhere they take a block at a time: GCC's code for these types
// on 256-bit vectors ran 4-25x slower than the products a block at a time (an AVX2 build on Zen 5).
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr bool PAIRS = true;
#else
constexpr bool PAIRS = false;
#pragma GCC diagnostic ignored "-Wpsabi"  // the pair types' functions are compiled, never called
#endif
typedef uint8_t PairBytes __attribute__((vector_size(64)));
typedef int8_t PairSigned __attribute__((vector_size(64)));
typedef int32_t PairSums __attribute__((vector_size(64)));
typedef float PairLanes __attribute__((vector_size(64)));
typedef int16_t PairShorts __attribute__((vector_size(64)));  // one per two bytes of a pair

template <typename V>
inline V load(const void* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

template <typename V>
inline void store(void* p, V v) {
    std::memcpy(p, &v, sizeof v);
}

template <typename V>
inline auto first_half(V v) {
    return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
                                   21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
}
template <typename V>
inline auto second_half(V v) {
    return __builtin_shufflevector(v, v, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50,
                                   51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63);
}

// Lane l: the sum over bytes [4 l, 4 l + 4) of u s, u unsigned and s signed (one VNNI instruction;
// two with AVX2, whose 16-bit pair sums hold 2 x 127 x 128: every format's codes stay below).
inline Sums dot_bytes(Bytes u, SignedBytes s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return (Sums)_mm256_dpbusd_epi32(_mm256_setzero_si256(), (__m256i)u, (__m256i)s);
#elif defined(__AVXVNNI__)
    return (Sums)_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), (__m256i)u, (__m256i)s);
#elif defined(__AVX2__)
    return (Sums)_mm256_madd_epi16(_mm256_maddubs_epi16((__m256i)u, (__m256i)s), _mm256_set1_epi16(1));
#else
    Sums sums;
    for (int l = 0; l < 8; ++l) {
        int32_t sum = 0;
        for (int k = 4 * l; k < 4 * l + 4; ++k) sum += int32_t(u[k]) * int32_t(s[k]);
        sums[l] = sum;
    }
    return sums;
#endif
}

inline PairSums dot_pairs(PairBytes u, PairSigned s) {
#if defined(__AVX512VNNI__)
    return (PairSums)_mm512_dpbusd_epi32(_mm512_setzero_si512(), (__m512i)u, (__m512i)s);
#else
    const Sums low = dot_bytes(first_half(u), first_half(s)), high = dot_bytes(second_half(u), second_half(s));
    return __builtin_shufflevector(low, high, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
}

// dot_scaled's arithmetic a lane at a time, for a block's sums or a pair's (builds without the
// instructions).
template <typename S, typename U, typename V, typename W>
inline S scaled_sums(S sums, U u, V s, W scales) {
    for (int l = 0; l < int(sizeof(S) / sizeof(int32_t)); ++l)
        for (int k = 0; k < 2; ++k) {
            const int b = 4 * l + 2 * k;
            sums[l] += (int32_t(u[b]) * s[b] + int32_t(u[b + 1]) * s[b + 1]) * scales[2 * l + k];
        }
    return sums;
}

// sums + the pair's products u s (u unsigned, s signed) in adjacent twos, each two times its
// ``scales`` lane, summed in adjacent twos again: lane l of the result adds bytes [4 l, 4 l + 4)'s
// products, those of bytes 4 l, 4 l + 1 times scale 2 l and 4 l + 2, 4 l + 3 times scale 2 l + 1.
inline PairSums dot_scaled(PairSums sums, PairBytes u, PairSigned s, PairShorts scales) {
#if defined(__AVX512BW__)
    const __m512i pairs = _mm512_maddubs_epi16((__m512i)u, (__m512i)s);
#if defined(__AVX512VNNI__)
    return (PairSums)_mm512_dpwssd_epi32((__m512i)sums, pairs, (__m512i)scales);
#else
    return sums + (PairSums)_mm512_madd_epi16(pairs, (__m512i)scales);
#endif
#else
    return scaled_sums(sums, u, s, scales);
#endif
}

// dot_scaled for one block (the products a block at a time, builds without AVX-512: AVX2's maddubs
// and madd, as llama.cpp's AVX2 K-quant products).
inline Sums dot_scaled(Sums sums, Bytes u, SignedBytes s, Shorts scales) {
#if defined(__AVX2__)
    return sums + (Sums)_mm256_madd_epi16(_mm256_maddubs_epi16((__m256i)u, (__m256i)s), (__m256i)scales);
#else
    return scaled_sums(sums, u, s, scales);
#endif
}

// The ``width`` bits of each byte of v from bit ``from`` moved to bit ``to`` (the K-quants' high bits
// above their low ones): one 16-bit shift and an and, where GCC wrote a byte shift left by n as n
// additions (Q6_K's codes took four a block). The bits a 16-bit shift carries over a byte's edge
// fall outside the mask.
template <typename V>
inline V move_bits(V v, int from, int to, int width) {
    typedef uint16_t Words __attribute__((vector_size(sizeof(V))));
    const Words words = (Words)v;
    const Words moved = to >= from ? words << (to - from) : words >> (from - to);
    return (V)moved & uint8_t(((1 << width) - 1) << to);
}

// Two 32-byte vectors (a pair of blocks' bytes, or their shorts) as one of 64 bytes: one insert with
// AVX-512, where GCC's shuffle of bytes took a permute of all 64.
template <typename V, size_t... I>
inline auto joined(V a, V b, std::index_sequence<I...>) {
    return __builtin_shufflevector(a, b, I...);
}
template <typename V>
inline auto pair_of(V a, V b) {
    static_assert(sizeof(V) == 32);
#if defined(__AVX512F__)
    typedef std::remove_reference_t<decltype(a[0])> Lane;
    typedef Lane Pair __attribute__((vector_size(64)));
    return (Pair)_mm512_inserti64x4(_mm512_castsi256_si512((__m256i)a), (__m256i)b, 1);
#else
    return joined(a, b, std::make_index_sequence<2 * sizeof(V) / sizeof(a[0])>());
#endif
}

inline float half_to_float(const uint8_t* p) { return Element<float, Float16>::widen(load<Float16>(p)); }

// The first and last eight of sixteen bytes.
template <typename V>
inline auto low_eight(V v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7); }
template <typename V>
inline auto high_eight(V v) { return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15); }

// Eight bytes as floats. (GCC writes __builtin_convertvector from bytes as scalar code, a lane at a
// time: 64 scalar conversions per Q4_K super-block of four rows, a one-row product at a quarter of
// its speed; x86 gets the two-instruction intrinsics.)
inline Lanes widen_eight(EightBytes b) {
#if defined(__AVX2__)
    return (Lanes)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(&b))));
#else
    return __builtin_convertvector(b, Lanes);
#endif
}
inline Lanes widen_eight(EightSigned b) {
#if defined(__AVX2__)
    return (Lanes)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(&b))));
#else
    return __builtin_convertvector(b, Lanes);
#endif
}

// Sixteen bytes as 16-bit integers (signed, or unsigned from HalfBytes).
inline Shorts widen_sixteen(SixteenSigned b) {
#if defined(__AVX2__)
    return (Shorts)_mm256_cvtepi8_epi16((__m128i)b);
#else
    return __builtin_convertvector(b, Shorts);
#endif
}
inline Shorts widen_sixteen(HalfBytes b) {
#if defined(__AVX2__)
    return (Shorts)_mm256_cvtepu8_epi16((__m128i)b);
#else
    return __builtin_convertvector(b, Shorts);
#endif
}

// Each format: VALUES per super-block (the unit of its row's bytes), row_bytes(in), and a Super,
// one super-block of one row decoded: codes(j) of its block j, signed(j, x) (x as its codes'
// products need it), scales(j) per lane, offset(sums, halves) (a vector whose lanes sum to what the
// minimums add, given the activations' per-32 and per-16 sums from the super-block on), and
// widen(out), its values as floats.
//
// The K-quants' Supers also give the exact integers that their products of every row count share
// (block_weights.h's super_block_step, so that a row's numbers do not depend on its batch): GROUPS
// integer scales a super-block (group_scales(), of 256 / GROUPS values each), and offset_weights(),
// per group of 16 values the integer the input's code sum over it is multiplied by: the minimums
// (with their own float scale dmin) where MINS, else the codes' offset times the group's scale,
// which joins the codes' sums.

// Bit j of ``bits`` as byte j: 16 where it is set, else 0 (the fifth bit of a block's codes).
inline Bytes sixteens_of_bits(uint32_t bits) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return (Bytes)_mm256_maskz_set1_epi8(__mmask32(bits), 16);
#elif defined(__AVX2__)  // byte j takes byte j / 8 of bits, then tests its bit j % 8
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(int32_t(bits)),
                                               _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                 0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201));
    return (Bytes)_mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
#else
    Bytes b;
    for (int j = 0; j < 32; ++j) b[j] = uint8_t((bits >> j) & 1) << 4;
    return b;
#endif
}
inline PairBytes sixteens_of_bits(uint64_t bits) {
#if defined(__AVX512BW__)
    return (PairBytes)_mm512_maskz_set1_epi8(__mmask64(bits), 16);
#else
    return pair_of(sixteens_of_bits(uint32_t(bits)), sixteens_of_bits(uint32_t(bits >> 32)));
#endif
}

// What most formats' Supers share: codes that are unsigned already, so the input meets them as it is
// (Loom8's signed codes move their signs onto it instead), ...
struct UnsignedCodes {
    static constexpr bool MOVES_SIGNS = false;  // the codes meet the input as it is
    SignedBytes signed_x(int, SignedBytes x) const { return x; }
    template <int>
    PairSigned pair_signed(PairSigned x) const { return x; }
};
// ... and pair P of a super-block as its blocks 2 P and 2 P + 1 (Q6_K, Q3_K, Q2_K).
struct ConsecutivePairs {
    static constexpr int first(int P) { return 2 * P; }
    static constexpr int second(int P) { return 2 * P + 1; }
};

// A block's sixteen bytes of nibbles as its 32 codes in the values' order (byte j holds value j in
// its low nibble, j + 16 in its high one); and two blocks' 32 bytes as their 64.
inline Bytes nibbles_of(HalfBytes packed) {
    return __builtin_shufflevector(packed & 15, packed >> 4, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,
                                   17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
}
inline PairBytes pair_nibbles_of(Bytes packed) {
    const Bytes low = packed & 15, high = packed >> 4;
#if defined(__AVX512F__)  // the four 16-byte quarters in the order low 0, high 0, low 1, high 1
    const __m512i both = (__m512i)pair_of(low, high);
    return (PairBytes)_mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));
#else
    return __builtin_shufflevector(low, high, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 32, 33, 34, 35, 36,
                                   37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25,
                                   26, 27, 28, 29, 30, 31, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63);
#endif
}

// LOOM_4BIT, and with HIGH LOOM_5BIT: the same codes with a fifth bit each, a block's 32 of them
// (bit j: value j) between the nibbles and the scales.
template <bool HIGH>
struct LoomNibbles {
    static constexpr int64_t ROUNDING = GROUP;  // values under one scale of the rounded input
    static constexpr int64_t VALUES = GROUP;
    static int64_t row_bytes(int64_t in) { return in / 2 + (HIGH ? in / 8 : 0) + in / GROUP * 8; }
    static const float* scales_of(const uint8_t* row, int64_t in) {
        return reinterpret_cast<const float*>(row + in / 2 + (HIGH ? in / 8 : 0));
    }
    struct Super : UnsignedCodes {
        HalfBytes packed;
        uint32_t high;
        float d, m;
        Super() = default;
        Super(const uint8_t* row, int64_t in, int64_t s)
            : packed(load<HalfBytes>(row + s * 16)), high(HIGH ? load<uint32_t>(row + in / 2 + 4 * s) : 0),
              d(scales_of(row, in)[s]), m(scales_of(row, in)[in / GROUP + s]) {}
        Bytes codes(int) const {
            if constexpr (!HIGH) return nibbles_of(packed);
            return nibbles_of(packed) | sixteens_of_bits(high);
        }
        Lanes scales(int) const { return Lanes{} + d; }
        Lanes offset(const float* sums, const float*) const { return Lanes{m * sums[0]}; }
        void widen(float* out) const {
            const Bytes q = codes(0);
            for (int i = 0; i < 32; ++i) out[i] = d * float(q[i]) + m;
        }
    };
};
using Loom4 = LoomNibbles<false>;
using Loom5 = LoomNibbles<true>;

struct Loom8 {
    static constexpr int64_t ROUNDING = GROUP;  // values under one scale of the rounded input
    static constexpr int64_t VALUES = GROUP;
    static int64_t row_bytes(int64_t in) { return in + in / GROUP * 4; }
    // The codes are signed: their magnitudes meet x with the codes' signs moved onto it.
    struct Super {
        SignedBytes q;
        float d;
        Super() = default;
        Super(const uint8_t* row, int64_t in, int64_t s)
            : q(load<SignedBytes>(row + s * GROUP)), d(reinterpret_cast<const float*>(row + in)[s]) {}
        Bytes codes(int) const {
#if defined(__AVX2__)
            return (Bytes)_mm256_abs_epi8((__m256i)q);
#else
            return (Bytes)(q < 0 ? -q : q);
#endif
        }
        SignedBytes signed_x(int, SignedBytes x) const {
#if defined(__AVX2__)
            return (SignedBytes)_mm256_sign_epi8((__m256i)x, (__m256i)q);
#else
            return q < 0 ? -x : x;
#endif
        }
        Lanes scales(int) const { return Lanes{} + d; }
        Lanes offset(const float*, const float*) const { return Lanes{}; }
        void widen(float* out) const {
            for (int i = 0; i < 32; ++i) out[i] = d * float(q[i]);
        }
    };
};

// Loom's blocks two at a time, where a row holds an even number of them (every model's width so
// far), for the products that take a pair of blocks per instruction (block_weights.h's
// block_pair_rows, and the tiles).
template <bool HIGH>
struct LoomNibblePairs {
    using Single = LoomNibbles<HIGH>;
    static constexpr int64_t ROUNDING = GROUP;  // values under one scale of the rounded input
    static constexpr int64_t VALUES = 2 * GROUP;
    static int64_t row_bytes(int64_t in) { return Single::row_bytes(in); }
    static const float* scales_of(const uint8_t* row, int64_t in) { return Single::scales_of(row, in); }
    static const float* mins_of(const uint8_t* row, int64_t in) { return scales_of(row, in) + in / GROUP; }
    struct Super : UnsignedCodes {
        Bytes packed;  // block 2 s in bytes 0-15, 2 s + 1 in 16-31 (values j and j + 16 in byte j)
        uint64_t high;  // the two blocks' fifth bits, block 2 s's in the low half
        float d[2], m[2];
        static constexpr bool MINS = true;
        static constexpr int CODE_OFFSET = 0;  // what the codes read stand above the format's
        Super() = default;
        Super(const uint8_t* row, int64_t in, int64_t s)
            : packed(load<Bytes>(row + s * 32)), high(HIGH ? load<uint64_t>(row + in / 2 + 8 * s) : 0) {
            const float* scales = Single::scales_of(row, in);
            d[0] = scales[2 * s], d[1] = scales[2 * s + 1];
            m[0] = scales[in / GROUP + 2 * s], m[1] = scales[in / GROUP + 2 * s + 1];
        }
        template <int>
        PairBytes pair_codes() const {
            if constexpr (!HIGH) return pair_nibbles_of(packed);
            return pair_nibbles_of(packed) | sixteens_of_bits(high);
        }
        void widen(float* out) const {
            const PairBytes q = pair_codes<0>();
            for (int i = 0; i < 64; ++i) out[i] = d[i / 32] * float(q[i]) + m[i / 32];
        }
    };
};
using Loom4Pairs = LoomNibblePairs<false>;
using Loom5Pairs = LoomNibblePairs<true>;

struct Loom8Pairs {
    static constexpr int64_t ROUNDING = GROUP;  // values under one scale of the rounded input
    static constexpr int64_t VALUES = 2 * GROUP;
    static int64_t row_bytes(int64_t in) { return Loom8::row_bytes(in); }
    static const float* scales_of(const uint8_t* row, int64_t in) { return reinterpret_cast<const float*>(row + in); }
    struct Super {
        PairSigned q;
        float d[2];
        static constexpr bool MINS = false;
        Super() = default;
        Super(const uint8_t* row, int64_t in, int64_t s) : q(load<PairSigned>(row + s * 64)) {
            const float* scales = reinterpret_cast<const float*>(row + in);
            d[0] = scales[2 * s], d[1] = scales[2 * s + 1];
        }
#if defined(__AVX512VNNI__)
        // The codes shifted to unsigned ones, q + 128 (VNNI's dpbusd sums their products with the
        // input in 32 bits, where maddubs's 16-bit pair sums would saturate), and each block's
        // integer sum takes 128 times the input block's code sum back: the codes' signs moved onto
        // the input instead cost two instructions per pair and input row (8192 x 2048, two Zen 5
        // threads: 64 rows 86 -> 89-92 Gvalue-rows/s).
        static constexpr int CODE_OFFSET = 128;
        static constexpr bool MOVES_SIGNS = false;
        template <int>
        PairBytes pair_codes() const { return (PairBytes)q ^ 0x80; }
        template <int>
        PairSigned pair_signed(PairSigned x) const { return x; }
#else
        static constexpr int CODE_OFFSET = 0;
        static constexpr bool MOVES_SIGNS = true;  // the codes' magnitudes meet the input with their signs
        template <int>
        PairBytes pair_codes() const { return (PairBytes)(q < 0 ? -q : q); }
        template <int>
        PairSigned pair_signed(PairSigned x) const { return q < 0 ? -x : x; }
#endif
        void widen(float* out) const {
            for (int i = 0; i < 64; ++i) out[i] = d[i / 32] * float(q[i]);
        }
    };
};

// IQ4_NL's and IQ4_XS's sixteen values, which their 4-bit codes index (llama.cpp's kvalues_iq4nl).
alignas(16) constexpr int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// MXFP4's sixteen values (E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) doubled into
// integers, as llama.cpp's kvalues_mxfp4 holds them; a block's scale is halved to match.
alignas(16) constexpr int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// The values of TABLE (sixteen int8s) that 32 codes of 4 bits index (a pair's 64): one byte shuffle,
// the table in each 128-bit lane.
template <const int8_t* TABLE = IQ4_VALUES>
inline SignedBytes table_values(Bytes codes) {
#if defined(__AVX2__)
    const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(TABLE)));
    return (SignedBytes)_mm256_shuffle_epi8(table, (__m256i)codes);
#else
    SignedBytes values;
    for (int j = 0; j < 32; ++j) values[j] = TABLE[codes[j]];
    return values;
#endif
}
template <const int8_t* TABLE = IQ4_VALUES>
inline PairSigned table_values(PairBytes codes) {
#if defined(__AVX512BW__)
    const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(TABLE)));
    return (PairSigned)_mm512_shuffle_epi8(table, (__m512i)codes);
#else
    return pair_of(table_values<TABLE>(first_half(codes)), table_values<TABLE>(second_half(codes)));
#endif
}

// LOOM_IQ4, IQ4_NL's and IQ4_XS's numbers: LOOM_4BIT's nibbles, each the index of one of
// IQ4_VALUES, then a float32 scale d a block, then a signed byte k a block: w = d k IQ4_VALUES[q]
// (IQ4_NL: its d, k = 1; IQ4_XS: its super-block's d, k its 6-bit sub-scale less 32; the product
// exact in float32, as llama.cpp computes it). 21 bytes a block, a size no other format's rows take
// (block_linear.py tells formats apart by their rows' bytes; d k as one float32 would be Q4_1 side by
// side's 20): where the build lays IQ4 rows side by side (AVX-512 with VNNI, or AVX2), the products
// read GGUF_IQ4_ROWS16's 19 instead. The products meet the looked-up values as Loom8's codes.
struct LoomIQ4 {
    static constexpr int64_t ROUNDING = GROUP;  // values under one scale of the rounded input
    static constexpr int64_t VALUES = GROUP;
    static int64_t row_bytes(int64_t in) { return in / 2 + in / GROUP * 5; }
    // where a row's d and k begin (its d's as bytes: a row of 21 bytes a block need not start at a
    // float's alignment)
    static const uint8_t* scales_d(const uint8_t* row, int64_t in) { return row + in / 2; }
    static const int8_t* multipliers(const uint8_t* row, int64_t in) {
        return reinterpret_cast<const int8_t*>(row + in / 2 + in / GROUP * 4);
    }
    static float d_of(const uint8_t* row, int64_t in, int64_t b) { return load<float>(scales_d(row, in) + 4 * b); }
    static float scale(const uint8_t* row, int64_t in, int64_t b) {  // block b's d k
        return d_of(row, in, b) * float(multipliers(row, in)[b]);
    }
    struct Super : Loom8::Super {
        Super() = default;
        Super(const uint8_t* row, int64_t in, int64_t s) {
            q = table_values(nibbles_of(load<HalfBytes>(row + s * 16)));
            d = scale(row, in, s);
        }
    };
};
struct LoomIQ4Pairs {
    static constexpr int64_t ROUNDING = GROUP;  // values under one scale of the rounded input
    static constexpr int64_t VALUES = 2 * GROUP;
    static int64_t row_bytes(int64_t in) { return LoomIQ4::row_bytes(in); }
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    // blocks [b, b + count)'s scales d k (count <= 8; zeros past), for block_pair_rows
    static Lanes scale_lanes(const uint8_t* row, int64_t in, int64_t b, int count) {
        const __mmask8 mask = __mmask8((1u << count) - 1);
        const __m256 d = _mm256_maskz_loadu_ps(mask, LoomIQ4::scales_d(row, in) + 4 * b);
        const __m128i k = _mm_maskz_loadu_epi8(__mmask16(mask), LoomIQ4::multipliers(row, in) + b);
        return (Lanes)_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(k)));
    }
#endif
    struct Super : Loom8Pairs::Super {
        Super() = default;
        Super(const uint8_t* row, int64_t in, int64_t s) {
            q = table_values(pair_nibbles_of(load<Bytes>(row + s * 32)));
            d[0] = LoomIQ4::scale(row, in, 2 * s), d[1] = LoomIQ4::scale(row, in, 2 * s + 1);
        }
    };
};

// GGUF_MXFP4 (gpt-oss's experts), as the file lays it out: per 32 values an E8M0 exponent byte e, then
// sixteen bytes of 4-bit codes (LOOM_4BIT's nibble order) indexing MXFP4_VALUES: w = 2^(e - 128)
// MXFP4_VALUES[q], the doubled values under a halved scale, as llama.cpp computes it (its
// GGML_E8M0_TO_FP32_HALF). 17 bytes a block, a size no other format's rows take. The products meet
// the looked-up values as Loom8's codes.
// 2^(e - 128) as a float's bits (a subnormal's below 2^-126) for an exponent byte e: an int32_t, or a
// vector of them, a lane each (the side-by-side layout's products take sixteen rows' at once).
template <typename I>
inline I exponent_scale_bits(I e) {
    return e < 2 ? (I{} + 0x00200000) << e : (e - 1) << 23;
}
struct MXFP4 {
    static constexpr int64_t ROUNDING = GROUP;  // values under one scale of the rounded input
    static constexpr int64_t VALUES = GROUP, BYTES = 17;
    static int64_t row_bytes(int64_t in) { return in / GROUP * BYTES; }
    static float exponent_scale(int32_t e) {  // 2^(e - 128)
        const int32_t bits = exponent_scale_bits(e);
        float d;
        std::memcpy(&d, &bits, 4);
        return d;
    }
    static float scale(const uint8_t* row, int64_t b) { return exponent_scale(row[b * BYTES]); }
    static HalfBytes nibbles(const uint8_t* row, int64_t b) { return load<HalfBytes>(row + b * BYTES + 1); }
    struct Super : Loom8::Super {
        Super() = default;
        Super(const uint8_t* row, int64_t, int64_t s) {
            q = table_values<MXFP4_VALUES>(nibbles_of(MXFP4::nibbles(row, s)));
            d = scale(row, s);
        }
    };
};
struct MXFP4Pairs {
    static constexpr int64_t ROUNDING = GROUP;  // values under one scale of the rounded input
    static constexpr int64_t VALUES = 2 * GROUP;
    static int64_t row_bytes(int64_t in) { return MXFP4::row_bytes(in); }
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    // blocks [b, b + count)'s scales (count <= 8; zeros past), for block_pair_rows
    static Lanes scale_lanes(const uint8_t* row, int64_t, int64_t b, int count) {
        Lanes d = {};
        for (int i = 0; i < count; ++i) d[i] = MXFP4::scale(row, b + i);
        return d;
    }
#endif
    struct Super : Loom8Pairs::Super {
        Super() = default;
        Super(const uint8_t* row, int64_t, int64_t s) {
            const HalfBytes first = MXFP4::nibbles(row, 2 * s), second = MXFP4::nibbles(row, 2 * s + 1);
            q = table_values<MXFP4_VALUES>(pair_nibbles_of(__builtin_shufflevector(
                first, second, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24,
                25, 26, 27, 28, 29, 30, 31)));
            d[0] = MXFP4::scale(row, 2 * s), d[1] = MXFP4::scale(row, 2 * s + 1);
        }
    };
};

// Q4_K, and with HIGH Q5_K: the same super-block with a fifth bit a code, 32 bytes of them before
// the nibbles.
template <bool HIGH>
struct KQuantWithMins {
    static constexpr int64_t ROUNDING = 256;  // as llama.cpp's Q8_K: one scale a super-block
    static constexpr int64_t VALUES = 256, BYTES = HIGH ? 176 : 144;
    // where sub-block b's input codes lie in the rounded input: each pair's (Super::first and
    // second) side by side, 0 2 1 3 4 6 5 7
    static constexpr int input_slot(int b) { return (b & ~3) | (b & 1) << 1 | (b & 2) >> 1; }
    static int64_t row_bytes(int64_t in) { return in / VALUES * BYTES; }
    struct Super : UnsignedCodes {
        const uint8_t *qs, *qh;  // the nibbles, and with HIGH the fifth bits
        Lanes scale, low;  // sub-block j's d sc_j and dmin m_j
        PairShorts sc;     // sub-block j's sc_j in lane j (a whole vector: a narrower one was stored
        float d, dmin;     // to the stack and read back whole, each time a store-forwarding stall)
        uint64_t min_codes;  // sub-block j's m_j in byte j
        static constexpr int GROUPS = 8;
        static constexpr bool MINS = true;
        Super() = default;
        Super(const uint8_t* row, int64_t, int64_t s) {
            const uint8_t* block = row + s * BYTES;
            qh = block + 16;
            qs = block + (HIGH ? 48 : 16);
            // twelve bytes: low 6 bits of scales 0-3, of minimums 0-3; then scales 4-7 and minimums
            // 4-7 as low and high nibbles, their top two bits in the first eight bytes' top bits
            uint32_t first, second, rest;
            std::memcpy(&first, block + 4, 4);
            std::memcpy(&second, block + 8, 4);
            std::memcpy(&rest, block + 12, 4);
            const uint64_t scales = uint64_t(first & 0x3F3F3F3F) |
                                    uint64_t((rest & 0x0F0F0F0F) | ((first >> 2) & 0x30303030)) << 32;
            const uint64_t mins = uint64_t(second & 0x3F3F3F3F) |
                                  uint64_t(((rest >> 4) & 0x0F0F0F0F) | ((second >> 2) & 0x30303030)) << 32;
            d = half_to_float(block);
            dmin = half_to_float(block + 2);
            min_codes = mins;
            scale = widen_eight(load<EightBytes>(&scales)) * d;
            low = widen_eight(load<EightBytes>(&mins)) * dmin;
#if defined(__AVX512F__)
            sc = (PairShorts)_mm512_zextsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(int64_t(scales))));
#else
            sc = PairShorts{};
            for (int j = 0; j < 8; ++j) sc[j] = int16_t((scales >> (8 * j)) & 0xFF);
#endif
        }
        Bytes codes(int j) const {
            const Bytes q = load<Bytes>(qs + 32 * (j / 2)), nibbles = j % 2 ? q >> 4 : q & 15;
            if constexpr (!HIGH) return nibbles;
            return nibbles | move_bits(load<Bytes>(qh), j, 4, 1);
        }
        Lanes scales(int j) const { return Lanes{} + scale[j]; }
        Lanes offset(const float* sums, const float*) const { return -(low * load<Lanes>(sums)); }
        // Pair P: 64 bytes' low nibbles (P even) or high ones (P odd), blocks first(P) and first(P) + 2
        static constexpr int first(int P) { return 4 * (P / 2) + P % 2; }
        static constexpr int second(int P) { return first(P) + 2; }
        template <int P>
        PairBytes pair_codes() const {
            const PairBytes q = load<PairBytes>(qs + 64 * (P / 2)), nibbles = P % 2 ? q >> 4 : q & 15;
            if constexpr (!HIGH) return nibbles;
            const Bytes high = load<Bytes>(qh);
            return nibbles | pair_of(move_bits(high, first(P), 4, 1), move_bits(high, second(P), 4, 1));
        }
        // sub-block J's scale across its sixteen twos of bytes
        template <int J>
        Shorts block_int_scales() const { return Shorts{} + sc[J]; }
        // the pair's two sub-block scales, each across its block's sixteen twos of bytes
        template <int P>
        PairShorts pair_int_scales() const {
            constexpr int a = first(P), b = second(P);
            return __builtin_shufflevector(sc, sc, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, b, b, b, b, b, b, b,
                                           b, b, b, b, b, b, b, b, b);
        }
        Sums group_scales() const { return __builtin_convertvector(low_eight(sc), Sums); }
        // each sub-block's minimum for both its sixteens
        Shorts offset_weights() const {
            const HalfBytes bytes = (HalfBytes)(FourWords{uint32_t(min_codes), uint32_t(min_codes >> 32), 0, 0});
            return widen_sixteen(__builtin_shufflevector(bytes, bytes, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7));
        }
        void widen(float* out) const {
            for (int j = 0; j < 8; ++j) {
                const Bytes q = codes(j);
                for (int i = 0; i < 32; ++i) out[32 * j + i] = scale[j] * float(q[i]) - low[j];
            }
        }
    };
};
using Q4K = KQuantWithMins<false>;
using Q5K = KQuantWithMins<true>;

// For the formats with a scale per group of 16 values (Q6_K, Q3_K, Q2_K), of group g in lane g:
// pair P's (blocks 2 P and 2 P + 1: groups 4 P to 4 P + 3) across its 32 twos of bytes, eight each,
template <int P>
inline PairShorts pair_group_scales(PairShorts groups) {
    constexpr int g = 4 * P, h = g + 1, i = g + 2, j = g + 3;
    return __builtin_shufflevector(groups, groups, g, g, g, g, g, g, g, g, h, h, h, h, h, h, h, h, i, i, i, i, i, i, i,
                                   i, j, j, j, j, j, j, j, j);
}
// and block J's (groups 2 J and 2 J + 1) across its sixteen twos of bytes, eight each, from the
// sixteen scales as bytes (a shuffle and a widening: taken from the 64-byte ``groups``, which builds
// without AVX-512 keep in memory, a one-row Q6_K product on AVX2 ran at 18 GB/s against 26);
template <int J>
inline Shorts block_group_scales(SixteenSigned bytes) {
    constexpr int g = 2 * J, h = g + 1;
    const SixteenSigned spread = __builtin_shufflevector(bytes, bytes, g, g, g, g, g, g, g, g, h, h, h, h, h, h, h, h);
#if defined(__AVX2__)
    return (Shorts)_mm256_cvtepi8_epi16((__m128i)spread);
#else
    return __builtin_convertvector(spread, Shorts);
#endif
}
// and the sixteen scales as bytes in the low sixteen lanes of a pair's shorts (``groups``, which
// only pair_rows, in builds with AVX-512, reads).
inline PairShorts pair_group_shorts(SixteenSigned bytes) {
#if defined(__AVX512F__)
    return (PairShorts)_mm512_zextsi256_si512(_mm256_cvtepi8_epi16((__m128i)bytes));
#else
    PairShorts groups = {};
    for (int g = 0; g < 16; ++g) groups[g] = bytes[g];
    return groups;
#endif
}
// and block j's float scales (in sc[g / 8][g % 8]) across its lanes: lanes 0-3 sum values 0-15
// (group 2 j), lanes 4-7 values 16-31 (2 j + 1).
inline Lanes block_group_scales(const Lanes* sc, int j) {
    const float first = sc[j / 4][2 * j % 8], second = sc[j / 4][2 * j % 8 + 1];
    return Lanes{first, first, first, first, second, second, second, second};
}
// The sum over groups of group_scale[g] times the input's sum over group g (``halves``, 16 floats).
inline Lanes group_offsets(const Lanes* group_scale, const float* halves) {
    return group_scale[0] * load<Lanes>(halves) + group_scale[1] * load<Lanes>(halves + 8);
}

struct Q6K {
    static constexpr int64_t ROUNDING = 256;  // as llama.cpp's Q8_K: one scale a super-block
    static constexpr int64_t VALUES = 256, BYTES = 210;
    static int64_t row_bytes(int64_t in) { return in / VALUES * BYTES; }
    struct Super : UnsignedCodes, ConsecutivePairs {
        const uint8_t *ql, *qh;
        Lanes sc[2];  // group g's scale (d sc_g) in sc[g / 8][g % 8]
        PairShorts groups;  // group g's sc_g in lane g, a whole vector as Q4K's sc (where PAIRS: pair_rows')
        SixteenSigned group_bytes;  // the same in byte g
        float d;
        static constexpr int GROUPS = 16;
        static constexpr bool MINS = false;
        static constexpr float dmin = 0.0f;
        Super() = default;
        Super(const uint8_t* row, int64_t, int64_t s) {
            const uint8_t* block = row + s * BYTES;
            ql = block;
            qh = block + 128;
            group_bytes = load<SixteenSigned>(block + 192);
            d = half_to_float(block + 208);
            sc[0] = widen_eight(load<EightSigned>(block + 192)) * d;
            sc[1] = widen_eight(load<EightSigned>(block + 200)) * d;
            if constexpr (PAIRS) groups = pair_group_shorts(group_bytes);
        }
        // block j = 4 n + k of half n: values l of ql[64 n + 32 (k % 2) + l]'s low (k < 2) or high
        // nibble, and bits 2 k, 2 k + 1 of qh[32 n + l] above them
        Bytes codes(int j) const {
            const int n = j / 4, k = j % 4;
            const Bytes low = load<Bytes>(ql + 64 * n + 32 * (k % 2)), high = load<Bytes>(qh + 32 * n);
            return (k < 2 ? low & 15 : low >> 4) | move_bits(high, 2 * k, 4, 2);
        }
        // blocks 2 P and 2 P + 1: 64 bytes of low nibbles (low halves for even P, high for odd)
        // and each block's pair of bits from the same 32 bytes of qh
        template <int P>
        PairBytes pair_codes() const {
            constexpr int n = P / 2, k = 2 * (P % 2);
            const PairBytes low = load<PairBytes>(ql + 64 * n);
            const Bytes high = load<Bytes>(qh + 32 * n);
            return (k == 0 ? low & 15 : low >> 4) | pair_of(move_bits(high, 2 * k, 4, 2), move_bits(high, 2 * k + 2, 4, 2));
        }
        template <int P>
        PairShorts pair_int_scales() const { return pair_group_scales<P>(groups); }
        template <int J>
        Shorts block_int_scales() const { return block_group_scales<J>(group_bytes); }
        Lanes scales(int j) const { return block_group_scales(sc, j); }
        Lanes offset(const float*, const float* halves) const {
            return group_offsets(sc, halves) * -32.0f;
        }
        PairSums group_scales() const { return __builtin_convertvector(group_bytes, PairSums); }
        Shorts offset_weights() const { return widen_sixteen(group_bytes) * int16_t(-32); }  // codes less 32
        void widen(float* out) const {
            for (int j = 0; j < 8; ++j) {
                const Bytes q = codes(j);
                const Lanes scale = scales(j);
                for (int i = 0; i < 32; ++i) out[32 * j + i] = scale[i / 4] * (float(q[i]) - 32.0f);
            }
        }
    };
};

#if defined(__AVX512BW__)
// 16-bit lanes holding a in the first half of a pair, b in the second: per-half shift counts.
inline __m512i halves_of(int16_t a, int16_t b) {
    return _mm512_inserti64x4(_mm512_set1_epi16(a), _mm256_set1_epi16(b), 1);
}
#endif

// Q2_K, and with THIRD Q3_K: 2-bit codes, four to a byte, in two halves of 128 values (block j = 4 n
// + k of half n: bits 2 k, 2 k + 1 of qs[32 n + l], value l), a scale per group of 16 values. Q3_K's
// third bit of value l of block j is bit j of hmask[l]; its codes are signed about 4.
template <bool THIRD>
struct KQuantTwoBit {
    static constexpr int64_t ROUNDING = 256;  // as llama.cpp's Q8_K: one scale a super-block
    static constexpr int64_t VALUES = 256, BYTES = THIRD ? 110 : 84;
    static int64_t row_bytes(int64_t in) { return in / VALUES * BYTES; }
    struct Super : UnsignedCodes, ConsecutivePairs {
        const uint8_t *qs, *hmask;
        Lanes sc[2];  // group g's float scale in sc[g / 8][g % 8]: d sc_g (Q3_K: d (sc_g - 32))
        Lanes low[2];  // Q2_K: group g's minimum dmin m_g, as sc
        PairShorts groups;  // group g's integer scale in lane g, a whole vector as Q4K's sc (where PAIRS: pair_rows')
        SixteenSigned group_bytes;  // the same in byte g
        SixteenSigned min_bytes;  // Q2_K: group g's m_g in byte g
        float d, dmin;
        static constexpr int GROUPS = 16;
        static constexpr bool MINS = !THIRD;
        Super() = default;
        Super(const uint8_t* row, int64_t, int64_t s) {
            const uint8_t* block = row + s * BYTES;
            // the sixteen scales built in a register: written to the stack a value at a time and read
            // back whole, they stalled every super-block on a failed store forward (one row, two Zen 5
            // threads: Q3_K 15.6-16.1 -> 19.5-19.9 GB/s, Q2_K 16.9-17.0 -> 18.8-19.3)
            SixteenSigned scales;
            if constexpr (THIRD) {  // hmask[32], qs[64], twelve bytes of sixteen 6-bit scales, d
                hmask = block;
                qs = block + 32;
                d = half_to_float(block + 108);
                // scales 0-7: low nibbles of bytes 0-7, 8-15: their high nibbles; the top two bits of
                // scale 4 i + k in bits 2 i, 2 i + 1 of byte 8 + k
                const uint32_t first = load<uint32_t>(block + 96), second = load<uint32_t>(block + 100),
                               top = load<uint32_t>(block + 104);
                const FourWords words = {(first & 0x0F0F0F0F) | ((top & 0x03030303) << 4),
                                         (second & 0x0F0F0F0F) | (((top >> 2) & 0x03030303) << 4),
                                         ((first >> 4) & 0x0F0F0F0F) | (((top >> 4) & 0x03030303) << 4),
                                         ((second >> 4) & 0x0F0F0F0F) | (((top >> 6) & 0x03030303) << 4)};
                scales = (SixteenSigned)words - 32;
                dmin = 0.0f;
                min_bytes = SixteenSigned{};
            } else {  // sixteen bytes of scales (low nibble) and minimums (high), qs[64], d, dmin
                qs = block + 16;
                hmask = nullptr;
                d = half_to_float(block + 80);
                dmin = half_to_float(block + 82);
                const HalfBytes packed = load<HalfBytes>(block);
                scales = (SixteenSigned)(packed & 15);
                const HalfBytes mins = packed >> 4;
                min_bytes = (SixteenSigned)mins;
                low[0] = widen_eight(low_eight(mins)) * dmin;
                low[1] = widen_eight(high_eight(mins)) * dmin;
            }
            group_bytes = scales;
            if constexpr (THIRD || !PAIRS) {  // the products' float scales (Q2_K's pairs take integers alone)
                sc[0] = widen_eight(low_eight(scales)) * d;
                sc[1] = widen_eight(high_eight(scales)) * d;
            }
            if constexpr (PAIRS) groups = pair_group_shorts(group_bytes);
        }
        Bytes codes(int j) const {
            const Bytes q = (load<Bytes>(qs + 32 * (j / 4)) >> (2 * (j % 4))) & 3;
            if constexpr (!THIRD) return q;
            return q | move_bits(load<Bytes>(hmask), j, 2, 1);
        }
        // blocks 2 P and 2 P + 1: bit pairs k and k + 1 (k = 2 (P % 2)) of the same 32 bytes of half P / 2
        template <int P>
        PairBytes pair_codes() const {
            constexpr int n = P / 2, k = 2 * (P % 2);
#if defined(__AVX512BW__)
            // the 32 bytes in both halves of the pair, each half shifted by its block's own count:
            // half the instructions of shifting two copies and joining them (8192 x 2048, two Zen 5
            // threads: Q3_K 16 / 64 rows 104 / 107 -> 116 / 118 Gvalue-rows/s, one row 13.5 -> 15.6
            // GB/s; Q2_K 64 rows 124 -> 126)
            const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * n)));
            const __m512i codes = _mm512_and_si512(_mm512_srlv_epi16(q, halves_of(2 * k, 2 * k + 2)), _mm512_set1_epi8(3));
            if constexpr (!THIRD) return (PairBytes)codes;
            // bits 2 P and 2 P + 1 of hmask to bit 2 of each half's bytes, then A | (B & C)
            const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hmask)));
            const __m512i third = P == 0 ? _mm512_sllv_epi16(h, halves_of(2, 1))
                                         : _mm512_srlv_epi16(h, halves_of(2 * P - 2, 2 * P - 1));
            return (PairBytes)_mm512_ternarylogic_epi32(codes, third, _mm512_set1_epi8(4), 0xF8);
#else
            const Bytes q = load<Bytes>(qs + 32 * n);
            const PairBytes codes = pair_of((q >> (2 * k)) & 3, (q >> (2 * k + 2)) & 3);
            if constexpr (!THIRD) return codes;
            const Bytes h = load<Bytes>(hmask);
            return codes | pair_of(move_bits(h, 2 * P, 2, 1), move_bits(h, 2 * P + 1, 2, 1));
#endif
        }
        template <int P>
        PairShorts pair_int_scales() const { return pair_group_scales<P>(groups); }
        template <int J>
        Shorts block_int_scales() const { return block_group_scales<J>(group_bytes); }
        Lanes scales(int j) const { return block_group_scales(sc, j); }
        // Q3_K: each code less 4; Q2_K: each group's minimum
        Lanes offset(const float*, const float* halves) const {
            if constexpr (THIRD) return group_offsets(sc, halves) * -4.0f;
            return -group_offsets(low, halves);
        }
        PairSums group_scales() const { return __builtin_convertvector(group_bytes, PairSums); }
        Shorts offset_weights() const {
            if constexpr (THIRD) return widen_sixteen(group_bytes) * int16_t(-4);  // codes less 4
            return widen_sixteen(min_bytes);
        }
        // from the integer scales, which every build keeps (Q2_K's float ones only where products read them)
        void widen(float* out) const {
            for (int j = 0; j < 8; ++j) {
                const Bytes q = codes(j);
                for (int i = 0; i < 32; ++i) {
                    const int g = 2 * j + i / 16;
                    const float value = float(group_bytes[g]) * d * (float(q[i]) - (THIRD ? 4.0f : 0.0f));
                    out[32 * j + i] = THIRD ? value : value - low[g / 8][g % 8];
                }
            }
        }
    };
};
using Q2K = KQuantTwoBit<false>;
using Q3K = KQuantTwoBit<true>;

// FLOAT, FLOAT16 and BFLOAT16: a GGUF file's float matrices as the file has them (F32, F16, BF16),
// and FLOAT_PADDED, float32 rows PAD values longer. Not blocks: their products take float32
// activations and widen each weight as they read it (cpu_linear.h's linear_rows); a "super-block"
// here is 32 values, for widen_row.
template <typename W, int64_t PAD = 0>
struct FloatRows {
    using Element = W;
    static constexpr int64_t VALUES = GROUP;
    static int64_t row_bytes(int64_t in) { return int64_t(sizeof(W)) * (in + PAD); }
    struct Super {
        const W* values;
        Super() = default;
        Super(const uint8_t* row, int64_t, int64_t s) : values(reinterpret_cast<const W*>(row) + s * GROUP) {}
        void widen(float* out) const {
            for (int i = 0; i < GROUP; ++i) out[i] = ::Element<float, W>::widen(values[i]);
        }
    };
};

// GGUF_Q4_K_ROWS16: sixteen weight rows at a time, each super-block of theirs in BLOCK_BYTES:
// codes [pair c of sub-blocks][four-value quad q][row][4 bytes] (Q4_K's bytes 32 c + 4 q to 4 q + 3
// of each row: sub-block 2 c in the low nibbles, 2 c + 1 in the high), then the sub-blocks' scales
// [8][row] and minimums [4][row][2] (sub-blocks 2 k and 2 k + 1 of a row side by side, for one
// 16-bit multiply-add to meet both) as bytes, then d [row] and dmin [row] as float16.
// GGUF_Q5_K_ROWS16 (HIGH): the same, then each code's fifth bit, a byte a row's quad of a pair of
// sub-blocks ([c][q][row]: bit b value 4 q + b of sub-block 2 c, bit 4 + b of 2 c + 1), 180 bytes a
// row's super-block where Q5_K's file has 176.
template <bool HIGH>
struct KRows16 {
    using From = KQuantWithMins<HIGH>;  // the rows it is made from
    static constexpr int64_t ROUNDING = 256, VALUES = 256;  // as Q4_K's
    static constexpr int64_t ROWS = 16, BYTES = HIGH ? 180 : 148, BLOCK_BYTES = ROWS * BYTES;
    static constexpr int64_t SCALES = 2048, MINS = SCALES + 128, D = MINS + 128, DMIN = D + 32;  // offsets
    static constexpr int64_t FIFTHS_AT = DMIN + 32;  // HIGH: the fifth bits [pair c][quad q][row], a byte
    static int64_t row_bytes(int64_t in) { return in / VALUES * BYTES; }
    // the offset of row r's minimum of sub-block j
    static constexpr int64_t min_at(int j, int r) { return MINS + (j / 2 * ROWS + r) * 2 + j % 2; }
};
using Q4KRows16 = KRows16<false>;
using Q5KRows16 = KRows16<true>;
// Whether this build multiplies that layout (block_interleaved.h's rows16: AVX-512, or AVX2 with FMA
// and F16C); elsewhere Q4_K keeps the file's layout.
#if (defined(__AVX512F__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define LOOM_ROWS16 1
#else
#define LOOM_ROWS16 0
#endif
constexpr bool ROWS16_BUILT = LOOM_ROWS16;

// Whether the AVX-512 build multiplies Q8_0 side by side: with VNNI, whose vpdpbusd meets four of
// sixteen rows' signed codes with four input codes made unsigned (block_interleaved.h); without it
// the 16-bit sums of its emulation would saturate.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define LOOM_Q8_0_QUADS 1
#else
#define LOOM_Q8_0_QUADS 0
#endif

// GGUF_Q8_0_ROWS16: sixteen weight rows at a time, each block of 32 values of theirs in BLOCK_BYTES:
// codes [unit u of values][row][UNIT bytes] (each row's values UNIT u to UNIT u + UNIT - 1: pairs for
// AVX2's 16-bit multiply-adds, quads for AVX-512's vpdpbusd, which takes them unsigned: each 128 more,
// OFFSET), then d [row] as float16 (Q8_0's own: w = d q, q in -128..127). A build's own layout: made
// at load, never stored.
struct Q80Rows16 {
    using From = Loom8;  // the blocks it is made from, as Q8_0's are
    static constexpr int64_t ROUNDING = GROUP, VALUES = GROUP;  // the input rounded as for Loom's blocks
    static constexpr int64_t ROWS = 16, BYTES = 34, BLOCK_BYTES = ROWS * BYTES, D = ROWS * GROUP;
    static constexpr int64_t UNIT = LOOM_Q8_0_QUADS ? 4 : 2;  // a row's code bytes side by side with the next row's
    static constexpr uint8_t OFFSET = LOOM_Q8_0_QUADS ? 0x80 : 0;  // what a code's byte holds more (its sign bit flipped)
    static constexpr bool MINS = false;
    static int64_t row_bytes(int64_t in) { return in / VALUES * BYTES; }
    // the offset of row r's code of value v in a block
    static constexpr int64_t code_at(int v, int r) { return (v / UNIT * ROWS + r) * UNIT + v % UNIT; }
};
// GGUF_Q4_1_ROWS16: sixteen weight rows at a time, each block of 32 values of theirs in BLOCK_BYTES:
// codes [quad q][row][4 bytes] (Loom's 4-bit bytes 4 q to 4 q + 3 of each row: values 4 q + b in the
// low nibbles, 4 q + b + 16 in the high), then d [row] and m [row] as float16: w = d q + m.
// GGUF_Q5_0_ROWS16 (HIGH): the same nibbles, then the fifth bits [quad q][row] a byte (bit b: value
// 4 q + b's, bit 4 + b: value 4 q + b + 16's, each 16 times it), then d [row] as float16, and no
// minimum: Q5_0's numbers, w = d q - 16 d, in 23 bytes a row's block where Loom's 5-bit blocks take
// 28. The file's 22 and a spare byte a row, at the block's end: block_linear.py tells formats apart by
// their rows' bytes, and 22 a block of 32 are Q5_K's (176 a super-block of 256). Q5_1's own minimums
// would make 25 (24 are Loom's 4-bit blocks'): Q5_1 files, rare, keep Loom's 5-bit blocks.
template <bool HIGH>
struct NibbleRows16 {
    using From = LoomNibbles<HIGH>;
    static constexpr int64_t ROUNDING = GROUP, VALUES = GROUP;
    static constexpr int64_t ROWS = 16, BYTES = HIGH ? 23 : 20, BLOCK_BYTES = ROWS * BYTES;
    // offsets: the fifth bits, d, and m (HIGH: none, the spare bytes lie there)
    static constexpr int64_t FIFTHS_AT = ROWS * GROUP / 2, D = FIFTHS_AT + (HIGH ? 4 * ROWS : 0), M = D + 2 * ROWS;
    static constexpr int64_t UNIT = 4;
    static constexpr bool MINS = true;
    static constexpr float IMPLIED_MINIMUM = -16.0f;  // HIGH: w = d q + m with m this times d
    static int64_t row_bytes(int64_t in) { return in / VALUES * BYTES; }
    // row r's minimum of the block at ``block``, given its scale d
    static float minimum(const uint8_t* block, int r, float d) {
        return HIGH ? IMPLIED_MINIMUM * d : half_to_float(block + M + 2 * r);
    }
};
using Q41Rows16 = NibbleRows16<false>;
using Q50Rows16 = NibbleRows16<true>;
// GGUF_IQ4_ROWS16 (AVX-512 with VNNI, or AVX2): sixteen weight rows at a time, each block of 32 values of theirs
// in BLOCK_BYTES: codes [quad q][row][4 bytes] as GGUF_Q4_1_ROWS16's (LOOM_IQ4's nibbles 4 q to 4 q + 3
// of each row: values 4 q + b in the low nibbles, 4 q + b + 16 in the high), then d [row] as float16
// (the file's), then k [row] as signed bytes: w = d k IQ4_VALUES[q], 19 bytes a row's block.
struct IQ4Rows16 {
    using From = LoomIQ4;
    static constexpr const int8_t* TABLE = IQ4_VALUES;  // what the codes index
    static constexpr int64_t ROUNDING = GROUP, VALUES = GROUP;  // the input rounded as for Loom's blocks
    static constexpr int64_t ROWS = 16, BYTES = 19, BLOCK_BYTES = ROWS * BYTES, D = ROWS * GROUP / 2, K = D + 2 * ROWS;
    static constexpr bool MINS = false;
    static int64_t row_bytes(int64_t in) { return in / VALUES * BYTES; }
};
// GGUF_MXFP4_ROWS16 (AVX-512 with VNNI, or AVX2): sixteen weight rows at a time, each block of 32 values of
// theirs in BLOCK_BYTES: codes [quad q][row][4 bytes] as GGUF_IQ4_ROWS16's (the file's nibbles 4 q to 4 q + 3
// of each row), then e [row] (the file's exponent bytes): w = 2^(e - 128) MXFP4_VALUES[q], MXFP4's numbers in
// its 17 bytes a row's block, and one spare byte a row, at the end of the sixteen rows' blocks: block_linear.py
// tells formats apart by their rows' bytes, and 17 a block are the file's layout's (18, with a spare byte a
// block, Q4_K's).
struct MXFP4Rows16 {
    using From = MXFP4;
    static constexpr const int8_t* TABLE = MXFP4_VALUES;
    static constexpr int64_t ROUNDING = GROUP, VALUES = GROUP;
    static constexpr int64_t ROWS = 16, BYTES = MXFP4::BYTES, BLOCK_BYTES = ROWS * BYTES, E = ROWS * GROUP / 2;
    static constexpr bool MINS = false;
    static int64_t row_bytes(int64_t in) { return in / VALUES * BYTES + 1; }
};
// GGUF_Q6_K_ROWS16: sixteen weight rows at a time, each super-block of theirs in BLOCK_BYTES (groups
// of 16 values G, each four quads of values t: values 16 G + 4 t to 16 G + 4 t + 3): low nibbles
// [set 4 (G % 8) + t][row][4 bytes] (groups G < 8 in the low nibbles, G + 8 in the high), high bit
// pairs [set 4 (G % 4) + t][row][4 bytes] (group G in bits 2 (G / 4), 2 (G / 4) + 1), then the
// groups' int8 scales [G][row], then d [row] as float32 (the file's float16 widened: the same value,
// and a row's bytes, 212, tell the layout from Q6_K's 210): Q6_K's numbers, w = d sc_G (q - 32).
struct Q6KRows16 {
    using From = Q6K;
    static constexpr int64_t ROUNDING = 256, VALUES = 256;  // as Q6_K's
    static constexpr int64_t ROWS = 16, BYTES = 212, BLOCK_BYTES = ROWS * BYTES;
    static constexpr int64_t HIGH = 2048, SCALES = HIGH + 1024, D = SCALES + 256;  // offsets
    static int64_t row_bytes(int64_t in) { return in / VALUES * BYTES; }
    // the offsets of quad t of group G's low-nibble bytes and high-bit bytes for rows 8 h on
    static constexpr int64_t low_at(int G, int t, int h) { return ((4 * (G % 8) + t) * ROWS + 8 * h) * 4; }
    static constexpr int64_t high_at(int G, int t, int h) { return HIGH + ((4 * (G % 4) + t) * ROWS + 8 * h) * 4; }
};
// Whether this build multiplies Q8_0 and Q6_K side by side (block_interleaved.h: AVX2 with FMA and
// F16C, without AVX-512, whose products over Loom's 8-bit blocks and Q6_K take pairs of blocks and the
// tiles instead; Q8_0 with AVX-512 too where it has VNNI, LOOM_Q8_0_QUADS); elsewhere Q8_0 is Loom's
// 8-bit blocks, and Q6_K keeps the file's layout. The
// nibbles side by side (Q4_0, Q4_1, Q5_0) are built as Q4_K's are, AVX-512 included: over
// Loom's 4- and 5-bit blocks a pair of blocks at a time, a one-row product was bound by its
// instructions (6912 x 1152 from L3, two Zen 4 threads: 26-29 GB/s, where Loom's 8-bit blocks read 47).
#if LOOM_ROWS16 && !(defined(__AVX512F__) && defined(__AVX512BW__))
#define LOOM_BLOCKS_ROWS16 1
#else
#define LOOM_BLOCKS_ROWS16 0
#endif
constexpr bool BLOCKS_ROWS16_BUILT = LOOM_BLOCKS_ROWS16;
constexpr bool Q8_0_ROWS16_BUILT = LOOM_BLOCKS_ROWS16 || LOOM_Q8_0_QUADS;

// Whether format F lays sixteen weight rows side by side (block_interleaved.h's products).
template <typename F>
constexpr bool rows_side_by_side() {
    return std::is_same_v<F, Q4KRows16> || std::is_same_v<F, Q5KRows16> || std::is_same_v<F, Q80Rows16> ||
           std::is_same_v<F, Q41Rows16> || std::is_same_v<F, Q50Rows16> || std::is_same_v<F, Q6KRows16> ||
           std::is_same_v<F, IQ4Rows16> || std::is_same_v<F, MXFP4Rows16>;
}
// Whether layout L's codes index a table of values (L::TABLE: IQ4's and MXFP4's), which its products look up.
template <typename L>
constexpr bool looks_up_codes() { return std::is_same_v<L, IQ4Rows16> || std::is_same_v<L, MXFP4Rows16>; }
// Whether this build multiplies layout L (one of those), which is made only where it does.
template <typename L>
constexpr bool rows16_built() {
    if constexpr (std::is_same_v<L, Q80Rows16>) return Q8_0_ROWS16_BUILT;
    else if constexpr (looks_up_codes<L>()) return Q8_0_ROWS16_BUILT;  // (Q8_0's builds)
    else if constexpr (std::is_same_v<L, Q6KRows16>) return BLOCKS_ROWS16_BUILT;
    else return ROWS16_BUILT;
}

template <typename F, typename = void>
struct IsFloatRows : std::false_type {};
template <typename F>
struct IsFloatRows<F, std::void_t<typename F::Element>> : std::true_type {};

// f(F{}) for the format struct of ``format`` in rows of ``in`` values.
template <typename F>
inline void with_format(int64_t format, int64_t in, F&& f) {
    const bool pairs = in % (2 * GROUP) == 0;
    switch (format) {
        case LOOM_4BIT:
            if constexpr (PAIRS) {
                if (pairs) return f(Loom4Pairs{});
            }
            return f(Loom4{});
        case LOOM_5BIT:
            if constexpr (PAIRS) {
                if (pairs) return f(Loom5Pairs{});
            }
            return f(Loom5{});
        case LOOM_8BIT:
            if constexpr (PAIRS) {
                if (pairs) return f(Loom8Pairs{});
            }
            return f(Loom8{});
        case LOOM_IQ4:
            if constexpr (PAIRS) {
                if (pairs) return f(LoomIQ4Pairs{});
            }
            return f(LoomIQ4{});
        case GGUF_MXFP4:
            if constexpr (PAIRS) {
                if (pairs) return f(MXFP4Pairs{});
            }
            return f(MXFP4{});
        case GGUF_Q2_K: f(Q2K{}); break;
        case GGUF_Q3_K: f(Q3K{}); break;
        case GGUF_Q4_K: f(Q4K{}); break;
        case GGUF_Q4_K_ROWS16:  // made only where the products over it are built
            if constexpr (rows16_built<Q4KRows16>()) return f(Q4KRows16{});
            __builtin_trap();
        case GGUF_Q5_K_ROWS16:
            if constexpr (rows16_built<Q5KRows16>()) return f(Q5KRows16{});
            __builtin_trap();
        case GGUF_Q8_0_ROWS16:
            if constexpr (rows16_built<Q80Rows16>()) return f(Q80Rows16{});
            __builtin_trap();
        case GGUF_Q4_1_ROWS16:
            if constexpr (rows16_built<Q41Rows16>()) return f(Q41Rows16{});
            __builtin_trap();
        case GGUF_Q5_0_ROWS16:
            if constexpr (rows16_built<Q50Rows16>()) return f(Q50Rows16{});
            __builtin_trap();
        case GGUF_Q6_K_ROWS16:
            if constexpr (rows16_built<Q6KRows16>()) return f(Q6KRows16{});
            __builtin_trap();
        case GGUF_IQ4_ROWS16:
            if constexpr (rows16_built<IQ4Rows16>()) return f(IQ4Rows16{});
            __builtin_trap();
        case GGUF_MXFP4_ROWS16:
            if constexpr (rows16_built<MXFP4Rows16>()) return f(MXFP4Rows16{});
            __builtin_trap();
        case GGUF_Q5_K: f(Q5K{}); break;
        case FLOAT: f(FloatRows<float>{}); break;
        case FLOAT_PADDED: f(FloatRows<float, ROW_PAD>{}); break;
        case FLOAT16: f(FloatRows<Float16>{}); break;
        case BFLOAT16: f(FloatRows<BFloat16>{}); break;
        default: f(Q6K{}); break;
    }
}

inline int64_t format_row_bytes(int64_t format, int64_t in) {
    // (asked of every BlockWeights: answered here so that a build without AVX-512 does not trap)
    if (format == GGUF_Q4_K_ROWS16) return Q4KRows16::row_bytes(in);
    if (format == GGUF_Q5_K_ROWS16) return Q5KRows16::row_bytes(in);
    if (format == GGUF_Q8_0_ROWS16) return Q80Rows16::row_bytes(in);
    if (format == GGUF_Q4_1_ROWS16) return Q41Rows16::row_bytes(in);
    if (format == GGUF_Q5_0_ROWS16) return Q50Rows16::row_bytes(in);
    if (format == GGUF_Q6_K_ROWS16) return Q6KRows16::row_bytes(in);
    if (format == GGUF_IQ4_ROWS16) return IQ4Rows16::row_bytes(in);
    if (format == GGUF_MXFP4_ROWS16) return MXFP4Rows16::row_bytes(in);
    int64_t bytes = 0;
    with_format(format, in, [&](auto f) { bytes = decltype(f)::row_bytes(in); });
    return bytes;
}

}  // namespace
