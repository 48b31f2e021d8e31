// GFLOP/s of cpu_linear.h's panel products in several tile shapes (VECTORS vectors of input rows x
// OUTS weight rows), over the default model's layer shapes at a decode step's row counts, the weights
// read from memory (copies cycled through, 200 MB in all) as a step reads them; two threads.
// docs/benchmarks-history.md, "Wide panels". From a checkout's root:
//
//     g++ -O3 -march=native -fopenmp -std=c++17 docs/bench/panel_shapes.cpp -o /tmp/panel_shapes
//     OMP_NUM_THREADS=2 /tmp/panel_shapes [rows ...]

#include <omp.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "../../models/kernels/cpu_linear.h"

namespace {

struct Shape {
    int64_t in, out;
    const char* name;
};

template <int VECTORS, int OUTS>
double gflops(int64_t rows, const Shape& s, int copies, const std::vector<float>& w, const std::vector<float>& x,
              std::vector<float>& packed, std::vector<float>& y) {
    double best = 1e30;
    for (int repeat = 0; repeat < 5; ++repeat) {
        const double start = omp_get_wtime();
#pragma omp parallel
        for (int c = 0; c < copies; ++c) {
            const float* wc = w.data() + int64_t(c) * s.in * s.out;
            panel_product<float, PanelShape<VECTORS, OUTS>>(x.data(), s.in, rows, s.in, s.out, k_chunk(s.in),
                                                            StoredWeights<float>(wc, s.in, s.in), nullptr, y.data(), s.out,
                                                            packed.data());
        }
        best = std::min(best, (omp_get_wtime() - start) / copies);
    }
    return 2.0 * rows * s.in * s.out / best / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
    std::vector<int64_t> counts;
    for (int i = 1; i < argc; ++i) counts.push_back(std::atoll(argv[i]));
    if (counts.empty()) counts = {16, 32, 64};
    const Shape shapes[] = {{576, 960, "qkv"}, {576, 3072, "gate_up"}, {1536, 576, "down"}, {576, 49152, "lm_head"}};
    // (4 x 6, a 64-row panel, was measured here too until panel_product kept the rows past the last
    // panel for few_rows: a quarter of 64 is more than one group of them, so it no longer builds.)
    printf("rows  layer     1x12  2x8   2x12  (GFLOP/s: vectors of rows x weight rows)\n");
    for (const int64_t rows : counts) {
        for (const Shape& s : shapes) {
            const int copies = std::max<int64_t>(1, 200'000'000 / (s.in * s.out * 4));
            std::vector<float> w(size_t(copies) * s.in * s.out, 0.01f), x(rows * s.in, 0.5f);
            std::vector<float> packed((rows + 63) / 64 * 64 * s.in), y(rows * s.out);
            printf("%4ld  %-8s  %4.0f  %4.0f  %4.0f\n", long(rows), s.name,
                   gflops<1, 12>(rows, s, copies, w, x, packed, y), gflops<2, 8>(rows, s, copies, w, x, packed, y),
                   gflops<2, 12>(rows, s, copies, w, x, packed, y));
        }
    }
}
