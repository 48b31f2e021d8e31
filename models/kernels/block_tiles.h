// Block products of many input rows (the K-quants, and Loom's blocks: takes_tiles), tiled as
// llama.cpp's CPU backend tiles them (ggml-cpu's
// tiled products): an input row in each 32-bit lane of a 512-bit vector, so that one
// vpdpbusd multiplies four bytes of sixteen input rows by four bytes of one weight row broadcast
// to every lane, and a group's sums take the group's integer scale in one vpmulld for all sixteen
// rows. block_weights.h's pair_rows, a pair of blocks at a time for each input row, takes two
// multiply instructions per 64 products of one row (maddubs, then dpwssd by the scales) where this
// takes about one, and spends nothing on adding up lanes: 8192 x 2048 Q4_K at 16 / 64 rows runs
// 192-203 / 243-246 Gvalue-rows/s on two Zen 5 threads against pair_rows' 145-152 / 147-155, Q6_K
// 165-167 / 209-228 against 104-124 / 126-129 (docs/benchmarks.md, "Tiled K-quant products").
//
// The weights are unpacked once per task (TASK_ROWS weight rows, into each thread's own scratch):
// every code a byte, every group's scale and offset weight an integer. The input is rounded as for
// pair_rows (the very codes and scales) into bands of BAND rows laid out lane by lane. A super-block's
// sums end as pair_rows' do, in exact integers given to block_weights.h's super_block_step, so a row's
// numbers are the same whichever kernel its product took. Loom's blocks, an input scale every 32
// values, end each block so instead, as block_pair_rows does (block_band_tile, UnpackedBlocks).
//
// Needs AVX-512 (BW): with VNNI one vpdpbusd, else maddubs and madd (the K-quants' and Loom's 4- and
// 5-bit codes stay under 64, so a pair of products never saturates 16 bits; Loom's 8-bit codes, read
// as q + 128, take the tiles only with VNNI).

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <vector>

namespace {

constexpr int BAND = 16;  // input rows a band: one a lane
constexpr int TILE = 8;   // weight rows a tile: eight sums of sixteen rows, eight of their groups', in registers
// block_rows takes the tiles from TILED_FROM rows, and a last band part full behind full ones from
// TILED_TAIL_FROM rows (measured: block_rows, docs/benchmarks.md)
constexpr int64_t TILED_FROM = 13, TILED_TAIL_FROM = 8;

// Input rows rounded for the tiled products, BAND rows to a band (rows past the last: zeros), in
// spans of ``span`` values under one scale (a K-quant's super-block of 256, a Loom block's 32).
struct Bands {
    int8_t* codes;      // [band][in / 4][BAND][4]: four codes of each row in turn
    int32_t* sixteens;  // [band][span][span / 32][BAND]: the code sums over sixteens 2 h, 2 h + 1 as two int16
    float* scales;      // [band][span][BAND]
    float* sums;        // [band][span][BAND]: the scale times the span's code sum (spans of 32)
    int64_t rows, in, span, bands, spans;

