// Products over weights kept in blocks (block_codes.h's formats: Loom's 4-, 5- and 8-bit blocks,
// GGUF's K-quants as the file has them, and Q4_K with sixteen rows side by side), block_linear.py's
// and the native layers'.
//
// The input is rounded to 8 bits first, as llama.cpp's CPU backend does: per 32 values (a K-quant's
// 256) a scale dx = max |x| / 127 and codes round(x / dx). A block's product is then an integer dot
// product of two rows of bytes (one VNNI instruction per 32 values, two with AVX2) scaled once, where
// float activations had the codes widened to floats and multiplied a lane at a time: a decode step
// ran arithmetic-bound at 0.28x llama.cpp's speed on a 1.7B Q4_K_M file (docs/benchmarks.md). Each
// row is rounded on its own and every row count takes the same products (int8_rows, pair_rows: the
// codes decoded in registers once and met by up to eight input rows there), so a request's numbers
// do not depend on its batch-mates.

#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include <omp.h>

#include "block_codes.h"
#include "cpu_linear.h"

namespace {

// A matrix [out, in] of one block format, row by row.
struct BlockWeights {
    const uint8_t* base;
    int64_t format, in, out, stride;  // stride: a row's bytes

    BlockWeights(const void* base, int64_t format, int64_t in, int64_t out)
        : base(static_cast<const uint8_t*>(base)), format(format), in(in), out(out),
          stride(format_row_bytes(format, in)) {}

    const uint8_t* row(int64_t r) const { return base + r * stride; }
};

// Weight bytes fetched into cache ahead of the products, to L2 and below (prefetcht1: the integer
// products consume a row faster than non-temporal fetches into L1 alone kept up with, the float
// kernels' choice in cpu_linear.h), a super-block's share at a time: a group of rows side by side
// fetches, as it reads its super-block s, the bytes FETCH_BYTES past the group's end as far along as
// it has read (one stream, whatever the rows' length). Where each group fetched the whole rows two
// groups on at once, the burst stalled the products behind it on long rows: one row of a 2048 x
// 8192 Q4_K product read 19.4 GB/s on two threads, now 29.5; of Q6_K 15.4, now 29.4; 8192 x 2048
// Q4_K 27.4, now 31.7 (Zen 5; 2048 bytes ahead: 29.7, 8192: 30.6, 16384: 28.8). Computed in
// the loop from its own bounds, the fetch addresses cost a one-row product half its speed.
constexpr int64_t FETCH_BYTES = 4096;

inline void fetch_lines(const uint8_t* from, int64_t bytes) {
    for (int64_t line = 0; line < bytes; line += CACHE_LINE) __builtin_prefetch(from + line, 0, 2);
}

// Where block b of a super-block has its input codes in the rounded rows: F::input_slot(b) where the
// format says (Q4_K: a pair's blocks side by side, for one 64-byte load), else b.
template <typename F, typename = void>
struct InputOrder {
    static constexpr int slot(int b) { return b; }
};
template <typename F>
struct InputOrder<F, std::void_t<decltype(F::input_slot(0))>> {
    static constexpr int slot(int b) { return F::input_slot(b); }
};

// Input rows rounded to 8-bit blocks: each row's codes, and per block of 32 its scale dx and
// dx times the sum of its codes, per half block the same sum over 16 (minimums and offsets meet
// those sums: block_codes.h's offset). Kept in records, a row's ``unit`` values each, which the
// products take FEW_ROWS rows at a time from row 0 (block_rows): within such a group, a unit's
// records lie row after row, [group][unit][row in group][the record's].
struct RoundedRows {
    int8_t* codes;  // unit bytes a record
    float *scales, *sums, *halves;  // unit / 32, unit / 32, unit / 16 a record
    // the K-quants' where pair_rows takes them (integer_records), in place of the float scales and
    // sums above: each record's code sums over 16 as integers, and its one scale (the records of a
    // group's rows for one super-block side by side)
    int16_t* sixteens;
    float* record_scales;
    // Q6_K side by side's (group_offset_words): per 16 values, 32 times the sums of its codes at
    // values 4 t and 4 t + 1, and at 4 t + 2 and 4 t + 3, as two 16-bit halves
    int32_t* group_offsets;
    // Loom's blocks' where block_pair_rows takes them (block_records): per block of a group's rows, side by
    // side, [group][block][row in group], each row's scale dx, its code sum and dx times that sum
    float *block_scales, *block_sums;
    int32_t* block_code_sums;
    int64_t rows, in, unit;

    // ``scratch``: at least floats_for(rows, in) floats, from a cache line's start
    RoundedRows(float* scratch, int64_t rows, int64_t in, int64_t unit) : rows(rows), in(in), unit(unit) {
        const int64_t blocks = rows * in / GROUP;
        codes = reinterpret_cast<int8_t*>(scratch);
        scales = scratch + whole_lines<float>(rows * in / 4);
        sums = scales + whole_lines<float>(blocks);
        halves = sums + whole_lines<float>(blocks);
        sixteens = reinterpret_cast<int16_t*>(halves + whole_lines<float>(rows * in / 16));
        record_scales = reinterpret_cast<float*>(sixteens) + whole_lines<float>(rows * in / 32);
        block_scales = record_scales + whole_lines<float>(rows * in / 256 + 8);
        block_sums = block_scales + whole_lines<float>(blocks + 16);
        block_code_sums = reinterpret_cast<int32_t*>(block_sums + whole_lines<float>(blocks + 16));
        group_offsets = block_code_sums + whole_lines<float>(blocks + 16);
    }
    static int64_t floats_for(int64_t rows, int64_t in) {
        // (the per-group arrays one vector over: a product of fewer rows loads eight or sixteen)
        const int64_t blocks = rows * in / GROUP;
        return whole_lines<float>(rows * in / 4) + 2 * whole_lines<float>(blocks) + whole_lines<float>(rows * in / 16) +
               whole_lines<float>(rows * in / 32) + whole_lines<float>(rows * in / 256 + 8) +
               3 * whole_lines<float>(blocks + 16) + whole_lines<float>(rows * in / 16);
    }
    // The index of row ``row``'s record of unit ``u``, and back; and of the entry of its block b in
    // the per-block arrays (block_scales ...), which lie as records of a block would.
    int64_t record(int64_t row, int64_t u) const { return entry(row, u, unit); }
    int64_t block_entry(int64_t row, int64_t b) const { return entry(row, b, GROUP); }
    std::pair<int64_t, int64_t> row_and_unit(int64_t record) const {
        const int64_t units = in / unit, first = record / (FEW_ROWS * units) * FEW_ROWS;  // the group's first row
        const int64_t group = std::min(FEW_ROWS, rows - first), rest = record - first * units;
        return {first + rest % group, rest / group};
    }

