// A Mamba2 layer's kernel alone (mamba_scan.h), for the torch layers of families/mamba2.py; the native
// decoder layers (decoder_layer.cpp) run it between their products. Built with the other kernels by
// native.py; called through ctypes, which releases the GIL.

#include "mamba_scan.h"

#define LOOM_MAMBA_MIXER(SUFFIX, T)                                                                          \
    extern "C" void loom_mamba_mixer_##SUFFIX(                                                               \
        const T* projected, int64_t stride, const T* conv_weight, const T* conv_bias, T* conv_states,         \
        const T* dt_bias, const T* decay, const T* skip, const T* norm_weight, T* states, T* convolved, T* out, \
        const int64_t* slots, const int64_t* lens, int64_t rows, int64_t heads, int64_t head_dim,             \
        int64_t state_size, int64_t groups, int64_t taps, double eps) {                                      \
        const Mamba2Mixer<T> mixer{projected, stride, conv_weight, conv_bias, conv_states, dt_bias, decay,   \
                                   skip, norm_weight, states, convolved, out, slots, lens, rows, heads,      \
                                   head_dim, state_size, groups, taps, eps};                                 \
        _Pragma("omp parallel")                                                                              \
        mixer.run();                                                                                         \
    }

LOOM_MAMBA_MIXER(f32, float)
LOOM_MAMBA_MIXER(f64, double)
