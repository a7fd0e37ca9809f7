#pragma once
// Test support for the CUDA parity tests (tests only; links GoogleTest): the skip without a
// device, host <-> device copies, poisoned outputs, the selection contract of id rows, tolerance
// compares, seeded inputs, and the measurements that tests/gpu_parity prints as one table.
// Header-only: every GPU test binary includes it instead of keeping its own copies.

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvr/common/cuda/cuda_util.h"

// Fails the current test (fatally) when an absl::Status expression is not OK.
#ifndef ASSERT_OK
#define ASSERT_OK(expr)                                  \
  do {                                                   \
    const absl::Status kvr_s_ = (expr);                  \
    ASSERT_TRUE(kvr_s_.ok()) << #expr << ": " << kvr_s_; \
  } while (false)
#endif

// Skips the current test without a CUDA device (a CPU machine, or a build without a driver).
#define KVR_SKIP_WITHOUT_GPU() \
  if (!kvr::cuda::HaveCudaDevice()) GTEST_SKIP() << "no CUDA device"

namespace kvr::cuda::testing {

// A fixture whose tests skip without a CUDA device.
class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override { KVR_SKIP_WITHOUT_GPU(); }
};

// Id and count outputs are memset to this byte before a launch: 0x7f7f7f7f per int32 is a count
// no kernel writes and an id outside every candidate range.
inline constexpr int kPoisonByte = 0x7f;
inline constexpr int32_t kPoison = 0x7f7f7f7f;
// 0xff bytes: NaN as float32, fp16 and bf16; -1 as int32; used for float outputs and scratch.
inline constexpr int kNanByte = 0xff;

