// A Mamba2 layer (Granite 4's recurrent layers) between its input and output products, over a step's rows,
// each sequence's a run of consecutive rows with one state slot (a run that starts at the sequence's first
// token, context length 1, starts from zeros):
//   1. a run at a time: x, B and C convolved with the taps - 1 inputs before, through a SiLU
//      (recurrent.h), and the slot's last inputs moved on;
//   2. a (run, head) at a time: dt = softplus(dt + dt_bias); for each row S = exp(dt A) S + dt x B^T and
//      y = S C + D x, B and C the head's group's (heads / groups consecutive heads read one), subnormals
//      flushed (FlushSubnormals);
//   3. a row at a time: y SiLU(z), RMS-normed a group of heads at a time, times the norm's weight.
// A head's matrix (head width x state width, 32 KiB at 64 x 128 floats) stays in the core's L1/L2 while
// the run's rows go through it, read and written once a row. Its work is shared among the threads of the
// enclosing team (work-sharing loops, each ending at a barrier).

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "recurrent.h"

namespace {

template <typename T>
struct Mamba2Mixer {
    const T* projected;     // [rows, stride]: z [inner], then x, B, C [conv width], then dt [heads]
    int64_t stride;
    const T* conv_weight;   // [conv width, taps], a channel's taps the oldest first
    const T* conv_bias;     // [conv width] or null
    T* conv_states;         // [slots, taps - 1, conv width]: a sequence's last inputs, the oldest first
    const T* dt_bias;       // [heads]
    const T* decay;         // [heads]: A, -exp(A_log)
    const T* skip;          // [heads]: D
    const T* norm_weight;   // [inner], or null: the answers gated, not normed
    T* states;              // [slots, heads, head_dim, state_size]
    T* convolved;           // [rows, conv width]: scratch
    T* out;                 // [rows, inner]
    const int64_t* slots;  // [rows]: each row's state slot (a run's rows share one)
    const int64_t* lens;   // [rows]: each row's context length (1: its sequence's first token)
    int64_t rows, heads, head_dim, state_size, groups, taps;
    double eps;

    int64_t inner() const { return heads * head_dim; }
    int64_t conv_width() const { return inner() + 2 * groups * state_size; }

    // Stage 2 for head h of the run of rows [start, start + n).
    void scan(int64_t start, int64_t n, int64_t h) const {
        const int64_t W = conv_width(), N = state_size, g = h / (heads / groups);
        T* S = states + (slots[start] * heads + h) * head_dim * N;
        if (lens[start] == 1) std::memset(S, 0, sizeof(T) * head_dim * N);
        for (int64_t row = start; row < start + n; ++row) {
            const T dt = softplus(projected[row * stride + inner() + W + h] + dt_bias[h]);
            const T a = std::exp(dt * decay[h]);
            const T* x = convolved + row * W + h * head_dim;
            const T* B = convolved + row * W + inner() + g * N;
            const T* C = B + groups * N;
            T* y = out + row * inner() + h * head_dim;
            for (int64_t i = 0; i < head_dim; ++i) {
                T* Si = S + i * N;
                const T xi = dt * x[i];
                T acc = 0;
#pragma omp simd reduction(+ : acc)
                for (int64_t j = 0; j < N; ++j) {
                    Si[j] = Si[j] * a + xi * B[j];
                    acc += Si[j] * C[j];
                }
                y[i] = acc + skip[h] * x[i];
            }
        }
    }

    // Stage 3 for one row: gated, then normed a group at a time (where the layer has a norm: Falcon-H1's may not).
    void gate_and_norm(int64_t row) const {
        const int64_t width = inner() / groups;
        T* y = out + row * inner();
        const T* z = projected + row * stride;
        for (int64_t i = 0; i < inner(); ++i) y[i] *= silu(z[i]);
        if (norm_weight == nullptr) return;
        for (int64_t g = 0; g < groups; ++g) {
            T* yg = y + g * width;
            T squares = 0;
            for (int64_t i = 0; i < width; ++i) squares += yg[i] * yg[i];
            const T inverse_rms = T(1) / std::sqrt(squares / T(width) + T(eps));
            for (int64_t i = 0; i < width; ++i) yg[i] = yg[i] * inverse_rms * norm_weight[g * width + i];
        }
    }

    // The three stages, in the enclosing team. The runs: where the slot changes (each thread finds them).
    void run() const {
        thread_local std::vector<T> scratch;
        thread_local std::vector<int64_t> starts;
        find_runs(slots, rows, starts);
        const int64_t runs = int64_t(starts.size()) - 1, W = conv_width(), back = taps - 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < runs; ++r) {
            const int64_t start = starts[r];
            convolve_run(projected + inner(), stride, conv_weight, conv_bias, conv_states + slots[start] * back * W,
                         lens[start] == 1, start, starts[r + 1] - start, W, taps, convolved, scratch);
        }  // (the loop's barrier: every row convolved before any head reads one)
        {
            const FlushSubnormals flushing;
#pragma omp for schedule(dynamic, 1) collapse(2)
            for (int64_t r = 0; r < runs; ++r) {
                for (int64_t h = 0; h < heads; ++h) scan(starts[r], starts[r + 1] - starts[r], h);
            }
        }
#pragma omp for
        for (int64_t row = 0; row < rows; ++row) gate_and_norm(row);
    }
};

}  // namespace
