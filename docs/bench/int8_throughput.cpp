// How many 512-bit integer dot-product instructions one core issues a second: the ceiling of the
// block products at many rows (models/kernels/block_weights.h's pair_rows: maddubs then dpwssd a
// pair of K-quant blocks, dpbusd for Loom's blocks). Independent chains, no loads, one core:
//
//     g++ -O2 -march=native docs/bench/int8_throughput.cpp -o /tmp/int8_throughput && taskset -c 0 /tmp/int8_throughput
//
// (needs AVX-512 VNNI). Zen 5 here, 2026-11-25: dpwssd 1.79 G/s, dpbusd 1.80 G/s, maddubs + dpwssd
// pairs 1.61 G/s (103 G byte products a second), 256-bit dpbusd 3.08 G/s, 512-bit fma 1.41 G/s.

#include <immintrin.h>

#include <chrono>
#include <cstdio>

template <typename Body>
double rate(long count, int per_iteration, Body body) {
    const auto start = std::chrono::steady_clock::now();
    for (long n = 0; n < count; ++n) body(n);
    return double(count) * per_iteration / std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int main() {
    const long count = 100000000;
    __m512i a[12], d[12], p[8];
    __m256i y[12];
    __m512 f[12];
    for (int i = 0; i < 12; ++i) a[i] = d[i] = _mm512_set1_epi32(i), y[i] = _mm256_set1_epi32(i), f[i] = _mm512_set1_ps(i);
    for (int i = 0; i < 8; ++i) p[i] = _mm512_set1_epi32(i);
    __m512i b = _mm512_set1_epi16(1), c = _mm512_set1_epi16(2), x = _mm512_set1_epi8(3);
    __m256i yb = _mm256_set1_epi16(1), yc = _mm256_set1_epi16(2);
    __m512 fb = _mm512_set1_ps(1.0001f), fc = _mm512_set1_ps(0.999f);
    const double dpwssd = rate(count, 12, [&](long) {
        for (int i = 0; i < 12; ++i) a[i] = _mm512_dpwssd_epi32(a[i], b, c);
        asm volatile("" : "+v"(b));  // keeps the loop from being folded
    });
    const double dpbusd = rate(count, 12, [&](long) {
        for (int i = 0; i < 12; ++i) d[i] = _mm512_dpbusd_epi32(d[i], b, c);
        asm volatile("" : "+v"(b));
    });
    const double pairs = rate(count, 8, [&](long n) {
        for (int i = 0; i < 8; ++i)
            p[i] = _mm512_dpwssd_epi32(p[i], _mm512_maddubs_epi16(x, _mm512_set1_epi32(int(i + n))), c);
        asm volatile("" : "+v"(x));
    });
    const double narrow = rate(count, 12, [&](long) {
        for (int i = 0; i < 12; ++i) y[i] = _mm256_dpbusd_epi32(y[i], yb, yc);
        asm volatile("" : "+v"(yb));
    });
    const double fma = rate(count, 12, [&](long) {
        for (int i = 0; i < 12; ++i) f[i] = _mm512_fmadd_ps(f[i], fb, fc);
        asm volatile("" : "+v"(fb));
    });
    printf("dpwssd %.2f G/s, dpbusd %.2f G/s, maddubs + dpwssd pairs %.2f G/s (%.0f G byte products/s), "
           "256-bit dpbusd %.2f G/s, fma %.2f G/s\n", dpwssd / 1e9, dpbusd / 1e9, pairs / 1e9, pairs * 64 / 1e9,
           narrow / 1e9, fma / 1e9);
    int sink = 0;
    for (int i = 0; i < 12; ++i) sink += _mm512_reduce_add_epi32(a[i]) + _mm512_reduce_add_epi32(d[i]) + int(f[i][0]);
    for (int i = 0; i < 8; ++i) sink += _mm512_reduce_add_epi32(p[i]);
    return sink == 42;  // (the results used, so that nothing is optimised away)
}
