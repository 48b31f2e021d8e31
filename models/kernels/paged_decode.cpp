// The paged pool kernels' entry points (the kernels themselves: paged_decode.h). Built with the
// other kernels by native.py; called through ctypes, which releases the GIL. A symbol's suffix names
// the model's type, then the pool's where it keeps another (kv_element.h): _f32_kv_f16.

#include "paged_decode.h"


#define LOOM_ROTATE_AND_STORE(SUFFIX, T, C)                                                             \
    extern "C" void loom_rotate_and_store_##SUFFIX(                                                     \
        const T* q, int64_t q_stride, const T* k, int64_t k_stride, const T* v, int64_t v_stride,      \
        const T* cos, const T* sin, int64_t rotary_dim, const int64_t* slots, int64_t tokens,           \
        C* k_cache, C* v_cache, T* q_out, int64_t heads, int64_t kv_heads, int64_t dim) {               \
        _Pragma("omp parallel if (tokens >= 16)")                                                       \
        rotate_and_store_rows<T, C>(q, q_stride, k, k_stride, v, v_stride, cos, sin, rotary_dim, slots, \
                                    tokens, k_cache, v_cache, q_out, heads, kv_heads, dim);             \
    }

LOOM_POOL_TYPES(LOOM_ROTATE_AND_STORE)

#define LOOM_DECODE_ATTENTION(SUFFIX, T, C)                                                             \
    extern "C" void loom_decode_attention_##SUFFIX(                                                     \
        const T* q, int64_t q_stride, const C* k_cache, const C* v_cache, const int64_t* block_tables,  \
        int64_t max_blocks, const int64_t* context_lens, T* out, int64_t out_stride, int64_t num_seqs,  \
        int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size, int64_t window, double scale, \
        double softcap, const T* sinks, const T* slopes) {                                               \
        _Pragma("omp parallel")                                                                         \
        decode_attention_rows<T, C>(q, q_stride, k_cache, v_cache, block_tables, max_blocks,            \
                                    context_lens, out, out_stride, num_seqs, heads, kv_heads, dim,      \
                                    block_size, window, scale, softcap, sinks, slopes);                 \
    }

LOOM_POOL_TYPES(LOOM_DECODE_ATTENTION)
