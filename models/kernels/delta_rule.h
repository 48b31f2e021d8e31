// A gated delta-rule layer (Qwen3.5's and Qwen3-Next's linear attention) between its products, over a step's
// rows, each sequence's a run of consecutive rows with one state slot (a run that starts at the sequence's
// first token, context length 1, starts from zeros):
//   1. a run at a time: each channel of the qkv product convolved with the taps - 1 inputs before (the
//      run's earlier rows, or its slot's last inputs), through a SiLU, and the slot's last inputs moved on;
//   2. a (run, head) at a time: q and k over their lengths (q times key_dim^-1/2), beta = sigmoid, decay =
//      exp(A softplus(alpha + dt_bias)); then for each row S = decay S; S += k (beta (v - S^T k))^T;
//      o = S^T q, and o normalised (RMS), times the norm's weight and SiLU(z); subnormals flushed
//      (recurrent.h's FlushSubnormals).
// A head's matrix (key width x value width, 64 KiB at 128 x 128 floats) stays in the core's L2 while the
// run's rows go through it, read and written twice a row. The torch path (qwen35.py) took some thirty
// operators a layer and gathered, masked and scattered every slot's matrices through memory. Its work is
// shared among the threads of the enclosing team (work-sharing loops, each ending at a barrier).

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "recurrent.h"

namespace {

template <typename T>
struct DeltaMixer {
    const T* mixed;          // [rows, width]: the qkv product's rows
    const T* conv_weight;    // [width, taps], a channel's taps the oldest first
    T* conv_states;          // [slots, taps - 1, width]: a sequence's last inputs, the oldest first
    const T* alpha;          // [rows, heads]
    const T* beta;           // [rows, heads]
    const T* dt_bias;        // [heads]
    const T* decay_rate;     // [heads]: -exp(A_log)
    T* states;               // [slots, heads, key_dim, value_dim]
    const T* z;              // [rows, heads * value_dim]
    const T* norm_weight;    // [value_dim]
    T* convolved;            // [rows, width]: scratch
    T* out;                  // [rows, heads * value_dim]
    const int64_t* slots;  // [rows]: each row's state slot (a run's rows share one)
    const int64_t* lens;   // [rows]: each row's context length (1: its sequence's first token)
    int64_t rows, key_heads, heads, key_dim, value_dim, taps;
    // the key head a value head reads: 1, the value heads of a key head side by side (Hugging Face's order,
    // Qwen3-Next files'); 0, tiled (Qwen3.5 files': value head h reads key head h mod key_heads)
    int64_t grouped;
    double eps;

    int64_t width() const { return 2 * key_heads * key_dim + heads * value_dim; }

    // Stage 2 for head h of the run of rows [start, start + n): its rows through the head's matrix, each
    // answer normalised and gated.
    void recur(int64_t start, int64_t n, int64_t h, std::vector<T>& scratch) const {
        const int64_t C = width(), kh = grouped ? h / (heads / key_heads) : h % key_heads;
        scratch.resize(2 * key_dim + 3 * value_dim);
        T* q = scratch.data();
        T* k = q + key_dim;
        T* memory = k + key_dim;        // S^T k
        T* delta = memory + value_dim;  // beta (v - S^T k)
        T* o = delta + value_dim;       // S^T q
        T* S = states + (slots[start] * heads + h) * key_dim * value_dim;
        if (lens[start] == 1) {
            std::memset(S, 0, sizeof(T) * key_dim * value_dim);
        }
        for (int64_t row = start; row < start + n; ++row) {
            const T* qkv = convolved + row * C;
            const T* v = qkv + 2 * key_heads * key_dim + h * value_dim;
            T qq = 0, kk = 0;
            for (int64_t i = 0; i < key_dim; ++i) {
                q[i] = qkv[kh * key_dim + i];
                k[i] = qkv[(key_heads + kh) * key_dim + i];
                qq += q[i] * q[i];
                kk += k[i] * k[i];
            }
            const T q_scale = T(1) / std::sqrt((qq + T(1e-6)) * T(key_dim)), k_scale = T(1) / std::sqrt(kk + T(1e-6));
            for (int64_t i = 0; i < key_dim; ++i) {
                q[i] *= q_scale;
                k[i] *= k_scale;
            }
            const int64_t at = row * heads + h;
            const T b = T(1) / (T(1) + std::exp(-beta[at]));
            const T a = std::exp(decay_rate[h] * softplus(alpha[at] + dt_bias[h]));
            for (int64_t j = 0; j < value_dim; ++j) {
                memory[j] = 0;
                o[j] = 0;
            }
            for (int64_t i = 0; i < key_dim; ++i) {  // decay, and read the state at k
                T* Si = S + i * value_dim;
                const T ki = k[i];
#pragma omp simd
                for (int64_t j = 0; j < value_dim; ++j) {
                    Si[j] *= a;
                    memory[j] += ki * Si[j];
                }
            }
            for (int64_t j = 0; j < value_dim; ++j) {
                delta[j] = b * (v[j] - memory[j]);
            }
            for (int64_t i = 0; i < key_dim; ++i) {  // write k's correction, and read the state at q
                T* Si = S + i * value_dim;
                const T ki = k[i], qi = q[i];
#pragma omp simd
                for (int64_t j = 0; j < value_dim; ++j) {
                    Si[j] += ki * delta[j];
                    o[j] += qi * Si[j];
                }
            }
            T squares = 0;
            for (int64_t j = 0; j < value_dim; ++j) {
                squares += o[j] * o[j];
            }
            const T inverse_rms = T(1) / std::sqrt(squares / T(value_dim) + T(eps));
            const T* gate = z + at * value_dim;
            T* result = out + at * value_dim;
            for (int64_t j = 0; j < value_dim; ++j) {
                result[j] = o[j] * inverse_rms * norm_weight[j] * silu(gate[j]);
            }
        }
    }

    // Both stages, in the enclosing team. The runs: where the slot changes (each thread finds them).
    void run() const {
        thread_local std::vector<T> scratch;
        thread_local std::vector<int64_t> starts;
        find_runs(slots, rows, starts);
        const int64_t runs = int64_t(starts.size()) - 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < runs; ++r) {
            const int64_t C = width(), back = taps - 1, start = starts[r];
            convolve_run(mixed, C, conv_weight, static_cast<const T*>(nullptr), conv_states + slots[start] * back * C,
                         lens[start] == 1, start, starts[r + 1] - start, C, taps, convolved, scratch);
        }  // (the loop's barrier: every row convolved before any head reads one)
        const FlushSubnormals flushing;
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t r = 0; r < runs; ++r) {
            for (int64_t h = 0; h < heads; ++h) {
                recur(starts[r], starts[r + 1] - starts[r], h, scratch);
            }
        }
    }
};

}  // namespace

