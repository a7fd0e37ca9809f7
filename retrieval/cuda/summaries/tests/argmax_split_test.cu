// The pre-split 3xTF32 assignment kernel (ArgmaxGemmTcSplitKernel, argmax_gemm.cuh: points split
// into tf32 halves once per CTA, centres split by their writer, cp.async double-buffered) against
// the 3xTF32 kernel that splits inside its k loop (ArgmaxGemmTcKernel): ids, best distances and
// `changed` flags must be BIT-equal (the same mma chain over the same fragment values). Shapes:
// head_dim 64 / 128, cosine and bias scores, point counts and centre counts that are not multiples
// of the 128 x 128 tile (one row with more than one centre tile, one with 5 centres), a skipped
// row, exact ties (duplicated centres, points equal to centres: lowest id must win in both).
// Label `gpu`: skips without a device.

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../argmax_gemm.cuh"
#include "kvr/common/cuda/cuda_util.h"

namespace kvr::retrieval::cuda::build_internal {
namespace {

template <typename T>
T* DeviceCopy(const std::vector<T>& v) {
  T* p = nullptr;
  EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(1, v.size()) * sizeof(T)),
            cudaSuccess);
  if (!v.empty()) {
    EXPECT_EQ(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  return p;
}

template <typename T>
std::vector<T> HostCopy(const T* p, size_t n) {
  std::vector<T> v(n);
  EXPECT_EQ(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}

__global__ void SplitAll(const float* c, int64_t n, float* copy, uint32_t* big, uint32_t* small) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) StoreSplitTf32(c[i], copy, big, small, i);
}

template <int D, bool kCosine>
void Compare() {
  const std::string where = std::string("D=") + std::to_string(D) + (kCosine ? " cosine" : " bias");
  SCOPED_TRACE(where);
  constexpr int kRows = 3, kMaxPoints = 1000, kMaxC = 300;
  const std::vector<int32_t> n_points = {1000, 777, 517};
  const std::vector<int32_t> n_c = {300, 64, 5};
  const std::vector<int32_t> skip = {0, 1, 0};
  std::mt19937 rng(1234 + D + kCosine);
  std::normal_distribution<float> nd(0.f, 1.f);
  auto unit = [&](float* v) {
    double ss = 0;
    for (int j = 0; j < D; ++j) ss += static_cast<double>(v[j]) * v[j];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss));
    for (int j = 0; j < D; ++j) v[j] *= inv;
  };
  std::vector<float> c(static_cast<size_t>(kRows) * kMaxC * D),
      x(static_cast<size_t>(kRows) * kMaxPoints * D);
  std::vector<float> bias(static_cast<size_t>(kRows) * kMaxC);
  for (float& v : c) v = nd(rng);
  for (float& v : x) v = nd(rng);
  for (int r = 0; r < kRows; ++r) {
    float* cr = c.data() + static_cast<size_t>(r) * kMaxC * D;
    for (int j = 0; j < kMaxC; ++j) {
      unit(cr + static_cast<size_t>(j) * D);
      // Every 7th centre duplicates the one before it (exact ties between ids j-1 and j, which
      // may sit in different warps or centre tiles: j = 129 crosses the first tile).
      if (j % 7 == 0 && j > 0) std::memcpy(cr + j * D, cr + (j - 1) * D, D * sizeof(float));
      if (j == 128) std::memcpy(cr + j * D, cr + 3 * D, D * sizeof(float));
      bias[static_cast<size_t>(r) * kMaxC + j] = kCosine ? 0.f : 0.5f * nd(rng);
    }
    if (!kCosine)
      bias[static_cast<size_t>(r) * kMaxC + 128] = bias[static_cast<size_t>(r) * kMaxC + 3];
    float* xr = x.data() + static_cast<size_t>(r) * kMaxPoints * D;
    for (int i = 0; i < kMaxPoints; ++i) {
      unit(xr + static_cast<size_t>(i) * D);
      // Every 5th point is a centre (a duplicated one every 35th): exact maxima and ties.
      if (i % 5 == 0) {
        const int j = (i / 5) % n_c[r];
        std::memcpy(xr + static_cast<size_t>(i) * D, cr + static_cast<size_t>(j) * D,
                    D * sizeof(float));
      }
    }
  }
  std::vector<int32_t> old_ids(static_cast<size_t>(kRows) * kMaxPoints);
  for (size_t i = 0; i < old_ids.size(); ++i) old_ids[i] = static_cast<int32_t>(i % 11);

  float* d_c = DeviceCopy(c);
  float* d_x = DeviceCopy(x);
  float* d_bias = DeviceCopy(bias);
  int32_t* d_np = DeviceCopy(n_points);
  int32_t* d_nc = DeviceCopy(n_c);
  int32_t* d_skip = DeviceCopy(skip);
  float* d_copy = DeviceCopy(std::vector<float>(c.size(), 0.f));
  uint32_t* d_big = DeviceCopy(std::vector<uint32_t>(c.size(), 0u));
  uint32_t* d_small = DeviceCopy(std::vector<uint32_t>(c.size(), 0u));
  SplitAll<<<static_cast<int>((c.size() + 255) / 256), 256>>>(d_c, static_cast<int64_t>(c.size()),
                                                              d_copy, d_big, d_small);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  // The writer's copy of the centres is the centres.
  ASSERT_EQ(HostCopy(d_copy, c.size()), c);

  struct Out {
    int32_t* ids;
    float* dist;
    int32_t* changed;
  };
  auto run = [&](bool split) {
    Out o{DeviceCopy(old_ids), DeviceCopy(std::vector<float>(old_ids.size(), -7.f)),
          DeviceCopy(std::vector<int32_t>(kRows, 0))};
    ArgmaxGemmArgs a;
    a.rows = kRows;
    a.x = d_x;
    a.x_row_stride = static_cast<int64_t>(kMaxPoints) * D;
    a.n_points = d_np;
    a.c = split ? nullptr : d_c;  // the split kernel reads only the halves
    a.c_big = split ? d_big : nullptr;
    a.c_small = split ? d_small : nullptr;
    a.c_row_stride = static_cast<int64_t>(kMaxC) * D;
    a.c_mod = kRows;
    a.n_c = d_nc;
    a.bias = d_bias;
    a.bias_row_stride = kMaxC;
    a.skip = d_skip;
    a.ids = o.ids;
    a.out_row_stride = kMaxPoints;
    a.best_dist = kCosine ? o.dist : nullptr;
    a.changed = o.changed;
    const cudaError_t e = split
                              ? LaunchArgmaxGemmTcSplit<D, kCosine, int32_t>(a, kMaxPoints, nullptr)
                              : LaunchArgmaxGemmTc<D, kCosine, int32_t>(a, kMaxPoints, nullptr);
    EXPECT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return o;
  };
  const Out ref = run(false), got = run(true);
  const auto ref_ids = HostCopy(ref.ids, old_ids.size()),
             got_ids = HostCopy(got.ids, old_ids.size());
  const auto ref_d = HostCopy(ref.dist, old_ids.size()), got_d = HostCopy(got.dist, old_ids.size());
  const auto ref_ch = HostCopy(ref.changed, kRows), got_ch = HostCopy(got.changed, kRows);
  int64_t checked = 0, ties = 0;
  for (int r = 0; r < kRows; ++r) {
    for (int i = 0; i < kMaxPoints; ++i) {
      const size_t k = static_cast<size_t>(r) * kMaxPoints + i;
      ASSERT_EQ(got_ids[k], ref_ids[k]) << where << " row " << r << " point " << i;
      uint32_t gb, rb;
      std::memcpy(&gb, &got_d[k], 4);
      std::memcpy(&rb, &ref_d[k], 4);
      ASSERT_EQ(gb, rb) << where << " row " << r << " point " << i << " " << got_d[k] << " vs "
                        << ref_d[k];
      if (skip[r] != 0 || i >= n_points[r]) {
        ASSERT_EQ(got_ids[k], old_ids[k]) << "untouched: row " << r << " point " << i;
        continue;
      }
      ASSERT_GE(got_ids[k], 0);
      ASSERT_LT(got_ids[k], n_c[r]);
      ++checked;
      // A point equal to a duplicated centre: the lower id of the pair won.
      const int j = (i / 5) % n_c[r];
      if (i % 5 == 0 && kCosine && j % 7 == 0 && j > 0) {
        ++ties;
        EXPECT_LE(got_ids[k], j - 1) << "tie not to the lowest id: row " << r << " point " << i;
      }
    }
  }
  EXPECT_EQ(got_ch, ref_ch);
  EXPECT_EQ(got_ch[0], 1);  // old ids i % 11 cannot all survive
  EXPECT_EQ(got_ch[1], 0);  // skipped
  EXPECT_GT(checked, 1000);
  if (kCosine) EXPECT_GT(ties, 10);
  std::printf(
      "[ clusterkv] pre-split assign %s: %lld ids and distances bit-equal, %lld exact ties\n",
      where.c_str(), static_cast<long long>(checked), static_cast<long long>(ties));
  for (void* p :
       {static_cast<void*>(d_c), static_cast<void*>(d_x), static_cast<void*>(d_bias),
        static_cast<void*>(d_np), static_cast<void*>(d_nc), static_cast<void*>(d_skip),
        static_cast<void*>(d_copy), static_cast<void*>(d_big), static_cast<void*>(d_small),
        static_cast<void*>(ref.ids), static_cast<void*>(ref.dist), static_cast<void*>(ref.changed),
        static_cast<void*>(got.ids), static_cast<void*>(got.dist),
        static_cast<void*>(got.changed)}) {
    cudaFree(p);
  }
}

class ArgmaxSplit : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!kvr::cuda::HaveCudaDevice()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(ArgmaxSplit, ClusterKvPreSplitBitEqualD64Cosine) { Compare<64, true>(); }
TEST_F(ArgmaxSplit, ClusterKvPreSplitBitEqualD128Cosine) { Compare<128, true>(); }
TEST_F(ArgmaxSplit, ClusterKvPreSplitBitEqualD64Bias) { Compare<64, false>(); }
TEST_F(ArgmaxSplit, ClusterKvPreSplitBitEqualD128Bias) { Compare<128, false>(); }

}  // namespace
}  // namespace kvr::retrieval::cuda::build_internal
