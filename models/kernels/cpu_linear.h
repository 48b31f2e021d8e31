// y = x w^T + b on the CPU: x [rows, in], w [out, in] as the checkpoint stores it, y [rows, out].
//
// Two products, chosen by the row count:
//
// - Below PANEL_MIN_ROWS rows (the decode steps of a few streams) a linear layer reads every
//   weight once to do little arithmetic with it, so its speed is how fast it streams the weights.
//   Each task takes 8 weight rows, one at a time, and runs every input row past each (few_rows):
//   one sequential read of the weights whatever the row count. oneDNN and MKL were 1.5-3x slower
//   at 1-4 rows on this project's AVX2 machine.
// - From PANEL_MIN_ROWS rows up the product is bound by arithmetic, and the question is how many
//   multiply-adds each load feeds. The input rows are copied into panels of 16 (two AVX2 vectors of
//   floats side by side, or one AVX-512 vector, one k after another); a tile of 6 weight rows (12
//   with AVX-512) x 16 input rows then keeps 12 vector sums in registers, broadcasting one weight per
//   weight row at each k: 12 multiply-adds for 2 vector loads and 6 broadcasts (1 and 12), no
//   horizontal sums. With AVX-512, rows beyond one panel take panels of 32 and tiles of 8 weight
//   rows (16 sums: 16 multiply-adds for 2 loads and 8 broadcasts). The row-at-a-time tiles
//   reloaded their input rows from L2 for every 3 weight rows and reached ~70 GFLOP/s; on two AVX2
//   cores the panels reach ~150: 1.3-1.9x oneDNN's product at 8-16 rows, 1.1-1.5x at 32-64, about
//   level from 128 up. On two Zen 5 cores with AVX-512 a decode step's products run 1.5x oneDNN's
//   at 16 rows and 1.2x at 64 (docs/benchmarks.md, "Panel products", "Zen 5 and AVX-512").
//
// Tasks are handed out dynamically in both, so a thread that the OS parks for a time slice on
// shared cores delays only the rows it holds. (The vectors: vector.h.)

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <omp.h>

#include "kv_element.h"
#include "vector.h"

