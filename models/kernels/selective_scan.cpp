// Mamba's layer kernels (selective_scan.h), for the torch layers of families/mamba.py: the convolution, then
// (after the products that make the time steps, B and C) the selective scan. Built with the other kernels by
// native.py; called through ctypes, which releases the GIL.

#include "selective_scan.h"

#define LOOM_SELECTIVE_SCAN(SUFFIX, T)                                                                         \
    extern "C" void loom_mamba_convolve_##SUFFIX(const T* mixed, int64_t stride, const T* weight, const T* bias, \
                                                 T* conv_states, T* out, const int64_t* slots,                 \
                                                 const int64_t* lens, int64_t rows, int64_t width, int64_t taps) { \
        _Pragma("omp parallel")                                                                                \
        convolve_runs(mixed, stride, weight, bias, conv_states, out, slots, lens, rows, width, taps);          \
    }                                                                                                          \
    extern "C" void loom_selective_scan_##SUFFIX(                                                              \
        const T* x, const T* dt, const T* bc, int64_t bc_stride, int64_t bc_offset, const T* decay, const T* skip, \
        T* states, T* out, const int64_t* slots, const int64_t* lens, int64_t rows, int64_t inner,              \
        int64_t state_size) {                                                                                  \
        const SelectiveScan<T> scan{x,   dt,    bc,   bc_stride, bc_offset, decay, skip,                       \
                                    states, out, slots, lens,    rows,      inner, state_size};                \
        _Pragma("omp parallel")                                                                                \
        scan.run();                                                                                            \
    }

LOOM_SELECTIVE_SCAN(f32, float)
LOOM_SELECTIVE_SCAN(f64, double)
