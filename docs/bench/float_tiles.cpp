// The lead for float32 files (docs/benchmarks-history.md, "Q4_K and Q6_K fetched a line at a
// time"): weight rows laid out six at a time side by side, [tile of 6 rows][k][6] (a tile reads as
// one stream), against the row-major matrices Loom multiplies now, the 1.7B model's layer shapes,
// weights from memory (copies cycled, ~400 MB), two threads. HUGE=1 puts the weights in 2 MB pages.
//
//   panels ROWS...   cpu_linear.h's panel tile (16 rows x 6 weight rows) over the row-major matrix,
//                    Loom's panel_product itself (with AVX2 each task's tiles spread across it:
//                    StoredWeights), the same with each tile's rows adjacent (``adjacent``), and the
//                    tile over the interleaved matrix, fetching DIST bytes ahead in its stream
//                    (DIST=0: nothing), Loom's product over one copy every turn (``cached``: the
//                    o shape's 16 MB stay in a 32 MB L3) and over rows padded by 16 floats (64
//                    bytes, so that a tile's rows fall in different L1 sets), spread, nothing
//                    fetched (``padded``): Gvalue-rows/s
//   few              1-6 input rows: Loom's few-row products (linear_rows) against the tiles read a
//                    few rows at a time (a tile's rows in passes, 1 / 2 / 4 tiles side by side), and
//                    over the panels' own [tile][k][6] layout, each input row's values spread to the
//                    weights' pattern by vpermps (tiled_permuted: two tiles side by side): GB/s
//
//     g++ -O3 -march=native -fopenmp -std=c++17 docs/bench/float_tiles.cpp -o /tmp/float_tiles
//     DIST=2048 OMP_NUM_THREADS=2 /tmp/float_tiles panels 16 64
//     OMP_NUM_THREADS=2 /tmp/float_tiles few
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../../models/kernels/cpu_linear.h"

