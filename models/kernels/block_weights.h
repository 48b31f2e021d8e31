// Linear weights kept in blocks of 32 values along each row, as llama.cpp's Q4_1 and Q8_0 files
// keep them, and the products that read them (weights="int4" and "int8", models/kernels/block_linear.py).
//
// - 4 bits: a code q in 0..15 per value, a scale d and a minimum m per block: w = d q + m.
// - 8 bits: a code q in -127..127 per value and a scale per block: w = d q.
//
// A matrix [out, in] is one buffer, row by row; a row is its codes (in / 2 or in bytes; a 4-bit
// block's byte j holds value j in its low nibble and value j + 16 in its high one, as Q4_1's
// does), then its in / 32 scales as floats, then for 4 bits its in / 32 minimums. A row is then
// one sequential read: with the scales and minimums in arrays of their own, one-row products
// streamed at half the bandwidth.
//
// A decode step reads every weight once, so its speed is the bytes it reads: 4-bit blocks are 0.75
// bytes a value against float32's 4. Up to 8 rows the codes are widened in registers and every
// input row meets them there (one_row_blocks, few_rows_blocks). From 9 rows the products widen a
// tile's weight rows into a small buffer that stays in L1 and run cpu_linear.h's panels over it:
// every panel then reuses the widened weights, and the arithmetic is the float product's on
// w = d q + m. (Above 128 rows block_linear.py widens whole weights for oneDNN's product instead.)

#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_linear.h"

namespace {

constexpr int64_t GROUP = 32;  // values per block

struct BlockWeights {
    const uint8_t* base;
    int64_t bits, in, out;
    int64_t code_bytes, blocks, stride;  // a row's codes, its blocks, and its bytes in all

    BlockWeights(const void* base, int64_t bits, int64_t in, int64_t out)
        : base(static_cast<const uint8_t*>(base)),
          bits(bits),
          in(in),
          out(out),
          code_bytes(in * bits / 8),
          blocks(in / GROUP),
          stride(code_bytes + (bits == 4 ? 2 : 1) * blocks * int64_t(sizeof(float))) {}

