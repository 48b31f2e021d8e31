// K-quant products of many input rows, tiled as llama.cpp's CPU backend tiles them (ggml-cpu's
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
// numbers are the same whichever kernel its product took.
//
// Needs AVX-512 (BW): with VNNI one vpdpbusd, else maddubs and madd (the codes stay under 64, so a
// pair of products never saturates 16 bits).

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

// Input rows rounded for the tiled products, BAND rows to a band (rows past the last: zeros).
struct Bands {
    int8_t* codes;      // [band][in / 4][BAND][4]: four codes of each row in turn
    int32_t* sixteens;  // [band][super-block][8][BAND]: the code sums over sixteens 2 h, 2 h + 1 as two int16
    float* scales;      // [band][super-block][BAND]
    int64_t rows, in, bands, supers;

    // ``scratch``: floats_for(rows, in) floats from a cache line's start
    Bands(float* scratch, int64_t rows, int64_t in)
        : rows(rows), in(in), bands((rows + BAND - 1) / BAND), supers(in / 256) {
        codes = reinterpret_cast<int8_t*>(scratch);
        sixteens = reinterpret_cast<int32_t*>(scratch + whole_lines<float>(bands * BAND * in / 4));
        scales = reinterpret_cast<float*>(sixteens + whole_lines<int32_t>(bands * supers * 8 * BAND));
    }
    static int64_t floats_for(int64_t rows, int64_t in) {
        const int64_t padded = (rows + BAND - 1) / BAND * BAND;
        return whole_lines<float>(padded * in / 4) + whole_lines<float>(padded * in / 32) +
               whole_lines<float>(padded * in / 256);
    }
    // super-block s of a band
    int8_t* codes_of(int64_t band, int64_t s) const { return codes + (band * in + s * 256) * BAND; }
    int32_t* sixteens_of(int64_t band, int64_t s) const { return sixteens + (band * supers + s) * 8 * BAND; }
    float* scales_of(int64_t band, int64_t s) const { return scales + (band * supers + s) * BAND; }
};

// ``rows`` rows of x rounded into ``b``, 256 values under each scale as for a K-quant's pair_rows
// (round_span). Each thread rounds whole super-blocks of a band, so that it writes lines of its own.
inline void round_bands(const float* x, int64_t x_stride, const Bands& b) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < b.bands * b.supers; ++i) {
        const int64_t band = i / b.supers, s = i % b.supers;
        int8_t* codes = b.codes_of(band, s);
        int32_t* sixteens = b.sixteens_of(band, s);
        for (int lane = 0; lane < BAND; ++lane) {
            const int64_t row = band * BAND + lane;
            int8_t q[256] = {};
            int32_t sums[16] = {};
            const float d = row < b.rows ? round_span(x + row * x_stride + s * 256, 256, q, sums) : 0.0f;
            for (int quad = 0; quad < 64; ++quad) std::memcpy(codes + (quad * BAND + lane) * 4, q + 4 * quad, 4);
            for (int h = 0; h < 8; ++h)
                sixteens[h * BAND + lane] = int32_t(uint32_t(uint16_t(sums[2 * h])) | uint32_t(sums[2 * h + 1]) << 16);
            b.scales_of(band, s)[lane] = d;
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

// y[l][t] = x . w for the band's rows l < ``rows`` (a lane each) and the tile of weight rows ``t0`` to
// t0 + ``count`` of the unpacked ones.
template <typename F>
inline void band_tile(const UnpackedRows& u, int t0, int count, const Bands& x, int64_t band, int rows, float* y,
                      int64_t y_stride) {
    using Super = typename F::Super;
    constexpr int GROUPS = Super::GROUPS, QUADS = 64 / GROUPS;  // four-byte quads a group
    __m512 sums[TILE];
    for (auto& sum : sums) sum = _mm512_setzero_ps();
    for (int64_t s = 0; s < x.supers; ++s) {
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
    alignas(64) float lanes[BAND];
    for (int t = 0; t < count; ++t) {
        _mm512_store_ps(lanes, sums[t]);
        for (int l = 0; l < rows; ++l) y[l * y_stride + t] = lanes[l];
    }
}

// y = x w^T + b over K-quant weights of format F, ``rows`` input rows in bands (block_rows's, from
// TILED_FROM rows): each task's weight rows unpacked once, then met by every band, a tile at a time.
template <typename F>
void tiled_rows(const float* x, int64_t x_stride, int64_t rows, const BlockWeights& w, const float* bias, float* y,
                int64_t y_stride, float* scratch) {
    const Bands bands(scratch, rows, w.in);
    round_bands(x, x_stride, bands);  // its barrier: every band is rounded before any product
    weight_row_tasks(w.out, TASK_ROWS, [&](int64_t o, int64_t count) {
        thread_local std::vector<uint8_t> buffer;
        const UnpackedRows unpacked(buffer, w.in);
        unpack_rows<F>(w, o, count, unpacked);
        for (int64_t band = 0; band < bands.bands; ++band) {
            const int band_rows = int(std::min<int64_t>(BAND, rows - band * BAND));
            for (int t0 = 0; t0 < count; t0 += TILE)
                band_tile<F>(unpacked, t0, int(std::min<int64_t>(TILE, count - t0)), bands, band, band_rows,
                             y + band * BAND * y_stride + o + t0, y_stride);
        }
        add_bias(y + o, y_stride, rows, bias == nullptr ? nullptr : bias + o, count);
    });
}
#endif

}  // namespace
