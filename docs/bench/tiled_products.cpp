// How fast a K-quant product of many rows can run here with an input row in each lane, as
// llama.cpp's tiled products do (ggml-cpu/tiled): Q4_K's codes unpacked once to bytes with their
// integer scales and minimums, sixteen input rows' 8-bit codes transposed so that each 32-bit lane
// holds four bytes of one row, and per 32-value sub-block eight vpdpbusd (four weight bytes
// broadcast) and one vpmulld by the sub-block's scale, for eight weight rows at a time. A
// measurement for the next step of Loom's block products (docs/benchmarks.md, "The input in
// records a super-block long, and llama.cpp's tiled products"), not Loom's kernel: the weights are
// made unpacked (the time of unpacking a real file's blocks, once per tile of weight rows and
// shared by all the input rows, is timed apart), and it checks itself against a scalar product.
//
//   c++ -O3 -march=native -fopenmp -std=c++17 docs/bench/tiled_products.cpp -o /tmp/tiled && /tmp/tiled [ROWS]
//
// Needs AVX-512 VNNI.
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

constexpr int OUT = 8192, IN = 2048, SUPERS = IN / 256, SUBS = IN / 32;
static int ROWS = 64;  // a multiple of 16: the first argument

struct Weights {  // Q4_K as a tile unpacks it
    std::vector<uint8_t> codes;      // [OUT][IN], 0-15
    std::vector<int32_t> scales;     // [OUT][SUBS], 0-63
    std::vector<int32_t> mins;       // [OUT][SUBS], 0-63
    std::vector<float> d, dmin;      // [OUT][SUPERS]
};

struct Input {  // 8-bit rows, sixteen to a band, four bytes of a row a lane
    std::vector<int8_t> codes;       // [ROWS][IN] as rows
    std::vector<int8_t> lanes;       // [ROWS / 16][IN / 4][16][4]
    std::vector<int32_t> sums;       // [ROWS / 16][SUBS][16]: each sub-block's code sum, a row a lane
    std::vector<float> dx;           // [ROWS / 16][SUPERS][16]
};

// y[row][o] for weight rows [o0, o0 + 8) and the band's sixteen input rows
static void band(const Weights& w, const Input& x, int o0, int b, float* y) {
    const int8_t* lanes = x.lanes.data() + size_t(b) * (IN / 4) * 64;
    __m512 result[8];
    for (auto& r : result) r = _mm512_setzero_ps();
    for (int s = 0; s < SUPERS; ++s) {
        __m512i s1[8], s2[8];
        for (int t = 0; t < 8; ++t) s1[t] = s2[t] = _mm512_setzero_si512();
        for (int sub = 0; sub < 8; ++sub) {
            const int j = s * 8 + sub;
            __m512i acc[8];
            for (auto& a : acc) a = _mm512_setzero_si512();
            for (int g = 0; g < 8; ++g) {
                const __m512i xq = _mm512_loadu_si512(lanes + size_t(j * 8 + g) * 64);
                for (int t = 0; t < 8; ++t) {
                    const int32_t four = *reinterpret_cast<const int32_t*>(&w.codes[size_t(o0 + t) * IN + j * 32 + g * 4]);
                    acc[t] = _mm512_dpbusd_epi32(acc[t], _mm512_set1_epi32(four), xq);
                }
            }
            for (int t = 0; t < 8; ++t)
                s1[t] = _mm512_add_epi32(s1[t], _mm512_mullo_epi32(acc[t], _mm512_set1_epi32(w.scales[size_t(o0 + t) * SUBS + j])));
        }
        for (int sub = 0; sub < 8; ++sub) {  // the minimums' term, apart from the products
            const int j = s * 8 + sub;
            const __m512i sums = _mm512_loadu_si512(&x.sums[(size_t(b) * SUBS + j) * 16]);
            for (int t = 0; t < 8; ++t)
                s2[t] = _mm512_add_epi32(s2[t], _mm512_mullo_epi32(sums, _mm512_set1_epi32(w.mins[size_t(o0 + t) * SUBS + j])));
        }
        const __m512 dx = _mm512_loadu_ps(&x.dx[(size_t(b) * SUPERS + s) * 16]);
        for (int t = 0; t < 8; ++t) {
            const size_t at = size_t(o0 + t) * SUPERS + s;
            const __m512 v = _mm512_fmsub_ps(_mm512_cvtepi32_ps(s1[t]), _mm512_set1_ps(w.d[at]),
                                             _mm512_mul_ps(_mm512_cvtepi32_ps(s2[t]), _mm512_set1_ps(w.dmin[at])));
            result[t] = _mm512_fmadd_ps(v, dx, result[t]);
        }
    }
    alignas(64) float out[16];
    for (int t = 0; t < 8; ++t) {
        _mm512_store_ps(out, result[t]);
        for (int l = 0; l < 16; ++l) y[size_t(b * 16 + l) * OUT + o0 + t] = out[l];
    }
}

