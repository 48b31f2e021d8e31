// How the paged KV pool keeps its elements: in the model's own type, or, for a float32 model, as
// float16 or bfloat16 (EngineOptions.kv_dtype). A 16-bit pool holds twice the tokens in the same
// memory, and decode attention, which reads every cached key and value of every sequence each step,
// reads half the bytes. Values are rounded to the stored type to nearest-even, as torch's .to() does,
// so the torch path (which casts) and these kernels keep the same bits; they are widened back to the
// model's type as the attention reads them, a vector at a time. (A GGUF file's float16 and bfloat16
// weights are widened the same way: cpu_linear.h.)

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "vector.h"

namespace {

struct BFloat16 {
    uint16_t bits;
};
struct Float16 {
    uint16_t bits;
};

// A float16 pool where the processor converts floats to it (F16C, with AVX-512 or AVX2) or the
// compiler has a half type; elsewhere no float16 pool kernels are built and such a pool stays on the
// torch path. (Widening float16 works everywhere.)
#if defined(__F16C__) || defined(__FLT16_MAX__)
#define LOOM_KV_FLOAT16 1
#endif

// Every (model type T, pool type C) the pool kernels are built for, as X(symbol suffix, T, C): each
// entry point is instantiated once per entry (paged_decode.cpp, decoder_layer.cpp).
#define LOOM_POOL_TYPES_16_BIT(X) X(f32_kv_bf16, float, BFloat16)
#ifdef LOOM_KV_FLOAT16
#undef LOOM_POOL_TYPES_16_BIT
#define LOOM_POOL_TYPES_16_BIT(X) X(f32_kv_bf16, float, BFloat16) X(f32_kv_f16, float, Float16)
#endif
#define LOOM_POOL_TYPES(X) X(f32, float, float) X(f64, double, double) LOOM_POOL_TYPES_16_BIT(X)

// Element<T, C>: a T value kept as a C: widen (one element), narrow (one value) and load (a vector's
// worth of lanes, widened).
template <typename T, typename C>
struct Element;

template <typename T>
struct Element<T, T> {
    static T widen(T x) { return x; }
    static T narrow(T x) { return x; }
    static typename Vector<T>::type load(const T* p) { return Vector<T>::load(p); }
};

// bfloat16 is a float's upper half: widening is a shift, narrowing rounds the lower half away.
template <>
struct Element<float, BFloat16> {
    static float widen(BFloat16 x) {
        const uint32_t bits = uint32_t(x.bits) << 16;
        float f;
        std::memcpy(&f, &bits, sizeof f);
        return f;
    }
    static BFloat16 narrow(float x) {
        uint32_t bits;
        std::memcpy(&bits, &x, sizeof bits);
        if ((bits & 0x7fffffffu) > 0x7f800000u) return {uint16_t((bits >> 16) | 0x40)};  // NaN stays a NaN
        bits += 0x7fffu + ((bits >> 16) & 1);
        return {uint16_t(bits >> 16)};
    }
    static Vector<float>::type load(const BFloat16* p) {
        typedef uint16_t Halves __attribute__((vector_size(VECTOR_BYTES / 2)));
        typedef uint32_t Words __attribute__((vector_size(VECTOR_BYTES)));
        Halves h;
        std::memcpy(&h, p, sizeof h);
        const Words words = __builtin_convertvector(h, Words) << 16;
        Vector<float>::type v;
        std::memcpy(&v, &words, sizeof v);
        return v;
    }
};

template <>
struct Element<float, Float16> {
    static float widen(Float16 x) {
#if defined(__F16C__)
        return _cvtsh_ss(x.bits);
#elif defined(__FLT16_MAX__)
        _Float16 h;
        std::memcpy(&h, &x.bits, sizeof h);
        return static_cast<float>(h);
#else  // sign, exponent and mantissa moved to float's places; subnormals scaled, 31 is inf or NaN
        const uint32_t sign = uint32_t(x.bits & 0x8000) << 16, exponent = (x.bits >> 10) & 0x1F,
                       mantissa = x.bits & 0x3FF;
        if (exponent == 0) return (sign ? -1.0f : 1.0f) * std::ldexp(float(mantissa), -24);
        const uint32_t bits =
            sign | (exponent == 31 ? 0x7F800000 | (mantissa << 13) : ((exponent + 112) << 23) | (mantissa << 13));
        float f;
        std::memcpy(&f, &bits, sizeof f);
        return f;
#endif
    }
#ifdef LOOM_KV_FLOAT16
    static Float16 narrow(float x) {
#ifdef __F16C__
        return {static_cast<uint16_t>(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT))};
#else
        const _Float16 h = static_cast<_Float16>(x);
        Float16 out;
        std::memcpy(&out.bits, &h, sizeof h);
        return out;
#endif
    }
#endif
    static Vector<float>::type load(const Float16* p) {
        Vector<float>::type v;
#if defined(__AVX512F__)
        // two 256-bit conversions joined: streaming float16 weights from memory, a one-row product
        // read 14.3 GB/s a Zen 5 thread with one 512-bit conversion a vector, 27.3 with these (bfloat16's
        // shifts: 27.2; in cache the two were level)
        const __m128i* half = reinterpret_cast<const __m128i*>(p);
        const __m256d low = _mm256_castps_pd(_mm256_cvtph_ps(_mm_loadu_si128(half)));
        const __m256d high = _mm256_castps_pd(_mm256_cvtph_ps(_mm_loadu_si128(half + 1)));
        const __m512 wide = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(low), high, 1));
        std::memcpy(&v, &wide, sizeof v);
#elif defined(__F16C__)
        const __m256 wide = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        std::memcpy(&v, &wide, sizeof v);
#else
        for (int i = 0; i < Vector<float>::lanes; ++i) v[i] = widen(p[i]);
#endif
        return v;
    }
};

}  // namespace
