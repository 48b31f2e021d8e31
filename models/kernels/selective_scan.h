// Mamba's selective scan (families/mamba.py's layers) over a step's rows, each sequence's a run of consecutive
// rows with one state slot (a run that starts at the sequence's first token, context length 1, starts from
// zeros): for each row and channel, its time step dt (softplus taken: torch's, vectorized), the channel's state
// of N values S = exp(dt A) S + dt x B, A a rate for each value; y = S . C + D x (the gate, SiLU(z), is the
// caller's: torch's, vectorized). The states lie a value's channels side by side ([N, inner] a sequence), so a
// block of 64 channels goes through its state a value at a time in vector loops, its 4 KiB in L1 while the run's
// rows go through it. The exponentials are most of the work (inner x N a row: 82k for mamba-2.8b's layers), so a float
// model's are a polynomial the compiler vectorizes (exp_fast), within a float's rounding; a float64 model's
// std::exp. Its work is shared among the threads of the enclosing team (a work-sharing loop over runs and
// blocks of channels).

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "recurrent.h"

namespace {

// exp(x) for x <= 0 (a decay's exponent), to within about a float's rounding: 2^k 2^f, k = t rounded (t = x
// log2 e; t - 0.5 truncated, toward zero, for t <= 0), f = t - k in (-0.5, 0.5], 2^f by its Taylor series to the
// sixth power (error below 2e-7 relative); 2^k's exponent held at the least normal one, so x below about -87 gives
// ~1e-38, which the recurrence's flush takes for 0 soon after. No calls and no float comparisons (which, as they may
// trap, GCC does not turn into vector selects), so the loops around it vectorize.
inline float exp_fast(float x) {
    const float t = x * 1.4426950408889634f;
    const int32_t k = static_cast<int32_t>(t - 0.5f);
    const float f = t - static_cast<float>(k);
    float p = 1.5403530393381606e-4f;
    p = p * f + 1.3333558146428443e-3f;
    p = p * f + 9.6181291076284772e-3f;
    p = p * f + 5.5504108664821580e-2f;
    p = p * f + 2.4022650695910071e-1f;
    p = p * f + 6.9314718055994531e-1f;
    p = p * f + 1.0f;
    const int32_t exponent = k + 127 < 1 ? 1 : k + 127;
    return p * __builtin_bit_cast(float, exponent << 23);
}

inline float decay_exp(float x) { return exp_fast(x); }
inline double decay_exp(double x) { return std::exp(x); }

template <typename T>
struct SelectiveScan {
    const T* x;            // [rows, inner]: the convolved inputs
    const T* dt;           // [rows, inner]: the time steps
    const T* bc;           // [rows, bc_stride]: B at bc_offset, C after it
    int64_t bc_stride, bc_offset;
    const T* decay;        // [N, inner]: A, -exp(A_log), a state value's rates side by side
    const T* skip;         // [inner]: D
    T* states;             // [slots, N, inner]: a state value's channels side by side
    T* out;                // [rows, inner]: the answers, D x added (the gate is the caller's)
    const int64_t* slots;  // [rows]: each row's state slot (a run's rows share one)
    const int64_t* lens;   // [rows]: each row's context length (1: its sequence's first token)
    int64_t rows, inner, N;

    static constexpr int64_t CHANNELS = 64;  // a work item's channels: the vectors a state value's loop runs over

    // Channels [first, last) of the run of rows [start, start + n): for each row, a state value at a time across
    // the channels (a vector loop), the answers summed as they go.
    void scan(int64_t start, int64_t n, int64_t first, int64_t last) const {
        T* S = states + slots[start] * N * inner;
        const int64_t width = last - first;
        if (lens[start] == 1)
            for (int64_t j = 0; j < N; ++j) std::memset(S + j * inner + first, 0, sizeof(T) * width);
        T acc[CHANNELS], step[CHANNELS], input[CHANNELS];
        for (int64_t row = start; row < start + n; ++row) {
            for (int64_t c = 0; c < width; ++c) {
                step[c] = dt[row * inner + first + c];
                input[c] = step[c] * x[row * inner + first + c];
                acc[c] = 0;
            }
            const T* B = bc + row * bc_stride + bc_offset;
            const T* C = B + N;
            for (int64_t j = 0; j < N; ++j) {
                T* Sj = S + j * inner + first;
                const T* Aj = decay + j * inner + first;
                const T b = B[j], c_j = C[j];
#pragma omp simd
                for (int64_t c = 0; c < width; ++c) {
                    Sj[c] = Sj[c] * decay_exp(step[c] * Aj[c]) + input[c] * b;
                    acc[c] += Sj[c] * c_j;
                }
            }
            for (int64_t c = 0; c < width; ++c)
                out[row * inner + first + c] = acc[c] + skip[first + c] * x[row * inner + first + c];
        }
    }

    // Every (run, block of channels), in the enclosing team. The runs: where the slot changes (each thread
    // finds them).
    void run() const {
        thread_local std::vector<int64_t> starts;
        find_runs(slots, rows, starts);
        const int64_t runs = int64_t(starts.size()) - 1, blocks = (inner + CHANNELS - 1) / CHANNELS;
        const FlushSubnormals flushing;
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t r = 0; r < runs; ++r) {
            for (int64_t b = 0; b < blocks; ++b) {
                const int64_t first = b * CHANNELS, last = first + CHANNELS < inner ? first + CHANNELS : inner;
                scan(starts[r], starts[r + 1] - starts[r], first, last);
            }
        }
    }
};

// The layer's convolution (recurrent.h's convolve_run) of ``width`` channels of ``mixed`` (``stride`` apart),
// a run at a time, in the enclosing team.
template <typename T>
void convolve_runs(const T* mixed, int64_t stride, const T* weight, const T* bias, T* conv_states, T* out,
                   const int64_t* slots, const int64_t* lens, int64_t rows, int64_t width, int64_t taps) {
    thread_local std::vector<T> scratch;
    thread_local std::vector<int64_t> starts;
    find_runs(slots, rows, starts);
    const int64_t runs = int64_t(starts.size()) - 1, back = taps - 1;
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < runs; ++r) {
        const int64_t start = starts[r];
        convolve_run(mixed, stride, weight, bias, conv_states + slots[start] * back * width, lens[start] == 1, start,
                     starts[r + 1] - start, width, taps, out, scratch);
    }
}

}  // namespace
