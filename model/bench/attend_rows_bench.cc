// Time of CpuKernels::attend_rows (one decode token's attention over an f16 KV cache) on one
// thread, SmolLM2-135M's shape (3 KV heads of head_dim 64, 3 query heads each), over every
// layer's rows as a decode step reads them: `layers` layers of `context` rows each (30 layers:
// ~50 MB at 2300 rows, more than the last-level cache; 1 layer: the rows stay in cache).
// Prints the best of 15 repetitions of 10 steps: ms per step, ns per (row, query head).
//
//   model_attend_rows_bench CONTEXT [LAYERS]   (KVR_CPU_ISA caps the instruction set)

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kvr/model/cpu_kernels.h"

int main(int argc, char** argv) {
  using kvr::model::AttentionRows;
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s CONTEXT [LAYERS]\n", argv[0]);
    return 2;
  }
  const int64_t context = std::atoll(argv[1]);
  const int layers = argc > 2 ? std::atoi(argv[2]) : 30;
  constexpr int kKvHeads = 3, kHeadDim = 64, kGroup = 3;
  if (context < 1 || layers < 1) {
    std::fprintf(stderr, "CONTEXT and LAYERS must be >= 1\n");
    return 2;
  }
  const size_t n = static_cast<size_t>(layers) * context * kKvHeads * kHeadDim;
  std::vector<uint16_t> k(n), v(n);
  for (size_t i = 0; i < n; ++i) {
    // Half values in [1, 2): finite, varied, no denormals.
    k[i] = v[i] = static_cast<uint16_t>(0x3c00 ^ ((i * 2654435761u >> 22) & 0x3ff));
  }
  std::vector<float> q(kGroup * kHeadDim, 0.01f), m(kGroup), l(kGroup), acc(kGroup * kHeadDim);
  const kvr::model::CpuKernels& kernels = kvr::model::BestCpuKernels();
  double best = 1e30;
  for (int rep = 0; rep < 15; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int step = 0; step < 10; ++step) {
      for (int layer = 0; layer < layers; ++layer) {
        for (int h = 0; h < kKvHeads; ++h) {
          const size_t at = (static_cast<size_t>(layer) * context * kKvHeads + h) * kHeadDim;
          const AttentionRows rows{k.data() + at, v.data() + at, context, kKvHeads * kHeadDim,
                                   true};
          std::fill(m.begin(), m.end(), -1e30f);
          std::fill(l.begin(), l.end(), 0.f);
          std::fill(acc.begin(), acc.end(), 0.f);
          kernels.attend_rows(q.data(), kGroup, kHeadDim, 0.125f, rows, m.data(), l.data(),
                              acc.data());
        }
      }
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
                              .count());
  }
  const double step = best / 10;
  std::printf("%s: context %lld, %d layers: %.2f ms per step (1 thread), %.1f ns per row and "
              "query head\n",
              kvr::model::CpuIsaName(kernels.isa), static_cast<long long>(context), layers,
              step * 1e3, step / (static_cast<double>(layers) * kKvHeads * kGroup * context) * 1e9);
  return 0;
}
