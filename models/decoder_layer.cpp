// A whole Llama-family decoder layer for a step of decode rows, in one call and one parallel
// region: RMSNorm, the q/k/v product, rotary + K/V writes into the pool, decode attention, the
// output product and residual, RMSNorm, gate/up product, SiLU x up, down product and residual.
//
// At one or a few rows the layer's arithmetic is small and its weights stream in about 0.5 ms; run
// as ~16 torch operators and 6 ctypes calls it also paid ~0.2 ms of dispatch per layer, a quarter
// of a one-stream step (docs/benchmarks.md, "Small-batch products"). Here the phases are separated
// by the implicit barriers of their work-sharing loops, and the threads stay in one team throughout.
// The torch path (models/llama.py) remains the reference and runs every step with prefill rows.

#include <cmath>
#include <vector>

#include "cpu_linear.h"
#include "paged_decode.h"

namespace {

// One layer's weights and shape, filled once at load (decoder_layer.py mirrors this layout: every
// field is 8 bytes). Biases may be null.
template <typename T>
struct Layer {
    const T *input_norm, *post_norm;
    const T *qkv, *qkv_bias, *out, *out_bias, *gate_up, *gate_up_bias, *down, *down_bias;
    T *k_cache, *v_cache;
    int64_t hidden, intermediate, heads, kv_heads, dim, window;
    double eps, scale;
};

// The step's decode rows, filled once per step: angles, pool slots, block tables (padded to the
// widest) and context lengths.
template <typename T>
struct Step {
    const T *cos, *sin;
    const int64_t *slots, *tables, *lens;
    int64_t rows, rotary_dim, max_blocks, block_size;
};

// y = rms_norm(x (+ delta, kept in x)) * weight, a row per task; the sum in T as torch's is.
template <typename T>
void norm_rows(T* x, const T* delta, const T* weight, double eps, T* y, int64_t rows, int64_t width) {
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) {
        T* xr = x + r * width;
        if (delta != nullptr)
            for (int64_t i = 0; i < width; ++i) xr[i] += delta[r * width + i];
        T squares = 0;
        for (int64_t i = 0; i < width; ++i) squares += xr[i] * xr[i];
        const T inv = T(1) / std::sqrt(squares / T(width) + T(eps));
        for (int64_t i = 0; i < width; ++i) y[r * width + i] = xr[i] * inv * weight[i];
    }
}

// gate_up rows [gate | up] -> gate = silu(gate) * up, in place.
template <typename T>
void silu_mul_rows(T* gate_up, int64_t rows, int64_t intermediate) {
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) {
        T* gate = gate_up + r * 2 * intermediate;
        const T* up = gate + intermediate;
        for (int64_t i = 0; i < intermediate; ++i) gate[i] = gate[i] / (T(1) + std::exp(-gate[i])) * up[i];
    }
}

template <typename T>
void add_rows(T* x, const T* delta, int64_t count) {
#pragma omp for
    for (int64_t i = 0; i < count; ++i) x[i] += delta[i];
}

template <typename T>
void decoder_layer(T* x, const Layer<T>& l, const Step<T>& s) {
    const int64_t rows = s.rows, hidden = l.hidden, inter = l.intermediate;
    const int64_t q_width = l.heads * l.dim, kv_width = l.kv_heads * l.dim, qkv_width = q_width + 2 * kv_width;
    // The layer's intermediates, kept per calling thread (the loop thread) from step to step: a fresh
    // buffer would come from new pages every layer. Its address is taken here, outside the region.
    thread_local std::vector<T> scratch;
    const size_t size = rows * (2 * hidden + qkv_width + 2 * q_width + 2 * inter)
                        + packed_size<T>(rows, std::max({hidden, q_width, inter}));
    scratch.resize(std::max(scratch.size(), size));
    T* h = scratch.data();                // [rows, hidden] normed input of a product
    T* qkv = h + rows * hidden;           // [rows, qkv_width]
    T* q = qkv + rows * qkv_width;        // [rows, q_width] rotated queries
    T* attn = q + rows * q_width;         // [rows, q_width]
    T* gate_up = attn + rows * q_width;   // [rows, 2 * intermediate]
    T* delta = gate_up + rows * 2 * inter;  // [rows, hidden] a product's output, added to x
    T* packed = delta + rows * hidden;    // the products' input panels, packed_size(rows, widest input)
#pragma omp parallel
    {
        norm_rows<T>(x, nullptr, l.input_norm, l.eps, h, rows, hidden);
        linear_rows(h, hidden, rows, l.qkv, l.qkv_bias, hidden, qkv_width, qkv, qkv_width, packed);
        rotate_and_store_rows(qkv, qkv_width, qkv + q_width, qkv_width, qkv + q_width + kv_width, qkv_width, s.cos,
                              s.sin, s.rotary_dim, s.slots, rows, l.k_cache, l.v_cache, q, l.heads, l.kv_heads, l.dim);
        decode_attention_rows(q, q_width, l.k_cache, l.v_cache, s.tables, s.max_blocks, s.lens, attn, q_width, rows,
                              l.heads, l.kv_heads, l.dim, s.block_size, l.window, l.scale);
        linear_rows(attn, q_width, rows, l.out, l.out_bias, q_width, hidden, delta, hidden, packed);
        norm_rows(x, delta, l.post_norm, l.eps, h, rows, hidden);
        linear_rows(h, hidden, rows, l.gate_up, l.gate_up_bias, hidden, 2 * inter, gate_up, 2 * inter, packed);
        silu_mul_rows(gate_up, rows, inter);
        linear_rows(gate_up, 2 * inter, rows, l.down, l.down_bias, inter, hidden, delta, hidden, packed);
        add_rows(x, delta, rows * hidden);
    }
}

}  // namespace

#define LOOM_DECODER_LAYER(NAME, T) \
    extern "C" void NAME(T* x, const Layer<T>* layer, const Step<T>* step) { decoder_layer<T>(x, *layer, *step); }

LOOM_DECODER_LAYER(loom_decoder_layer_f32, float)
LOOM_DECODER_LAYER(loom_decoder_layer_f64, double)
