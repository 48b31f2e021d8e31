// The linear kernels' entry points (the kernels themselves: cpu_linear.h, and block_weights.h for
// weights kept in blocks).

#include <vector>

#include "block_weights.h"
#include "cpu_linear.h"

namespace {

template <typename T>
void linear(const T* x, int64_t x_stride, int64_t rows, const T* w, const T* bias, int64_t in, int64_t out, T* y,
            int64_t y_stride, int64_t panel_from) {
    // The panels' scratch, kept per calling thread: a fresh buffer of this size would come from new
    // pages on every call. Its address is taken here: inside the region each thread has its own.
    thread_local std::vector<T> buffer;
    T* packed = rows >= panel_from ? line_aligned(buffer, packed_size<T>(rows, in)) : nullptr;
#pragma omp parallel
    linear_rows(x, x_stride, rows, w, in, bias, in, out, y, y_stride, packed, panel_from);
}

void block_linear(const float* x, int64_t x_stride, int64_t rows, const void* blocks, int64_t format,
                  const float* bias, int64_t in, int64_t out, float* y, int64_t y_stride) {
    thread_local std::vector<float> buffer;  // as linear's
    float* scratch = line_aligned(buffer, block_scratch_size(rows, in));
    const BlockWeights w(blocks, format, in, out);
#pragma omp parallel
    block_linear_rows(x, x_stride, rows, w, bias, y, y_stride, scratch);
}

// ``heads`` products side by side in one region (DeepSeek's up-projections a head each, block_heads.py): head h
// multiplies its values of x (from x + h x_head) by its own ``out`` rows (from blocks + h head_bytes) into y + h
// y_head.
void block_heads(const float* x, int64_t x_stride, int64_t x_head, int64_t rows, const uint8_t* blocks,
                 int64_t head_bytes, int64_t format, int64_t in, int64_t out, int64_t heads, float* y, int64_t y_stride,
                 int64_t y_head) {
    thread_local std::vector<float> buffer;  // as linear's
    float* scratch = line_aligned(buffer, block_scratch_size(rows, in));
#pragma omp parallel
    for (int64_t h = 0; h < heads; ++h) {
        const BlockWeights w(blocks + h * head_bytes, format, in, out);
        block_linear_rows(x + h * x_head, x_stride, rows, w, nullptr, y + h * y_head, y_stride, scratch);
#pragma omp barrier  // (the next head's rounded inputs go where this head's are read)
    }
}

// Weight rows row_of(0), ..., row_of(count - 1) of block weights as floats into dst [count, in], the
// rows shared among threads.
template <typename RowOf>
void widen_rows(const void* blocks, int64_t format, int64_t in, int64_t out, int64_t count, RowOf row_of, float* dst) {
    const BlockWeights w(blocks, format, in, out);
    with_format(format, in, [&](auto f) {
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < count; ++r) widen_row<decltype(f)>(w, row_of(r), dst + r * in);
    });
}

// ``rows`` rows of x as the floats their rounding (``span`` values a scale) stands for: what block
// products multiply.
void round_activations(const float* x, int64_t x_stride, int64_t rows, int64_t in, float* out, int64_t span) {
#pragma omp parallel
    rounded_floats(x, x_stride, rows, in, out, span);
}

}  // namespace

extern "C" void loom_block_widen_f32(const void* blocks, int64_t format, int64_t in, int64_t out, int64_t first,
                                     int64_t count, float* dst) {
    widen_rows(blocks, format, in, out, count, [=](int64_t r) { return first + r; }, dst);
}

// An embedding's lookup, rows ids[0 .. count) (the layouts with rows side by side keep no row apart
// for the caller to gather). Each id is below ``out``: block_linear.py's BlockEmbedding checks.
extern "C" void loom_block_lookup_f32(const void* blocks, int64_t format, int64_t in, int64_t out, const int64_t* ids,
                                      int64_t count, float* dst) {
    widen_rows(blocks, format, in, out, count, [=](int64_t r) { return ids[r]; }, dst);
}

extern "C" void loom_block_linear_f32(const float* x, int64_t x_stride, int64_t rows, const void* blocks,
                                      int64_t format, const float* bias, int64_t in, int64_t out, float* y,
                                      int64_t y_stride) {
    block_linear(x, x_stride, rows, blocks, format, bias, in, out, y, y_stride);
}

