// The gated delta-rule layer's kernel alone (delta_rule.h), for the torch layers of qwen35.py; the native
// decoder layers (decoder_layer.cpp) run it between their products. Built with the other kernels by
// native.py; called through ctypes, which releases the GIL.

#include "delta_rule.h"

#define LOOM_DELTA_MIXER(SUFFIX, T)                                                                           \
    extern "C" void loom_delta_mixer_##SUFFIX(                                                                \
        const T* mixed, const T* conv_weight, T* conv_states, const T* alpha, const T* beta, const T* dt_bias, \
        const T* decay_rate, T* states, const T* z, const T* norm_weight, T* convolved, T* out,              \
        const int64_t* slots, const int64_t* lens, int64_t rows, int64_t key_heads, int64_t heads,            \
        int64_t key_dim, int64_t value_dim, int64_t taps, int64_t grouped, double eps) {                      \
        const DeltaMixer<T> mixer{mixed, conv_weight, conv_states, alpha, beta, dt_bias, decay_rate, states, z, \
                                  norm_weight, convolved, out, slots, lens, rows, key_heads, heads, key_dim,   \
                                  value_dim, taps, grouped, eps};                                             \
        _Pragma("omp parallel")                                                                               \
        mixer.run();                                                                                          \
    }

LOOM_DELTA_MIXER(f32, float)
LOOM_DELTA_MIXER(f64, double)
