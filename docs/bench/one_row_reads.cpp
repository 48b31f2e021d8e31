// How fast a one-row float32 product can read its weights on this machine, by access pattern: a
// weight row at a time (as cpu_linear.h's few_rows<1>: four sums along the row, the row two ahead
// fetched non-temporally, into L2, or not at all), 2 / 4 weight rows side by side (as tinyBLAS's
// tiles read), or 4 weight rows 8 rows apart (four runs of a 32-row task, as few_rows reads them
// with AVX2). Distinct matrices are cycled (~480 MB) so the weights come from memory; twelve
// alternating rounds, median / min / max GB/s. Build and run:
//
//     g++ -O3 -march=native -fopenmp docs/bench/one_row_reads.cpp -o /tmp/one_row_reads
//     IN=960 OUT=2560 OMP_NUM_THREADS=2 /tmp/one_row_reads
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

// y = w x for one input row: SIDE weight rows at a time, APART rows apart, FETCH: the rows ahead
// fetched (LOCALITY: 0 non-temporal, 2 into L2), the tasks of 8 SIDE rows shared among the threads
// as cpu_linear.h's weight_row_tasks shares them (two runs of tasks a thread).
template <int SIDE, bool FETCH, int LOCALITY, int APART = 1>
void product(const float* x, const float* w, long in, long out, float* y) {
    static_assert(APART == 1 || APART == 8, "rows side by side, or runs of 8");
    static_assert(!(FETCH && APART > 1), "the fetches ahead are for adjacent rows");
    const long tasks = out / (8 * SIDE), chunk = std::max(1L, tasks / (2 * omp_get_num_threads()));
#pragma omp for schedule(dynamic, chunk)
    for (long t = 0; t < tasks; ++t)
        for (long j = 0; j < 8; ++j) {
            const long o = t * 8 * SIDE + (APART == 1 ? j * SIDE : j);
            const float* r = w + o * in;
            constexpr int SUMS = SIDE > 1 ? SIDE : 4;
            __m256 acc[SUMS];
            for (auto& a : acc) a = _mm256_setzero_ps();
            if constexpr (SIDE == 1) {
                for (long k = 0; k < in; k += 32) {
                    if (FETCH)
                        for (int l = 0; l < 32; l += 16) __builtin_prefetch(r + 2 * in + k + l, 0, LOCALITY);
                    for (int s = 0; s < 4; ++s)
                        acc[s] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8 * s), _mm256_loadu_ps(r + k + 8 * s), acc[s]);
                }
                acc[0] = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            } else {
                for (long k = 0; k < in; k += 8) {
                    if (FETCH && k % 16 == 0)
                        for (int s = 0; s < SIDE; ++s) __builtin_prefetch(r + (SIDE + s) * in + k, 0, LOCALITY);
                    const __m256 xv = _mm256_loadu_ps(x + k);
                    for (int s = 0; s < SIDE; ++s)
                        acc[s] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(r + s * APART * in + k), acc[s]);
                }
            }
            for (int s = 0; s < (SIDE > 1 ? SIDE : 1); ++s) {
                float lanes[8], sum = 0;
                _mm256_storeu_ps(lanes, acc[s]);
                for (float v : lanes) sum += v;
                y[o + s * APART] = sum;
            }
        }
}

int main() {
    const long in = atol(getenv("IN") ? getenv("IN") : "960"), out = atol(getenv("OUT") ? getenv("OUT") : "2560");
    if (out % 32 != 0) {  // every variant's tasks are whole (8 x 4 rows at most)
        fprintf(stderr, "OUT must be a multiple of 32, not %ld\n", out);
        return 1;
    }
    const long copies = std::max(2L, 480000000L / (in * out * 4));
    std::vector<float*> matrices;
    for (long c = 0; c < copies; ++c) {
        // 2 MiB aligned, as Loom maps a GGUF file's tensors (and transparent huge pages can back it)
        const long bytes = (in * out * 4 + (2L << 20) - 1) / (2L << 20) * (2L << 20);
        float* w = static_cast<float*>(aligned_alloc(2L << 20, bytes));
        for (long i = 0; i < in * out; ++i) w[i] = 0.001f * float(i % 7);
        matrices.push_back(w);
    }
    std::vector<float> x(in, 1.0f), y(out);
    using Product = void (*)(const float*, const float*, long, long, float*);
    const Product products[] = {product<1, true, 0>, product<1, true, 2>, product<1, false, 0>,
                                product<2, false, 0>, product<4, false, 0>, product<4, true, 2>,
                                product<4, false, 0, 8>};
    const char* names[] = {"a row, fetched non-temporally", "a row, fetched into L2", "a row, not fetched",
                           "2 rows side by side", "4 rows side by side", "4 rows, fetched into L2",
                           "4 runs of 8 rows side by side"};
    constexpr int KINDS = 7;
    std::vector<std::vector<double>> rates(KINDS);
    for (int round = 0; round < 12; ++round)
        for (int v = 0; v < KINDS; ++v) {
            const auto start = std::chrono::steady_clock::now();
#pragma omp parallel
            for (long c = 0; c < copies; ++c) products[v](x.data(), matrices[c], in, out, y.data());
            const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            rates[v].push_back(double(copies * in * out * 4) / seconds / 1e9);
        }
    printf("%ld x %ld floats, %d threads (GB/s of weights: median, min, max)\n", out, in, omp_get_max_threads());
    for (int v = 0; v < KINDS; ++v) {
        std::sort(rates[v].begin(), rates[v].end());
        printf("%-32s %5.1f %5.1f %5.1f\n", names[v], rates[v][rates[v].size() / 2], rates[v][0], rates[v].back());
    }
}
