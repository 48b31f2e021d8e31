// The kernels' SIMD vectors: GCC vector extensions rather than intrinsics, so that one source serves
// float and double and every instruction set -march=native allows. Vectors are 64 bytes where the
// processor has AVX-512 (Zen 5 and recent Xeons multiply-add 16 floats per instruction at the rate
// AVX2 does 8; a Zen 4 core at half that rate, the same floats a second, and there the float panels
// of either width ran level: docs/benchmarks-history.md, "Zen 4: the GGUF files on a third machine"),
// 32 otherwise.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

#ifdef __AVX512F__
constexpr int VECTOR_BYTES = 64;
#else
constexpr int VECTOR_BYTES = 32;
#endif

template <typename T>
struct Vector {
    static constexpr int lanes = VECTOR_BYTES / sizeof(T);
    typedef T type __attribute__((vector_size(VECTOR_BYTES)));
    typedef std::conditional_t<sizeof(T) == 4, int32_t, int64_t> lane_index;
    typedef lane_index mask __attribute__((vector_size(VECTOR_BYTES)));
    static type load(const T* p) {  // unaligned
        type v;
        std::memcpy(&v, p, sizeof v);
        return v;
    }
    static void store(T* p, type v) { std::memcpy(p, &v, sizeof v); }
};

// Scratch that starts on a cache line, and element counts rounded up to whole lines: a vector load
// that straddles two lines costs two. std::vector's storage is only 16-byte aligned, and the native
// layers' intermediates were not: their row-at-a-time products took 46.7 ms a step at 8 rows on one
// Zen 5 thread, against 31.4 aligned (docs/benchmarks.md, "A 16-bit KV pool").
constexpr size_t CACHE_LINE = 64;

template <typename T>
constexpr int64_t whole_lines(int64_t elements) {
    constexpr int64_t per_line = CACHE_LINE / sizeof(T);
    return (elements + per_line - 1) / per_line * per_line;
}

template <typename T>
T* line_aligned(std::vector<T>& buffer, size_t elements) {
    buffer.resize(std::max(buffer.size(), elements + CACHE_LINE / sizeof(T)));
    const uintptr_t address = reinterpret_cast<uintptr_t>(buffer.data());
    return reinterpret_cast<T*>((address + CACHE_LINE - 1) / CACHE_LINE * CACHE_LINE);
}

// Lane i of the result is lane Pick::lane(i) of x, or of y from ``lanes`` up.
template <typename T, typename Pick, size_t... I>
inline typename Vector<T>::type shuffle(typename Vector<T>::type x, typename Vector<T>::type y,
                                        std::index_sequence<I...>) {
#if defined(__clang__) || __GNUC__ >= 12
    return __builtin_shufflevector(x, y, Pick::lane(I)...);
#else
    return __builtin_shuffle(x, y, typename Vector<T>::mask{Pick::lane(I)...});
#endif
}

// Within blocks of B lanes: even blocks take x's lanes, odd blocks y's (Low); High takes the
// neighbouring block's lanes instead, so that Low + High holds x's lanes summed in pairs B apart in
// its even blocks and y's in its odd ones.
template <int N, int B>
struct Low {
    static constexpr int lane(size_t i) { return (i / B) % 2 == 0 ? int(i) : N + int(i); }
};
template <int N, int B>
struct High {
    static constexpr int lane(size_t i) { return (i / B) % 2 == 0 ? int(i) + B : N + int(i) - B; }
};

template <typename T, int B>
inline void fold_pairs(typename Vector<T>::type* p) {
    constexpr int N = Vector<T>::lanes;
    const auto lanes = std::make_index_sequence<N>();
    for (int i = 0; i < B; ++i)
        p[i] = shuffle<T, Low<N, B>>(p[2 * i], p[2 * i + 1], lanes)
               + shuffle<T, High<N, B>>(p[2 * i], p[2 * i + 1], lanes);
    if constexpr (B > 1) fold_pairs<T, B / 2>(p);
}

// The position of vector j in sums_of_lanes's input for its sum to land in lane j: the folds leave
// vector k's sum in the lane whose index is k's bits reversed.
template <typename T>
constexpr int sum_position(int j) {
    int reversed = 0;
    for (int bit = 1; bit < Vector<T>::lanes; bit <<= 1) reversed = (reversed << 1) | ((j & bit) != 0);
    return reversed;
}

