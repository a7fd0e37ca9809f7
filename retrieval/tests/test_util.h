#pragma once
// Helpers for the retrieval tests: the core methods' registry, small random tensors and an
// index factory.

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "gtest/gtest.h"
#include "kvr/retrieval/index.h"
#include "kvr/retrieval/registry.h"

namespace kvr::retrieval::testing {

// A registry of the core methods (RegisterCoreMethods).
inline MethodRegistry CoreRegistry() {
  MethodRegistry r;
  EXPECT_TRUE(RegisterCoreMethods(r).ok());
  return r;
}

inline IndexShape SmallShape() {
  IndexShape s;
  s.n_heads = 4;
  s.n_kv_heads = 2;
  s.head_dim = 16;
  s.layer = 0;
  s.n_layers = 1;
  return s;
}

// [n, heads, dim] Gaussian values.
inline std::vector<float> RandomTensor(int64_t n, int heads, int dim, uint64_t seed,
                                       float stddev = 1.f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, stddev);
  std::vector<float> v(n * heads * dim);
  for (float& x : v) x = nd(rng);
  return v;
}

inline TokenTensor View(const std::vector<float>& v, int heads, int dim, int64_t first = 0,
                        int64_t count = -1) {
  TokenTensor t;
  const int64_t row = static_cast<int64_t>(heads) * dim;
  t.data = v.data() + first * row;
  t.n_tokens = count >= 0 ? count : static_cast<int64_t>(v.size()) / row - first;
  t.row_stride = row;
  return t;
}

// `status` is INVALID_ARGUMENT and its message contains `part`.
inline void ExpectInvalidArgument(const absl::Status& status, absl::string_view part) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find(part), absl::string_view::npos) << status;
}

// What a method's typed state accessor (CtkvrStateOf, KeyDiffStateOf, ...) answers for an index
// of another method `other`: InvalidArgument naming that method.
inline void ExpectOtherMethodRefused(const absl::Status& status, absl::string_view other) {
  ExpectInvalidArgument(status, absl::StrCat("'", other, "'"));
}

}  // namespace kvr::retrieval::testing