// A device copy of `v` (at least one element, so that an empty input still has an address).
template <typename T>
DeviceBuffer<T> Upload(const std::vector<T>& v) {
  auto b = DeviceBuffer<T>::Create(std::max<size_t>(1, v.size()));
  EXPECT_TRUE(b.ok()) << b.status();
  if (!b.ok()) return DeviceBuffer<T>();
  if (!v.empty()) {
    EXPECT_EQ(cudaMemcpy(b->data(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  return std::move(*b);
}

// n elements of `b` from element `offset` on.
template <typename T>
std::vector<T> Download(const DeviceBuffer<T>& b, size_t n, size_t offset = 0) {
  std::vector<T> v(n);
  EXPECT_EQ(cudaMemcpy(v.data(), b.data() + offset, n * sizeof(T), cudaMemcpyDeviceToHost),
            cudaSuccess);
  return v;
}

// n elements (at least one) with every byte `byte`.
template <typename T>
DeviceBuffer<T> Poisoned(size_t n, int byte) {
  auto b = DeviceBuffer<T>::Create(std::max<size_t>(1, n));
  EXPECT_TRUE(b.ok()) << b.status();
  if (!b.ok()) return DeviceBuffer<T>();
  EXPECT_EQ(cudaMemset(b->data(), byte, b->bytes()), cudaSuccess);
  return std::move(*b);
}

// A kernel workspace of `bytes` (at least one), poisoned with `byte`.
inline DeviceBuffer<char> Scratch(size_t bytes, int byte = kNanByte) {
  return Poisoned<char>(bytes, byte);
}

// Launches `launch(p)` with a workspace of workspace_bytes(p) bytes poisoned with `byte` (set
// into p.workspace / p.workspace_bytes, freed on return) and waits for the device.
template <typename P>
void LaunchWithWorkspace(P& p, size_t (*workspace_bytes)(const P&),
                         absl::Status (*launch)(const P&, cudaStream_t), int byte = kNanByte) {
  auto ws = Scratch(workspace_bytes(p), byte);
  p.workspace = ws.data();
  p.workspace_bytes = ws.bytes();
  ASSERT_OK(launch(p, nullptr));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// ---- the selection contract -------------------------------------------------------------------

// Checks one output row of a selector: 0 <= count <= budget; ids[0, count) in [lo, hi),
// ascending and distinct; ids[count, budget) -1. Returns the ids (empty when count is invalid).
inline std::vector<int64_t> CheckIdRow(const int32_t* ids, int32_t count, int budget, int64_t lo,
                                       int64_t hi, const std::string& where) {
  std::vector<int64_t> out;
  EXPECT_GE(count, 0) << where;
  EXPECT_LE(count, budget) << where;
  if (count < 0 || count > budget) return out;
  for (int i = 0; i < count; ++i) {
    EXPECT_GE(ids[i], lo) << where << " slot " << i;
    EXPECT_LT(ids[i], hi) << where << " slot " << i;
    if (i > 0) {
      EXPECT_LT(ids[i - 1], ids[i]) << where << " not ascending/distinct at " << i;
    }
    out.push_back(ids[i]);
  }
  for (int i = count; i < budget; ++i) {
    EXPECT_EQ(ids[i], -1) << where << " padding slot " << i;
    if (ids[i] != -1) break;
  }
  return out;
}

// Agreement of selected sets with a reference over one sweep: rows with identical sets and the
// recall (selected reference ids / reference ids).
struct SetAgreement {
  int rows = 0, identical = 0;
  double hit = 0, total = 0;
  void Add(const std::vector<int64_t>& got, const std::vector<int64_t>& want) {
    ++rows;
    identical += got == want;
    std::set<int64_t> w(want.begin(), want.end());
    for (int64_t t : got) hit += static_cast<double>(w.count(t));
    total += static_cast<double>(want.size());
  }
  double recall() const { return total > 0 ? hit / total : 1.0; }
};

// ---- tolerance compares -----------------------------------------------------------------------

struct CloseResult {
  int64_t bad = 0;   // elements non-finite or outside rtol |want| + atol
  double worst = 0;  // max |got - want|
};

// Every element finite and |got - want| <= rtol |want| + atol; reports the first few misses.
inline CloseResult ExpectClose(const std::vector<float>& got, const std::vector<float>& want,
                               float rtol, float atol, const std::string& what) {
  CloseResult r;
  EXPECT_EQ(got.size(), want.size()) << what;
  if (got.size() != want.size()) {
    r.bad = static_cast<int64_t>(std::max(got.size(), want.size()));
    return r;
  }
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(double{got[i]} - want[i]);
    r.worst = std::max(r.worst, err);
    if (!std::isfinite(got[i]) || err > rtol * std::abs(want[i]) + atol) {
      if (++r.bad <= 5) {
        ADD_FAILURE() << what << ": element " << i << " got " << got[i] << " want " << want[i];
      }
    }
  }
  EXPECT_EQ(r.bad, 0) << what << ": " << r.bad << " of " << got.size() << " elements off, worst "
                      << r.worst;
  return r;
}

// Agreement of one row of floats with its reference as a direction and a size: the cosine and
// max |got - want| (for a tolerance relative to the reference's rms).
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

// ---- seeded inputs ----------------------------------------------------------------------------

// n floats uniform in [lo, hi), reproducible from `seed`.
inline std::vector<float> RandomUniform(size_t n, float lo, float hi, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Keys with topic structure from given topics [32, hd]: token t of KV head h is
// topics[(t / 40 + 7 h + salt) % 32] + 0.7 N(0, 1), the noise drawn with `nd` from `rng`;
// [n, nkv, hd] token-major.
inline std::vector<float> TopicKeysFrom(const std::vector<float>& topics, int n, int nkv, int hd,
                                        int salt, std::normal_distribution<float>& nd,
                                        std::mt19937& rng) {
  std::vector<float> keys(static_cast<size_t>(n) * nkv * hd);
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < nkv; ++h) {
      const int topic = (t / 40 + h * 7 + salt) % 32;
      for (int d = 0; d < hd; ++d)
        keys[(static_cast<size_t>(t) * nkv + h) * hd + d] = topics[topic * hd + d] + 0.7f * nd(rng);
    }
  return keys;
}

// Keys with topic structure (32 topics, 40-token runs, noise), so that attention scores spread
// like real keys': [n, nkv, hd] token-major. Draws the topics, then the noise, from `rng`.
inline std::vector<float> TopicKeys(int n, int nkv, int hd, std::mt19937& rng, int salt) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> topics(static_cast<size_t>(32) * hd);
  for (float& x : topics) x = nd(rng);
  return TopicKeysFrom(topics, n, nkv, hd, salt, nd, rng);
}

// ---- parity measurements ----------------------------------------------------------------------
// A test records its measurements as test properties ("parity_<i>": metric TAB value TAB bound
// TAB PASS|FAIL); tests/gpu_parity's listener prints them as one table at the end. Outside that
// binary they are plain gtest properties.

inline std::string FormatValue(double v) {
  char buf[32];
  if (v == std::floor(v) && std::abs(v) < 1e15) {
    std::snprintf(buf, sizeof(buf), "%.0f", v);
  } else {
    std::snprintf(buf, sizeof(buf), "%.4g", v);
  }
  return buf;
}

// Records one measurement of the current test; does not fail it (the test's own assertions do).
inline void RecordMeasure(const std::string& metric, double value, const std::string& bound,
                          bool ok) {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  if (info == nullptr) return;
  const int i = info->result()->test_property_count();
  ::testing::Test::RecordProperty(
      "parity_" + std::to_string(i),
      metric + "\t" + FormatValue(value) + "\t" + bound + "\t" + (ok ? "PASS" : "FAIL"));
}

// Records a measurement and fails the test when it is out of bound.
inline bool ExpectMeasure(const std::string& metric, double value, const std::string& bound,
                          bool ok) {
  RecordMeasure(metric, value, bound, ok);
  EXPECT_TRUE(ok) << metric << " = " << value << ", bound " << bound;
  return ok;
}
inline bool ExpectAtMost(const std::string& metric, double value, double max) {
  return ExpectMeasure(metric, value, "<= " + FormatValue(max), value <= max);
}
inline bool ExpectAtLeast(const std::string& metric, double value, double min) {
  return ExpectMeasure(metric, value, ">= " + FormatValue(min), value >= min);
}

}  // namespace kvr::cuda::testing