    const uint8_t* codes(int64_t row) const { return base + row * stride; }
    const float* scales(int64_t row) const { return reinterpret_cast<const float*>(codes(row) + code_bytes); }
    const float* mins(int64_t row) const { return scales(row) + blocks; }  // 4 bits only
};

using Floats = Vector<float>;
constexpr int LANES = Floats::lanes;
typedef int32_t Ints __attribute__((vector_size(VECTOR_BYTES)));

// LANES bytes from ``p`` widened to 32-bit lanes, zero- or sign-extended. GCC writes
// __builtin_convertvector from a byte vector as scalar code, a lane at a time, so x86 gets the
// one-instruction intrinsics.
template <bool Signed>
inline Ints widen_bytes(const uint8_t* p) {
#if defined(__AVX512F__)
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return (Ints)(Signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
#elif defined(__AVX2__)
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return (Ints)(Signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
#else
    Ints q;
    for (int i = 0; i < LANES; ++i) q[i] = Signed ? int32_t(int8_t(p[i])) : int32_t(p[i]);
    return q;
#endif
}

// Block ``b`` of a row's codes as floats, a vector at a time: f(v, values) for the vector holding
// values [v * LANES, (v + 1) * LANES) of the block.
template <int BITS, typename F>
inline void widen_block(const uint8_t* row_codes, int64_t b, F&& f) {
    if constexpr (BITS == 4) {
        const uint8_t* c = row_codes + b * GROUP / 2;
        for (int h = 0; h < GROUP / 2 / LANES; ++h) {  // LANES bytes hold LANES low and LANES high values
            const Ints q = widen_bytes<false>(c + h * LANES);
            f(h, __builtin_convertvector(q & 15, Floats::type));
            f(h + GROUP / 2 / LANES, __builtin_convertvector(q >> 4, Floats::type));
        }
    } else {
        const uint8_t* c = row_codes + b * GROUP;
        for (int v = 0; v < GROUP / LANES; ++v)
            f(v, __builtin_convertvector(widen_bytes<true>(c + v * LANES), Floats::type));
    }
}

// Fetch weight row ``row``'s blocks into cache, non-temporally: a step reads them once (as
// cpu_linear.h's few_rows; one stream 177 -> 186 tok/s, 4 streams 347 -> 361, alternating builds).
inline void prefetch_row(const BlockWeights& w, int64_t row) {
    const uint8_t* p = w.codes(row);
    for (int64_t byte = 0; byte < w.stride; byte += CACHE_LINE) __builtin_prefetch(p + byte, 0, 0);
}

// Weight rows [first, first + count), values [k, k + width) (both multiples of GROUP), as floats
// into ``dst``, rows ``stride`` apart; with the first values, rows [first + count, ahead) are
// fetched into cache meanwhile (the next rows this thread widens).
template <int BITS>
inline void widen_rows(const BlockWeights& w, int64_t first, int64_t count, int64_t k, int64_t width, float* dst,
                       int64_t stride, int64_t ahead) {
    for (int64_t r = 0; r < count; ++r) {
        const int64_t row = first + r;
        if (k == 0 && row + count < ahead) prefetch_row(w, row + count);
        const uint8_t* codes = w.codes(row);
        const float *scales = w.scales(row), *mins = w.mins(row);
        for (int64_t b = k / GROUP; b < (k + width) / GROUP; ++b) {
            const float d = scales[b], m = BITS == 4 ? mins[b] : 0.0f;
            float* out = dst + r * stride + b * GROUP - k;
            widen_block<BITS>(codes, b, [&](int v, Floats::type q) { Floats::store(out + v * LANES, q * d + m); });
        }
    }
}

// SIDE weight rows side by side, [row, row + side) of a task's [.., end): their codes, scales and
// minimums (past the last row, the last row again: its sums go unused), the rows two groups ahead
// fetched meanwhile (without, a one-stream step took 7.0-7.5 ms against 4.6-5.0; one or three
// groups ahead: no better).
template <int SIDE>
struct SideBySide {
    const uint8_t* codes[SIDE];
    const float *scales[SIDE], *mins[SIDE];
    int side;

    SideBySide(const BlockWeights& w, int64_t row, int64_t end) : side(int(std::min<int64_t>(SIDE, end - row))) {
        for (int64_t ahead = row + 2 * SIDE; ahead < std::min(w.out, row + 3 * SIDE); ++ahead) prefetch_row(w, ahead);
        for (int i = 0; i < SIDE; ++i) {
            const int64_t r = row + std::min(i, side - 1);
            codes[i] = w.codes(r);
            scales[i] = w.scales(r);
            mins[i] = w.mins(r);
        }
    }
};

// y[o] = x . w[o] for weight rows [first, first + count), count <= LANES: the codes widened in
// registers and each block's sum scaled once. Four weight rows go side by side (sharing each
// block's loads of x), and the rows' lane sums are taken together at the end (sums_of_lanes: one
// reduction for up to LANES rows). A 4-bit block's minimum m adds m times the block's sum of x:
// m times the sum of x's vectors over the block, folded into the same lanes.
template <int BITS>
inline void one_row_blocks(const float* x, const BlockWeights& w, int64_t first, int64_t count, float* y) {
    constexpr int SIDE = 4;
    Floats::type lanes[LANES] = {};
    for (int64_t r = 0; r < count; r += SIDE) {
        const SideBySide<SIDE> rows(w, first + r, first + count);
        const auto& codes = rows.codes;
        const auto &scales = rows.scales, &mins = rows.mins;
        Floats::type acc[SIDE] = {};
        for (int64_t b = 0; b < w.blocks; ++b) {
            Floats::type xs[GROUP / LANES], x_total = {};
            for (int v = 0; v < GROUP / LANES; ++v) x_total += xs[v] = Floats::load(x + b * GROUP + v * LANES);
            for (int i = 0; i < SIDE; ++i) {
                Floats::type sum = {};
                widen_block<BITS>(codes[i], b, [&](int v, Floats::type q) { sum += q * xs[v]; });
                acc[i] += sum * scales[i][b];
                if constexpr (BITS == 4) acc[i] += x_total * mins[i][b];
            }
        }
        for (int i = 0; i < rows.side; ++i) lanes[sum_position<float>(int(r) + i)] = acc[i];
    }
    const Floats::type sums = sums_of_lanes<float>(lanes);
    for (int64_t i = 0; i < count; ++i) y[first + i] = sums[i];
}

// ROWS (2 to 8) input rows against weight rows [first, first + count), count <= LANES: two weight
// rows side by side (four, as one_row_blocks takes, were 13-20% slower at 3-4 rows), each vector of
// codes widened to weights (w = d q + m) once in registers and multiplied with every input row
// there. The row tiles it replaced widened three weight rows into a buffer first and ran the rows
// past them: a 4-bit forward at 2 / 4 / 6 / 8 rows took 7.46 / 11.11 / 14.23 / 16.22 ms against
// 5.63 / 7.94 / 9.70 / 13.80 (docs/benchmarks.md, "A few rows, one weight row at a time").
template <int BITS, int ROWS>
inline void few_rows_blocks(const float* x, int64_t x_stride, const BlockWeights& w, int64_t first, int64_t count,
                            float* y, int64_t y_stride) {
    constexpr int SIDE = 2;
    Floats::type lanes[ROWS][LANES] = {};  // each input row's sums, a vector per weight row
    for (int64_t r = 0; r < count; r += SIDE) {
        const SideBySide<SIDE> group(w, first + r, first + count);
        const auto& codes = group.codes;
        const auto &scales = group.scales, &mins = group.mins;
        Floats::type acc[SIDE][ROWS] = {};
        for (int64_t b = 0; b < w.blocks; ++b) {
            for (int i = 0; i < SIDE; ++i) {
                const float d = scales[i][b], m = BITS == 4 ? mins[i][b] : 0.0f;
                widen_block<BITS>(codes[i], b, [&](int v, Floats::type q) {
                    const Floats::type weights = BITS == 4 ? q * d + m : q * d;
                    for (int row = 0; row < ROWS; ++row)
                        acc[i][row] += weights * Floats::load(x + row * x_stride + b * GROUP + v * LANES);
                });
            }
        }
        for (int i = 0; i < group.side; ++i)
            for (int row = 0; row < ROWS; ++row) lanes[row][sum_position<float>(int(r) + i)] = acc[i][row];
    }
    for (int row = 0; row < ROWS; ++row) {
        const Floats::type sums = sums_of_lanes<float>(lanes[row]);
        for (int64_t i = 0; i < count; ++i) y[row * y_stride + first + i] = sums[i];
    }
}

// The widened rows a thread works on, kept from call to call (a fresh buffer would come from new
// pages), on whole cache lines.
inline float* widened_scratch(int64_t elements) {
    thread_local std::vector<float> buffer;
    return line_aligned(buffer, elements);
}

// From how many rows block products take the panels; below, the codes are widened in registers
// (one_row_blocks, few_rows_blocks). The panels read widened weights from L1, so the float
// products' threshold (measured over weights read from memory) does not carry over: on Zen 5 a
// 4-bit forward at 6 and 8 rows took 8.1 / 11.8 ms in registers against 16.0 / 16.5 on the panels
// (and the row tiles before few_rows_blocks had been ahead of the panels up to 8 rows).
constexpr int64_t BLOCK_PANEL_MIN_ROWS = 9;
static_assert(BLOCK_PANEL_MIN_ROWS <= 9, "few_rows_blocks takes up to 8 rows");

// y = x w^T + b over block weights of BITS bits (block_linear_rows).
template <int BITS>
void block_rows(const float* x, int64_t x_stride, int64_t rows, const BlockWeights& w, const float* bias, float* y,
                int64_t y_stride, float* packed) {
    const int64_t in = w.in, out = w.out;
    if (rows == 0)  // (the output layer of a step none of whose rows is sampled; with_few_rows
        return;     // would take 8): every thread of the team returns alike
    if (rows >= BLOCK_PANEL_MIN_ROWS) {
        // Each tile is widened a chunk of k at a time (at most 1024 values: 12 rows of them, 48 KiB,
        // stay in L1/L2), whole blocks, which every panel then passes.
        const int64_t chunk = k_chunk(in, GROUP);
        float* widened = widened_scratch(MAX_TILE_OUTS * chunk);
        auto weights = [&w, widened](int64_t o, int64_t outs, int64_t k, int64_t count, int64_t end) {
            widen_rows<BITS>(w, o, outs, k, count, widened, count, end);
            return TileWeights<float>{widened, count, nullptr};
        };
        panels(x, x_stride, rows, in, out, chunk, weights, bias, y, y_stride, packed);
        return;
    }
    const int64_t outs = LANES, tasks = (out + outs - 1) / outs;
    const int64_t chunk = std::max<int64_t>(1, tasks / (8 * omp_get_num_threads()));
#pragma omp for schedule(dynamic, chunk)
    for (int64_t task = 0; task < tasks; ++task) {
        const int64_t o = task * outs, count = std::min(outs, out - o);
        with_few_rows(rows, [&](auto group) {
            if constexpr (group == 1)
                one_row_blocks<BITS>(x, w, o, count, y);
            else
                few_rows_blocks<BITS, group>(x, x_stride, w, o, count, y, y_stride);
        });
        add_bias(y + o, y_stride, rows, bias == nullptr ? nullptr : bias + o, count);
    }
}

// y = x w^T + b over block weights, the work shared among the threads of the enclosing parallel
// region. ``packed``: packed_size(rows, in) floats shared by the region's threads where rows >=
// BLOCK_PANEL_MIN_ROWS.
inline void block_linear_rows(const float* x, int64_t x_stride, int64_t rows, const BlockWeights& w,
                              const float* bias, float* y, int64_t y_stride, float* packed) {
    if (w.bits == 4)
        block_rows<4>(x, x_stride, rows, w, bias, y, y_stride, packed);
    else
        block_rows<8>(x, x_stride, rows, w, bias, y, y_stride, packed);
}

}  // namespace