namespace {

using V = Vector<float>;
int64_t DIST = 0;  // bytes ahead the interleaved tiles fetch

// ``floats`` floats, 2 MB-aligned, in 2 MB pages with HUGE set, filled with small values.
float* weights(size_t floats) {
    constexpr size_t PAGE = 2 << 20;
    const size_t bytes = (floats * 4 + PAGE - 1) / PAGE * PAGE;
    auto* w = static_cast<float*>(aligned_alloc(PAGE, bytes));
    if (getenv("HUGE") != nullptr) madvise(w, bytes, MADV_HUGEPAGE);
    for (size_t i = 0; i < floats; ++i) w[i] = float(int(i % 97)) * 0.01f;
    return w;
}

// panel_tile's arithmetic over a 16-row panel and 6 weight rows, the weights row-major (row o's k at
// w[o * w_stride + k]) or INTERleaved (w[k * 6 + o]).
template <bool INTER>
__attribute__((noinline)) void tile(const float* panel, const float* w, int64_t w_stride, int64_t count, float* sums,
                                    bool first) {
    constexpr int OUTS = 6, VECTORS = 2, L = V::lanes;
    V::type acc[OUTS][VECTORS];
    auto step = [&](int64_t k, bool start) {
        V::type xs[VECTORS];
        for (int v = 0; v < VECTORS; ++v) xs[v] = V::load(panel + (k * VECTORS + v) * L);
        for (int o = 0; o < OUTS; ++o) {
            const float weight = INTER ? w[k * OUTS + o] : w[o * w_stride + k];
            for (int v = 0; v < VECTORS; ++v) acc[o][v] = start ? xs[v] * weight : acc[o][v] + xs[v] * weight;
        }
    };
    step(0, true);
    int64_t k = 1;
    if (INTER && DIST > 0)
        for (; k + 8 <= count; k += 8) {  // 8 values of k: 192 bytes, three lines
            for (int line = 0; line < 3; ++line)
                __builtin_prefetch(reinterpret_cast<const char*>(w + k * OUTS) + DIST + 64 * line, 0, 2);
            for (int j = 0; j < 8; ++j) step(k + j, false);
        }
    for (; k < count; ++k) step(k, false);
    for (int o = 0; o < OUTS; ++o)
        for (int v = 0; v < VECTORS; ++v) {
            float* dst = sums + o * 16 + v * L;
            V::store(dst, first ? acc[o][v] : V::load(dst) + acc[o][v]);
        }
}

// y = x w^T over packed panels of 16 rows, tasks of TASK_OUTS weight rows, chunks of k as Loom's.
template <bool INTER>
void tiled_product(const float* packed, int64_t rows, int64_t in, int64_t out, const float* w, float* y) {
    constexpr int64_t P = 16, OUTS = 6;
    const int64_t chunk = k_chunk(in), panels = (rows + P - 1) / P;
#pragma omp for schedule(dynamic)
    for (int64_t first = 0; first < out; first += TASK_OUTS) {
        thread_local std::vector<float> buffer;
        float* sums = line_aligned(buffer, panels * P * TASK_OUTS);
        const int64_t end = std::min(out, first + TASK_OUTS);
        for (int64_t o = first; o + OUTS <= end; o += OUTS)  // (rows past whole tiles left out: a timing)
            for (int64_t k = 0; k < in; k += chunk) {
                const float* wt = INTER ? w + o * in + k * OUTS : w + o * in + k;
                for (int64_t panel = 0; panel < panels; ++panel)
                    tile<INTER>(packed + (panel * in + k) * P, wt, in, std::min(chunk, in - k),
                                sums + (panel * TASK_OUTS + (o - first)) * P, k == 0);
            }
        sums_to_rows<float, P>(sums, rows, end - first, nullptr, y + first, out);
    }
}

// ROWS input rows against interleaved tiles read a few rows at a time ([tile][k / 8][6][8] here: a
// weight row's 8 values of k side by side), a tile's rows in passes of G, SIDE tiles far apart side
// by side.
template <int ROWS, int G, int SIDE>
void tiled_few(const float* x, const float* w, int64_t in, int64_t out, float* y) {
    const int64_t tiles = out / 6, tile_floats = 6 * in, per_run = 4;
    const int64_t task_tiles = per_run * SIDE, tasks = tiles / task_tiles;
#pragma omp for schedule(dynamic, std::max<int64_t>(1, tasks / 4))
    for (int64_t t = 0; t < tasks; ++t)
        for (int64_t j = 0; j < per_run; ++j)
            for (int g0 = 0; g0 < 6; g0 += G) {
                const float* tl[SIDE];
                for (int i = 0; i < SIDE; ++i) tl[i] = w + (t * task_tiles + i * per_run + j) * tile_floats;
                V::type acc[SIDE][G][ROWS] = {};
                for (int64_t kb = 0; kb < in / 8; ++kb) {
                    V::type xv[ROWS];
                    for (int m = 0; m < ROWS; ++m) xv[m] = V::load(x + m * in + kb * 8);
                    for (int i = 0; i < SIDE; ++i)
                        for (int o = 0; o < G; ++o) {
                            const V::type wv = V::load(tl[i] + (kb * 6 + g0 + o) * 8);
                            for (int m = 0; m < ROWS; ++m) acc[i][o][m] += xv[m] * wv;
                        }
                }
                for (int i = 0; i < SIDE; ++i)
                    for (int o = 0; o < G; ++o)
                        for (int m = 0; m < ROWS; ++m) {
                            float s = 0;
                            for (int l = 0; l < 8; ++l) s += acc[i][o][m][l];
                            y[m * out + (t * task_tiles + i * per_run + j) * 6 + g0 + o] = s;
                        }
            }
}

// ROWS input rows against the [tile of 6 rows][k][6] layout (the panels' own) as it is: four values
// of k a step, 24 weights in three vectors, each input row's four values spread to their pattern
// (k0 x6, k1 x2 | k1 x4, k2 x4 | k2 x2, k3 x6) by vpermps; passes of at most 3 rows (3 rows x 3
// patterns x SIDE sums and the 3 index vectors fill AVX2's 16 registers), SIDE tiles side by side.
template <int ROWS, int SIDE>
void permuted_pass(const float* x, int64_t in, const float* const* tiles, float* y, int64_t out) {
    const __m256i spread[3] = {_mm256_setr_epi32(0, 0, 0, 0, 0, 0, 1, 1), _mm256_setr_epi32(1, 1, 1, 1, 2, 2, 2, 2),
                               _mm256_setr_epi32(2, 2, 3, 3, 3, 3, 3, 3)};
    __m256 acc[SIDE][ROWS][3] = {};
    for (int64_t k = 0; k + 4 <= in; k += 4) {
        __m256 xs[ROWS][3];
        for (int m = 0; m < ROWS; ++m) {
            const __m256 four = _mm256_castps128_ps256(_mm_loadu_ps(x + m * in + k));
            for (int j = 0; j < 3; ++j) xs[m][j] = _mm256_permutevar8x32_ps(four, spread[j]);
        }
        for (int i = 0; i < SIDE; ++i)
            for (int j = 0; j < 3; ++j) {
                const __m256 w = _mm256_loadu_ps(tiles[i] + k * 6 + 8 * j);
                for (int m = 0; m < ROWS; ++m) acc[i][m][j] = _mm256_fmadd_ps(xs[m][j], w, acc[i][m][j]);
            }
    }
    static constexpr int OUT_OF[3][8] = {{0, 1, 2, 3, 4, 5, 0, 1}, {2, 3, 4, 5, 0, 1, 2, 3}, {4, 5, 0, 1, 2, 3, 4, 5}};
    for (int i = 0; i < SIDE; ++i)
        for (int m = 0; m < ROWS; ++m) {
            float sums[6] = {}, lanes[8];
            for (int j = 0; j < 3; ++j) {
                _mm256_storeu_ps(lanes, acc[i][m][j]);
                for (int l = 0; l < 8; ++l) sums[OUT_OF[j][l]] += lanes[l];
            }
            for (int o = 0; o < 6; ++o) y[m * out + i * 6 + o] = sums[o];
        }
}

template <int ROWS>
void tiled_permuted(const float* x, const float* w, int64_t in, int64_t out, float* y) {
    constexpr int SIDE = 2;
    const int64_t tiles = out / 6, task = 8;
#pragma omp for schedule(dynamic, 2)
    for (int64_t first = 0; first < tiles; first += task)
        for (int64_t t = first; t + SIDE <= std::min(tiles, first + task); t += SIDE) {
            const float* pair[SIDE] = {w + t * 6 * in, w + (t + 1) * 6 * in};
            for (int m = 0; m < ROWS; m += 3) {
                const float* xm = x + m * in;
                float* ym = y + m * out + t * 6;
                if (ROWS - m >= 3) permuted_pass<3, SIDE>(xm, in, pair, ym, out);
                else if (ROWS - m == 2) permuted_pass<2, SIDE>(xm, in, pair, ym, out);
                else permuted_pass<1, SIDE>(xm, in, pair, ym, out);
            }
        }
}

// The fastest of ``rounds`` runs of each of WAYS products, taking turns (``run(which, copy)``: way
// ``which`` over weight copy ``copy``, inside a parallel region): seconds per copy.
template <int WAYS, typename Run>
std::array<double, WAYS> fastest(int rounds, int copies, Run&& run) {
    std::array<double, WAYS> best;
    best.fill(1e30);
    for (int round = 0; round < rounds; ++round)
        for (int which = 0; which < WAYS; ++which) {
            const double start = omp_get_wtime();
#pragma omp parallel
            for (int c = 0; c < copies; ++c) run(which, c);
            best[which] = std::min(best[which], (omp_get_wtime() - start) / copies);
        }
    return best;
}

struct Shape {
    int64_t in, out;
    const char* name;
};

void panels(const std::vector<int64_t>& counts) {
    const Shape shapes[] = {{2048, 6144, "qkv"},     {2048, 2048, "o"},         {2048, 16384, "gate_up"},
                            {8192, 2048, "down"},    {2048, 49152, "lm_head"}};
    printf("rows layer    row-major  Loom  adjacent  interleaved  cached  padded  (Gvalue-rows/s; DIST=%ld)\n",
           long(DIST));
    for (const int64_t rows : counts)
        for (const Shape& s : shapes) {
            const int64_t n = s.in * s.out;
            const int copies = int(std::max<int64_t>(2, 400'000'000 / (n * 4)));
            float* w = weights(size_t(copies) * n);  // (the values do not matter to the time)
            constexpr int64_t PAD = 16;  // floats a padded row has past its in
            float* padded = weights(size_t(copies) * s.out * (s.in + PAD));
            std::vector<float> x(rows * s.in, 0.5f), y(rows * s.out), packed(packed_size<float>(rows, s.in));
            const auto best = fastest<6>(10, copies, [&](int which, int c) {
                const float* wc = which == 5 ? padded + int64_t(c) * s.out * (s.in + PAD)
                                             : w + int64_t(which == 4 ? 0 : c) * n;
                if (which == 1 || which == 2 || which >= 4) {
                    StoredWeights<float> stored(wc, s.in, which == 5 ? s.in + PAD : s.in);
                    stored.spread = stored.spread && which != 2;
                    panel_product<float, NarrowPanels>(x.data(), s.in, rows, s.in, s.out, k_chunk(s.in), stored,
                                                       nullptr, y.data(), s.out, packed.data());
                } else {
                    pack_panels<float, 16>(x.data(), s.in, rows, s.in, packed.data());
                    if (which == 0)
                        tiled_product<false>(packed.data(), rows, s.in, s.out, wc, y.data());
                    else
                        tiled_product<true>(packed.data(), rows, s.in, s.out, wc, y.data());
                }
            });
            free(w), free(padded);
            const double values = double(rows) * n / 1e9;
            printf("%4ld %-8s %8.1f %6.1f %8.1f %8.1f %8.1f %8.1f\n", long(rows), s.name, values / best[0],
                   values / best[1], values / best[2], values / best[3], values / best[4], values / best[5]);
        }
}

template <int ROWS>
void few(const float* w, int copies, int64_t in, int64_t out) {
    const int64_t n = in * out;
    std::vector<float> x(ROWS * in, 0.5f), y(ROWS * out), packed(packed_size<float>(16, in));
    constexpr int ONE = ROWS <= 2 ? 6 : ROWS <= 4 ? 3 : 2, TWO = ROWS <= 1 ? 6 : ROWS <= 2 ? 3 : ROWS <= 3 ? 2 : 1;
    const auto best = fastest<5>(8, copies, [&](int which, int c) {
        const float* wc = w + int64_t(c) * n;
        if (which == 0)
            linear_rows<float>(x.data(), in, ROWS, wc, in, nullptr, in, out, y.data(), out, packed.data(), 1000);
        else if (which == 1)
            tiled_few<ROWS, ONE, 1>(x.data(), wc, in, out, y.data());
        else if (which == 2)
            tiled_few<ROWS, TWO, 2>(x.data(), wc, in, out, y.data());
        else if (which == 3)
            tiled_few<ROWS, ROWS <= 1 ? 3 : 1, 4>(x.data(), wc, in, out, y.data());
        else
            tiled_permuted<ROWS>(x.data(), wc, in, out, y.data());
    });
    const double gb = n * 4 / 1e9;
    printf("%d   %8.1f %6.1f %6.1f %6.1f %9.1f\n", ROWS, gb / best[0], gb / best[1], gb / best[2], gb / best[3],
           gb / best[4]);
}

}  // namespace

int main(int argc, char** argv) {
    DIST = getenv("DIST") != nullptr ? atoll(getenv("DIST")) : 0;
    if (argc > 1 && strcmp(argv[1], "panels") == 0) {
        std::vector<int64_t> counts;
        for (int i = 2; i < argc; ++i) counts.push_back(atoll(argv[i]));
        panels(counts.empty() ? std::vector<int64_t>{16, 64} : counts);
    } else if (argc > 1 && strcmp(argv[1], "few") == 0) {
        const int64_t in = 2048, out = 8160;  // 8160: whole tasks of 6 x 4 x 4 rows
        const int copies = int(400'000'000 / (in * out * 4) + 1);
        const float* w = weights(size_t(copies) * in * out);
        printf("rows Loom  tiles: 1   2   4 side by side  permuted  (GB/s of weights, %ld x %ld)\n", long(out), long(in));
        few<1>(w, copies, in, out), few<2>(w, copies, in, out), few<3>(w, copies, in, out);
        few<4>(w, copies, in, out), few<6>(w, copies, in, out);
    } else {
        fprintf(stderr, "usage: float_tiles panels [ROWS ...] | float_tiles few\n");
        return 1;
    }
}