extern "C" void loom_block_heads_f32(const float* x, int64_t x_stride, int64_t x_head, int64_t rows, const void* blocks,
                                     int64_t head_bytes, int64_t format, int64_t in, int64_t out, int64_t heads,
                                     float* y, int64_t y_stride, int64_t y_head) {
    block_heads(x, x_stride, x_head, rows, static_cast<const uint8_t*>(blocks), head_bytes, format, in, out, heads, y,
                y_stride, y_head);
}

extern "C" void loom_round_activations_f32(const float* x, int64_t x_stride, int64_t rows, int64_t in, float* out,
                                           int64_t span) {
    round_activations(x, x_stride, rows, in, out, span);
}

// ``panel_from``: from how many rows the product takes the panels (the model's, cpu_linear.py).
#define LOOM_LINEAR(NAME, T)                                                                       \
    extern "C" void NAME(const T* x, int64_t x_stride, int64_t rows, const T* w, const T* bias,    \
                         int64_t in, int64_t out, T* y, int64_t y_stride, int64_t panel_from) {     \
        linear<T>(x, x_stride, rows, w, bias, in, out, y, y_stride, panel_from);                    \
    }

LOOM_LINEAR(loom_linear_f32, float)
LOOM_LINEAR(loom_linear_f64, double)

// From how many rows products take the panels unless a model measured otherwise (cpu_linear.py).
extern "C" int64_t loom_default_panel_min_rows() { return PANEL_MIN_ROWS; }

extern "C" int64_t loom_bfloat16_dots() { return BFLOAT16_DOTS; }

// The bytes of the vectors the kernels were built for: 32 (AVX2) or 64 (AVX-512).
extern "C" int64_t loom_vector_bytes() { return VECTOR_BYTES; }

// The rows a float32 product of ``rows`` input rows computes on the panels, zero rows included.
extern "C" int64_t loom_float_panel_rows(int64_t rows) { return panel_computed_rows<float>(rows); }

// Whether a file's float32 rows a multiple of 4 KiB long are worth padding at load (cpu_linear.h).
extern "C" int64_t loom_pads_float_rows() { return PADS_FLOAT_ROWS; }

// Whether the products over the K-quants' own layouts end every super-block in exact integers, as
// rows16's do, so that a Q4_K matrix gives the same numbers in either layout (with AVX-512: pair_rows
// and the tiles; int8_rows elsewhere adds a super-block's blocks in float lanes).
extern "C" int64_t loom_k_quant_super_blocks_exact() { return PAIRS; }

// Whether this build multiplies Q4_K and Q5_K weights with sixteen rows side by side (GGUF_Q4_K_ROWS16,
// GGUF_Q5_K_ROWS16), Q6_K (GGUF_Q6_K_ROWS16), Loom's 8-, 4- and 5-bit blocks (GGUF_Q8_0_ROWS16,
// GGUF_Q4_1_ROWS16, GGUF_Q5_0_ROWS16; each scale and minimum a float16's value), IQ4's
// (GGUF_IQ4_ROWS16) and MXFP4's (GGUF_MXFP4_ROWS16). The file's tensors are laid out so at load by
// gguf_blocks.cpp.
extern "C" int64_t loom_multiplies_q4_k_rows16() { return rows16_built<Q4KRows16>(); }
extern "C" int64_t loom_multiplies_q5_k_rows16() { return rows16_built<Q5KRows16>(); }
extern "C" int64_t loom_multiplies_q8_0_rows16() { return rows16_built<Q80Rows16>(); }
extern "C" int64_t loom_multiplies_q4_1_rows16() { return rows16_built<Q41Rows16>(); }
extern "C" int64_t loom_multiplies_q5_0_rows16() { return rows16_built<Q50Rows16>(); }
extern "C" int64_t loom_multiplies_q6_k_rows16() { return rows16_built<Q6KRows16>(); }
extern "C" int64_t loom_multiplies_iq4_rows16() { return rows16_built<IQ4Rows16>(); }
extern "C" int64_t loom_multiplies_mxfp4_rows16() { return rows16_built<MXFP4Rows16>(); }