namespace {

// How many runs of its weight rows few_rows reads side by side at ``rows`` input rows (1: a weight row
// at a time; why, below).
constexpr int spread_runs(int64_t rows) {
    return VECTOR_BYTES != 32 || rows > 6 ? 1 : rows <= 3 ? 4 : rows == 4 ? 3 : 2;
}

// ROWS input rows against ``count`` consecutive weight rows, a weight row at a time (with AVX2 up to
// 6 input rows, several runs of them side by side: below), each input row with a few sums along it:
// the weights are then read as one sequential stream, which the hardware prefetcher follows best,
// and the input rows (at most FEW_ROWS x the width) stay in L1. Three weight rows side by side (the
// row tiles it replaced) made a decode step's forward 1.2-1.5x slower at 2-8 rows, and the panels
// 1.05-1.3x slower at 3-8 rows on Zen 5 (docs/benchmarks.md, "A few rows, one weight row at a
// time"). Block weights do the same with integer products over their
// codes (block_weights.h's int8_rows and pair_rows).
// The row two ahead is fetched as well, into L2, which takes the prefetcher over the starts of a
// layer's small products sooner (a one-stream step 15.8-16.3 -> 15.3-15.8 ms on Zen 5). At one row
// it was fetched non-temporally for a while: on Zen 5 the default model's one-stream forward ran
// 12.4 -> 11.8 ms so, but on Zen 4 that held the one-row product 10-15% below a plain read's rate
// (8192 x 2048 from memory, the two alternating in one process ten times: float16 37.9 against
// 44.3 GB/s, float32 30.7 against 33.9; the default model's one stream level, 53-56 tok/s either
// way). From two rows into L2 was measured on Zen 5: 8192 x 2048 float16 at 2 / 4 rows 26 / 38 ->
// 42-47 / 49-51 Gvalue-rows/s, float32 at 2 rows 15.5 -> 19.4-20 (8 rows level).
// The weights are T, or kept as W (16-bit floats: a GGUF file's F16/BF16, block_codes.h's
// FloatRows) and widened a vector at a time as they are read (kv_element.h's Element).
// With AVX-512, from 3 input rows, two weight rows go side by side, each input load meeting both:
// widening them, the input rows' loads from L2 (a 2048-wide matrix's 8 rows are 64 KiB) held the
// product to a third of a multiply-add a cycle (8192 x 2048 float16 at 4 / 6 / 8 rows 36 / 38 / 40
// -> 51 / 61 / 62 Gvalue-rows/s, two Zen 4 threads; float32 at 6 / 8 rows 35 / 30 -> 48 / 38). With
// AVX2 they do not: its 16 registers hold fewer sums, and float16 at 3 / 4 rows ran 38 -> 28.
// With AVX2, up to 6 input rows, the weight rows are read as several streams at once instead: each
// step takes a row from each of spread_runs runs of a task's rows (4 at 1-3 input rows, 3 at 4, 2 at
// 5-6: as many sums as the 16 registers hold), and nothing is fetched ahead. One stream kept too few
// lines in flight to draw the memory's rate on a Zen 3 (AVX2 only; docs/bench/one_row_reads.cpp,
// four runs of 8 rows side by side against a row at a time: 8192 x 2048 36.6-40.0 against
// 26.3-27.1 GB/s, 2560 x 960 32.1-36.2 against 23.8-28.4; fetching ahead was slower for both). The
// 1.7B F32 file's decode step at 1 / 4 / 6 rows ran 231-279 / 334-338 / 388-397 -> 181-244 /
// 222-244 / 304-332 ms, the 360M F32's at 1 / 2 / 3 rows 54-63 / 72-81 / 66-92 -> 44-46 / 52-62 /
// 49-54, the 360M F16's at 1 / 3 / 4 rows 33-36 / 39-43 / 42-47 -> 27-34 / 33-35 / 39-40 (two
// checkouts alternating). Adjacent weight rows side by side had been slower (above); runs far apart
// are separate streams, which the prefetchers follow each on its own. AVX-512 is unmeasured.
// ``w``: ``count`` weight rows ``w_stride`` apart, each ``in`` values long.
template <typename T, int ROWS, typename W = T>
inline void few_rows(const T* x, int64_t x_stride, const W* w, int64_t w_stride, int64_t in, int64_t count, T* y,
                     int64_t y_stride) {
    using V = Vector<T>;
    using E = Element<T, W>;
    constexpr bool SPREAD = spread_runs(ROWS) > 1;
    constexpr int SIDE = SPREAD ? spread_runs(ROWS) : VECTOR_BYTES == 64 && ROWS >= 3 ? 2 : 1;
    constexpr bool FETCH = !SPREAD;  // (every row count that reads a row at a time fetches ahead)
    // Independent sums per input row and weight row: 4 at one row a weight row at a time, else 2; one
    // with several weight rows, and with AVX2's 16 registers from 5 rows up (two per row spilled two
    // of 8 rows' sums to the stack: 8 rows 20.2 -> 18.5 ms with one).
    constexpr int L = V::lanes, SUMS = SIDE > 1 ? 1 : ROWS == 1 ? 4 : VECTOR_BYTES == 32 && ROWS > 4 ? 1 : 2;
    // Step j takes weight rows j SIDE ... j SIDE + SIDE - 1, or spread, row j of each of SIDE runs of
    // ``run`` rows; a row past the last stands in for it and is not stored.
    const int64_t run = (count + SIDE - 1) / SIDE;
    for (int64_t j = 0; j < run; ++j) {
        int64_t index[SIDE];
        const W* rows[SIDE];
        for (int i = 0; i < SIDE; ++i) {
            index[i] = SPREAD ? i * run + j : j * SIDE + i;
            rows[i] = w + std::min(index[i], count - 1) * w_stride;
        }
        typename V::type acc[SIDE][ROWS][SUMS] = {};
        int64_t k = 0;
        for (; k + SUMS * L <= in; k += SUMS * L) {
            if constexpr (FETCH)
                for (int i = 0; i < SIDE; ++i)
                    for (int64_t line = 0; line < SUMS * L; line += 64 / sizeof(W))
                        __builtin_prefetch(rows[i] + 2 * SIDE * w_stride + k + line, 0, 2);
            for (int s = 0; s < SUMS; ++s) {
                typename V::type weights[SIDE];
                for (int i = 0; i < SIDE; ++i) weights[i] = E::load(rows[i] + k + s * L);
                for (int m = 0; m < ROWS; ++m) {
                    const typename V::type input = V::load(x + m * x_stride + k + s * L);
                    for (int i = 0; i < SIDE; ++i) acc[i][m][s] += input * weights[i];
                }
            }
        }
        for (; k + L <= in; k += L)
            for (int m = 0; m < ROWS; ++m)
                for (int i = 0; i < SIDE; ++i) acc[i][m][0] += V::load(x + m * x_stride + k) * E::load(rows[i] + k);
        for (int i = 0; i < SIDE; ++i) {
            if (index[i] >= count) continue;
            for (int m = 0; m < ROWS; ++m) {
                typename V::type sums = acc[i][m][0];
                for (int s = 1; s < SUMS; ++s) sums += acc[i][m][s];
                T sum = 0;
                for (int lane = 0; lane < L; ++lane) sum += sums[lane];
                for (int64_t r = k; r < in; ++r) sum += x[m * x_stride + r] * E::widen(rows[i][r]);
                y[m * y_stride + index[i]] = sum;
            }
        }
    }
}

// The weight rows of a task of few_rows at ``rows`` input rows: 8, and 32 where they are read in
// runs (runs of 8 rows; of 2, 2560 x 960 read at 32.4 against 36.2 GB/s).
inline int64_t few_rows_task(int64_t rows) { return spread_runs(rows) > 1 ? 32 : 8; }

// The input rows few_rows takes at a time: every count below the panels that measure_panel_rows
// times (models/kernels/cpu_linear.py's LAST_TIMED_ROWS). With AVX2, 8 rows ran 1.5x faster than the row
// tiles.
constexpr int64_t FEW_ROWS = 8;

// f(std::integral_constant<int, R>{}) for rows = R, 1 <= R <= FEW_ROWS (more as FEW_ROWS): a row
// count known at run time handed to a product whose row count is a template argument.
template <typename F>
inline void with_few_rows(int64_t rows, F&& f) {
    static_assert(FEW_ROWS == 8);
    switch (rows) {
        case 1: f(std::integral_constant<int, 1>{}); break;
        case 2: f(std::integral_constant<int, 2>{}); break;
        case 3: f(std::integral_constant<int, 3>{}); break;
        case 4: f(std::integral_constant<int, 4>{}); break;
        case 5: f(std::integral_constant<int, 5>{}); break;
        case 6: f(std::integral_constant<int, 6>{}); break;
        case 7: f(std::integral_constant<int, 7>{}); break;
        default: f(std::integral_constant<int, 8>{}); break;
    }
}

// y[m][r] += bias[r] for ``rows`` rows of ``count`` columns (nothing where bias is null).
template <typename T>
inline void add_bias(T* y, int64_t y_stride, int64_t rows, const T* bias, int64_t count) {
    if (bias == nullptr) return;
    for (int64_t m = 0; m < rows; ++m)
        for (int64_t r = 0; r < count; ++r) y[m * y_stride + r] += bias[r];
}

// How many runs of tasks a thread takes on average: 8, short enough that a parked thread's share is
// taken over; where a product has at most STREAM_ROWS input rows it is bound by reading its weights,
// each run a stream the prefetchers must find again, and takes 2 (the 360M Q8_0 file's one-row decode
// step on two Zen 4 threads: 14.4-15.5 ms at 8 runs, 13.2-14.0 at 2, 17.1-17.4 at 32; beside one
// busy process 31-32 ms at 8, 25.6-25.9 at 2).
constexpr int64_t TASK_RUNS = 8, STREAM_RUNS = 2, STREAM_ROWS = 2;

// ``task(o, count)`` for the tasks of ``outs`` weight rows [o, o + count) of ``out``, shared among
// the threads of the enclosing parallel region, each taking ``runs`` runs of tasks on average.
template <typename Task>
inline void weight_row_tasks(int64_t out, int64_t outs, int64_t runs, Task&& task) {
    const int64_t tasks = (out + outs - 1) / outs;
    const int64_t chunk = std::max<int64_t>(1, tasks / (runs * omp_get_num_threads()));
#pragma omp for schedule(dynamic, chunk)
    for (int64_t t = 0; t < tasks; ++t) task(t * outs, std::min(outs, out - t * outs));
}

// y = x w^T + b as weight_row_tasks against every input row, FEW_ROWS input rows at a time
// (``product(group, m, o, count)``: input rows [m, m + group) against weight rows [o, o + count),
// group a constant), then the bias.
template <typename T, typename Product>
inline void row_group_tasks(int64_t rows, int64_t out, int64_t outs, const T* bias, T* y, int64_t y_stride,
                            Product&& product) {
    weight_row_tasks(out, outs, rows <= STREAM_ROWS ? STREAM_RUNS : TASK_RUNS, [&](int64_t o, int64_t count) {
        for (int64_t m = 0; m < rows; m += FEW_ROWS)
            with_few_rows(std::min(FEW_ROWS, rows - m), [&](auto group) { product(group, m, o, count); });
        add_bias(y + o, y_stride, rows, bias == nullptr ? nullptr : bias + o, count);
    });
}

// The panels: rows of x in groups of P (a panel's rows), each group stored k-major (P values per k),
// the last group padded with zero rows. A tile runs one panel past OUTS weight rows, with VECTORS x
// OUTS vector sums in registers (a panel is VECTORS vectors of rows): per k, VECTORS loads and OUTS
// broadcasts feed VECTORS x OUTS multiply-adds.
template <int VECTORS, int OUTS>
struct PanelShape {
    static constexpr int vectors = VECTORS, outs = OUTS;
    template <typename T>
    static constexpr int64_t rows() { return VECTORS * Vector<T>::lanes; }
};

// AVX2's 16 registers hold 12 sums: 16 rows (two vectors of floats) x 6 weight rows. AVX-512 has 32:
// up to 16 rows, one vector of them x 8 weight rows, 9 loads per 8 multiply-adds; beyond, where the
// narrow panels would take two, 32 rows x 8 weight rows, 10 loads per 16. A 576 x 3072 product at
// 64 rows from memory ran at 240-300 GFLOP/s on the narrow tiles and 340-380 on the wide (two Zen 5
// cores, whose peak is 483); 4 vectors x 6 rows was as fast at 64 rows, and at 32 rows wasted half
// its sums. The narrow tiles took 12 weight rows (13 loads per 12) until twelve strided streams from
// memory proved slower than eight: 8192 x 2048 at 8 / 16 rows 34 / 66 -> 50 / 97 Gvalue-rows/s (the
// AVX2 build's 87-91 at 16), a 1.7B F32 file's decode step at 8 / 16 rows 394-404 / 422 -> 289-292 /
// 312 ms, the 360M F32's at 4 / 16 rows 71.5 / 82 -> 68.5 / 79, the default model's level (six
// weight rows as fast as eight).
#ifdef __AVX512F__
using NarrowPanels = PanelShape<1, 8>;
using WidePanels = PanelShape<2, 8>;
#else
using NarrowPanels = PanelShape<2, 6>;
using WidePanels = NarrowPanels;
#endif

// A task is TASK_OUTS weight rows (12 tiles of 8 with AVX-512's panels; divisible by every
// shape's OUTS): 96 x 576 floats stay in L2 while every panel passes them (on Zen 5, 96 rows made a
// step's products at 16 streams ~10% faster than 48).
constexpr int64_t TASK_OUTS = 96;
static_assert(TASK_OUTS % NarrowPanels::outs == 0 && TASK_OUTS % WidePanels::outs == 0);

// From how many rows the panels beat the row-at-a-time tiles. With AVX2 from 8 rows, half a float
// panel: level with the row tiles there once, and ahead of few_rows' one weight row at a time (past
// the counts it spreads) on a Zen 3 (a decode step at 8 rows, three alternations: the 1.7B F32 file
// 524-534 -> 444-455 ms, the 360M F32 103-111 -> 98-108; at 7 rows the 360M's products ran ~10%
// slower on the panels, the 1.7B's ~10% faster). With AVX-512, from 3 rows: a decode step's forward
// at 3 / 4 / 8 rows took 19.7-20.3 / 20.9-22.2 / 19.0-19.9 ms against 22.7-23.2 / 22.4-24.5 / 21.9-27.0 on the tiles
// (Zen 5, two alternating runs each); at 2 rows neither was ahead.
// On an Emerald Rapids Xeon, whose 512-bit FMA rate is a third of Zen 5's, the tiles won at 3-4
// rows instead (a 4-row step 30 ms against 46-49 on the panels): a panel issues its 12
// multiply-adds per k whatever rows it holds. So this is only the default: models/kernels/cpu_linear.py
// measures the machine at load, for each model, which passes its own threshold with every call.
constexpr int64_t PANEL_MIN_ROWS = VECTOR_BYTES == 64 ? 3 : 8;


// Elements of the panel buffer for ``rows`` rows of width ``in``, whichever panels they take.
template <typename T>
inline int64_t packed_size(int64_t rows, int64_t in) {
    constexpr int64_t P = std::max(NarrowPanels::rows<T>(), WidePanels::rows<T>());
    return (rows + P - 1) / P * P * in;
}

// Blocks of lanes rows x lanes values of k are transposed in registers (a value at a time, the packing
// was 2.6% of a 64-row decode step of the 360M F32 file).
template <typename T, int64_t P>
void pack_panels(const T* x, int64_t x_stride, int64_t rows, int64_t in, T* packed) {
    using V = Vector<T>;
    constexpr int L = V::lanes;
    const int64_t blocks = (rows + L - 1) / L, whole = in / L * L;
#pragma omp for nowait
    for (int64_t block = 0; block < blocks; ++block) {
        const int64_t first = block * L, count = std::min<int64_t>(L, rows - first);
        T* dst = packed + first / P * P * in + first % P;  // value k of the block's rows at dst + k * P
        for (int64_t k = 0; k < whole; k += L) {
            typename V::type t[L];
            for (int i = 0; i < L; ++i) t[i] = i < count ? V::load(x + (first + i) * x_stride + k) : typename V::type{};
            transpose<T>(t);
            for (int i = 0; i < L; ++i) V::store(dst + (k + i) * P, t[i]);
        }
        for (int64_t k = whole; k < in; ++k)
            for (int i = 0; i < L; ++i) dst[k * P + i] = i < count ? x[(first + i) * x_stride + k] : T(0);
    }
    // the zero rows that pad the last panel past the last block (this loop's barrier ends the packing)
    const int64_t padded = (rows + P - 1) / P * P;
#pragma omp for
    for (int64_t block = blocks; block < padded / L; ++block) {
        T* dst = packed + block * L / P * P * in + block * L % P;
        for (int64_t k = 0; k < in; ++k) V::store(dst + k * P, typename V::type{});
    }
}

// Where the next tile's weights lie in memory, to fetch while a tile runs: its first row at its
// first k (null: nowhere), rows ``row_bytes`` apart, a value of k ``value_bytes`` (16-bit weights
// are fetched where they lie, not where they are widened to).
struct NextTile {
    const char* at = nullptr;
    int64_t row_bytes = 0, value_bytes = 0;
};

// sums[o][m] (+)= panel rows m . w[o] over ``count`` values of k, for OUTS weight rows (w: the
// first, at the chunk's first k; rows ``w_stride`` apart) and every row of the panel; ``sums`` holds
// a weight row's sums of the panel's rows together, weight rows ``sums_stride`` apart, so that each
// vector of sums is stored whole. The first chunk of k stores, later ones add. ``next``: the first
// panel's pass reads its weights from memory, as OUTS strided streams that the hardware prefetcher
// follows poorly, so it fetches the next tile's lines into L2 meanwhile (a decode step's products
// at 16-32 rows: 23.7 -> 20.4 and 36.0 -> 31.4 ms on Zen 5).
// Never inlined: inlined into the decoder layers' product, GCC kept the weight rows' offsets on the
// stack and reloaded six of them every k (a 64-row decode step of the 360M F32 file 246 -> 255 ms on
// Zen 4).
template <typename T, int OUTS, int VECTORS>
__attribute__((noinline)) void panel_tile(const T* panel, const T* w, int64_t w_stride, int64_t count, T* sums,
                                          int64_t sums_stride, bool first, NextTile next) {
    using V = Vector<T>;
    constexpr int L = V::lanes;
    constexpr int64_t LINE = 64 / sizeof(T);
    // The sums start from the first k's products rather than from zero: GCC keeps this array in
    // memory, and zeroing it was a memset call per tile (1.7% of a 64-row step's time).
    typename V::type acc[OUTS][VECTORS];
    auto step = [&](int64_t k, bool start) {
        typename V::type xs[VECTORS];
        for (int v = 0; v < VECTORS; ++v) xs[v] = V::load(panel + (k * VECTORS + v) * L);
        for (int o = 0; o < OUTS; ++o) {
            const T weight = w[o * w_stride + k];
            for (int v = 0; v < VECTORS; ++v) acc[o][v] = start ? xs[v] * weight : acc[o][v] + xs[v] * weight;
        }
    };
    step(0, true);
    int64_t k = 1;
    if (next.at != nullptr) {
        for (; k + LINE <= count; k += LINE) {
            for (int o = 0; o < OUTS; ++o)
                __builtin_prefetch(next.at + o * next.row_bytes + k * next.value_bytes, 0, 2);
            for (int64_t j = 0; j < LINE; ++j) step(k + j, false);
        }
    }
    for (; k < count; ++k) step(k, false);
    // Stored as they are, a vector a store: written row by row into [m][o] sums they took 256 scalar
    // moves a tile, which held a 32 x 8 tile over 960 values of k to 96% of the multiply-add rate
    // (100% so; 77% -> 100% over 128 values).
    for (int o = 0; o < OUTS; ++o) {
        for (int v = 0; v < VECTORS; ++v) {
            T* dst = sums + o * sums_stride + v * L;
            V::store(dst, first ? acc[o][v] : V::load(dst) + acc[o][v]);
        }
    }
}

// Where a tile's weights are: ``w`` (at the chunk's first k) with rows ``stride`` apart, and where
// the next tile's lie in memory, to fetch meanwhile (panel_tile's ``next``).
template <typename T>
struct TileWeights {
    const T* w;
    int64_t stride;
    NextTile next;
};

// Tile o + outs's weights at k in a matrix of W whose rows lie ``w_stride`` values apart, where a
// whole tile follows tile o before ``end`` (else nowhere).
template <typename W>
inline NextTile next_tile(const W* w, int64_t w_stride, int64_t o, int64_t outs, int64_t k, int64_t end) {
    if (o + 2 * outs > end) return {};
    return {reinterpret_cast<const char*>(w + (o + outs) * w_stride + k), w_stride * int64_t(sizeof(W)), sizeof(W)};
}

// Where a tile's weights are in a matrix of rows: in place, the next tile's fetched meanwhile,
// except with AVX2 where the rows lie a multiple of 4 KiB apart: the next tile's lines then fall in
// the L1 sets of the tile's own (a Zen 3's prefetches fill L1 at every locality), and on the Zen 3
// the hardware prefetchers alone ran the panels faster over the 1.7B F32 file's layer shapes (16 /
// 32 rows 129-150 / 136-162 against 108-125 / 131-150 GFLOP/s, docs/bench/panel_shapes.cpp, 64
// level; rows 2064 and 8208 wide: level or behind), its decode step at 16 / 32 / 64 rows 424-541 /
// 943-954 / 1649-1960 -> 402-469 / 832-864 / 1444-1687 ms. Over the 360M F32's 960-wide rows the
// fetch helps: 16-row panels 112-146 GFLOP/s with it, 80-137 without.
// Where nothing is fetched, a task's tiles take rows spread across it (``spread``; panel_task): the
// prefetchers then follow six streams that each run on from one tile into the next, where a tile
// of six adjacent rows ended six streams and the next started six new ones. Over the 1.7B F32
// file's layer shapes on the Zen 3 (docs/bench/float_tiles.cpp ``panels``, Loom against
// ``adjacent``): 16 rows 74-83 against 68-78 Gvalue-rows/s, 32 rows 81-90 against 79-83, 64 level
// (rows 16 apart ran ahead of 2 and 4 apart, and of 64 apart in tasks of 384); its decode step at
// 16 rows 436-473 -> 398-421 ms, a 304-row prefill 7.52-7.59 -> 7.24-7.27 s, 64 rows level; W6's
// cells in-process at 16 / 64 streams 20.3-20.8 / 22.9-24.4 -> 23.3-24.4 / 25.2-25.6 tok/s (two
// checkouts alternating).
// Rows ``w_stride`` values apart, past their ``in`` (ROW_PAD more: models/kernels/block_linear.py's
// padded_rows), lie in different L1 sets where rows a multiple of 4 KiB long would share one, and
// take the spread tiles too, nothing fetched (over the padded rows fetching was level, spreading
// 3-7% ahead in a harness of the layer products): on the Zen 3 the 1.7B F32 file's decode step at
// 16 / 64 rows 409-464 / 1505-1624 -> 354-380 / 1361-1457 ms, a 368-row prefill 8.1-9.0 -> 7.0-7.9 s,
// one row level (2-4 alternations; the padded copy lies in 2 MB pages too, models/pages.py).
// With AVX-512 the padded rows' tiles are still fetched ahead (StoredWeights), and ran faster too: on
// an Intel Xeon the same file's decode step at 16 / 64 rows 400-407 / 1053-1113 -> 345-361 / 954-1004
// ms (three alternations; docs/benchmarks.md, "Subnormal activations"); the Zen 4 and Zen 5 were not
// measured with them. Whether a file's float32 rows a multiple of 4 KiB long are laid out padded at
// load (block_linear.py's pads_rows, asking loom_pads_float_rows); builds without AVX2 never measured.
#if defined(__AVX2__)
constexpr bool PADS_FLOAT_ROWS = true;
#else
constexpr bool PADS_FLOAT_ROWS = false;
#endif

template <typename T>
struct StoredWeights {
    const T* w;
    int64_t w_stride;  // values between the rows of w: in, or more where they are padded
    bool fetch, spread;

