// y = x w^T + b for the few rows of a decode step: x [rows, in], w [out, in] as the checkpoint
// stores it, y [rows, out].
//
// At a few rows a linear layer reads every weight once to do little arithmetic with it, so its
// speed is how fast it streams the weights. Each task takes a handful of weight rows and keeps
// them in registers' reach while it runs every input row past them: one sequential read of the
// weights whatever the row count, and, from a few rows up, a fused multiply-add for every load.
// oneDNN and MKL were 1.5-3x slower at 1-4 rows and ~1.3x at 16 on this project's AVX2 machine
// (docs/benchmarks.md, "Small-batch products"). Tasks are handed out dynamically, so a thread that
// the OS parks for a time slice on shared cores delays only the rows it holds.
//
// GCC vector extensions rather than intrinsics: one source for float and double and for every
// instruction set -march=native allows.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include <omp.h>

namespace {

template <typename T>
struct Vector {
    static constexpr int lanes = 32 / sizeof(T);
    typedef T type __attribute__((vector_size(32)));
    static type load(const T* p) {  // unaligned
        type v;
        std::memcpy(&v, p, sizeof v);
        return v;
    }
};

// y[m][r] = x[m] . w[r] for ROWS input rows and OUTS weight rows, over the whole input width.
// ``next``, if given, is the weight block to fetch into cache meanwhile: the next OUTS rows.
template <typename T, int ROWS, int OUTS>
inline void tile(const T* x, int64_t x_stride, const T* w, int64_t in, T* y, int64_t y_stride,
                 const T* next = nullptr) {
    using V = Vector<T>;
    typename V::type acc[ROWS][OUTS] = {};
    int64_t k = 0;
    for (; k + V::lanes <= in; k += V::lanes) {
        typename V::type weights[OUTS];
        for (int o = 0; o < OUTS; ++o) weights[o] = V::load(w + o * in + k);
        if (next != nullptr && k % (64 / sizeof(T)) == 0)  // a cache line per row every 64 bytes
            for (int o = 0; o < OUTS; ++o) __builtin_prefetch(next + o * in + k);
        for (int m = 0; m < ROWS; ++m) {
            const typename V::type xs = V::load(x + m * x_stride + k);
            for (int o = 0; o < OUTS; ++o) acc[m][o] += xs * weights[o];
        }
    }
    for (int m = 0; m < ROWS; ++m) {
        for (int o = 0; o < OUTS; ++o) {
            T sum = 0;
            for (int lane = 0; lane < V::lanes; ++lane) sum += acc[m][o][lane];
            for (int64_t j = k; j < in; ++j) sum += x[m * x_stride + j] * w[o * in + j];
            y[m * y_stride + o] = sum;
        }
    }
}

// One input row against ``count`` consecutive weight rows, a row at a time with four sums along it:
// the weights are then read as one sequential stream, which the hardware prefetcher follows best
// (8 rows side by side measured 10% slower on the default model's layers).
template <typename T>
inline void one_row(const T* x, const T* w, int64_t in, int64_t count, T* y) {
    using V = Vector<T>;
    constexpr int L = V::lanes;
    for (int64_t o = 0; o < count; ++o, w += in) {
        typename V::type a0 = {}, a1 = {}, a2 = {}, a3 = {};
        int64_t k = 0;
        for (; k + 4 * L <= in; k += 4 * L) {
            a0 += V::load(x + k) * V::load(w + k);
            a1 += V::load(x + k + L) * V::load(w + k + L);
            a2 += V::load(x + k + 2 * L) * V::load(w + k + 2 * L);
            a3 += V::load(x + k + 3 * L) * V::load(w + k + 3 * L);
        }
        for (; k + L <= in; k += L) a0 += V::load(x + k) * V::load(w + k);
        const typename V::type sums = (a0 + a1) + (a2 + a3);
        T sum = 0;
        for (int lane = 0; lane < L; ++lane) sum += sums[lane];
        for (; k < in; ++k) sum += x[k] * w[k];
        y[o] = sum;
    }
}

// All input rows against OUTS weight rows: four rows at a time (12 accumulators), then the rest.
// The first pass also fetches the next weight block, which the later passes (on cached weights)
// would otherwise leave the memory bus idle for.
template <typename T, int OUTS>
inline void all_rows(const T* x, int64_t x_stride, int64_t rows, const T* w, int64_t in, T* y, int64_t y_stride,
                     const T* next = nullptr) {
    int64_t m = 0;
    for (; m + 4 <= rows; m += 4, next = nullptr)
        tile<T, 4, OUTS>(x + m * x_stride, x_stride, w, in, y + m * y_stride, y_stride, next);
    for (; m < rows; ++m, next = nullptr) tile<T, 1, OUTS>(x + m * x_stride, x_stride, w, in, y + m * y_stride, y_stride, next);
}

// Shares the work among the threads of the enclosing parallel region (alone, outside one).
template <typename T>
void linear_rows(const T* x, int64_t x_stride, int64_t rows, const T* w, const T* bias, int64_t in, int64_t out,
                 T* y, int64_t y_stride) {
    // A task is 8 weight rows for one input row; for more, 3 weight rows x 4 input rows (12
    // accumulators, 7 loads for 12 multiply-adds). Each thread takes 8 runs of tasks on average:
    // long enough to stream, short enough that a parked thread's share is taken over.
    const int64_t outs = rows == 1 ? 8 : 3;
    const int64_t tasks = (out + outs - 1) / outs;
    const int64_t chunk = std::max<int64_t>(1, tasks / (8 * omp_get_num_threads()));
#pragma omp for schedule(dynamic, chunk)
    for (int64_t task = 0; task < tasks; ++task) {
        const int64_t o = task * outs;
        const T* wo = w + o * in;
        T* yo = y + o;
        if (rows == 1) {
            one_row(x, wo, in, std::min(outs, out - o), yo);
        } else if (o + outs > out) {  // the last few weight rows, one at a time
            for (int64_t r = o; r < out; ++r) all_rows<T, 1>(x, x_stride, rows, w + r * in, in, y + r, y_stride);
        } else {
            all_rows<T, 3>(x, x_stride, rows, wo, in, yo, y_stride, o + 2 * outs <= out ? wo + outs * in : nullptr);
        }
        if (bias != nullptr) {
            for (int64_t m = 0; m < rows; ++m)
                for (int64_t r = o; r < std::min(o + outs, out); ++r) y[m * y_stride + r] += bias[r];
        }
    }
}

}  // namespace