  private:
    // [group][piece][row in group], pieces of ``values`` values
    int64_t entry(int64_t row, int64_t piece, int64_t values) const {
        const int64_t first = row - row % FEW_ROWS, group = std::min(FEW_ROWS, rows - first);
        return first * (in / values) + piece * group + row % FEW_ROWS;
    }
};

// Whether format F's input is rounded under one scale a super-block (the K-quants: their products
// keep a super-block's sums in integers), and the records its products take: a K-quant's
// super-block, so that a product reaches its rows' codes and scales of a super-block from one
// address, each row a constant past it (in whole rows, the eight rows' codes took an index register
// each and their scales' and sums' addresses, recomputed a super-block at a time, spilled the rest;
// 8192 x 2048, 64 rows, two Zen 5 threads: Q6_K 117-118 -> 131, Q5_K 129-133 -> 136-139, Q3_K
// 118-120 -> 126-127, Q2_K 131 -> 138-139 Gvalue-rows/s, Q4_K level; the AVX2 build's Q4_K 113-116
// -> 135-137); for Loom's blocks a whole row (in records of a pair of blocks, their weights read
// slower at eight rows: Q8_0 98 -> 72).
template <typename F>
constexpr bool rounds_by_super_block() { return F::ROUNDING == F::VALUES && F::VALUES > GROUP; }
template <typename F>
int64_t record_values(int64_t in) { return rounds_by_super_block<F>() ? F::VALUES : in; }
// Whether format F's products read its rounded input as integer sums and one scale a record
// (pair_rows' K-quants and rows16's Q4_K, ending each super-block in exact integers) rather than as
// float scales and sums per block (int8_rows', and every other format's).
template <typename F>
constexpr bool integer_records() {
    return (PAIRS || std::is_same_v<F, Q4KRows16> || std::is_same_v<F, Q5KRows16> || std::is_same_v<F, Q6KRows16>) &&
           rounds_by_super_block<F>();
}
// Whether format F's products read its rounded input's integer code sums a block (Q8_0, IQ4 and MXFP4
// side by side with VNNI, whose codes are made unsigned instead of the input).
template <typename F>
constexpr bool takes_code_sums() {
    return LOOM_Q8_0_QUADS && (std::is_same_v<F, Q80Rows16> || looks_up_codes<F>());
}
// Whether format F's products read its rounded input's group_offsets too (Q6_K side by side).
template <typename F>
constexpr bool takes_group_offsets() { return std::is_same_v<F, Q6KRows16>; }
// Whether format F's products read its rounded input per block of a group's rows (block_pair_rows':
// Loom's blocks a pair at a time, each block ending in an exact integer; the tiles round their own
// Bands) rather than as int8_rows' float scales and sums.
template <typename F>
constexpr bool block_records() { return PAIRS && !rounds_by_super_block<F>() && F::VALUES == 2 * GROUP; }

// The rounded rows [row0, row0 + ROWS) of one of block_rows's groups, as format F's products read
// them.
template <typename F, int ROWS>
struct RoundedGroup {
    static constexpr int64_t BLOCKS = F::VALUES / GROUP;
    const int8_t* codes_;
    const float *scales_, *sums_, *halves_, *record_scales_, *block_scales_, *block_sums_;
    const int16_t* sixteens_;
    const int32_t *block_code_sums_, *group_offsets_;
    int64_t in;