    StoredWeights(const T* w, int64_t in, int64_t w_stride)
        : w(w), w_stride(w_stride),
          fetch(VECTOR_BYTES == 64 || (w_stride == in && w_stride * int64_t(sizeof(T)) % 4096 != 0)),
          spread(!fetch) {}

    // Tile o's weights for [k, k + count): rows o, o + gap, ..., the next tile's fetched (gap 1 only).
    TileWeights<T> operator()(int64_t o, int64_t gap, int64_t outs, int64_t k, int64_t, int64_t end) const {
        return {w + o * w_stride + k, gap * w_stride,
                fetch && gap == 1 ? next_tile(w, w_stride, o, outs, k, end) : NextTile{}};
    }
};

// Where a tile's weights are when the matrix keeps them as W (16-bit floats): widened into a buffer
// of the thread's own, the tile's rows of the chunk, once for every panel to pass; the next tile's
// 16-bit rows fetched meanwhile as StoredWeights' are (without, the widening waited on memory for
// 40% of a 16-row product's time: 8192 x 2048 float16 at 16 / 64 rows 68 / 96 -> 89 / 103
// Gvalue-rows/s, two Zen 4 threads).
template <typename T, typename W>
struct WidenedWeights {
    const W* w;
    int64_t w_stride;  // values between the rows of w
    static constexpr bool spread = false;  // (its 16-bit rows are fetched ahead instead)

