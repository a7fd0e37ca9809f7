// The pre-split 3xTF32 assignment kernel (ArgmaxGemmTcSplitKernel, argmax_gemm.cuh: points split
// into tf32 halves once per CTA, centres split by their writer, cp.async double-buffered) against
// the 3xTF32 kernel that splits inside its k loop (ArgmaxGemmTcKernel): ids, best distances and
// `changed` flags must be BIT-equal (the same mma chain over the same fragment values). Shapes:
// head_dim 64 / 128, cosine and bias scores, point counts and centre counts that are not multiples
// of the 128 x 128 tile (one row with more than one centre tile, one with 5 centres), a skipped
// row, exact ties (duplicated centres, points equal to centres: lowest id must win in both).
// Not a CPU reference: the in-loop-split kernel is the reference, itself checked against the CPU
// by the ClusterKvBuild rows.

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "argmax_gemm.cuh"
#include "kvr/common/cuda/cuda_util.h"
#include "kvr/common/gpu_testing.h"
#include "parity.h"

namespace kvr::retrieval::cuda::build_internal {
namespace {

using kvr::cuda::DeviceBuffer;
using kvr::cuda::testing::Download;
using kvr::cuda::testing::RecordMeasure;
using kvr::cuda::testing::Upload;

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

  const DeviceBuffer<float> c_buf = Upload(c), x_buf = Upload(x), bias_buf = Upload(bias);
  const DeviceBuffer<int32_t> np_buf = Upload(n_points), nc_buf = Upload(n_c),
                              skip_buf = Upload(skip);
  const DeviceBuffer<float> copy_buf = Upload(std::vector<float>(c.size(), 0.f));
  const DeviceBuffer<uint32_t> big_buf = Upload(std::vector<uint32_t>(c.size(), 0u)),
                               small_buf = Upload(std::vector<uint32_t>(c.size(), 0u));
  float* d_c = c_buf.data();
  float* d_x = x_buf.data();
  float* d_bias = bias_buf.data();
  int32_t* d_np = np_buf.data();
  int32_t* d_nc = nc_buf.data();
  int32_t* d_skip = skip_buf.data();
  float* d_copy = copy_buf.data();
  uint32_t* d_big = big_buf.data();
  uint32_t* d_small = small_buf.data();
  SplitAll<<<static_cast<int>((c.size() + 255) / 256), 256>>>(d_c, static_cast<int64_t>(c.size()),
                                                              d_copy, d_big, d_small);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  // The writer's copy of the centres is the centres.
  ASSERT_EQ(Download(copy_buf, c.size()), c);

  struct Out {
    DeviceBuffer<int32_t> ids;
    DeviceBuffer<float> dist;
    DeviceBuffer<int32_t> changed;
  };
  auto run = [&](bool split) {
    Out o{Upload(old_ids), Upload(std::vector<float>(old_ids.size(), -7.f)),
          Upload(std::vector<int32_t>(kRows, 0))};
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
    a.ids = o.ids.data();
    a.out_row_stride = kMaxPoints;
    a.best_dist = kCosine ? o.dist.data() : nullptr;
    a.changed = o.changed.data();
    const cudaError_t e = split
                              ? LaunchArgmaxGemmTcSplit<D, kCosine, int32_t>(a, kMaxPoints, nullptr)
                              : LaunchArgmaxGemmTc<D, kCosine, int32_t>(a, kMaxPoints, nullptr);
    EXPECT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return o;
  };
  const Out ref = run(false), got = run(true);
  const auto ref_ids = Download(ref.ids, old_ids.size()),
             got_ids = Download(got.ids, old_ids.size());
  const auto ref_d = Download(ref.dist, old_ids.size()), got_d = Download(got.dist, old_ids.size());
  const auto ref_ch = Download(ref.changed, kRows), got_ch = Download(got.changed, kRows);
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
  RecordMeasure("ids and distances bit-equal", static_cast<double>(checked), "all", true);
  if (kCosine)
    RecordMeasure("exact ties to the lower id", static_cast<double>(ties), "> 10", ties > 10);
}

}  // namespace
}  // namespace kvr::retrieval::cuda::build_internal

namespace kvr::gpu_parity {

std::vector<ParityRow> AssignRows() {
  using namespace kvr::retrieval::cuda::build_internal;
  const char* ref = "ArgmaxGemmTcKernel (3xTF32 split in the k loop)";
  const char* cmp = "ids, distances, changed bit-equal; ties to the lower id";
  return {
      {"ArgmaxGemmTcSplit", "d64 cosine rows 1000/777/517 centres 300/64/5", ref, cmp,
       [] { Compare<64, true>(); }},
      {"ArgmaxGemmTcSplit", "d128 cosine rows 1000/777/517 centres 300/64/5", ref, cmp,
       [] { Compare<128, true>(); }},
      {"ArgmaxGemmTcSplit", "d64 bias rows 1000/777/517 centres 300/64/5", ref, cmp,
       [] { Compare<64, false>(); }},
      {"ArgmaxGemmTcSplit", "d128 bias rows 1000/777/517 centres 300/64/5", ref, cmp,
       [] { Compare<128, false>(); }},
  };
}

}  // namespace kvr::gpu_parity
