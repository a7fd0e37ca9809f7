#pragma once
// Helpers shared by the CudaModel tests (cuda_*_test.cc): the GPU skip, the parity tolerance of
// GPU against CPU (or sparse against dense) rows, the reproducible prompts. Tests only.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "gtest/gtest.h"
#include "kvr/model/cuda_model.h"

#define SKIP_WITHOUT_GPU() \
  if (!kvr::model::CudaModelAvailable()) GTEST_SKIP() << "no CUDA device (or a CPU-only build)"

namespace kvr::model::cuda_test {

// A row passes when cosine >= kMinCosine and max |err| <= kMaxErrOverRms * rms(want).
inline constexpr double kMinCosine = 0.999;
inline constexpr double kMaxErrOverRms = 0.1;

struct RowError {
  double cosine = 1, max_err = 0, rms = 0;  // a non-finite `got`: cosine -1, max_err infinite
};

inline RowError Compare(std::span<const float> got, std::span<const float> want) {
  double dot = 0, gg = 0, ww = 0, max_err = 0;
  bool finite = true;
  for (size_t i = 0; i < want.size(); ++i) {
    finite = finite && std::isfinite(got[i]);
    dot += double{got[i]} * want[i];
    gg += double{got[i]} * got[i];
    ww += double{want[i]} * want[i];
    max_err = std::max(max_err, std::abs(double{got[i]} - want[i]));
  }
  RowError e;
  e.cosine = finite ? dot / std::sqrt(gg * ww + 1e-30) : -1;
  e.max_err = finite ? max_err : INFINITY;
  e.rms = std::sqrt(ww / want.size());
  return e;
}

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
