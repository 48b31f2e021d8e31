// How fast Loom's block products over the sixteen-rows-side-by-side layouts read their weights at a
// few rows, the matrices in 4 KB pages and in 2 MB pages (madvise's MADV_HUGEPAGE, as models/pages.py
// asks for the layouts made at load): block_linear (models/kernels/cpu_linear.cpp) over distinct
// copies of a random matrix (~400 MB in all, so that they come from memory; FORMAT 18:
// GGUF_Q4_K_ROWS16, 21: GGUF_Q6_K_ROWS16, its scales set finite), the two page sizes alternating
// for ten rounds; median / min / max GB/s of weights and Gvalue-rows/s. docs/benchmarks-history.md,
// "Q4_K and Q6_K fetched a line at a time". From a checkout's root:
//
//     g++ -O3 -march=native -fopenmp -std=c++17 docs/bench/rows16_reads.cpp -o /tmp/rows16_reads
//     OMP_NUM_THREADS=2 /tmp/rows16_reads [IN OUT ROWS FORMAT]
#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>

#include "../../models/kernels/cpu_linear.cpp"

namespace {

// ``copies`` matrices of ``bytes`` each in one 2 MB-aligned buffer, in 2 MB pages if ``huge``.
uint8_t* random_matrices(int64_t format, int64_t in, int64_t out, int64_t bytes, int copies, bool huge) {
    constexpr size_t PAGE = 2 << 20;
    const size_t total = (size_t(copies) * bytes + PAGE - 1) / PAGE * PAGE;
    auto* w = static_cast<uint8_t*>(aligned_alloc(PAGE, total));
    if (huge) madvise(w, total, MADV_HUGEPAGE);  // before the first write, which places the pages
    std::mt19937 rng(1);
    for (size_t i = 0; i < total; ++i) w[i] = uint8_t(rng());
    const float d = 0.01f;
    for (int c = 0; c < copies; ++c)
        for (int64_t block = 0; block < out / 16 * in / 256; ++block) {  // finite scales
            uint8_t* b = w + c * bytes + block * (format == GGUF_Q4_K_ROWS16 ? Q4KRows16::BLOCK_BYTES
                                                                              : Q6KRows16::BLOCK_BYTES);
            for (int r = 0; r < 16; ++r) {
                if (format == GGUF_Q4_K_ROWS16) {
                    const uint8_t half[2] = {0, 0x20};  // float16 2^-7
                    std::memcpy(b + Q4KRows16::D + 2 * r, half, 2);
                    std::memcpy(b + Q4KRows16::DMIN + 2 * r, half, 2);
                } else {
                    std::memcpy(b + Q6KRows16::D + 4 * r, &d, 4);
                }
            }
        }
    return w;
}

}  // namespace

int main(int argc, char** argv) {
    const int64_t in = argc > 1 ? atoll(argv[1]) : 2048, out = argc > 2 ? atoll(argv[2]) : 8192;
    const int64_t rows = argc > 3 ? atoll(argv[3]) : 1, format = argc > 4 ? atoll(argv[4]) : GGUF_Q4_K_ROWS16;
    if ((format != GGUF_Q4_K_ROWS16 && format != GGUF_Q6_K_ROWS16) || in % 256 || out % 16) {
        fprintf(stderr, "FORMAT 18 (Q4_K) or 21 (Q6_K), IN a multiple of 256, OUT of 16\n");
        return 1;
    }
    const int64_t bytes = format_row_bytes(format, in) * out;
    const int copies = int(std::max<int64_t>(2, 400'000'000 / bytes));
    uint8_t* matrices[2] = {random_matrices(format, in, out, bytes, copies, false),
                            random_matrices(format, in, out, bytes, copies, true)};
    std::vector<float> x(rows * in), y(rows * out);
    for (size_t i = 0; i < x.size(); ++i) x[i] = float(int(i % 200) - 100) * 0.01f;
    std::vector<double> seconds[2];
    for (int round = 0; round < 10; ++round)
        for (int huge = 0; huge < 2; ++huge) {
            const double start = omp_get_wtime();
            for (int c = 0; c < copies; ++c)
                block_linear(x.data(), in, rows, matrices[huge] + c * bytes, format, nullptr, in, out, y.data(), out);
            seconds[huge].push_back((omp_get_wtime() - start) / copies);
        }
    printf("format %ld, %ld x %ld, %ld rows, %d threads (median / min / max)\n", long(format), long(out), long(in),
           long(rows), omp_get_max_threads());
    for (int huge = 0; huge < 2; ++huge) {
        auto& s = seconds[huge];
        std::sort(s.begin(), s.end());
        const double values = double(out) * in * rows;
        const double median = s[s.size() / 2];
        printf("%s pages: %5.1f / %5.1f / %5.1f GB/s, %6.1f Gvalue-rows/s\n", huge ? "2 MB" : "4 KB",
               bytes / median / 1e9, bytes / s.back() / 1e9, bytes / s[0] / 1e9, values / median / 1e9);
    }
}
