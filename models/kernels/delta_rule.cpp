// The gated delta rule (Qwen3.5's linear attention) over a step's runs of rows, each run one sequence's,
// its heads' state matrices read and written where the pool keeps them (its state slot): for each row,
// S = decay S; S += k (beta (v - S^T k))^T; out = S^T q. One (run, head) a task: a head's matrix (key
// width x value width, 64 KiB at 128 x 128 floats) stays in the core's L2 while the run's rows go
// through it, read and written twice a row, where the torch path gathered, masked, decayed, updated
// and scattered every slot's matrices through memory (325 ms a 16-stream step of the 0.8B shape).
// Built with the other kernels by native.py; called through ctypes, which releases the GIL.

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

template <typename T>
void delta_rule_rows(const T* q, const T* k, const T* v, const T* decay, const T* beta, T* states, T* out,
                     const int64_t* slots, const uint8_t* fresh, const int64_t* starts, const int64_t* lengths,
                     int64_t runs, int64_t heads, int64_t key_dim, int64_t value_dim) {
    std::vector<T> scratch(2 * value_dim);
    T* memory = scratch.data();       // S^T k: what the state reads at k, a value a column
    T* delta = memory + value_dim;    // beta (v - S^T k)
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (int64_t r = 0; r < runs; ++r) {
        for (int64_t h = 0; h < heads; ++h) {
            T* S = states + (slots[r] * heads + h) * key_dim * value_dim;
            if (fresh[r]) {
                std::memset(S, 0, sizeof(T) * key_dim * value_dim);
            }
            for (int64_t row = starts[r]; row < starts[r] + lengths[r]; ++row) {
                const int64_t at = row * heads + h;
                const T* kr = k + at * key_dim;
                const T* qr = q + at * key_dim;
                const T* vr = v + at * value_dim;
                T* o = out + at * value_dim;
                const T a = decay[at], b = beta[at];
                for (int64_t j = 0; j < value_dim; ++j) {
                    memory[j] = 0;
                    o[j] = 0;
                }
                for (int64_t i = 0; i < key_dim; ++i) {  // decay, and read the state at k
                    T* Si = S + i * value_dim;
                    const T ki = kr[i];
#pragma omp simd
                    for (int64_t j = 0; j < value_dim; ++j) {
                        Si[j] *= a;
                        memory[j] += ki * Si[j];
                    }
                }
                for (int64_t j = 0; j < value_dim; ++j) {
                    delta[j] = b * (vr[j] - memory[j]);
                }
                for (int64_t i = 0; i < key_dim; ++i) {  // write k's correction, and read the state at q
                    T* Si = S + i * value_dim;
                    const T ki = kr[i], qi = qr[i];
#pragma omp simd
                    for (int64_t j = 0; j < value_dim; ++j) {
                        Si[j] += ki * delta[j];
                        o[j] += qi * Si[j];
                    }
                }
            }
        }
    }
}

}  // namespace

#define LOOM_DELTA_RULE(SUFFIX, T)                                                                          \
    extern "C" void loom_delta_rule_##SUFFIX(const T* q, const T* k, const T* v, const T* decay, const T* beta, \
                                             T* states, T* out, const int64_t* slots, const uint8_t* fresh,   \
                                             const int64_t* starts, const int64_t* lengths, int64_t runs,     \
                                             int64_t heads, int64_t key_dim, int64_t value_dim) {            \
        _Pragma("omp parallel")                                                                             \
        delta_rule_rows<T>(q, k, v, decay, beta, states, out, slots, fresh, starts, lengths, runs, heads,   \
                           key_dim, value_dim);                                                             \
    }

LOOM_DELTA_RULE(f32, float)
LOOM_DELTA_RULE(f64, double)
