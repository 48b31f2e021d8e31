// The machine's float32 multiply-add peak: GFLOP/s of independent vfmadd231ps chains, 256- and
// 512-bit, on every thread of the OpenMP team at once (OMP_NUM_THREADS). The denominator for the
// panel products' rates (docs/benchmarks-history.md, "Zen 4: the GGUF files on a third machine"): processors with AVX-512 differ by 2x
// here, a Zen 4 core issuing one 512-bit multiply-add a cycle (two 256-bit), a Zen 5 core two. From a
// checkout's root:
//
//     g++ -O2 -march=native -fopenmp docs/bench/fma_peak.cpp -o /tmp/fma_peak
//     OMP_NUM_THREADS=1 /tmp/fma_peak; OMP_NUM_THREADS=2 /tmp/fma_peak

#include <omp.h>

#include <cstdio>

namespace {

constexpr long ITERATIONS = 200'000'000;

// Twelve chains of multiply-adds on registers (enough to cover the latency of two pipes), each
// iteration 12 instructions; the asm keeps the compiler from folding or spilling them. Registers
// 14 and 15 hold the operands, so that the 256-bit form runs on AVX2 alone.
#define FMA(R, N) "vfmadd231ps %%" R "14, %%" R "15, %%" R #N "\n"
#define CHAINS(R)                                                                                       \
    FMA(R, 0) FMA(R, 1) FMA(R, 2) FMA(R, 3) FMA(R, 4) FMA(R, 5) FMA(R, 6) FMA(R, 7) FMA(R, 8) FMA(R, 9) \
        FMA(R, 10) FMA(R, 11)
#define CLOBBERS                                                                                        \
    "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",   \
        "xmm14", "xmm15"

// GFLOP/s of the team, each thread running the chains on vectors of LANES floats
template <int LANES>
double team_gflops() {
    double total = 0;
#pragma omp parallel reduction(+ : total)
    {
        static const float one = 1.0f;  // normal numbers, so that no lane takes a slow path
        const double start = omp_get_wtime();
        for (long i = 0; i < ITERATIONS; ++i) {
            if constexpr (LANES == 16)
                asm volatile("vbroadcastss %0, %%zmm14\n vbroadcastss %0, %%zmm15\n" CHAINS("zmm")::"m"(one) : CLOBBERS);
            else
                asm volatile("vbroadcastss %0, %%ymm14\n vbroadcastss %0, %%ymm15\n" CHAINS("ymm")::"m"(one) : CLOBBERS);
        }
        total += ITERATIONS * 12.0 * LANES * 2 / (omp_get_wtime() - start) / 1e9;
    }
    return total;
}

}  // namespace

int main() {
    const int threads = omp_get_max_threads();
    const double ymm = team_gflops<8>();
    std::printf("%d threads: 256-bit %.1f GFLOP/s (%.1f Gvalue-rows/s, a multiply-add each)\n", threads, ymm, ymm / 2);
#ifdef __AVX512F__
    const double zmm = team_gflops<16>();
    std::printf("%d threads: 512-bit %.1f GFLOP/s (%.1f Gvalue-rows/s)\n", threads, zmm, zmm / 2);
#endif
}
