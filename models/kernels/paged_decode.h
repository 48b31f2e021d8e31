// The paged KV pool's two kernels: writing a step's keys and values into it (with the rotary
// embedding applied to queries and keys on the way), and decode attention read straight from it:
// one query token per sequence, each sequence's keys and values found through its block table.
// Together they replace some twenty torch operators per layer, which at one or a few decode rows
// cost more in dispatch than the arithmetic they do.
//
// Decode attention: The torch path first gathers every
// sequence's blocks into a padded buffer and then runs SDPA over it, so the cache is read twice
// and written once per layer; here each key and each value is read once, and nothing is padded.
//
// The kernels share the work among the threads of the enclosing parallel region (alone, outside
// one): paged_decode.cpp opens one for each call, decoder_layer.cpp one for a whole layer.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "kv_element.h"
#include "vector.h"

namespace {

// exp(row[i] - peak) in place, returning their sum. Generic: std::exp.
template <typename T>
T exp_shifted(T* row, int64_t n, T peak) {
    T sum = 0;
    for (int64_t i = 0; i < n; ++i) {
        row[i] = std::exp(row[i] - peak);
        sum += row[i];
    }
    return sum;
}

// float: a vector at a time (exp_lanes), since a scalar expf per score was most of decode
// attention's time at 64 sequences.
template <>
float exp_shifted<float>(float* row, int64_t n, float peak) {
    using V = Vector<float>;
    V::type sums = {};
    int64_t i = 0;
    for (; i + V::lanes <= n; i += V::lanes) {
        const V::type e = exp_lanes(V::load(row + i) - peak);
        V::store(row + i, e);
        sums += e;
    }
    float sum = 0;
    for (int lane = 0; lane < V::lanes; ++lane) sum += sums[lane];
    for (; i < n; ++i) {
        row[i] = std::exp(row[i] - peak);
        sum += row[i];
    }
    return sum;
}

// row[i] = cap tanh(row[i] / cap) for i < n: attention scores soft-capped before their softmax, as
// Gemma 2 does (within (-cap, cap), nearly unchanged well inside). Generic: std::tanh.
template <typename T>
void soft_cap(T* row, int64_t n, T cap) {
    for (int64_t i = 0; i < n; ++i) row[i] = cap * std::tanh(row[i] / cap);
}

// float: a vector at a time, tanh |x| = (1 - e) / (1 + e) with e = exp(-2 |x|) (exp_lanes), which
// stays finite for any score; a scalar tanhf per score would cost as much as the scores themselves.
template <>
void soft_cap<float>(float* row, int64_t n, float cap) {
    using V = Vector<float>;
    const V::type zero = {};
    int64_t i = 0;
    for (; i + V::lanes <= n; i += V::lanes) {
        const V::type x = V::load(row + i) / cap;
        const V::type e = exp_lanes((x < zero ? x : -x) * 2.0f);
        const V::type capped = (1.0f - e) / (1.0f + e) * cap;
        V::store(row + i, x < zero ? -capped : capped);
    }
    for (; i < n; ++i) row[i] = cap * std::tanh(row[i] / cap);
}

// The largest of row[0, n), n a whole number of vectors: a vector of maxima, then its lanes (the
// scalar std::max_element waited on each comparison in turn: 7% of decode attention's time).
template <typename T>
T largest(const T* row, int64_t n) {
    using V = Vector<T>;
    typename V::type peak = V::load(row);
    for (int64_t i = V::lanes; i < n; i += V::lanes) {
        const typename V::type x = V::load(row + i);
        peak = x > peak ? x : peak;
    }
    T lanes[V::lanes];
    V::store(lanes, peak);
    return *std::max_element(lanes, lanes + V::lanes);
}

// A key's or value's row (``elements`` long), asked into the cache ahead of its use. One K/V head's
// rows are a slot apart (every K/V head's row of a token), a pattern the hardware prefetcher follows
// poorly: over 30 layers' pools, from memory, 64 sequences of 110 tokens took 567 us a layer without
// these hints, 475 with them; with a float16 pool 470 and 286 (docs/benchmarks.md, "A 16-bit KV pool").
template <typename C>
inline void prefetch_row(const C* row, int64_t elements) {
    const char* bytes = reinterpret_cast<const char*>(row);
    for (int64_t b = 0; b < elements * int64_t(sizeof(C)); b += 64) __builtin_prefetch(bytes + b);
}

// scores[h][j] = scale * q[h] . key j, for the ``group`` query heads that share one K head: its key
// rows (kept as C: kv_element.h) at k + offsets[j], n of them. A block of ``lanes`` keys is read
// once for every head of the group (from L1 after the first); each key leaves a vector of partial
// sums, and a block's vectors are summed across their lanes together (sums_of_lanes). The keys of a
// block take turns within each vector of dimensions, so that their sums are independent: one key
// at a time, each sum waited on its own previous multiply-add, and scores were half of decode
// attention's time (docs/benchmarks.md, "Key scores"). A last partial block repeats its last key.
// Dimensions past the last whole vector are summed one by one. Head h's scores start at
// scores + h * stride, rows of whole vectors: past n they hold the repeated key's score.
template <typename T, typename C>
void key_scores(const T* q, int64_t group, const C* k, const int64_t* offsets, int64_t n, int64_t dim, T scale,
                T* scores, int64_t stride) {
    using V = Vector<T>;
    using E = Element<T, C>;
    constexpr int L = V::lanes;
    const int64_t whole = dim / L * L;
    for (int64_t t0 = 0; t0 < n; t0 += L) {
        const int64_t count = std::min<int64_t>(L, n - t0);
        // the keys two blocks on (at the start, the first three blocks)
        for (int64_t j = t0 == 0 ? 0 : t0 + 2 * L; j < std::min<int64_t>(t0 + 3 * L, n); ++j)
            prefetch_row(k + offsets[j], dim);
        const C* keys[L];
        for (int j = 0; j < L; ++j) keys[j] = k + offsets[t0 + std::min<int64_t>(j, count - 1)];
        for (int64_t h = 0; h < group; ++h) {
            const T* qh = q + h * dim;
            typename V::type parts[L] = {};
            for (int64_t d = 0; d < whole; d += L) {
                const typename V::type qd = V::load(qh + d);
                for (int j = 0; j < L; ++j) parts[sum_position<T>(j)] += qd * E::load(keys[j] + d);
            }
            T tails[L] = {};
            for (int64_t j = 0; j < count; ++j)
                for (int64_t d = whole; d < dim; ++d) tails[j] += qh[d] * E::widen(keys[j][d]);
            V::store(scores + h * stride + t0, (sums_of_lanes<T>(parts) + V::load(tails)) * scale);
        }
    }
}

// out[h][d] = scale[h] x the sum over j of p[h][j] * value j [d] for H heads (p rows stride apart) and DV
// vectors of dimensions: H x DV sums stay in registers while the values (at v + offsets[j]) stream
// past.
template <typename T, typename C, int H, int DV>
void weigh_values_tile(const T* p, int64_t stride, int64_t n, const C* v, const int64_t* offsets, const T* scale,
                       T* out, int64_t dim, bool accumulate) {
    using V = Vector<T>;
    constexpr int L = V::lanes;
    typename V::type sums[H][DV] = {};
    if (accumulate)
        for (int h = 0; h < H; ++h)
            for (int c = 0; c < DV; ++c) sums[h][c] = V::load(out + h * dim + c * L);
    for (int64_t j = 0; j < n; ++j) {
        if (j + 16 < n) prefetch_row(v + offsets[j + 16], DV * L);
        const C* value = v + offsets[j];
        typename V::type values[DV];
        for (int c = 0; c < DV; ++c) values[c] = Element<T, C>::load(value + c * L);
        for (int h = 0; h < H; ++h) {
            const T weight = p[h * stride + j];
            for (int c = 0; c < DV; ++c) sums[h][c] += weight * values[c];
        }
    }
    for (int h = 0; h < H; ++h)
        for (int c = 0; c < DV; ++c) V::store(out + h * dim + c * L, sums[h][c] * scale[h]);
}

template <typename T, typename C, int H>
void weigh_values_heads(const T* p, int64_t stride, int64_t n, const C* v, const int64_t* offsets, const T* scale,
                        T* out, int64_t dim, bool accumulate) {
    constexpr int L = Vector<T>::lanes;
    const int64_t whole = dim / L * L;
    int64_t d = 0;
    for (; d + 4 * L <= whole; d += 4 * L)
        weigh_values_tile<T, C, H, 4>(p, stride, n, v + d, offsets, scale, out + d, dim, accumulate);
    switch ((whole - d) / L) {
        case 3: weigh_values_tile<T, C, H, 3>(p, stride, n, v + d, offsets, scale, out + d, dim, accumulate); break;
        case 2: weigh_values_tile<T, C, H, 2>(p, stride, n, v + d, offsets, scale, out + d, dim, accumulate); break;
        case 1: weigh_values_tile<T, C, H, 1>(p, stride, n, v + d, offsets, scale, out + d, dim, accumulate); break;
    }
    for (int h = 0; h < H; ++h)
        for (d = whole; d < dim; ++d) {
            T sum = accumulate ? out[h * dim + d] : T(0);
            for (int64_t j = 0; j < n; ++j) sum += p[h * stride + j] * Element<T, C>::widen(v[offsets[j] + d]);
            out[h * dim + d] = sum * scale[h];
        }
}

// The ``group`` heads' weighted values, each head's scaled by its scale[h], three heads at a time (12
// sums of four vectors each); with ``accumulate``, added to what ``out`` holds.
template <typename T, typename C>
void weigh_values(const T* p, int64_t stride, int64_t group, int64_t n, const C* v, const int64_t* offsets,
                  const T* scale, T* out, int64_t dim, bool accumulate = false) {
    int64_t h = 0;
    auto heads = [&](auto count) {
        weigh_values_heads<T, C, decltype(count)::value>(p + h * stride, stride, n, v, offsets, scale + h,
                                                         out + h * dim, dim, accumulate);
    };
    for (; h + 3 <= group; h += 3) heads(std::integral_constant<int, 3>());
    if (group - h == 2) heads(std::integral_constant<int, 2>());
    if (group - h == 1) heads(std::integral_constant<int, 1>());
}

// Where a token's keys (every K/V head's row) span a page or more, as a multi-head model's do (the
// 1.7B SmolLM2's 32 heads of 64 floats: 8 KB), one head's keys and values lie a page apart, and a
// task of several K/V heads takes its scores, then its weighted values, a block of SCORE_TOKENS
// tokens at a time for every head in turn rather than a head at a time over all its tokens: each
// block's pages are then read while open and the prefetcher's (64 sequences of 100 tokens, 32 / 32
// heads, 24 layers' pools, two Zen 5 threads: 3.9-5.2 -> 3.2-3.7 ms a layer, AVX2 build 4.7-6.0 ->
// 3.1-3.8 ms). Shorter rows keep a head at a time (with the default model's 3 K/V heads and a 7B's
// 4, the blocks ran level to 4% slower). A ``softcap`` above 0 soft-caps each score (soft_cap)
// before the softmax; a ``window`` above 0 reads a sequence's last ``window`` keys only, one below 0 the keys of
// its last key's chunk of -window positions (Llama 4's chunked attention: from the last multiple of -window); ``sinks``
// (a logit a query head, gpt-oss's; null: none) join each head's softmax denominator and weigh no value;
// ``slopes`` (a query head's ALiBi slope, BLOOM's and MPT's; null: none) add slope x (key's position - query's)
// to each score, the query the row's last key.
constexpr int64_t SCORE_TOKENS = 16, SCORE_BLOCKS_FROM_BYTES = 4096;

template <typename T, typename C>
void decode_attention_rows(const T* q, int64_t q_stride, const C* k_cache, const C* v_cache,
                      const int64_t* block_tables, int64_t max_blocks, const int64_t* context_lens,
                      T* out, int64_t out_stride, int64_t num_seqs, int64_t heads, int64_t kv_heads,
                      int64_t dim, int64_t block_size, int64_t window, double scale, double softcap,
                      const T* sinks = nullptr, const T* slopes = nullptr) {
    const int64_t group = heads / kv_heads;  // query heads sharing one K/V head (GQA)
    const int64_t slot_stride = kv_heads * dim;
    // A task is a sequence, a run of its KV heads and a run of each one's query heads. Whole sequences keep
    // the reads sequential (a token's keys for all heads are one contiguous row); with few sequences, split
    // the heads so that every thread has work: the K/V heads, and where those tasks are still fewer than the
    // threads (a latent attention's one key head at one stream), each one's query heads too, which then read
    // its keys and values once a run (one stream of a GLM-4.7-Flash shape at 2,000 tokens: 94 -> 73 ms a step
    // on two threads; at 4 streams the heads' second reads cost what the split gained).
    const int64_t threads = omp_get_num_threads();
    const bool few = num_seqs < 4 * threads;
    const int64_t splits = few ? kv_heads : 1, tasks = num_seqs * splits;
    const int64_t head_splits = tasks < threads ? std::min(group, (threads + tasks - 1) / tasks) : 1;
    {
        std::vector<int64_t> offsets;  // each key's row in the pool, relative to the K/V head's first
        std::vector<T> scores;         // [the task's K/V heads, heads of a K/V head, keys]
        std::vector<T> inv_sum;        // [the task's K/V heads, heads of a K/V head]
        const std::vector<T> ones(group, T(1));  // the scales of the weighted values' blocks but the last

#pragma omp for collapse(3) schedule(dynamic)
        for (int64_t s = 0; s < num_seqs; ++s) {
            for (int64_t split = 0; split < splits; ++split) {
                for (int64_t head_split = 0; head_split < head_splits; ++head_split) {
                    const int64_t kv_first = split * kv_heads / splits, kv_end = (split + 1) * kv_heads / splits;
                    // the run of each K/V head's query heads, ``run`` of them from ``h_first``
                    const int64_t h_first = head_split * group / head_splits;
                    const int64_t run = (head_split + 1) * group / head_splits - h_first;
                    const int64_t end = context_lens[s];
                    const int64_t first = window > 0   ? std::max<int64_t>(0, end - window)
                                          : window < 0 ? (end - 1) / -window * -window
                                                       : 0;
                    const int64_t n = end - first;
                    const int64_t* table = block_tables + s * max_blocks;
                    offsets.resize(n);
                    // block by block, where a key at a time took an integer division each (block_size is
                    // a run-time value): 64 sequences of 110 tokens 209-244 -> 203-233 us a layer
                    for (int64_t t = first, block = first / block_size; t < end; ++block) {
                        const int64_t slot = table[block] * block_size;
                        const int64_t block_end = std::min(end, (block + 1) * block_size);
                        for (int64_t in_block = t - block * block_size; t < block_end; ++t, ++in_block)
                            offsets[t - first] = (slot + in_block) * slot_stride;
                    }
                    // Each head's scores in whole vectors, padded with -inf, whose weights come out 0:
                    // the softmax then has no scalar tail.
                    const int64_t width = (n + Vector<T>::lanes - 1) / Vector<T>::lanes * Vector<T>::lanes;
                    const int64_t task_heads = (kv_end - kv_first) * run;
                    scores.resize(task_heads * width);
                    inv_sum.resize(task_heads);
                    const bool blocks =
                        kv_end - kv_first > 1 && slot_stride * int64_t(sizeof(C)) >= SCORE_BLOCKS_FROM_BYTES;
                    const int64_t tokens = blocks ? SCORE_TOKENS : n;  // a block's (all of them in one, else)
                    // f(K/V head, its run of query heads' scores, their outputs)
                    const auto each_head = [&](const auto& f) {
                        for (int64_t g = kv_first; g < kv_end; ++g)
                            f(g, scores.data() + (g - kv_first) * run * width,
                              out + s * out_stride + (g * group + h_first) * dim);
                    };
                    for (int64_t t0 = 0; t0 < n; t0 += tokens)
                        each_head([&](int64_t g, T* head_scores, T*) {
                            key_scores(q + s * q_stride + (g * group + h_first) * dim, run, k_cache + g * dim,
                                       offsets.data() + t0, std::min(tokens, n - t0), dim, static_cast<T>(scale),
                                       head_scores + t0, width);
                        });
                    // Softmax per query head; the 1/sum scales the weighted values as the last block's are
                    // added and stored.
                    each_head([&](int64_t g, T* head_scores, T*) {
                        for (int64_t h = 0; h < run; ++h) {
                            T* row = head_scores + h * width;
                            if (softcap > 0) soft_cap(row, n, static_cast<T>(softcap));
                            if (slopes != nullptr) {  // (the row's keys from first, its query at end - 1)
                                const T slope = slopes[g * group + h_first + h];
                                for (int64_t i = 0; i < n; ++i) row[i] += slope * T(first + i - (end - 1));
                            }
                            std::fill(row + n, row + width, -std::numeric_limits<T>::infinity());
                            // a head's sink (gpt-oss's) joins the peak and the sum, and weighs no value
                            const T sink = sinks ? sinks[g * group + h_first + h] : -std::numeric_limits<T>::infinity();
                            const T peak = std::max(sink, largest(row, width));
                            inv_sum[(g - kv_first) * run + h] =
                                T(1) / (exp_shifted(row, width, peak) + std::exp(sink - peak));
                        }
                    });
                    for (int64_t t0 = 0; t0 < n; t0 += tokens)
                        each_head([&](int64_t g, T* head_scores, T* o) {
                            const T* head_scale =
                                t0 + tokens >= n ? inv_sum.data() + (g - kv_first) * run : ones.data();
                            weigh_values(head_scores + t0, width, run, std::min(tokens, n - t0), v_cache + g * dim,
                                         offsets.data() + t0, head_scale, o, dim, t0 > 0);
                        });
                }
            }
        }
    }
}

// One head ``x`` turned into ``y`` (y may be x; a row of the pool, C, where it is stored as it turns): its first
// ``half`` features paired with the next ``half`` as transformers' rotate_half pairs them, by the token's angles.
template <typename T, typename Y>
void rotate_head(const T* x, const T* c, const T* s, int64_t half, Y* y) {
    for (int64_t i = 0; i < half; ++i) {
        const T first = x[i], second = x[i + half];
        y[i] = Element<T, Y>::narrow(first * c[i] - second * s[i]);
        y[i + half] = Element<T, Y>::narrow(second * c[i + half] + first * s[i + half]);
    }
}

// q_out[t] = rotate(q[t]); pool[slots[t]] = rotate(k[t]), v[t]. rotate() turns the first
// rotary_dim features of each head by the token's angles (cos, sin: [tokens, rotary_dim], halves
// paired as transformers' rotate_half does) and keeps the rest; rotary_dim 0 leaves q and k as they
// are, and q_out may then be null. Rows are contiguous per head and may be views of a fused qkv. The
// pool keeps its keys and values as C (kv_element.h), rounded as they are stored.
template <typename T, typename C>
void rotate_and_store_rows(const T* q, int64_t q_stride, const T* k, int64_t k_stride, const T* v, int64_t v_stride,
                      const T* cos, const T* sin, int64_t rotary_dim, const int64_t* slots, int64_t tokens,
                      C* k_cache, C* v_cache, T* q_out, int64_t heads, int64_t kv_heads, int64_t dim) {
    const int64_t half = rotary_dim / 2, width = kv_heads * dim;
    // y is a query row (T) or a row of the pool (C)
    auto rotate = [&](const T* x, const T* c, const T* s, auto* y) {
        using Y = std::remove_pointer_t<decltype(y)>;
        rotate_head(x, c, s, half, y);
        for (int64_t i = rotary_dim; i < dim; ++i) y[i] = Element<T, Y>::narrow(x[i]);
    };
    auto store = [](const T* x, int64_t n, C* y) {
        for (int64_t i = 0; i < n; ++i) y[i] = Element<T, C>::narrow(x[i]);
    };
#pragma omp for
    for (int64_t t = 0; t < tokens; ++t) {
        const T* c = cos + t * rotary_dim;
        const T* s = sin + t * rotary_dim;
        C* keys = k_cache + slots[t] * width;
        store(v + t * v_stride, width, v_cache + slots[t] * width);
        if (rotary_dim == 0) {
            store(k + t * k_stride, width, keys);
            continue;
        }
        for (int64_t h = 0; h < kv_heads; ++h) rotate(k + t * k_stride + h * dim, c, s, keys + h * dim);
        for (int64_t h = 0; h < heads; ++h) rotate(q + t * q_stride + h * dim, c, s, q_out + (t * heads + h) * dim);
    }
}

// Each row's ``heads`` heads of ``dim`` (rows ``stride`` apart) rotated in place, as rotate_and_store_rows turns
// them: HunYuan's queries and keys, whose norms come after the rotation. A task per row.
template <typename T>
void rotate_rows(T* x, int64_t stride, const T* cos, const T* sin, int64_t rotary_dim, int64_t rows, int64_t heads,
                 int64_t dim) {
#pragma omp for
    for (int64_t t = 0; t < rows; ++t)
        for (int64_t h = 0; h < heads; ++h)
            rotate_head(x + t * stride + h * dim, cos + t * rotary_dim, sin + t * rotary_dim, rotary_dim / 2,
                        x + t * stride + h * dim);
}

}  // namespace