    TileWeights<T> operator()(int64_t o, int64_t gap, int64_t outs, int64_t k, int64_t count, int64_t end) const {
        using V = Vector<T>;
        thread_local std::vector<T> buffer;
        const int64_t stride = whole_lines<T>(count) + CACHE_LINE / sizeof(T);
        T* tile = line_aligned(buffer, stride * outs);
        for (int64_t r = 0; r < outs; ++r) {
            const W* from = w + (o + r * gap) * w_stride + k;
            T* to = tile + r * stride;
            int64_t j = 0;
            for (; j + V::lanes <= count; j += V::lanes) V::store(to + j, Element<T, W>::load(from + j));
            for (; j < count; ++j) to[j] = Element<T, W>::widen(from[j]);
        }
        return {tile, stride, gap == 1 ? next_tile(w, w_stride, o, outs, k, end) : NextTile{}};
    }
};

// The panels' chunks of k: widths above 1024 are cut into even chunks, so that a tile's weights and
// a panel's share of them stay cached on wider models too.
inline int64_t k_chunk(int64_t in) {
    const int64_t chunks = (in + 1023) / 1024;
    return (in + chunks - 1) / chunks;
}

// y[m][r] = sums[m / P][r][m % P] + bias[r] for the task's ``outs`` weight rows: blocks of lanes x lanes
// transposed in registers, where a value at a time (P apart) took 3-5% of a 960-wide product's time.
template <typename T, int64_t P>
void sums_to_rows(const T* sums, int64_t rows, int64_t outs, const T* bias, T* y, int64_t y_stride) {
    using V = Vector<T>;
    constexpr int L = V::lanes;
    const int64_t whole = outs / L * L;
    for (int64_t m0 = 0; m0 < rows; m0 += L) {
        const T* block = sums + (m0 / P * TASK_OUTS) * P + m0 % P;  // weight row r's L rows at block + r * P
        const int64_t count = std::min<int64_t>(L, rows - m0);
        for (int64_t r0 = 0; r0 < whole; r0 += L) {
            typename V::type t[L];
            for (int i = 0; i < L; ++i) t[i] = V::load(block + (r0 + i) * P);
            transpose<T>(t);
            const typename V::type b = bias != nullptr ? V::load(bias + r0) : typename V::type{};
            for (int64_t i = 0; i < count; ++i) V::store(y + (m0 + i) * y_stride + r0, t[i] + b);
        }
        for (int64_t i = 0; i < count; ++i)
            for (int64_t r = whole; r < outs; ++r)
                y[(m0 + i) * y_stride + r] = block[r * P + i] + (bias != nullptr ? bias[r] : T(0));
    }
}

// Rows past the last whole panel, up to a quarter of a panel of them, take no panel of their own
// (which costs what a whole one does: an 18-row prompt took a 32-row panel) but run past each tile's
// weights while the panels have them cached, a few rows at a time (few_rows). 8192 x 2048, two Zen 4
// threads, at 18 / 20 / 34 / 38 / 40 rows: float32 55-57 / 61-66 / 55-57 / 58-64 / 65-67 -> 80-81 /
// 74-84 / 86-92 / 82-94 / 82-90 Gvalue-rows/s, float16 50-53 / 57-59 / 52-54 / 58-61 / 62 -> 74-80 /
// 66-71 / 82 / 83-88 / 71-81. From a quarter to a half of a panel left over the two took turns ahead
// from run to run (24 / 44 rows: 72-81 / 72-93 against a whole panel's 74-78 / 67-74); past half, a
// whole panel was ahead (26 rows: 83 against 64).
template <int64_t P>
inline int64_t panel_rows(int64_t rows) {  // of ``rows`` input rows, those the panels of P rows take
    static_assert(P / 4 <= FEW_ROWS, "the rows left over are one group of few_rows");
    return rows > P && rows % P <= P / 4 ? rows - rows % P : rows;
}

// One task of the panels' product: weight rows [first, end) against every panel, in chunks of
// ``chunk`` values of k (a chunk of a tile's weights stays cached while every panel passes it).
// ``weights(o, gap, outs, k, count, end)`` says where the weights of tile o (rows o, o + gap, ...)
// for [k, k + count) are (StoredWeights: in w itself); ``weights.spread``, whether a whole task's
// tiles may take rows spread across it. The sums gather in a buffer of the thread's own, a panel's
// weight row by weight row ([panel][TASK_OUTS][P]: a tile stores its sums a vector at a time), and
// reach y with the bias once the task is done (sums_to_rows): written straight into y, a tile's
// column of 32 rows hit 32 lines of one cache set wherever y's rows are a multiple of 4 KiB apart
// (the default model's 3072-wide intermediate and 49152-wide logits), and the next tile found them
// evicted: a 576 x 3072 product at 64 rows ran at 150-190 GFLOP/s against 330-380 with the sums
// apart. The ``left`` rows after the panels' (``x_left``, ``x_stride`` apart) meet each chunk of a
// tile after the panels, their sums gathered [row][TASK_OUTS] after the panels'.
template <typename T, typename Shape, typename Weights>
void panel_task(const T* packed, int64_t rows, int64_t in, int64_t chunk, int64_t first, int64_t end, Weights weights,
                const T* bias, T* y, int64_t y_stride, const T* x_left, int64_t x_stride, int64_t left) {
    constexpr int64_t P = Shape::template rows<T>();
    constexpr int OUTS = Shape::outs;
    const int64_t panels = (rows + P - 1) / P;
    thread_local std::vector<T> buffer;
    T* sums = line_aligned(buffer, panels * P * TASK_OUTS + left * (TASK_OUTS + OUTS));
    T* left_sums = sums + panels * P * TASK_OUTS;
    T* left_chunk = left_sums + left * TASK_OUTS;  // [row][OUTS]: a chunk's
    // The tiles: rows o, o + gap, ..., o + (OUTS - 1) gap each. Adjacent rows (gap 1: o = first,
    // first + OUTS, ...) or, spread where the weights ask and the task is whole tiles, tile i takes
    // rows first + i + j gap for j < OUTS, gap = (end - first) / OUTS (why: StoredWeights).
    const int64_t gap = weights.spread && (end - first) % OUTS == 0 ? (end - first) / OUTS : 1;
    for (int64_t i = 0; i < (end - first + OUTS - 1) / OUTS; ++i) {
        const int64_t o = first + (gap > 1 ? i : i * OUTS), outs = std::min<int64_t>(OUTS, end - o);
        for (int64_t k = 0; k < in; k += chunk) {
            const int64_t count = std::min(chunk, in - k);
            const TileWeights<T> tile = weights(o, gap, outs, k, count, end);
            for (int64_t panel = 0; panel < panels; ++panel) {
                const T* xp = packed + (panel * in + k) * P;
                T* sp = sums + (panel * TASK_OUTS + (o - first)) * P;
                if (outs == OUTS) {
                    panel_tile<T, OUTS, Shape::vectors>(xp, tile.w, tile.stride, count, sp, gap * P, k == 0,
                                                        panel == 0 ? tile.next : NextTile{});
                } else {  // the last few weight rows, one at a time
                    for (int64_t r = 0; r < outs; ++r)
                        panel_tile<T, 1, Shape::vectors>(xp, tile.w + r * tile.stride, tile.stride, count, sp + r * P,
                                                         P, k == 0, NextTile{});
                }
            }
            if (left > 0) {
                with_few_rows(left, [&](auto group) {
                    few_rows<T, group>(x_left + k, x_stride, tile.w, tile.stride, count, outs, left_chunk, OUTS);
                });
                for (int64_t m = 0; m < left; ++m)
                    for (int64_t r = 0; r < outs; ++r) {
                        T& sum = left_sums[m * TASK_OUTS + (o - first) + r * gap];
                        sum = (k == 0 ? T(0) : sum) + left_chunk[m * OUTS + r];
                    }
            }
        }
    }
    sums_to_rows<T, P>(sums, rows, end - first, bias == nullptr ? nullptr : bias + first, y + first, y_stride);
    for (int64_t m = 0; m < left; ++m)
        for (int64_t r = 0; r < end - first; ++r)
            y[(rows + m) * y_stride + first + r] =
                left_sums[m * TASK_OUTS + r] + (bias != nullptr ? bias[first + r] : T(0));
}

template <typename T, typename Shape, typename Weights>
void panel_product(const T* x, int64_t x_stride, int64_t rows, int64_t in, int64_t out, int64_t chunk,
                   Weights weights, const T* bias, T* y, int64_t y_stride, T* packed) {
    constexpr int64_t P = Shape::template rows<T>();
    const int64_t paneled = panel_rows<P>(rows);
    pack_panels<T, P>(x, x_stride, paneled, in, packed);  // its barrier: the panels are whole
#pragma omp for schedule(dynamic)
    for (int64_t first = 0; first < out; first += TASK_OUTS)
        panel_task<T, Shape>(packed, paneled, in, chunk, first, std::min(out, first + TASK_OUTS), weights, bias, y,
                             y_stride, x + paneled * x_stride, x_stride, rows - paneled);
}

// y = x w^T + b on the panels, the tasks shared among the threads of the enclosing parallel region
// (``packed``: packed_size(rows, in) elements that they share). ``weights``: as panel_task's.
template <typename T, typename Weights>
void panels(const T* x, int64_t x_stride, int64_t rows, int64_t in, int64_t out, int64_t chunk, Weights weights,
            const T* bias, T* y, int64_t y_stride, T* packed) {
    if (rows > NarrowPanels::rows<T>() * 5 / 4)  // past a quarter of a narrow panel left over
        panel_product<T, WidePanels>(x, x_stride, rows, in, out, chunk, weights, bias, y, y_stride, packed);
    else
        panel_product<T, NarrowPanels>(x, x_stride, rows, in, out, chunk, weights, bias, y, y_stride, packed);
}

// The rows a product of ``rows`` input rows computes on the panels: whole panels of the shape
// ``panels`` takes, their zero rows included, then any rows past the last whole panel that take none
// (panel_rows). decoder_layer.py weighs the rows threads would carry alone against the team's by it.
template <typename T>
int64_t panel_computed_rows(int64_t rows) {
    auto computed = [rows](auto shape) {
        constexpr int64_t P = decltype(shape)::template rows<T>();
        const int64_t paneled = panel_rows<P>(rows);
        return (paneled + P - 1) / P * P + rows - paneled;
    };
    return rows > NarrowPanels::rows<T>() * 5 / 4 ? computed(WidePanels{}) : computed(NarrowPanels{});
}

#if defined(__AVX512BF16__)
// bfloat16 weights multiplied by AVX-512's bfloat16 dot products (vdpbf16ps: two multiply-adds a
// float lane an instruction, where widening to float32 took a shift and one), as llama.cpp does:
// the input rounded to bfloat16 once (to nearest even), a bfloat16 model's products then the same
// at every row count, the sums in float32. 8192 x 2048 on two Zen 5 threads, 8 / 16 / 64 rows:
// widened (the panels from 9 rows) 37 / 56 / 90 Gvalue-rows/s, so 103 / 135 / 149; one row level
// (memory-bound); a 1.7B BF16 file's 16 streams 0.51x -> 0.98x llama.cpp's rate.
constexpr bool BFLOAT16_DOTS = true;

// Rows [0, rows) of x rounded to bfloat16 into ``out`` [rows, in], shared among the region's threads.
inline void round_to_bfloat16(const float* x, int64_t x_stride, int64_t rows, int64_t in, uint16_t* out) {
    const int64_t spans = (in + 31) / 32;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows * spans; ++i) {
        const int64_t row = i / spans, k = (i % spans) * 32, n = std::min<int64_t>(32, in - k);
        const __mmask32 lanes = n == 32 ? ~__mmask32(0) : (__mmask32(1) << n) - 1;
        const float* from = x + row * x_stride + k;
        const __m512 low = _mm512_maskz_loadu_ps(__mmask16(lanes), from);
        const __m512 high = _mm512_maskz_loadu_ps(__mmask16(lanes >> 16), from + 16);
        _mm512_mask_storeu_epi16(out + row * in + k, lanes, (__m512i)_mm512_cvtne2ps_pbh(high, low));
    }
}

