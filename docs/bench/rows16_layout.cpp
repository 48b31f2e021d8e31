// How fast a load lays a file's K-quant rows out sixteen side by side (block_interleaved.h's repack_rows16, which
// gguf_blocks.cpp's loom_lay_out_gguf_rows16 runs a block of sixteen rows at a time on each thread): one thread, a
// matrix of random bytes in the file's layout, its layout written into memory already touched (the copy's own rate,
// the first write of fresh pages apart), the best of seven passes, in GB/s of the file's bytes: Q4_K and Q5_K 8192 x
// 2048, Q6_K 2048 x 8192 (a 1.7B's gate and down products). docs/benchmarks-history.md, "The start-up on the Zen
// 3". From a checkout's root:
//
//     g++ -O3 -march=native -fopenmp -std=c++17 docs/bench/rows16_layout.cpp -o /tmp/rows16_layout
//     /tmp/rows16_layout
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "../../models/kernels/block_weights.h"

namespace {

template <typename L>
void measure(const char* name, int64_t in, int64_t rows) {
    if constexpr (!rows16_built<L>()) {
        std::printf("%s: this build does not multiply its layout\n", name);
    } else {
        std::vector<uint8_t> src(rows * L::From::row_bytes(in)), dst(rows * L::row_bytes(in));
        std::mt19937 random(1);
        for (auto& byte : src) byte = uint8_t(random());
        const int64_t from = L::ROWS * L::From::row_bytes(in), to = L::ROWS * L::row_bytes(in);
        double best = 1e9;
        for (int pass = 0; pass < 7; ++pass) {
            const auto start = std::chrono::steady_clock::now();
            for (int64_t k = 0; k < rows / L::ROWS; ++k)
                repack_rows16(L{}, src.data() + k * from, in, dst.data() + k * to);
            best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
        }
        std::printf("%s %lld x %lld: %.2f GB/s\n", name, (long long)rows, (long long)in, src.size() / best / 1e9);
    }
}

}  // namespace

int main() {
    measure<Q4KRows16>("Q4_K", 2048, 8192);
    measure<Q5KRows16>("Q5_K", 2048, 8192);
    measure<Q6KRows16>("Q6_K", 8192, 2048);
}