    // ``scratch``: floats_for(rows, in) floats from a cache line's start
    Bands(float* scratch, int64_t rows, int64_t in, int64_t span)
        : rows(rows), in(in), span(span), bands((rows + BAND - 1) / BAND), spans(in / span) {
        codes = reinterpret_cast<int8_t*>(scratch);
        sixteens = reinterpret_cast<int32_t*>(scratch + whole_lines<float>(bands * BAND * in / 4));
        scales = reinterpret_cast<float*>(sixteens + whole_lines<int32_t>(bands * BAND * in / 32));
        sums = scales + whole_lines<float>(bands * spans * BAND);
    }
    static int64_t floats_for(int64_t rows, int64_t in) {  // (the most any span takes)
        const int64_t padded = (rows + BAND - 1) / BAND * BAND;
        return whole_lines<float>(padded * in / 4) + 3 * whole_lines<float>(padded * in / 32);
    }
    // span s of a band
    int8_t* codes_of(int64_t band, int64_t s) const { return codes + (band * in + s * span) * BAND; }
    int32_t* sixteens_of(int64_t band, int64_t s) const { return sixteens + (band * spans + s) * (span / 32) * BAND; }
    float* scales_of(int64_t band, int64_t s) const { return scales + (band * spans + s) * BAND; }
    float* sums_of(int64_t band, int64_t s) const { return sums + (band * spans + s) * BAND; }
};

// ``rows`` rows of x rounded into ``b``, SPAN values under each scale as for pair_rows and
// block_pair_rows (round_span, the very arithmetic). Each thread rounds whole spans of a band, so
// that it writes lines of its own.
template <int SPAN>
inline void round_bands(const float* x, int64_t x_stride, const Bands& b) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < b.bands * b.spans; ++i) {
        const int64_t band = i / b.spans, s = i % b.spans;
        int8_t* codes = b.codes_of(band, s);
        int32_t* sixteens = b.sixteens_of(band, s);
        for (int lane = 0; lane < BAND; ++lane) {
            const int64_t row = band * BAND + lane;
            int8_t q[SPAN] = {};
            int32_t sums[SPAN / 16] = {};
            const float d = row < b.rows ? round_span(x + row * x_stride + s * SPAN, SPAN, q, sums) : 0.0f;
            for (int quad = 0; quad < SPAN / 4; ++quad) std::memcpy(codes + (quad * BAND + lane) * 4, q + 4 * quad, 4);
            for (int h = 0; h < SPAN / 32; ++h)
                sixteens[h * BAND + lane] = int32_t(uint32_t(uint16_t(sums[2 * h])) | uint32_t(sums[2 * h + 1]) << 16);
            b.scales_of(band, s)[lane] = d;
            if constexpr (SPAN == GROUP) b.sums_of(band, s)[lane] = d * float(sums[0] + sums[1]);
        }
    }
}

// A task's weight rows unpacked: TASK_ROWS rows (past the task's last: zeros) of format F.
struct UnpackedRows {
    uint8_t* codes;     // [super-block][TASK_ROWS][256], in the values' order
    int32_t* scales;    // [super-block][TASK_ROWS][groups]: F::Super::group_scales
    int32_t* offsets;   // [super-block][TASK_ROWS][8]: offset_weights 2 h, 2 h + 1 as two int16
    float *d, *dmin;    // [super-block][TASK_ROWS]

    // in each thread's buffer, for rows of ``in`` values
    UnpackedRows(std::vector<uint8_t>& buffer, int64_t in) {
        const int64_t supers = in / 256;
        const int64_t code_bytes = supers * TASK_ROWS * 256, word_bytes = supers * TASK_ROWS * 4;
        uint8_t* base = line_aligned(buffer, size_t(code_bytes + (16 + 8 + 2) * word_bytes));
        codes = base;
        scales = reinterpret_cast<int32_t*>(base + code_bytes);
        offsets = scales + supers * 16 * TASK_ROWS;
        d = reinterpret_cast<float*>(offsets + supers * 8 * TASK_ROWS);
        dmin = d + supers * TASK_ROWS;
    }
};