// ROWS rounded input rows against ``count`` consecutive bfloat16 weight rows, SIDE weight rows at a
// time (each input load met by SIDE of them: 16 / 64 rows 85 / 101 -> 103 / 121 Gvalue-rows/s),
// few_rows' order otherwise, the weights fetched two rows ahead into L2 (where few_rows fetches
// them non-temporally: 103 / 121 -> 135 / 149; one row level).
template <int ROWS>
inline void bfloat16_rows(const uint16_t* x, int64_t in, const BFloat16* w, int64_t count, float* y,
                          int64_t y_stride) {
    // independent sums per input row and weight row: 4 at one row, 2 at two, else 1; two weight
    // rows side by side from four input rows
    constexpr int SUMS = ROWS == 1 ? 4 : ROWS == 2 ? 2 : 1, SIDE = ROWS >= 4 ? 2 : 1;
    const int64_t whole = in / 32 * 32;
    const __mmask32 tail = (__mmask32(1) << (in - whole)) - 1;
    for (int64_t o = 0; o < count; o += SIDE) {
        const int side = int(std::min<int64_t>(SIDE, count - o));
        const BFloat16* rows[SIDE];
        for (int i = 0; i < SIDE; ++i) rows[i] = w + (o + std::min(i, side - 1)) * in;
        __m512 acc[SIDE][ROWS][SUMS];
        for (auto& of_row : acc)
            for (auto& sums : of_row)
                for (auto& sum : sums) sum = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 32 * SUMS <= whole; k += 32 * SUMS)
            for (int s = 0; s < SUMS; ++s) {
                __m512bh weights[SIDE];
                for (int i = 0; i < SIDE; ++i) {
                    __builtin_prefetch(rows[i] + 2 * SIDE * in + k + 32 * s, 0, 2);
                    weights[i] = (__m512bh)_mm512_loadu_si512(rows[i] + k + 32 * s);
                }
                for (int m = 0; m < ROWS; ++m) {
                    const __m512bh input = (__m512bh)_mm512_loadu_si512(x + m * in + k + 32 * s);
                    for (int i = 0; i < SIDE; ++i) acc[i][m][s] = _mm512_dpbf16_ps(acc[i][m][s], input, weights[i]);
                }
            }
        for (; k < in; k += 32) {  // the rest, 32 at a time, the last masked
            const __mmask32 lanes = k + 32 <= whole ? ~__mmask32(0) : tail;
            for (int m = 0; m < ROWS; ++m) {
                const __m512bh input = (__m512bh)_mm512_maskz_loadu_epi16(lanes, x + m * in + k);
                for (int i = 0; i < SIDE; ++i) {
                    const __m512bh weights = (__m512bh)_mm512_maskz_loadu_epi16(lanes, rows[i] + k);
                    acc[i][m][0] = _mm512_dpbf16_ps(acc[i][m][0], input, weights);
                }
            }
        }
        for (int i = 0; i < side; ++i)
            for (int m = 0; m < ROWS; ++m) {
                __m512 sums = acc[i][m][0];
                for (int s = 1; s < SUMS; ++s) sums = _mm512_add_ps(sums, acc[i][m][s]);
                y[m * y_stride + o + i] = _mm512_reduce_add_ps(sums);
            }
    }
}