// a tile of weight rows' unpacking from Q4_K's 144-byte blocks (the nibbles split, the twelve bytes
// of scales and minimums decoded), as the tiled products do once per tile: timed apart
static void unpack(const uint8_t* blocks, int rows, uint8_t* codes, int32_t* scales, int32_t* mins, float* d) {
    for (int r = 0; r < rows; ++r)
        for (int s = 0; s < SUPERS; ++s) {
            const uint8_t* block = blocks + (size_t(r) * SUPERS + s) * 144;
            const uint8_t* qs = block + 16;
            uint8_t* c = codes + size_t(r) * IN + s * 256;
            for (int h = 0; h < 4; ++h) {
                const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * h));
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + 64 * h), _mm256_and_si256(q, _mm256_set1_epi8(15)));
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + 64 * h + 32),
                                    _mm256_and_si256(_mm256_srli_epi16(q, 4), _mm256_set1_epi8(15)));
            }
            for (int j = 0; j < 8; ++j) {
                const int sc = j < 4 ? (block[4 + j] & 63) : ((block[12 + j - 4] & 15) | ((block[4 + j - 4] >> 6) << 4));
                const int mn = j < 4 ? (block[8 + j] & 63) : ((block[12 + j - 4] >> 4) | ((block[8 + j - 4] >> 6) << 4));
                scales[(size_t(r) * SUPERS + s) * 8 + j] = sc;
                mins[(size_t(r) * SUPERS + s) * 8 + j] = mn;
            }
            d[size_t(r) * SUPERS + s] = float(block[0]);
        }
}

int main(int argc, char** argv) {
    if (argc > 1) ROWS = std::atoi(argv[1]) / 16 * 16;
    std::mt19937 rng(1);
    Weights w;
    w.codes.resize(size_t(OUT) * IN), w.scales.resize(size_t(OUT) * SUBS), w.mins.resize(size_t(OUT) * SUBS);
    w.d.resize(size_t(OUT) * SUPERS), w.dmin.resize(size_t(OUT) * SUPERS);
    for (auto& c : w.codes) c = rng() % 16;
    for (auto& s : w.scales) s = rng() % 64;
    for (auto& m : w.mins) m = rng() % 64;
    for (auto& v : w.d) v = 1e-3f * float(rng() % 1000);
    for (auto& v : w.dmin) v = 1e-3f * float(rng() % 1000);
    Input x;
    x.codes.resize(size_t(ROWS) * IN), x.sums.resize(size_t(ROWS / 16) * SUBS * 16), x.dx.resize(size_t(ROWS / 16) * SUPERS * 16);
    for (auto& c : x.codes) c = int8_t(int(rng() % 255) - 127);
    x.lanes.resize(x.codes.size());
    for (int n = 0; n < ROWS; ++n)
        for (int k = 0; k < IN; ++k) x.lanes[((size_t(n / 16) * (IN / 4) + k / 4) * 16 + n % 16) * 4 + k % 4] = x.codes[size_t(n) * IN + k];
    for (int n = 0; n < ROWS; ++n)
        for (int j = 0; j < SUBS; ++j) {
            int32_t sum = 0;
            for (int k = 0; k < 32; ++k) sum += x.codes[size_t(n) * IN + j * 32 + k];
            x.sums[(size_t(n / 16) * SUBS + j) * 16 + n % 16] = sum;
        }
    for (int n = 0; n < ROWS; ++n)
        for (int s = 0; s < SUPERS; ++s) x.dx[(size_t(n / 16) * SUPERS + s) * 16 + n % 16] = 1e-2f * float(1 + rng() % 100);

    std::vector<float> y(size_t(ROWS) * OUT);
    auto run = [&] {
#pragma omp parallel for schedule(dynamic, 16)
        for (int o0 = 0; o0 < OUT; o0 += 8)
            for (int b = 0; b < ROWS / 16; ++b) band(w, x, o0, b, y.data());
    };
    run();
    double worst = 0;  // against a scalar product, for a few outputs
    for (int probe = 0; probe < 64; ++probe) {
        const int n = int(rng() % ROWS), o = int(rng() % OUT);
        double expect = 0;
        for (int s = 0; s < SUPERS; ++s) {
            double sum = 0, mins = 0;
            for (int sub = 0; sub < 8; ++sub) {
                const int j = s * 8 + sub;
                long dot = 0, xs = 0;
                for (int k = 0; k < 32; ++k) {
                    dot += long(w.codes[size_t(o) * IN + j * 32 + k]) * x.codes[size_t(n) * IN + j * 32 + k];
                    xs += x.codes[size_t(n) * IN + j * 32 + k];
                }
                sum += double(w.scales[size_t(o) * SUBS + j]) * dot;
                mins += double(w.mins[size_t(o) * SUBS + j]) * xs;
            }
            const size_t at = size_t(o) * SUPERS + s;
            expect += (sum * w.d[at] - mins * w.dmin[at]) * x.dx[(size_t(n / 16) * SUPERS + s) * 16 + n % 16];
        }
        worst = std::max(worst, std::fabs(y[size_t(n) * OUT + o] - expect) / (std::fabs(expect) + 1.0));
    }
    double best = 1e9;
    for (int round = 0; round < 20; ++round) {
        const auto start = std::chrono::steady_clock::now();
        run();
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    std::vector<uint8_t> blocks(size_t(OUT) * SUPERS * 144);
    for (auto& v : blocks) v = uint8_t(rng());
    std::vector<uint8_t> codes(size_t(64) * IN);
    std::vector<int32_t> scales(size_t(64) * SUBS), mins(size_t(64) * SUBS);
    std::vector<float> d(size_t(64) * SUPERS);
    double unpacking = 1e9;
    for (int round = 0; round < 5; ++round) {
        const auto start = std::chrono::steady_clock::now();
        for (int o0 = 0; o0 < OUT; o0 += 64) unpack(blocks.data() + size_t(o0) * SUPERS * 144, 64, codes.data(), scales.data(), mins.data(), d.data());
        unpacking = std::min(unpacking, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    std::printf("%d x %d, %d rows, %d threads: %.1f Gvalue-rows/s (products %.2f ms; unpacking every weight row once, one "
                "thread: %.2f ms); worst relative error %.1e\n",
                OUT, IN, ROWS, omp_get_max_threads(), double(OUT) * IN * ROWS / best / 1e9, best * 1e3, unpacking * 1e3, worst);
}