// Weight rows [first, first + count) into ``u``, the rows a task has; meanwhile the next task's
// rows (the same bytes on: a task's rows lie together) are fetched into L2, which the products
// of its bands give the time to arrive (unfetched, a 16-row Q4_K product spent a fifth of its time
// waiting on the first bytes of each row).
template <typename F>
inline void unpack_rows(const BlockWeights& w, int64_t first, int64_t count, const UnpackedRows& u) {
    using Super = typename F::Super;
    const int64_t supers = w.in / 256;
    const int64_t share = w.stride / supers;  // a super-block's bytes
    const uint8_t* next = w.row(first) + TASK_ROWS * w.stride;  // (never faults past the end)
    for (int t = 0; t < TASK_ROWS; ++t)
        for (int64_t s = 0; s < supers; ++s) {
            fetch_lines(next + t * w.stride + s * share, share);
            const int64_t at = s * TASK_ROWS + t;
            uint8_t* codes = u.codes + at * 256;
            int32_t *scales = u.scales + at * Super::GROUPS, *offsets = u.offsets + at * 8;
            if (t >= count) {
                std::memset(codes, 0, 256);
                std::memset(scales, 0, Super::GROUPS * sizeof(int32_t));
                std::memset(offsets, 0, 8 * sizeof(int32_t));
                u.d[at] = u.dmin[at] = 0.0f;
                continue;
            }
            const Super super(w.row(first + t), w.in, s);
            for_each_index<4>([&](auto pair) {
                constexpr int P = decltype(pair)::value;
                const PairBytes pair_codes = super.template pair_codes<P>();
                store(codes + 32 * Super::first(P), first_half(pair_codes));
                store(codes + 32 * Super::second(P), second_half(pair_codes));
            });
            store(scales, super.group_scales());
            store(offsets, super.offset_weights());  // little-endian: shorts 2 h, 2 h + 1 are int h's halves
            u.d[at] = super.d;
            u.dmin[at] = super.dmin;
        }
}

// A task's weight rows of Loom's blocks unpacked (format F's pairs), as UnpackedRows the K-quants'.
struct UnpackedBlocks {
    uint8_t* codes;  // [pair][TASK_ROWS][64]: F::Super::pair_codes, in the values' order
    float *d, *m;    // [block][TASK_ROWS]: each block's scale and (4 and 5 bits) minimum

    UnpackedBlocks(std::vector<uint8_t>& buffer, int64_t in) {
        const int64_t code_bytes = in * TASK_ROWS, floats = in / GROUP * TASK_ROWS;
        uint8_t* base = line_aligned(buffer, size_t(code_bytes + 2 * floats * int64_t(sizeof(float))));
        codes = base;
        d = reinterpret_cast<float*>(base + code_bytes);
        m = d + floats;
    }
};