// y = x w^T + b over bfloat16 weights, shared among the threads of the enclosing parallel region.
// ``rounded``: rows x in bfloat16s of scratch shared by the region's threads.
inline void bfloat16_linear_rows(const float* x, int64_t x_stride, int64_t rows, const BFloat16* w, const float* bias,
                                 int64_t in, int64_t out, float* y, int64_t y_stride, uint16_t* rounded) {
    round_to_bfloat16(x, x_stride, rows, in, rounded);  // its barrier: every row is rounded before any product
    row_group_tasks(rows, out, 8, bias, y, y_stride, [&](auto group, int64_t m, int64_t o, int64_t count) {
        bfloat16_rows<group>(rounded + m * in, in, w + o * in, count, y + m * y_stride + o, y_stride);
    });
}
#else
constexpr bool BFLOAT16_DOTS = false;
#endif

// Shares the work among the threads of the enclosing parallel region (alone, outside one). The
// weights' rows lie ``w_stride`` values apart (``in``, or more: StoredWeights).
// ``packed``: packed_size(rows, in) elements of scratch, shared by the region's threads; panels from
// ``panel_from`` rows (the model's threshold, cpu_linear.py). The weights are T, or 16-bit floats W
// (a GGUF file's F16 and BF16 tensors as the file has them), widened as they are read (BF16 where
// the processor has no bfloat16 dot products: bfloat16_linear_rows above).
template <typename T, typename W = T>
void linear_rows(const T* x, int64_t x_stride, int64_t rows, const W* w, int64_t w_stride, const T* bias, int64_t in,
                 int64_t out, T* y, int64_t y_stride, T* packed, int64_t panel_from) {
    if (rows >= panel_from) {
        if constexpr (std::is_same_v<T, W>)
            panels(x, x_stride, rows, in, out, k_chunk(in), StoredWeights<T>(w, in, w_stride), bias, y, y_stride,
                   packed);
        else
            panels(x, x_stride, rows, in, out, k_chunk(in), WidenedWeights<T, W>{w, w_stride}, bias, y, y_stride,
                   packed);
        return;
    }
    // A task is few_rows_task weight rows against every input row, FEW_ROWS of them at a time (more
    // only where the panels are set to start later than measure_panel_rows would: the weights of a
    // task are then cached for the later groups).
    const int64_t outs = few_rows_task(rows);
    row_group_tasks(rows, out, outs, bias, y, y_stride, [&](auto group, int64_t m, int64_t o, int64_t count) {
        few_rows<T, group, W>(x + m * x_stride, x_stride, w + o * w_stride, w_stride, in, count, y + m * y_stride + o,
                              y_stride);
    });
}

}  // namespace
