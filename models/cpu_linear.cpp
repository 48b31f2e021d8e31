// The linear kernel's entry point (the kernel itself: cpu_linear.h).

#include "cpu_linear.h"

namespace {

template <typename T>
void linear(const T* x, int64_t x_stride, int64_t rows, const T* w, const T* bias, int64_t in, int64_t out, T* y,
            int64_t y_stride) {
#pragma omp parallel
    linear_rows(x, x_stride, rows, w, bias, in, out, y, y_stride);
}

}  // namespace

#define LOOM_LINEAR(NAME, T)                                                                       \
    extern "C" void NAME(const T* x, int64_t x_stride, int64_t rows, const T* w, const T* bias,    \
                         int64_t in, int64_t out, T* y, int64_t y_stride) {                         \
        linear<T>(x, x_stride, rows, w, bias, in, out, y, y_stride);                                \
    }

LOOM_LINEAR(loom_linear_f32, float)
LOOM_LINEAR(loom_linear_f64, double)
