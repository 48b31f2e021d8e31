// LFM2's short convolution over a step's rows, in the attention's place in decoder_layer.cpp: the
// rows of the tokens before a row come from the paged pool, a row a token, as keys do
// (models/families/lfm2.py says why; its ShortConv is the reference these follow, operation for
// operation).
#pragma once

#include <cstdint>

#include "kv_element.h"

namespace {

// ``bcx`` [rows, 3 x hidden]: each row's B, C and x (the input product's output). Each row's B x is
// kept in place of its B and stored at its slot of the layer's pool (``pool`` [blocks, block_size,
// hidden], as C); once every row's is, each row's output [rows, hidden] into ``out``: a channel's
// ``taps`` weights (``weights`` [hidden, taps], the oldest token's first) over the B x of this token
// and of the taps - 1 before it in its sequence (from the pool, through the row's block table; none
// before the sequence's first token), plus ``bias`` (null: none), times C. A row's position is its
// context length less one (``lens``), as a decode row's. Rows of one sequence may be in one step (a
// prefill chunk's): the stores' loop ends at its barrier before any row reads.
template <typename T, typename C>
void convolve_rows(T* bcx, int64_t hidden, const T* weights, const T* bias, int64_t taps, C* pool,
                   const int64_t* slots, const int64_t* tables, int64_t max_blocks, const int64_t* lens,
                   int64_t block_size, int64_t rows, T* out) {
    const int64_t width = 3 * hidden;
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) {
        T* row = bcx + r * width;
        C* stored = pool + slots[r] * hidden;
        for (int64_t c = 0; c < hidden; ++c) {
            row[c] *= row[2 * hidden + c];
            stored[c] = Element<T, C>::narrow(row[c]);
        }
    }
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) {
        const T* row = bcx + r * width;
        const int64_t position = lens[r] - 1;
        const int64_t* table = tables + r * max_blocks;
        T* y = out + r * hidden;
        for (int64_t c = 0; c < hidden; ++c) y[c] = row[c] * weights[c * taps + taps - 1];
        for (int64_t back = 1; back < taps && back <= position; ++back) {
            const int64_t p = position - back;
            const C* earlier = pool + (table[p / block_size] * block_size + p % block_size) * hidden;
            for (int64_t c = 0; c < hidden; ++c) y[c] += Element<T, C>::widen(earlier[c]) * weights[c * taps + taps - 1 - back];
        }
        if (bias != nullptr)
            for (int64_t c = 0; c < hidden; ++c) y[c] += bias[c];
        for (int64_t c = 0; c < hidden; ++c) y[c] *= row[hidden + c];
    }
}

}  // namespace