// The lane sums of ``lanes`` vectors at once, p[sum_position(j)]'s in lane j (p is overwritten):
// lanes - 1 additions and twice as many shuffles, where summing each vector alone takes a chain of
// log2(lanes) shuffle-and-adds (or, as the compiler writes a reduction, lanes dependent scalar adds).
template <typename T>
inline typename Vector<T>::type sums_of_lanes(typename Vector<T>::type* p) {
    fold_pairs<T, Vector<T>::lanes / 2>(p);
    return p[0];
}

// Transposing lanes x vectors: within blocks of 2B lanes, the first B lanes of x then the first B of y
// (Interleave), or the last B of each (InterleaveHigh).
template <int N, int B>
struct Interleave {
    static constexpr int lane(size_t i) { return (i / B) % 2 == 0 ? int(i) : N + int(i) - B; }
};
template <int N, int B>
struct InterleaveHigh {
    static constexpr int lane(size_t i) { return (i / B) % 2 == 0 ? int(i) + B : N + int(i); }
};

// p[0..lanes) transposed in place (lane j of p[i] becomes lane i of p[j]): log2(lanes) rounds of
// lanes two-vector shuffles, each round exchanging the off-diagonal blocks of B x B, B halving.
template <typename T, int B = Vector<T>::lanes / 2>
inline void transpose(typename Vector<T>::type* p) {
    constexpr int N = Vector<T>::lanes;
    const auto lanes = std::make_index_sequence<N>();
    for (int i = 0; i < N; ++i) {
        if ((i & B) != 0) continue;
        const typename Vector<T>::type x = p[i], y = p[i + B];
        p[i] = shuffle<T, Interleave<N, B>>(x, y, lanes);
        p[i + B] = shuffle<T, InterleaveHigh<N, B>>(x, y, lanes);
    }
    if constexpr (B > 1) transpose<T, B / 2>(p);
}

// exp(x) lane by lane, for floats: exp(x) = 2^k exp(r), k = round(x / ln 2), |r| <= ln(2) / 2, exp(r)
// by its degree-6 Taylor polynomial (relative error below 2e-7, about float's rounding step), on x
// held to [-87, 88], where 2^k is a normal float. Outside, 0 below and infinity above, as std::exp
// gives: exp(-87) and exp(88) standing in for them made a SiLU of x below -88 x / e^88 rather than
// 0, values near 1e-36 whose products' scales came out subnormal (an Intel Xeon's subnormal
// arithmetic takes microcode assists: a random 7B file, every gate near -400, decoded 1.7x slower;
// docs/benchmarks.md, "Subnormal activations"), and a softmax weight exp(-87), times a value, subnormal.
inline Vector<float>::type exp_lanes(Vector<float>::type x) {
    typedef Vector<float>::type V;
    typedef Vector<float>::mask I;  // its lanes as 32-bit integers
    const V lowest = V{} - 87.0f, highest = V{} + 88.0f;
    const V given = x;
    x = x < lowest ? lowest : x;
    x = x > highest ? highest : x;
    const V shift = V{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
    const V k = (x * 1.44269504f + shift) - shift;
    const V r = (x - k * 0.693359375f) + k * 2.12194440e-4f;  // ln 2 in two parts, for the precision
    V p = V{} + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const I bits = (__builtin_convertvector(k, I) + 127) << 23;  // 2^k
    V scale;
    std::memcpy(&scale, &bits, sizeof scale);
    const V e = p * scale;
    return given < lowest ? V{} : given > highest ? V{} + std::numeric_limits<float>::infinity() : e;
}

// erf(x) a vector at a time, within 1.5e-7 (Abramowitz and Stegun's 7.1.26: a polynomial in t = 1 / (1 + p|x|)
// times exp(-x^2), subtracted from 1, the sign put back after).
inline Vector<float>::type erf_lanes(Vector<float>::type x) {
    typedef Vector<float>::type V;
    const V a = x < 0.0f ? -x : x;
    const V t = 1.0f / (1.0f + 0.3275911f * a);
    V p = V{} + 1.061405429f;
    p = p * t - 1.453152027f;
    p = p * t + 1.421413741f;
    p = p * t - 0.284496736f;
    p = p * t + 0.254829592f;
    const V e = 1.0f - p * t * exp_lanes(-a * a);
    return x < 0.0f ? -e : e;
}

}  // namespace