// unpack_rows for Loom's blocks
template <typename F>
inline void unpack_blocks(const BlockWeights& w, int64_t first, int64_t count, const UnpackedBlocks& u) {
    using Super = typename F::Super;
    const int64_t pairs = w.in / (2 * GROUP), share = w.stride / pairs;  // a pair's share of a row's bytes
    const uint8_t* next = w.row(first) + TASK_ROWS * w.stride;  // (never faults past the end)
    for (int t = 0; t < TASK_ROWS; ++t)
        for (int64_t p = 0; p < pairs; ++p) {
            fetch_lines(next + t * w.stride + p * share, share);
            uint8_t* codes = u.codes + (p * TASK_ROWS + t) * 2 * GROUP;
            float *d = u.d + 2 * p * TASK_ROWS + t, *m = u.m + 2 * p * TASK_ROWS + t;  // the pair's first block's
            if (t >= count) {
                std::memset(codes, 0, 2 * GROUP);
                d[0] = d[TASK_ROWS] = m[0] = m[TASK_ROWS] = 0.0f;
                continue;
            }
            const Super super(w.row(first + t), w.in, p);
            store(codes, super.template pair_codes<0>());
            for (int h = 0; h < 2; ++h) {
                d[h * TASK_ROWS] = super.d[h];
                if constexpr (Super::MINS) m[h * TASK_ROWS] = super.m[h];
            }
        }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// acc + the products of a's unsigned bytes and b's signed ones, four to a lane
inline __m512i dot_quads(__m512i acc, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(a, b), _mm512_set1_epi16(1)));
#endif
}
// acc + the products of a's and b's 16-bit halves, two to a lane
inline __m512i dot_halves(__m512i acc, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

// A tile's sums, weight row t's in sums[t] (an input row a lane), into y[l][t] for t < ``count`` and
// l < ``rows``.
inline void store_tile(const __m512* sums, int count, int rows, float* y, int64_t y_stride) {
    alignas(64) float lanes[BAND];
    for (int t = 0; t < count; ++t) {
        _mm512_store_ps(lanes, sums[t]);
        for (int l = 0; l < rows; ++l) y[l * y_stride + t] = lanes[l];
    }
}

// y[l][t] = x . w for the band's rows l < ``rows`` (a lane each) and the tile of weight rows ``t0`` to
// t0 + ``count`` of the unpacked ones.
template <typename F>
inline void band_tile(const UnpackedRows& u, int t0, int count, const Bands& x, int64_t band, int rows, float* y,
                      int64_t y_stride) {
    using Super = typename F::Super;
    constexpr int GROUPS = Super::GROUPS, QUADS = 64 / GROUPS;  // four-byte quads a group
    __m512 sums[TILE];
    for (auto& sum : sums) sum = _mm512_setzero_ps();
    for (int64_t s = 0; s < x.spans; ++s) {
        const uint8_t* codes = u.codes + (s * TASK_ROWS + t0) * 256;
        const int32_t* scales = u.scales + (s * TASK_ROWS + t0) * GROUPS;
        const int8_t* input = x.codes_of(band, s);
        __m512i a[TILE];
        for (int g = 0; g < GROUPS; ++g) {
            __m512i acc[TILE];
            for (auto& v : acc) v = _mm512_setzero_si512();
            for (int q = g * QUADS; q < (g + 1) * QUADS; ++q) {
                const __m512i lanes = _mm512_loadu_si512(input + q * 4 * BAND);
                for (int t = 0; t < TILE; ++t)
                    acc[t] = dot_quads(acc[t], _mm512_set1_epi32(load<int32_t>(codes + t * 256 + 4 * q)), lanes);
            }
            for (int t = 0; t < TILE; ++t) {
                const __m512i scaled = _mm512_mullo_epi32(acc[t], _mm512_set1_epi32(scales[t * GROUPS + g]));
                a[t] = g == 0 ? scaled : _mm512_add_epi32(a[t], scaled);
            }
        }
        __m512i b[TILE];  // the offsets' integers
        for (auto& v : b) v = _mm512_setzero_si512();
        const int32_t *sixteens = x.sixteens_of(band, s), *offsets = u.offsets + (s * TASK_ROWS + t0) * 8;
        for (int h = 0; h < 8; ++h) {
            const __m512i lanes = _mm512_loadu_si512(sixteens + h * BAND);
            for (int t = 0; t < TILE; ++t) b[t] = dot_halves(b[t], lanes, _mm512_set1_epi32(offsets[t * 8 + h]));
        }
        const __m512 dx = _mm512_loadu_ps(x.scales_of(band, s));
        for (int t = 0; t < TILE; ++t) {
            const int64_t at = s * TASK_ROWS + t0 + t;
            if constexpr (!Super::MINS) a[t] = _mm512_add_epi32(a[t], b[t]);
            sums[t] = super_block_step<Super::MINS>(sums[t], a[t], b[t], _mm512_mul_ps(_mm512_set1_ps(u.d[at]), dx),
                                                     _mm512_mul_ps(_mm512_set1_ps(u.dmin[at]), dx));
        }
    }
    store_tile(sums, count, rows, y, y_stride);
}

// band_tile for Loom's blocks: each block's integer sums (less CODE_OFFSET times the input's code
// sum) take block_term, a block at a time in the row's order, as block_pair_rows's.
template <typename F>
inline void block_band_tile(const UnpackedBlocks& u, int t0, int count, const Bands& x, int64_t band, int rows,
                            float* y, int64_t y_stride) {
    using Super = typename F::Super;
    constexpr int QUADS = GROUP / 4;
    const __m512i code_offset = _mm512_set1_epi16(int16_t(-Super::CODE_OFFSET));  // both sixteens' weight
    __m512 sums[TILE];
    for (auto& sum : sums) sum = _mm512_setzero_ps();
    for (int64_t b = 0; b < x.spans; ++b) {
        const uint8_t* codes = u.codes + (b / 2 * TASK_ROWS + t0) * 2 * GROUP + b % 2 * GROUP;
        const int8_t* input = x.codes_of(band, b);
        __m512i a[TILE];
        for (auto& v : a) v = _mm512_setzero_si512();
        for (int q = 0; q < QUADS; ++q) {
            const __m512i lanes = _mm512_loadu_si512(input + q * 4 * BAND);
            for (int t = 0; t < TILE; ++t)
                a[t] = dot_quads(a[t], _mm512_set1_epi32(load<int32_t>(codes + t * 2 * GROUP + 4 * q)), lanes);
        }
        if constexpr (Super::CODE_OFFSET != 0) {
            const __m512i sixteens = _mm512_loadu_si512(x.sixteens_of(band, b));
            for (int t = 0; t < TILE; ++t) a[t] = dot_halves(a[t], sixteens, code_offset);
        }
        const __m512 dx = _mm512_loadu_ps(x.scales_of(band, b));
        const __m512 xs = Super::MINS ? _mm512_loadu_ps(x.sums_of(band, b)) : _mm512_setzero_ps();
        const float *d = u.d + b * TASK_ROWS + t0, *m = u.m + b * TASK_ROWS + t0;
        for (int t = 0; t < TILE; ++t) {
            const __m512 minimum = Super::MINS ? _mm512_set1_ps(m[t]) : _mm512_setzero_ps();  // (Loom8: none kept)
            sums[t] = _mm512_add_ps(sums[t], block_term<Super::MINS>(_mm512_cvtepi32_ps(a[t]),
                                                                      _mm512_mul_ps(_mm512_set1_ps(d[t]), dx), minimum, xs));
        }
    }
    store_tile(sums, count, rows, y, y_stride);
}

// Whether format F's products of many rows take the tiles: the K-quants, and Loom's blocks in pairs
// whose codes meet the input as it is (not Loom's 8-bit blocks without VNNI, whose signs move onto
// the input).
template <typename F>
constexpr bool takes_tiles() {
    if constexpr (rows_side_by_side<F>()) return false;  // (their own products: block_interleaved.h)
    else if constexpr (rounds_by_super_block<F>()) return true;
    else if constexpr (block_records<F>()) return !F::Super::MOVES_SIGNS;
    else return false;
}

// y = x w^T + b over weights of format F (takes_tiles), ``rows`` input rows in bands (block_rows's,
// from TILED_FROM rows): each task's weight rows unpacked once, then met by every band, a tile at a
// time.
template <typename F>
void tiled_rows(const float* x, int64_t x_stride, int64_t rows, const BlockWeights& w, const float* bias, float* y,
                int64_t y_stride, float* scratch) {
    constexpr bool K_QUANT = rounds_by_super_block<F>();
    constexpr int SPAN = int(F::ROUNDING);
    using Unpacked = std::conditional_t<K_QUANT, UnpackedRows, UnpackedBlocks>;
    const Bands bands(scratch, rows, w.in, SPAN);
    round_bands<SPAN>(x, x_stride, bands);  // its barrier: every band is rounded before any product
    weight_row_tasks(w.out, TASK_ROWS, TASK_RUNS, [&](int64_t o, int64_t count) {
        thread_local std::vector<uint8_t> buffer;
        const Unpacked unpacked(buffer, w.in);
        if constexpr (K_QUANT) unpack_rows<F>(w, o, count, unpacked);
        else unpack_blocks<F>(w, o, count, unpacked);
        for (int64_t band = 0; band < bands.bands; ++band) {
            const int band_rows = int(std::min<int64_t>(BAND, rows - band * BAND));
            for (int t0 = 0; t0 < count; t0 += TILE) {
                const int tile = int(std::min<int64_t>(TILE, count - t0));
                float* out = y + band * BAND * y_stride + o + t0;
                if constexpr (K_QUANT) band_tile<F>(unpacked, t0, tile, bands, band, band_rows, out, y_stride);
                else block_band_tile<F>(unpacked, t0, tile, bands, band, band_rows, out, y_stride);
            }
        }
        add_bias(y + o, y_stride, rows, bias == nullptr ? nullptr : bias + o, count);
    });
}
#endif

}  // namespace
