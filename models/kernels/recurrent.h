// What the recurrent layers' kernels share (delta_rule.h, mamba_scan.h; the torch side's is
// families/recurrent.py): subnormals flushed through their recurrences; a step's runs of rows, each
// sequence's with one state slot; and the short causal convolution they run before their recurrence over a
// run's rows: each channel of this row's input and the taps - 1 before it (the run's earlier rows, or its
// state slot's last inputs: zeros where the run starts its sequence), times the channel's taps, plus its
// bias, through a SiLU; the slot's last inputs then moved on.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace {

// For its lifetime, this thread's arithmetic flushes subnormal results and reads subnormal inputs as 0
// (x86's FTZ and DAZ; a no-op elsewhere), for the recurrences: a time step or decay underflows where softplus
// meets a very negative input (below about -87), and what it feeds (x dt B, a decayed state) takes it on; each
// such multiply-add then took a microcode assist on Intel's cores: the random Granite 4.0 H-1B shape's
// 16-stream decode step 367 ms against 186 flushed, Qwen3.5-2B's 216 against 208, 64 streams 694 against 636
// (docs/benchmarks-history.md, "Granite 4's hybrids"). What is flushed is below float32's least normal value,
// 1.2e-38, beside a state or a term that a float sum keeps.
class FlushSubnormals {
#if defined(__SSE__)
    unsigned before_ = _mm_getcsr();

public:
    FlushSubnormals() { _mm_setcsr(before_ | 0x8040); }  // (FTZ 0x8000, DAZ 0x0040)
    ~FlushSubnormals() { _mm_setcsr(before_); }
#endif
};

template <typename T>
T silu(T x) {
    return x / (T(1) + std::exp(-x));
}

// log(1 + e^x), x itself past 20 (torch's threshold): the recurrences' time steps and decays.
template <typename T>
T softplus(T x) {
    return x > T(20) ? x : std::log1p(std::exp(x));
}

// Where each run of ``slots`` [rows] (a row's state slot) starts, then ``rows``: a run's rows share a slot.
void find_runs(const int64_t* slots, int64_t rows, std::vector<int64_t>& starts) {
    starts.clear();
    for (int64_t r = 0; r < rows; ++r) {
        if (r == 0 || slots[r] != slots[r - 1]) starts.push_back(r);
    }
    starts.push_back(rows);
}

// Rows [start, start + n) of ``mixed`` (``stride`` apart, ``width`` channels from each row's start) into
// ``out`` [rows, width]; ``weight`` [width, taps] (a channel's taps, the oldest first), ``bias`` [width] or
// null; ``earlier`` [taps - 1, width] the slot's last inputs, the oldest first (zeroed first where ``fresh``).
// ``tail``: scratch.
template <typename T>
void convolve_run(const T* mixed, int64_t stride, const T* weight, const T* bias, T* earlier, bool fresh,
                  int64_t start, int64_t n, int64_t width, int64_t taps, T* out, std::vector<T>& tail) {
    const int64_t back = taps - 1;
    if (fresh) std::memset(earlier, 0, sizeof(T) * back * width);
    // input at run position p (negative: the slot's, p = -back the oldest)
    auto input = [&](int64_t p) { return p >= 0 ? mixed + (start + p) * stride : earlier + (back + p) * width; };
    for (int64_t t = 0; t < n; ++t) {
        T* o = out + (start + t) * width;
        for (int64_t c = 0; c < width; ++c) o[c] = bias == nullptr ? T(0) : bias[c];
        for (int64_t j = 0; j < taps; ++j) {
            const T* x = input(t - back + j);
            for (int64_t c = 0; c < width; ++c) o[c] += weight[c * taps + j] * x[c];
        }
        for (int64_t c = 0; c < width; ++c) o[c] = silu(o[c]);
    }
    tail.resize(back * width);
    for (int64_t j = 0; j < back; ++j) std::memcpy(tail.data() + j * width, input(n - back + j), sizeof(T) * width);
    std::memcpy(earlier, tail.data(), sizeof(T) * back * width);
}

}  // namespace