    RoundedGroup(const RoundedRows& x, int64_t row0) : in(x.in) {
        const int64_t record = x.record(row0, 0), first = record * (x.unit / GROUP);  // the group's first block
        codes_ = x.codes + first * GROUP;
        scales_ = x.scales + first, sums_ = x.sums + first, halves_ = x.halves + first * 2;
        sixteens_ = x.sixteens + first * 2, record_scales_ = x.record_scales + record;
        group_offsets_ = x.group_offsets + first * 2;
        block_scales_ = x.block_scales + first, block_sums_ = x.block_sums + first;
        block_code_sums_ = x.block_code_sums + first;
    }
    // The first block of row m's super-block s, in its arrays' blocks.
    int64_t block(int m, int64_t s) const {
        if constexpr (rounds_by_super_block<F>()) return (s * ROWS + m) * BLOCKS;
        return m * (in / GROUP) + s * BLOCKS;
    }
    // row m's codes of block j of super-block s (where InputOrder puts them)
    const int8_t* codes(int m, int64_t s, int j) const {
        return codes_ + (block(m, s) + InputOrder<F>::slot(j)) * GROUP;
    }
    float scale(int m, int64_t s, int j = 0) const { return scales_[block(m, s) + j]; }
    const float* sums(int m, int64_t s) const { return sums_ + block(m, s); }
    // row m's code sum of block b (takes_code_sums formats')
    int32_t code_sum(int m, int64_t b) const { return block_code_sums_[block(m, b)]; }
    const float* halves(int m, int64_t s) const { return halves_ + 2 * block(m, s); }
    // row m's code sums over each 16 of super-block s, and the group's rows' scales of it side by side
    // (the K-quants')
    const int16_t* sixteens(int m, int64_t s) const { return sixteens_ + 2 * block(m, s); }
    const int32_t* group_offsets(int m, int64_t s) const { return group_offsets_ + 2 * block(m, s); }
    const float* super_block_scales(int64_t s) const {
        static_assert(integer_records<F>());
        return record_scales_ + s * ROWS;
    }
    // block b of the row: the group's rows' scales dx of it side by side, their code sums, and dx
    // times those (Loom's blocks in block_pair_rows)
    const float* block_scales(int64_t b) const { return block_scales_ + b * ROWS; }
    const int32_t* block_code_sums(int64_t b) const { return block_code_sums_ + b * ROWS; }
    const float* block_sums(int64_t b) const { return block_sums_ + b * ROWS; }
};

// Values [0, span) of x under one scale: the scale and the codes (round half to even, as
// torch.round: block_linear.py's round_activations is the same arithmetic), and the codes' sums
// over each 16 (span / 16 of them). Eight lanes at a time (a value at a time, the rounding of a
// 64-row step's input took 4% of its products' time); the product x / scale is rounded as a float
// first, then to an integer, as torch's x * inverse then round (an add beside the multiply would
// let the compiler fuse them, rounding once).
inline Lanes nearest_integers(Lanes v) {  // ties to even, as nearbyint
#if defined(__AVX__)
    return (Lanes)_mm256_round_ps((__m256)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    for (int l = 0; l < 8; ++l) v[l] = std::nearbyint(v[l]);
    return v;
#endif
}
inline float round_span(const float* x, int64_t span, int8_t* codes, int32_t* sixteens) {
    Lanes largest = {};
    for (int64_t i = 0; i < span; i += 8) {
        const Lanes v = load<Lanes>(x + i), magnitude = v < 0.0f ? -v : v;
        largest = magnitude > largest ? magnitude : largest;
    }
    float amax = 0.0f;
    for (int l = 0; l < 8; ++l) amax = std::max(amax, largest[l]);
    const float d = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int64_t k = 0; k < span; k += 16) {
        const Sums low = __builtin_convertvector(nearest_integers(load<Lanes>(x + k) * inverse), Sums);
        const Sums high = __builtin_convertvector(nearest_integers(load<Lanes>(x + k + 8) * inverse), Sums);
        const Sums both = low + high;
        int32_t sum = 0;
        for (int l = 0; l < 8; ++l) sum += both[l];
        sixteens[k / 16] = sum;
        typedef int8_t EightCodes __attribute__((vector_size(8)));
        store(codes + k, __builtin_convertvector(low, EightCodes));
        store(codes + k + 8, __builtin_convertvector(high, EightCodes));
    }
    return d;
}

// For a group of 16 input codes, what Q6_K side by side's products (block_interleaved.h) take off
// their 16-bit sums to stand for the weights' codes less 32: 32 times the codes' sum at values
// 4 t and 4 t + 1 (the low half of each 32-bit lane that maddubs fills), and at 4 t + 2 and 4 t + 3
// (the high half), over the group's four quads t. (Each at most 32 x 8 x 127: 32512.)
inline int32_t group_offset_word(const int8_t* codes) {
    int32_t low = 0, high = 0;
    for (int t = 0; t < 4; ++t) {
        low += codes[4 * t] + codes[4 * t + 1];
        high += codes[4 * t + 2] + codes[4 * t + 3];
    }
    return int32_t(uint32_t(uint16_t(32 * low)) | uint32_t(uint16_t(32 * high)) << 16);
}

// ``rows`` rows of x rounded into ``r`` (in records of record_values<F>) for products over format
// F: F::ROUNDING values (32, or a K-quant's 256) under each scale, each block's codes where
// InputOrder puts them. The region's threads share the spans in the records' order, so that each
// writes a stretch of its own (in the rows' order, the two threads of an eight-row product would
// write a K-quant group's records alternately).
template <typename F>
inline void round_rows(const float* x, int64_t x_stride, const RoundedRows& r) {
    constexpr int64_t span = F::ROUNDING, blocks = span / GROUP, SUPER_BLOCKS = F::VALUES / GROUP;
    static_assert(F::VALUES % span == 0, "a super-block holds whole spans");
    const int64_t spans = r.unit / span, record_blocks = r.unit / GROUP;  // a record's
#pragma omp for schedule(static)
    for (int64_t i = 0; i < r.rows * r.in / span; ++i) {
        const int64_t at = i / spans, part = i % spans;  // the record, and the span in it
        const auto [row, unit] = r.row_and_unit(at);
        int8_t codes[span];
        int32_t sixteens[span / 16];
        const float d = round_span(x + row * x_stride + unit * r.unit + part * span, span, codes, sixteens);
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t j = part * blocks + b, block = at * record_blocks + j;  // in the record, in the records
            const int64_t slot = j / SUPER_BLOCKS * SUPER_BLOCKS + InputOrder<F>::slot(int(j % SUPER_BLOCKS));
            std::memcpy(r.codes + (at * record_blocks + slot) * GROUP, codes + b * GROUP, GROUP);
            const int32_t code_sum = sixteens[2 * b] + sixteens[2 * b + 1];
            if constexpr (block_records<F>()) {
                const int64_t at_block = r.block_entry(row, (unit * r.unit + part * span) / GROUP + b);
                r.block_scales[at_block] = d;
                r.block_code_sums[at_block] = code_sum;
                r.block_sums[at_block] = d * float(code_sum);
            } else if constexpr (!integer_records<F>()) {
                r.scales[block] = d;
                r.sums[block] = d * float(code_sum);
                if constexpr (takes_code_sums<F>()) r.block_code_sums[block] = code_sum;
                r.halves[2 * block] = d * float(sixteens[2 * b]);
                r.halves[2 * block + 1] = d * float(sixteens[2 * b + 1]);
            }
        }
        if constexpr (integer_records<F>()) {  // a record is the span
            r.record_scales[at] = d;
            for (int k = 0; k < span / 16; ++k) r.sixteens[at * (span / 16) + k] = int16_t(sixteens[k]);
        }
        if constexpr (takes_group_offsets<F>())
            for (int k = 0; k < span / 16; ++k) r.group_offsets[at * (span / 16) + k] = group_offset_word(codes + 16 * k);
    }
}

// ``rows`` rows of x as the floats their rounding (``span`` values a scale) stands for, into
// ``out`` [rows, in].
inline void rounded_floats(const float* x, int64_t x_stride, int64_t rows, int64_t in, float* out, int64_t span) {
    const int64_t per_row = in / span;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows * per_row; ++i) {
        const int64_t row = i / per_row, at = (i % per_row) * span;
        int8_t codes[256];
        int32_t sixteens[256 / 16];
        const float d = round_span(x + row * x_stride + at, span, codes, sixteens);
        for (int64_t k = 0; k < span; ++k) out[row * in + at + k] = d * float(codes[k]);
    }
}

inline float lane_sum(Lanes v) {
    float sum = 0.0f;
    for (int l = 0; l < 8; ++l) sum += v[l];
    return sum;
}

// The products' weight rows in a task (block_rows's).
constexpr int TASK_ROWS = 16;

