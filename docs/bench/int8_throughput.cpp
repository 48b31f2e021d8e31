// How many 512-bit (without AVX-512 VNNI: 256-bit) dot-product and multiply-add instructions one
// core issues a second: the ceilings of the block products at many rows (models/kernels/
// block_weights.h, block_tiles.h: dpbusd for the tiles and Loom's blocks, maddubs then dpwssd a pair
// of K-quant blocks in pair_rows) and of the float32 panels (cpu_linear.h: one fma per sixteen
// multiply-adds). Twelve independent chains, each
// in a register of its own (an array of them was kept in memory, each instruction then waiting on a
// store and a load: the figures this file printed before 2026-11-27 were those, 1.4-1.8 G/s), no
// loads, one core:
//
//     g++ -O2 -march=native docs/bench/int8_throughput.cpp -o /tmp/int8_throughput && taskset -c 0 /tmp/int8_throughput
//
// With AVX-512 VNNI (Zen 5 here, 2026-11-27: see docs/benchmarks.md, "Loom's blocks tiled too").
// Without, the AVX2 ceilings: 256-bit madd (the AVX2 builds' Q8_0 side by side, two codes of eight
// rows an instruction, block_interleaved.h), maddubs (their 4- and 6-bit codes) and fma (the float
// panels), which tell a Zen 2 (madd and maddubs on one pipe) from a Zen 3 (two).

#include <immintrin.h>

#include <chrono>
#include <cstdio>

template <typename Body>
double rate(long count, int per_iteration, Body body) {
    const auto start = std::chrono::steady_clock::now();
    for (long n = 0; n < count; ++n) body(n);
    return double(count) * per_iteration / std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Twelve chains of ``step`` (one instruction each), in named registers, timed; their results kept.
#define TWELVE_CHAINS(T, init, step, keep)                                                              \
    [&] {                                                                                               \
        T v0 = init(1), v1 = init(2), v2 = init(3), v3 = init(4), v4 = init(5), v5 = init(6);             \
        T v6 = init(7), v7 = init(8), v8 = init(9), v9 = init(10), v10 = init(11), v11 = init(12);        \
        const double r = rate(count, 12, [&](long) {                                                    \
            v0 = step(v0); v1 = step(v1); v2 = step(v2); v3 = step(v3); v4 = step(v4); v5 = step(v5);   \
            v6 = step(v6); v7 = step(v7); v8 = step(v8); v9 = step(v9); v10 = step(v10); v11 = step(v11); \
            asm volatile("" : "+v"(v0), "+v"(v6));                                                      \
        });                                                                                             \
        keep(v0); keep(v1); keep(v2); keep(v3); keep(v4); keep(v5);                                     \
        keep(v6); keep(v7); keep(v8); keep(v9); keep(v10); keep(v11);                                   \
        return r;                                                                                       \
    }()

int main() {
    const long count = 200000000;
    volatile int seed = 1;
    long long sink = 0;
#if defined(__AVX512VNNI__)
    __m512i b = _mm512_set1_epi16(short(seed)), c = _mm512_set1_epi16(2), x = _mm512_set1_epi8(3);
    __m256i yb = _mm256_set1_epi16(short(seed)), yc = _mm256_set1_epi16(2);
    __m512 fb = _mm512_set1_ps(1.0001f), fc = _mm512_set1_ps(0.999f);
    const auto keep_int = [&](__m512i v) { sink += _mm512_reduce_add_epi32(v); };
    const auto keep_narrow = [&](__m256i v) { sink += _mm256_extract_epi32(v, 0); };
    const auto keep_float = [&](__m512 v) { sink += (long long)_mm512_reduce_add_ps(v); };
    const auto int_of = [&](int i) { return _mm512_set1_epi32(i * seed); };
    const auto narrow_of = [&](int i) { return _mm256_set1_epi32(i * seed); };
    const auto float_of = [&](int i) { return _mm512_set1_ps(float(i * seed) * 0.001f); };
    const auto dpwssd = [&](__m512i a) { return _mm512_dpwssd_epi32(a, b, c); };
    const auto dpbusd = [&](__m512i a) { return _mm512_dpbusd_epi32(a, b, c); };
    const auto pair = [&](__m512i a) { return _mm512_dpwssd_epi32(a, _mm512_maddubs_epi16(x, a), c); };  // (a chain of two)
    const auto narrow = [&](__m256i a) { return _mm256_dpbusd_epi32(a, yb, yc); };
    const auto fma = [&](__m512 a) { return _mm512_fmadd_ps(a, fb, fc); };
    const double r_dpwssd = TWELVE_CHAINS(__m512i, int_of, dpwssd, keep_int);
    const double r_dpbusd = TWELVE_CHAINS(__m512i, int_of, dpbusd, keep_int);
    const double r_pairs = TWELVE_CHAINS(__m512i, int_of, pair, keep_int);
    const double r_narrow = TWELVE_CHAINS(__m256i, narrow_of, narrow, keep_narrow);
    const double r_fma = TWELVE_CHAINS(__m512, float_of, fma, keep_float);
    printf("dpwssd %.2f G/s, dpbusd %.2f G/s, maddubs + dpwssd pairs %.2f G/s (%.0f G byte products/s), "
           "256-bit dpbusd %.2f G/s, 512-bit fma %.2f G/s (%.0f GFLOP/s)\n", r_dpwssd / 1e9, r_dpbusd / 1e9,
           r_pairs / 1e9, r_pairs * 64 / 1e9, r_narrow / 1e9, r_fma / 1e9, r_fma * 32 / 1e9);
#else
    __m256i b = _mm256_set1_epi16(short(seed)), x = _mm256_set1_epi8(3);
    __m256 fb = _mm256_set1_ps(1.0001f), fc = _mm256_set1_ps(0.999f);
    const auto keep_int = [&](__m256i v) { sink += _mm256_extract_epi32(v, 0); };
    const auto keep_float = [&](__m256 v) { sink += (long long)_mm256_cvtss_f32(v); };
    const auto int_of = [&](int i) { return _mm256_set1_epi32(i * seed); };
    const auto float_of = [&](int i) { return _mm256_set1_ps(float(i * seed) * 0.001f); };
    const auto madd = [&](__m256i a) { return _mm256_madd_epi16(a, b); };
    const auto maddubs = [&](__m256i a) { return _mm256_maddubs_epi16(x, a); };
    const auto fma = [&](__m256 a) { return _mm256_fmadd_ps(a, fb, fc); };
    const double r_madd = TWELVE_CHAINS(__m256i, int_of, madd, keep_int);
    const double r_maddubs = TWELVE_CHAINS(__m256i, int_of, maddubs, keep_int);
    const double r_fma = TWELVE_CHAINS(__m256, float_of, fma, keep_float);
    printf("256-bit madd %.2f G/s (%.0f G 16-bit products/s), maddubs %.2f G/s (%.0f G byte products/s), "
           "fma %.2f G/s (%.0f GFLOP/s)\n", r_madd / 1e9, r_madd * 16 / 1e9, r_maddubs / 1e9, r_maddubs * 32 / 1e9,
           r_fma / 1e9, r_fma * 16 / 1e9);
#endif
    return sink == 42;  // (the results used, so that nothing is optimised away)
}
