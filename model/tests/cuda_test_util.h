#pragma once
// Helpers shared by the CudaModel tests (cuda_*_test.cc): the GPU skip, the parity tolerance of
// GPU against CPU (or sparse against dense) rows, the reproducible prompts. Tests only; the
// generic GPU test support (row compare, device copies) is kvr/common/gpu_testing.h.

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "kvr/common/gpu_testing.h"
#include "kvr/model/cuda_model.h"

#define SKIP_WITHOUT_GPU() \
  if (!kvr::model::CudaModelAvailable()) GTEST_SKIP() << "no CUDA device (or a CPU-only build)"

namespace kvr::model::cuda_test {

// A row passes when cosine >= kMinCosine and max |err| <= kMaxErrOverRms * rms(want).
inline constexpr double kMinCosine = 0.999;
inline constexpr double kMaxErrOverRms = 0.1;

using kvr::cuda::testing::Compare;
using kvr::cuda::testing::RowError;

// n token ids in [0, vocab), reproducible from `seed` (an LCG's high bits).
inline std::vector<int32_t> Tokens(int n, int vocab, uint64_t seed) {
  std::vector<int32_t> t(n);
  uint64_t x = seed;
  for (int32_t& v : t) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    v = static_cast<int32_t>((x >> 33) % static_cast<uint64_t>(vocab));
  }
  return t;
}

}  // namespace kvr::model::cuda_test