// y[i] = the lane sum of v[i], i < count: where V is the kernels' vector, a task's rows at once
// (vector.h's sums_of_lanes); summed one vector at a time, the compiler wrote a chain of 15
// dependent scalar additions per row, which took as long as a 576-wide row's products (the default
// model's output layer ran at 8 Gvalues/s).
template <typename V>
inline void store_lane_sums(const V* v, int count, float* y) {
    if constexpr (sizeof(V) == VECTOR_BYTES) {
        constexpr int L = Vector<float>::lanes;
        for (int first = 0; first < count; first += L) {
            V p[L];
            for (int j = 0; j < L; ++j) p[sum_position<float>(j)] = first + j < count ? v[first + j] : V{};
            const V sums = sums_of_lanes<float>(p);
            for (int j = 0; j < L && first + j < count; ++j) y[first + j] = sums[j];
        }
    } else {
        for (int i = 0; i < count; ++i) y[i] = lane_sum(v[i]);
    }
}

// f(std::integral_constant<int, I>{}) for I in [0, N): a loop whose index is a constant in its body.
template <typename Fn, int... I>
inline void for_each_of(Fn& f, std::integer_sequence<int, I...>) {
    (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename Fn>
inline void for_each_index(Fn&& f) {
    for_each_of(f, std::make_integer_sequence<int, N>{});
}

// The next SIDE weight rows from ``row`` (of a task's [.., end)) into ``rows`` (past the last, the
// last again: its sums go unused), and how many are real.
template <int SIDE>
inline int side_by_side(const BlockWeights& w, int64_t row, int64_t end, const uint8_t** rows) {
    const int side = int(std::min<int64_t>(SIDE, end - row));
    for (int i = 0; i < SIDE; ++i) rows[i] = w.row(row + std::min(i, side - 1));
    return side;
}

// y[o] = x . w[o] for weight rows [first, first + count) and ROWS rounded input rows: SIDE weight
// rows side by side (each block's input codes loaded once for them), each block's codes decoded
// once and met by every input row; a block's integer sums take its weight scales times the input
// block's scale, and each super-block adds its minimums' term.
template <typename F, int ROWS, int SIDE>
inline void int8_rows(const RoundedGroup<F, ROWS>& x, const BlockWeights& w, int64_t first, int64_t count,
                      float* y, int64_t y_stride) {
    constexpr int64_t BLOCKS = F::VALUES / GROUP;
    const int64_t supers = w.in / F::VALUES, share = w.stride / supers;  // a super-block's share of a row's bytes
    Lanes totals[ROWS][TASK_ROWS];
    for (int64_t r = 0; r < count; r += SIDE) {
        const uint8_t* rows[SIDE];
        const int side = side_by_side<SIDE>(w, first + r, first + count, rows);
        const uint8_t* ahead = w.row(first + r) + SIDE * w.stride + FETCH_BYTES;  // (never faults past the end)
        Lanes acc[SIDE][ROWS] = {};
        for (int64_t s = 0; s < supers; ++s) {
            typename F::Super supers_of[SIDE];
            for (int i = 0; i < SIDE; ++i) supers_of[i] = typename F::Super(rows[i], w.in, s);
            fetch_lines(ahead + SIDE * s * share, SIDE * share);
            if constexpr (rounds_by_super_block<F>()) {  // K-quants: integer sums, as pair_rows
                Sums sums[SIDE][ROWS] = {};
                for_each_index<BLOCKS>([&](auto block) {  // j a constant: Q6_K's shifts by it are too
                    constexpr int j = decltype(block)::value;
                    Bytes codes[SIDE];
                    Shorts scales[SIDE];
                    for (int i = 0; i < SIDE; ++i) {
                        codes[i] = supers_of[i].codes(j);
                        scales[i] = supers_of[i].template block_int_scales<j>();
                    }
                    for (int m = 0; m < ROWS; ++m) {
                        const SignedBytes xq = load<SignedBytes>(x.codes(m, s, j));
                        for (int i = 0; i < SIDE; ++i) sums[i][m] = dot_scaled(sums[i][m], codes[i], xq, scales[i]);
                    }
                });
                for (int m = 0; m < ROWS; ++m) {
                    const float dx = x.scale(m, s);
                    for (int i = 0; i < SIDE; ++i)
                        acc[i][m] += __builtin_convertvector(sums[i][m], Lanes) * (supers_of[i].d * dx);
                }
            } else {
                for_each_index<BLOCKS>([&](auto block) {
                    constexpr int j = decltype(block)::value;
                    Bytes codes[SIDE];
                    Lanes scales[SIDE];
                    for (int i = 0; i < SIDE; ++i) {
                        codes[i] = supers_of[i].codes(j);
                        scales[i] = supers_of[i].scales(j);
                    }
                    for (int m = 0; m < ROWS; ++m) {
                        const SignedBytes xq = load<SignedBytes>(x.codes(m, s, j));
                        const float dx = x.scale(m, s, j);
                        for (int i = 0; i < SIDE; ++i) {
                            const Sums sums = dot_bytes(codes[i], supers_of[i].signed_x(j, xq));
                            acc[i][m] += __builtin_convertvector(sums, Lanes) * (scales[i] * dx);
                        }
                    }
                });
            }
            for (int m = 0; m < ROWS; ++m)
                for (int i = 0; i < SIDE; ++i)
                    acc[i][m] += supers_of[i].offset(x.sums(m, s), x.halves(m, s));
        }
        for (int i = 0; i < side; ++i)
            for (int m = 0; m < ROWS; ++m) totals[m][r + i] = acc[i][m];
    }
    for (int m = 0; m < ROWS; ++m) store_lane_sums(totals[m], int(count), y + m * y_stride + first);
}

// Input row ``row``'s codes of a pair of blocks A, B of super-block ``s``: one 64-byte load where they
// lie side by side (InputOrder puts them so for Q4_K, whose pairs are blocks 4c and 4c + 2: gathered
// with an insert a row, its 8192 x 2048 products ran at 133 Gvalue-rows/s on 16 rows and 135 on 64
// against 148 and 152 so, two Zen 5 threads), else gathered.
template <int A, int B, typename F, int ROWS>
inline PairSigned input_pair(const RoundedGroup<F, ROWS>& x, int m, int64_t s) {
    if constexpr (InputOrder<F>::slot(B) == InputOrder<F>::slot(A) + 1) return load<PairSigned>(x.codes(m, s, A));
    return pair_of(load<SignedBytes>(x.codes(m, s, A)), load<SignedBytes>(x.codes(m, s, B)));
}

// Lane i of pick_lanes<Pick>(a, b): lane Pick::lane(i) of a, or of b from V's lane count on.
template <typename Pick, typename V, size_t... I>
inline V pick_lanes(V a, V b, std::index_sequence<I...>) {
    return __builtin_shufflevector(a, b, Pick::lane(I)...);
}
template <typename Pick, typename V>
inline V pick_lanes(V a, V b) {
    return pick_lanes<Pick>(a, b, std::make_index_sequence<sizeof(V) / sizeof(a[0])>());
}
template <int ROWS>
struct RowOfLane {  // lane i of one side of ROWS input rows: row i % ROWS
    static constexpr int lane(size_t i) { return int(i) % ROWS; }
};

// The sums of the halves of V vectors (V a power of two up to 8; p overwritten): vector.h's folds,
// each level adding neighbouring blocks of lanes of two vectors into one (a vector folded with itself
// once they run out), within each half. The sum of p[v]'s first half ends in lane
// half_sum_lane(v, 0), of its second in half_sum_lane(v, 1).
template <int V, int B = 4>
inline PairSums half_sums(PairSums* p) {
    if constexpr (B == 0) {
        return p[0];
    } else {
        for (int t = 0; t < std::max(V / 2, 1); ++t) {
            const PairSums a = p[2 * t], b = V > 1 ? p[2 * t + 1] : a;
            p[t] = pick_lanes<Low<16, B>>(a, b) + pick_lanes<High<16, B>>(a, b);
        }
        return half_sums<std::max(V / 2, 1), B / 2>(p);
    }
}
constexpr int half_sum_lane(int v, int half) {  // v's three bits reversed, in the half
    return 8 * half + ((v & 1) << 2 | (v & 2) | (v & 4) >> 2);
}

// Eight of a vector's sixteen lanes: lane i, Pick::lane(i).
template <typename Pick, typename V, size_t... I>
inline auto eight_lanes(V v, std::index_sequence<I...>) {
    return __builtin_shufflevector(v, v, Pick::lane(I)...);
}
template <typename Pick, typename V>
inline auto eight_lanes(V v) { return eight_lanes<Pick>(v, std::make_index_sequence<8>()); }

// Where pair_rows' half_sums leave item i's sum (item 2 v in vector FIRST + v's first half, 2 v + 1
// in its second).
template <int FIRST>
struct ItemLane {
    static constexpr int lane(size_t i) { return half_sum_lane(FIRST + int(i) / 2, int(i) % 2); }
};

// Lane l: a's lanes 2 l and 2 l + 1 times b's, summed (AVX-512's madd).
inline PairSums madd_shorts(PairShorts a, PairShorts b) {
#if defined(__AVX512BW__)
    return (PairSums)_mm512_madd_epi16((__m512i)a, (__m512i)b);
#else
    PairSums sums;
    for (int l = 0; l < 16; ++l) sums[l] = int32_t(a[2 * l]) * b[2 * l] + int32_t(a[2 * l + 1]) * b[2 * l + 1];
    return sums;
#endif
}

// A K-quant super-block's share of a row's sum, lane by lane, from the exact integers of its
// product: acc + a (d dx) - b (dmin dx), where a sums the codes' products (each group's times its
// integer scale, offsets included) and b the minimums' (MINS). Every row count takes these very
// steps (pair_rows a product's pairs of rows in lanes, block_tiles.h's bands an input row a lane),
// so that a row's numbers do not depend on how many rows its product had: two multiply-adds,
// rounded once each.
template <bool MINS>
inline Lanes super_block_step(Lanes acc, Sums a, Sums b, Lanes d_dx, Lanes dmin_dx) {
#if defined(__FMA__)
    acc = (Lanes)_mm256_fmadd_ps(_mm256_cvtepi32_ps((__m256i)a), (__m256)d_dx, (__m256)acc);
    if constexpr (MINS) acc = (Lanes)_mm256_fnmadd_ps(_mm256_cvtepi32_ps((__m256i)b), (__m256)dmin_dx, (__m256)acc);
#else
    for (int l = 0; l < 8; ++l) {
        acc[l] = std::fma(float(a[l]), d_dx[l], acc[l]);
        if constexpr (MINS) acc[l] = std::fma(-float(b[l]), dmin_dx[l], acc[l]);
    }
#endif
    return acc;
}
#if defined(__AVX512F__)
template <bool MINS>
inline __m512 super_block_step(__m512 acc, __m512i a, __m512i b, __m512 d_dx, __m512 dmin_dx) {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), d_dx, acc);
    if constexpr (MINS) acc = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(b), dmin_dx, acc);
    return acc;
}
#endif

// int8_rows two blocks at a time, for the K-quants (with AVX-512): a pair's codes meet 64 bytes of
// input in one 512-bit instruction. One block at a time, a one-row Q4_K product ran at 12 Gvalues/s
// on a Zen 5 core, still arithmetic-bound. The input is rounded under one scale a super-block, so
// the sums stay in integers through it, each pair's products multiplied by their blocks' integer
// scales as they are added (llama.cpp's way: two instructions a pair, maddubs and VNNI's dpwssd),
// and take floats once a super-block: where every pair was converted and scaled in floats, a
// one-row Q4_K product ran at 30 Gvalues/s a core. A super-block's sums of every pair of rows (weight
// row, input row) are then added up into one exact integer each, the offsets' integers beside
// them, and take super_block_step as the tiled products of many rows do.
template <typename F, int ROWS, int SIDE>
inline void pair_rows(const RoundedGroup<F, ROWS>& x, const BlockWeights& w, int64_t first, int64_t count,
                      float* y, int64_t y_stride) {
    static_assert(rounds_by_super_block<F>());
    constexpr int64_t BLOCKS = F::VALUES / GROUP;
    constexpr bool MINS = F::Super::MINS;
    // the items, every pair of rows (item j: weight row j / ROWS, input row j % ROWS), two to a
    // vector of half_sums
    constexpr int ITEMS = SIDE * ROWS, K = ITEMS <= 2 ? 2 : ITEMS <= 4 ? 4 : 8, V = MINS ? K : K / 2;
    const int64_t supers = w.in / F::VALUES, share = w.stride / supers;  // a super-block's share of a row's bytes
    for (int64_t r = 0; r < count; r += SIDE) {
        const uint8_t* rows[SIDE];
        const int side = side_by_side<SIDE>(w, first + r, first + count, rows);
        const uint8_t* ahead = w.row(first + r) + SIDE * w.stride + FETCH_BYTES;  // (never faults past the end)
        Lanes row_sums = {};  // lane j: item j's
        for (int64_t s = 0; s < supers; ++s) {
            typename F::Super supers_of[SIDE];
            for (int i = 0; i < SIDE; ++i) supers_of[i] = typename F::Super(rows[i], w.in, s);
            fetch_lines(ahead + SIDE * s * share, SIDE * share);
            PairSums sums[SIDE][ROWS] = {};
            for_each_index<BLOCKS / 2>([&](auto pair) {
                constexpr int P = decltype(pair)::value, A = F::Super::first(P), B = F::Super::second(P);
                PairBytes codes[SIDE];
                PairShorts scales[SIDE];
                for (int i = 0; i < SIDE; ++i) {
                    codes[i] = supers_of[i].template pair_codes<P>();
                    scales[i] = supers_of[i].template pair_int_scales<P>();
                }
                for (int m = 0; m < ROWS; ++m) {
                    const PairSigned xq = input_pair<A, B>(x, m, s);
                    for (int i = 0; i < SIDE; ++i) sums[i][m] = dot_scaled(sums[i][m], codes[i], xq, scales[i]);
                }
            });
            // each item's sums added up, two items in the halves of one vector: their codes' sums
            // folded, their offsets from one madd; with MINS the minimums' vectors after the codes'
            PairSums vectors[K];
            for (int v = 0; v < K / 2; ++v) {
                PairSums codes[2] = {};  // items 2 v and 2 v + 1 (zeros past the last)
                Shorts weights[2] = {}, sixteens[2] = {};
                for (int h = 0; h < 2; ++h) {
                    const int j = 2 * v + h, i = j / ROWS, m = j % ROWS;
                    if (j >= ITEMS) continue;
                    codes[h] = sums[i][m];
                    weights[h] = supers_of[i].offset_weights();
                    sixteens[h] = load<Shorts>(x.sixteens(m, s));
                }
                vectors[v] = pick_lanes<Low<16, 8>>(codes[0], codes[1]) + pick_lanes<High<16, 8>>(codes[0], codes[1]);
                const PairSums offset = madd_shorts(pair_of(weights[0], weights[1]), pair_of(sixteens[0], sixteens[1]));
                if constexpr (MINS) vectors[K / 2 + v] = offset;
                else vectors[v] += offset;
            }
            const PairSums totals = half_sums<V>(vectors);
            const Sums a = eight_lanes<ItemLane<0>>(totals), b = eight_lanes<ItemLane<K / 2>>(totals);
            const auto per_side = [&](float first_row, float last_row) {  // lane j: weight row j / ROWS's
                constexpr Lanes lane = {0, 1, 2, 3, 4, 5, 6, 7};
                return SIDE == 1 ? Lanes{} + first_row : lane < float(ROWS) ? Lanes{} + first_row : Lanes{} + last_row;
            };
            const Lanes d = per_side(supers_of[0].d, supers_of[SIDE - 1].d);
            const Lanes dmin = per_side(supers_of[0].dmin, supers_of[SIDE - 1].dmin);
            Lanes dx = load<Lanes>(x.super_block_scales(s));
            if constexpr (SIDE > 1) dx = pick_lanes<RowOfLane<ROWS>>(dx, dx);
            row_sums = super_block_step<MINS>(row_sums, a, b, d * dx, dmin * dx);
        }
        for (int i = 0; i < side; ++i)
            for (int m = 0; m < ROWS; ++m) y[m * y_stride + first + r + i] = row_sums[i * ROWS + m];
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// A Loom block's share of a row's sum, from the exact integer a of its codes' products: the block's
// term c = a (d dx), with minimums + m xs (xs: dx times the input block's code sum), then acc + c.
// As super_block_step, every row count takes these very steps, a block at a time in the row's order
// (block_pair_rows sixteen terms in a vector, block_tiles.h's bands each weight row's blocks in turn).
// (The product takes an explicit rounding, so that GCC, which fuses a multiply and an add written
// apart, cannot fuse it into the add of the term that follows in one kernel and not the other.)
template <bool MINS>
inline __m512 block_term(__m512 a, __m512 d_dx, __m512 m, __m512 xs) {
    const __m512 c = _mm512_mul_round_ps(a, d_dx, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if constexpr (!MINS) return c;
    return _mm512_fmadd_ps(m, xs, c);
}

// Where block_pair_rows's vectors and their terms lie: G pairs of blocks at a time, vector v = item j
// (weight row j / ROWS, input row j % ROWS) times G plus pair g; half_sums leaves block h of the pair
// in lane half_sum_lane(v, h).
template <int ROWS, int SIDE, int G>
struct TermLanes {
    static constexpr int ITEMS = SIDE * ROWS;
    struct Term {  // the term of lane L: item, pair and block half
        int item, pair, half;
    };
    static constexpr Term term(size_t lane) {
        const int bits = int(lane) % 8, v = (bits & 1) << 2 | (bits & 2) | (bits & 4) >> 2;
        return {v / G < ITEMS ? v / G : 0, v % G, int(lane) / 8};
    }
    struct OfWeights {  // from two weight rows' eight block floats side by side, each from the group's first
        static constexpr int lane(size_t L) { return term(L).item / ROWS * 8 + 2 * term(L).pair + term(L).half; }
    };
    struct OfInput {  // from the group's [block][row] input floats (RoundedGroup::block_scales)
        static constexpr int lane(size_t L) { return (2 * term(L).pair + term(L).half) * ROWS + term(L).item % ROWS; }
    };
    template <int g, int h>
    struct OfBlock {  // lane j: item j's term of the group's pair g, block half h
        static constexpr int lane(size_t j) {
            const int v = (int(j) < ITEMS ? int(j) : 0) * G + g;
            return half_sum_lane(v, h);
        }
    };
};

// Eight floats of a weight row from ``from`` (``count`` of them, zeros past: a row's last floats
// may end the matrix)
inline Lanes row_floats(const float* from, int count) {
    return (Lanes)_mm256_maskz_loadu_ps(__mmask8((1u << count) - 1), from);
}

// Whether format F's rows keep their blocks' scales as float32s, which block_pair_rows loads from
// them (F::scales_of); else it makes them eight at a time (F::scale_lanes: LoomIQ4Pairs', a d and a
// multiplier each; as the Supers' scalar arithmetic, a one-row product ran at 16 GB/s).
template <typename F, typename = void>
struct KeepsScales : std::false_type {};
template <typename F>
struct KeepsScales<F, std::void_t<decltype(F::scales_of(nullptr, 0))>> : std::true_type {};

// pair_rows for Loom's blocks (with AVX-512), whose input has a scale a block: each block's products
// of every pair of rows added up into one exact integer, then block_term in the row's order. G pairs
// of blocks go at a time, so that half_sums adds up eight vectors at once (one or two input rows: a
// pair at a time, the adding up took most of a one-row product's time), and their sixteen terms are
// taken in one vector: the weights' and input's scales loaded as vectors and placed in its lanes by
// constant shuffles.
template <typename F, int ROWS, int SIDE>
inline void block_pair_rows(const RoundedGroup<F, ROWS>& x, const BlockWeights& w, int64_t first, int64_t count,
                            float* y, int64_t y_stride) {
    using Super = typename F::Super;
    constexpr int ITEMS = SIDE * ROWS, G = ITEMS <= 2 ? 4 : ITEMS <= 4 ? 2 : 1;
    using Place = TermLanes<ROWS, SIDE, G>;
    constexpr bool KEEPS_SCALES = KeepsScales<F>::value;
    const int64_t pairs = w.in / (2 * GROUP), share = w.stride / pairs;  // a pair's share of a row's bytes
    for (int64_t r = 0; r < count; r += SIDE) {
        const uint8_t* rows[SIDE];
        const int side = side_by_side<SIDE>(w, first + r, first + count, rows);
        const uint8_t* ahead = w.row(first + r) + SIDE * w.stride + FETCH_BYTES;  // (never faults past the end)
        Lanes row_sums = {};  // lane j: item j's
        for (int64_t s = 0; s < pairs; s += G) {
            const int n = int(std::min<int64_t>(G, pairs - s));  // pairs in this group
            fetch_lines(ahead + SIDE * s * share, SIDE * G * share);
            PairSums vectors[8] = {};
            for_each_index<G>([&](auto pair) {
                constexpr int g = decltype(pair)::value;
                if (g >= n) return;
                Super supers_of[SIDE];
                PairBytes codes[SIDE];
                for (int i = 0; i < SIDE; ++i) {
                    supers_of[i] = Super(rows[i], w.in, s + g);
                    codes[i] = supers_of[i].template pair_codes<0>();
                }
                for (int m = 0; m < ROWS; ++m) {
                    const PairSigned xq = input_pair<0, 1>(x, m, s + g);
                    for (int i = 0; i < SIDE; ++i)
                        vectors[(i * ROWS + m) * G + g] = dot_pairs(codes[i], supers_of[i].template pair_signed<0>(xq));
                }
            });
            PairSums totals = half_sums<8>(vectors);
            const int64_t b = 2 * s;  // the group's first block
            const auto of_input = [](auto v) { return pick_lanes<typename Place::OfInput>(v, v); };
            if constexpr (Super::CODE_OFFSET != 0)
                totals -= Super::CODE_OFFSET * of_input(load<PairSums>(x.block_code_sums(b)));
            const auto of_weights = [&](const float* (*at)(const uint8_t*, int64_t)) {
                return pick_lanes<typename Place::OfWeights>(
                    pair_of(row_floats(at(rows[0], w.in) + b, 2 * n), row_floats(at(rows[SIDE - 1], w.in) + b, 2 * n)),
                    PairLanes{});
            };
            PairLanes m = {}, xs = {};
            if constexpr (Super::MINS) m = of_weights(F::mins_of), xs = of_input(load<PairLanes>(x.block_sums(b)));
            PairLanes d = {};
            if constexpr (KEEPS_SCALES) {
                d = of_weights(F::scales_of);
            } else {
                const Lanes first = F::scale_lanes(rows[0], w.in, b, 2 * n), last = F::scale_lanes(rows[SIDE - 1], w.in, b, 2 * n);
                d = pick_lanes<typename Place::OfWeights>(pair_of(first, last), PairLanes{});
            }
            const PairLanes d_dx = d * of_input(load<PairLanes>(x.block_scales(b)));
            const PairLanes terms = (PairLanes)block_term<Super::MINS>(
                _mm512_cvtepi32_ps((__m512i)totals), (__m512)d_dx, (__m512)m, (__m512)xs);
            for_each_index<G>([&](auto pair) {
                constexpr int g = decltype(pair)::value;
                if (g >= n) return;
                row_sums += eight_lanes<typename Place::template OfBlock<g, 0>>(terms);
                row_sums += eight_lanes<typename Place::template OfBlock<g, 1>>(terms);
            });
        }
        for (int i = 0; i < side; ++i)
            for (int m = 0; m < ROWS; ++m) y[m * y_stride + first + r + i] = row_sums[i * ROWS + m];
    }
}

#endif

// Weight rows side by side at a time: two for up to three input rows, else one. Four for one row
// read memory slower (each thread a stream per row beside the rows fetched ahead): two threads, the
// 1.7B Q4_K_M decode forward took 51.8 ms with four, 44.6-46.2 with two, 44.2 with one; the default
// model's 6.6, 6.0 and 7.3 ms (Zen 5, quiet).
template <int ROWS>
constexpr int side_for() { return ROWS <= 3 ? 2 : 1; }

// The products of many rows (K-quants and Loom's blocks), and Q4_K's sixteen rows side by side,
// built on the above.
#include "block_tiles.h"
#include "block_interleaved.h"

// Weight row ``row`` as floats into ``dst`` (an embedding's lookup: block_linear.py's BlockEmbedding).
template <typename F>
inline void widen_row(const BlockWeights& w, int64_t row, float* dst) {
    if constexpr (rows_side_by_side<F>())
        widen_row16(F{}, w, row, dst);
    else
        for (int64_t s = 0; s < w.in / F::VALUES; ++s) typename F::Super(w.row(row), w.in, s).widen(dst + s * F::VALUES);
}

// Floats of scratch a block product of ``rows`` rows of width ``in`` takes (block_linear_rows):
// its rounded input (in records or bands), or for 16-bit floats the panels.
inline int64_t block_scratch_size(int64_t rows, int64_t in) {
    return std::max({RoundedRows::floats_for(rows, in), Bands::floats_for(rows, in), packed_size<float>(rows, in)});
}

// How many input rows of width ``in`` a band of block_rows takes: as many whole groups of FEW_ROWS
// as BAND_BYTES of rounded input hold, at least MIN_BAND_ROWS.
constexpr int64_t BAND_BYTES = 384 << 10, MIN_BAND_ROWS = 32;
inline int64_t input_band_rows(int64_t in) {
    const int64_t group_bytes = FEW_ROWS * in * 9 / 8;  // the codes, a byte a value, and their scales and sums
    return std::max(MIN_BAND_ROWS, BAND_BYTES / group_bytes * FEW_ROWS);
}

// y = x w^T + b over block weights of format F (block_linear_rows).
template <typename F>
void block_rows(const float* x, int64_t x_stride, int64_t rows, const BlockWeights& w, const float* bias, float* y,
                int64_t y_stride, float* scratch) {
    const int64_t in = w.in, out = w.out;
    if (rows == 0)  // (the output layer of a step none of whose rows is sampled): every thread of the
        return;     // team returns alike
#if defined(__AVX512F__) && defined(__AVX512BW__)
    // takes_tiles formats: whole bands of rows tiled, and a last band part full from TILED_FROM rows alone or
    // TILED_TAIL_FROM behind full ones (whose tasks have unpacked the weights already); fewer rows
    // left over take the products below, the numbers the same either way (block_tiles.h). A band
    // of one row cost as much as a full one: 17 / 20 / 24-token prompts of the 1.7B Q4_K_M file took
    // 245-268 / 244-255 / 245-267 ms to their first token with every band tiled, 196-198 / 218-221 /
    // 258-262 with tails below 13 left to the pairs.
    if constexpr (takes_tiles<F>()) {
        const int64_t tail = rows % BAND;
        const int64_t tiled = tail >= (rows > BAND ? TILED_TAIL_FROM : TILED_FROM) ? rows : rows - tail;
        if (tiled >= TILED_FROM) {
            tiled_rows<F>(x, x_stride, tiled, w, bias, y, y_stride, scratch);  // (ends at a barrier)
            if (tiled == rows) return;
            x += tiled * x_stride, y += tiled * y_stride, rows -= tiled;
        }
    }
#endif
    const RoundedRows rounded(scratch, rows, in, record_values<F>(in));
    round_rows<F>(x, x_stride, rounded);  // its barrier: every row is rounded before any product
    // FEW_ROWS input rows at a time, a task's weights cached for the later groups: from 16 to 512
    // rows this ran 1.1-2x the panels over weights widened a tile at a time (one Zen 5 thread, a
    // 4096 x 2048 product: Q4_K 67 against 32-51 Gvalues/s, Q6_K 64 against 12-38, Loom's 8-bit
    // blocks 44 against 35-41, its 4-bit ones 38 against 22-38), which block products then left.
    const auto product = [&](auto group, int64_t m, int64_t o, int64_t count) {
        float* ym = y + m * y_stride;
#if LOOM_ROWS16
        if constexpr (rows_side_by_side<F>())
            rows16<group>(RoundedGroup<F, group>(rounded, m), w, o, count, ym, y_stride);
        else
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
        if constexpr (block_records<F>())
            block_pair_rows<F, group, side_for<group>()>(RoundedGroup<F, group>(rounded, m), w, o, count, ym, y_stride);
        else if constexpr (rounds_by_super_block<F>())
            pair_rows<F, group, side_for<group>()>(RoundedGroup<F, group>(rounded, m), w, o, count, ym, y_stride);
        else
#endif
            int8_rows<F, group, side_for<group>()>(RoundedGroup<F, group>(rounded, m), w, o, count, ym, y_stride);
    };
    // Long prompts' input rows in bands whose rounded codes stay in L2 while every weight row of
    // the matrix passes them (the weights are read again for each band: little beside the products).
    const int64_t band = input_band_rows(in);
    for (int64_t m0 = 0; m0 < rows; m0 += band)
        row_group_tasks(std::min(band, rows - m0), out, int64_t(TASK_ROWS), bias, y + m0 * y_stride, y_stride,
                        [&](auto group, int64_t m, int64_t o, int64_t count) { product(group, m0 + m, o, count); });
}

// The panels widen a tile of 16-bit weights for every chunk of k, which few input rows do not
// repay: 8192 x 2048 float16 at 4 / 8 / 16 rows ran 15.8 / 31.5 / 61.9 Gvalue-rows/s on the panels
// and 34.2 / 36.3 / 41.1 a few rows at a time (two Zen 5 threads), where float32 weights take the
// panels from 3 rows (cpu_linear.h's PANEL_MIN_ROWS). With AVX-512's two weight rows side by side a
// few rows at a time, from 12 (two Zen 4 threads, 9 / 10 / 12 / 16 rows: 58 / 60 / 64 / 65 against
// the panels' 47 / 53 / 63 / 83).
constexpr int64_t HALF_PANEL_MIN_ROWS = VECTOR_BYTES == 64 ? 12 : FEW_ROWS + 1;

// y = x w^T + b over block weights (or a file's float rows: cpu_linear.h's products, panels from
// ``panel_from`` rows), the work shared among the threads of the enclosing parallel region.
// ``scratch``: block_scratch_size(rows, in) floats shared by the region's threads, from a cache
// line's start.
inline void block_linear_rows(const float* x, int64_t x_stride, int64_t rows, const BlockWeights& w,
                              const float* bias, float* y, int64_t y_stride, float* scratch,
                              int64_t panel_from = PANEL_MIN_ROWS) {
    with_format(w.format, w.in, [&](auto f) {
        using F = decltype(f);
        // 16-bit weights take the panels from HALF_PANEL_MIN_ROWS rows up at the earliest
        if constexpr (IsFloatRows<F>::value) {
            using W = typename F::Element;
#if defined(__AVX512BF16__)
            if constexpr (std::is_same_v<W, BFloat16>) {
                bfloat16_linear_rows(x, x_stride, rows, reinterpret_cast<const BFloat16*>(w.base), bias, w.in, w.out,
                                     y, y_stride, reinterpret_cast<uint16_t*>(scratch));
                return;
            }
#endif
            const int64_t from = std::is_same_v<W, float> ? panel_from : std::max(panel_from, HALF_PANEL_MIN_ROWS);
            linear_rows(x, x_stride, rows, reinterpret_cast<const W*>(w.base), w.stride / int64_t(sizeof(W)), bias, w.in,
                        w.out, y, y_stride, scratch, from);
        } else {
            block_rows<F>(x, x_stride, rows, w, bias, y, y_stride, scratch);
        }
    });
}

}  // namespace
