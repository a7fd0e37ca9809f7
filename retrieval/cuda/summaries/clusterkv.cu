// ClusterKvBuild: batched cosine k-means over (sequence, KV head) rows and the cluster-sorted
// layout of the GPU clusterkv selector (build.cuh). Step by step as kvr::retrieval::KMeans
// (ops.cc) and ClusterKvIndex::AddClusters (clusterkv.cc):
//   normalise points -> initial centroids = the plan's points ->
//   per iteration: assign (fused GEMM + argmax, argmax_gemm.cuh; with 3xTF32 the centroids'
//   tf32 halves are written by whichever kernel writes the centroid, so the assignment only
//   loads them: ArgmaxGemmTcSplitKernel) -> stop rows whose assignment
//   did not change (after the first iteration) -> group points by cluster (stable radix sort of
//   (row, cluster) keys, so members stay in token order) -> new centroids = fp64 mean of the
//   members' unit keys, normalised; empty clusters re-seeded in id order with the point farthest
//   from its centroid
//   -> final grouping -> drop empty clusters -> centroid = fp64 mean of the raw member keys.
// Rows never wait for each other on the host: a row's "done" flag lives on the device and every
// kernel of a finished row returns at once, so the whole build is one asynchronous sequence.

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <bit>

#include "argmax_gemm.cuh"
#include "build_common.cuh"
#include "kvr/common/status.h"

namespace kvr::retrieval::cuda {
namespace {

using build_internal::ArgmaxGemmArgs;
using build_internal::Carver;
using build_internal::Invalid;
using build_internal::KeyBase;
using build_internal::LaunchStatus;
using build_internal::LoadKey;
using build_internal::StoreSplitTf32;

// Workspace pieces (one layout for sizing and for the launch).
struct Work {
  float* x = nullptr;           // [rows, max_points, D] unit keys
  float* best_dist = nullptr;   // [rows, max_points]
  int32_t* assign = nullptr;    // [rows, max_points] (the caller's when given)
  float* unit = nullptr;        // [rows, K, D] (the caller's when given)
  uint32_t* unit_big = nullptr;    // [rows, K, D] tf32 halves of unit (3xTF32 only, else null)
  uint32_t* unit_small = nullptr;
  int32_t* counts = nullptr;    // [rows * K]
  int32_t* starts = nullptr;    // [rows * K] exclusive scan of counts
  int32_t* new_id = nullptr;    // [rows * K] compacted cluster id or -1
  uint32_t* keys_in = nullptr;  // [rows * max_points]
  uint32_t* keys_out = nullptr;
  int32_t* vals_in = nullptr;
  int32_t* vals_out = nullptr;
  int32_t* changed = nullptr;  // [rows]
  int32_t* done = nullptr;     // [rows]
  void* cub_temp = nullptr;
  size_t cub_bytes = 0;
};

int SortEndBit(int64_t rows, int64_t k) {
  return std::max(1, static_cast<int>(std::bit_width(static_cast<uint64_t>(rows * k))));
}

size_t CubBytes(int64_t rows, int64_t max_points, int64_t k) {
  size_t sort_bytes = 0, scan_bytes = 0;
  const int64_t items = rows * max_points;
  cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<const uint32_t*>(nullptr),
                                  static_cast<uint32_t*>(nullptr),
                                  static_cast<const int32_t*>(nullptr),
                                  static_cast<int32_t*>(nullptr), items, 0, SortEndBit(rows, k));
  cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, static_cast<const int32_t*>(nullptr),
                                static_cast<int32_t*>(nullptr), rows * k);
  return std::max<size_t>(std::max(sort_bytes, scan_bytes), 1);
}

Work Carve(const ClusterKvBuildParams& p, void* base) {
  const int64_t rows = static_cast<int64_t>(p.batch) * p.n_kv_heads;
  const int64_t items = rows * p.max_points, ck = rows * p.max_clusters;
  Carver c(base);
  Work w;
  w.x = c.Take<float>(items * p.head_dim);
  w.best_dist = c.Take<float>(items);
  w.assign = c.Take<int32_t>(items);
  w.unit = c.Take<float>(ck * p.head_dim);
  if (p.math == AssignMath::k3xTf32) {
    w.unit_big = c.Take<uint32_t>(ck * p.head_dim);
    w.unit_small = c.Take<uint32_t>(ck * p.head_dim);
  }
  w.counts = c.Take<int32_t>(ck);
  w.starts = c.Take<int32_t>(ck);
  w.new_id = c.Take<int32_t>(ck);
  w.keys_in = c.Take<uint32_t>(items);
  w.keys_out = c.Take<uint32_t>(items);
  w.vals_in = c.Take<int32_t>(items);
  w.vals_out = c.Take<int32_t>(items);
  w.changed = c.Take<int32_t>(rows);
  w.done = c.Take<int32_t>(rows);
  w.cub_bytes = CubBytes(rows, p.max_points, p.max_clusters);
  w.cub_temp = c.TakeBytes(w.cub_bytes);
  if (base == nullptr) w.cub_bytes = c.used();  // sizing: total bytes
  return w;
}

// Unit keys: x[r, i] = key(b, h, first_token[b] + i) / |key| (KMeans' NormaliseRow: v * (1/|v|),
// unchanged when |v| = 0). One warp per point.
template <typename T, int D>
__global__ void __launch_bounds__(256)
    NormaliseKernel(ClusterKvBuildParams p, float* __restrict__ x) {
  constexpr int kPer = D / 32;
  const int row = blockIdx.y;
  const int b = row / p.n_kv_heads, h = row % p.n_kv_heads;
  const int i = blockIdx.x * 8 + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (i >= p.n_points[row]) return;
  const int64_t base = KeyBase(p.keys, b, h, p.n_kv_heads) +
                       static_cast<int64_t>(p.first_token[b] + i) * p.keys.token_stride;
  float v[kPer];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    v[j] = LoadKey<T>(p.keys.data, base + lane * kPer + j);
    ss = fmaf(v[j], v[j], ss);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const float norm = sqrtf(ss);
  const float inv = norm > 0.f ? 1.f / norm : 1.f;
  float* out = x + (static_cast<int64_t>(row) * p.max_points + i) * D + lane * kPer;
#pragma unroll
  for (int j = 0; j < kPer; ++j) out[j] = norm > 0.f ? v[j] * inv : v[j];
}

// unit[r, c] = x[r, init_points[r, c]]; assignment reset to -1 (KMeans: assignment(n, -1)).
template <int D>
__global__ void InitKernel(ClusterKvBuildParams p, const float* __restrict__ x,
                           float* __restrict__ unit, uint32_t* __restrict__ unit_big,
                           uint32_t* __restrict__ unit_small, int32_t* __restrict__ assign,
                           int32_t* __restrict__ changed, int32_t* __restrict__ done) {
  const int row = blockIdx.x;
  const int k = p.n_init[row];
  if (threadIdx.x == 0) {
    changed[row] = 0;
    done[row] = p.n_points[row] <= 0 || k <= 0;
  }
  for (int idx = threadIdx.x; idx < k * D; idx += blockDim.x) {
    const int c = idx / D, d = idx % D;
    const int src = p.init_points[static_cast<int64_t>(row) * p.max_clusters + c];
    StoreSplitTf32(x[(static_cast<int64_t>(row) * p.max_points + src) * D + d], unit, unit_big,
                   unit_small, (static_cast<int64_t>(row) * p.max_clusters + c) * D + d);
  }
  for (int i = threadIdx.x; i < p.max_points; i += blockDim.x) {
    assign[static_cast<int64_t>(row) * p.max_points + i] = -1;
  }
}

// After an assignment pass: KMeans' `if (!changed && it > 0) break;` per row.
__global__ void ControlKernel(int rows, int it, int32_t* __restrict__ changed,
                              int32_t* __restrict__ done) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  if (!done[r] && !changed[r] && it > 0) done[r] = 1;
  changed[r] = 0;
}

// Sort input: key (row, cluster), value point index; padding points sort last. Also counts.
__global__ void SortPrepKernel(ClusterKvBuildParams p, int rows, const int32_t* __restrict__ assign,
                               uint32_t* __restrict__ keys, int32_t* __restrict__ vals,
                               int32_t* __restrict__ counts) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t items = static_cast<int64_t>(rows) * p.max_points;
  if (idx >= items) return;
  const int row = static_cast<int>(idx / p.max_points);
  const int i = static_cast<int>(idx % p.max_points);
  const int a = i < p.n_points[row] ? assign[idx] : -1;
  if (a >= 0) {
    const uint32_t key = static_cast<uint32_t>(row) * p.max_clusters + a;
    keys[idx] = key;
    atomicAdd(counts + key, 1);
  } else {
    keys[idx] = static_cast<uint32_t>(rows) * p.max_clusters;
  }
  vals[idx] = i;
}

// New unit centroid of one non-empty cluster: fp64 mean of its members' unit keys (members in
// token order, as the CPU's sums), rounded to fp32, normalised. One warp per (row, cluster).
template <int D>
__global__ void __launch_bounds__(256)
    UpdateKernel(ClusterKvBuildParams p, int rows, const float* __restrict__ x,
                 const int32_t* __restrict__ counts, const int32_t* __restrict__ starts,
                 const int32_t* __restrict__ sorted_points, const int32_t* __restrict__ done,
                 float* __restrict__ unit, uint32_t* __restrict__ unit_big,
                 uint32_t* __restrict__ unit_small) {
  constexpr int kPer = D / 32;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * 8 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (w >= static_cast<int64_t>(rows) * p.max_clusters) return;
  const int row = static_cast<int>(w / p.max_clusters);
  const int c = static_cast<int>(w % p.max_clusters);
  if (done[row] || c >= p.n_init[row]) return;
  const int count = counts[w];
  if (count == 0) return;  // ReseedKernel
  const int start = starts[w];
  double s[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) s[j] = 0.0;
  const float* xr = x + static_cast<int64_t>(row) * p.max_points * D + lane * kPer;
  // Member ids fetched 32 at a time (one per lane) and broadcast, so the point loads of
  // consecutive members do not wait on each other's id load; the sum stays in member order.
  for (int m0 = 0; m0 < count; m0 += 32) {
    const int mine = m0 + lane < count ? sorted_points[start + m0 + lane] : 0;
    const int cnt = min(32, count - m0);
#pragma unroll 4
    for (int m = 0; m < cnt; ++m) {
      const float* pt = xr + static_cast<int64_t>(__shfl_sync(0xffffffffu, mine, m)) * D;
#pragma unroll
      for (int j = 0; j < kPer; ++j) s[j] += pt[j];
    }
  }
  float v[kPer];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    v[j] = static_cast<float>(s[j] / count);
    ss = fmaf(v[j], v[j], ss);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const float norm = sqrtf(ss);
  const int64_t out = w * D + lane * kPer;
  const float inv = norm > 0.f ? 1.f / norm : 1.f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    StoreSplitTf32(norm > 0.f ? v[j] * inv : v[j], unit, unit_big, unit_small, out + j);
  }
}

// Empty clusters, in id order: the point with the largest best distance (first on ties) becomes
// the centroid and its distance is zeroed (KMeans). One CTA per row.
template <int D>
__global__ void __launch_bounds__(256)
    ReseedKernel(ClusterKvBuildParams p, const float* __restrict__ x,
                 const int32_t* __restrict__ counts, const int32_t* __restrict__ done,
                 float* __restrict__ best_dist, float* __restrict__ unit,
                 uint32_t* __restrict__ unit_big, uint32_t* __restrict__ unit_small) {
  using Reduce = cub::BlockReduce<float2, 256>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ int far_s;
  const int row = blockIdx.x;
  if (done[row]) return;
  const int k = p.n_init[row], n = p.n_points[row];
  float* bd = best_dist + static_cast<int64_t>(row) * p.max_points;
  for (int c = 0; c < k; ++c) {
    if (counts[static_cast<int64_t>(row) * p.max_clusters + c] != 0) continue;
    // (distance, -index) pairs: max distance, then lowest index. Index as float is exact below
    // 2^24 points per row.
    float2 best = make_float2(-INFINITY, 0.f);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const float d = bd[i];
      if (d > best.x || (d == best.x && -static_cast<float>(i) > best.y)) {
        best = make_float2(d, -static_cast<float>(i));
      }
    }
    const float2 r = Reduce(tmp).Reduce(
        best, [](float2 a, float2 b) { return (b.x > a.x || (b.x == a.x && b.y > a.y)) ? b : a; });
    if (threadIdx.x == 0) {
      const int far = r.x == -INFINITY ? 0 : static_cast<int>(-r.y);
      far_s = far;
      bd[far] = 0.f;
    }
    __syncthreads();
    const int far = far_s;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
      StoreSplitTf32(x[(static_cast<int64_t>(row) * p.max_points + far) * D + d], unit, unit_big,
                     unit_small, (static_cast<int64_t>(row) * p.max_clusters + c) * D + d);
    }
    __syncthreads();
  }
}

// Drops empty clusters: new ids in order, n_clusters, offsets. One CTA (1024) per row.
__global__ void __launch_bounds__(1024)
    CompactKernel(ClusterKvBuildParams p, const int32_t* __restrict__ counts,
                  const int32_t* __restrict__ starts, int32_t* __restrict__ new_id) {
  using Scan = cub::BlockScan<int, 1024>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ int carry_s;
  const int row = blockIdx.x;
  const int k = p.n_init[row], n = p.n_points[row];
  const int64_t ck = static_cast<int64_t>(row) * p.max_clusters;
  const int row_start = starts[ck];
  int32_t* offsets = p.offsets + static_cast<int64_t>(row) * (p.max_clusters + 1);
  if (threadIdx.x == 0) carry_s = 0;
  __syncthreads();
  for (int c0 = 0; c0 < p.max_clusters; c0 += 1024) {
    const int c = c0 + threadIdx.x;
    const bool keep = c < k && counts[ck + c] > 0;
    int pos = 0, total = 0;
    Scan(tmp).ExclusiveSum(keep ? 1 : 0, pos, total);
    const int carry = carry_s;
    if (c < p.max_clusters) new_id[ck + c] = keep ? carry + pos : -1;
    if (keep) offsets[carry + pos] = starts[ck + c] - row_start;
    __syncthreads();
    if (threadIdx.x == 0) carry_s = carry + total;
    __syncthreads();
  }
  const int nc = carry_s;
  for (int j = nc + threadIdx.x; j <= p.max_clusters; j += blockDim.x) offsets[j] = max(n, 0);
  if (threadIdx.x == 0) p.n_clusters[row] = nc;
}

// members[r, i] = token id of the i-th point in cluster order; -1 padding.
__global__ void MembersKernel(ClusterKvBuildParams p, int rows, const int32_t* __restrict__ starts,
                              const int32_t* __restrict__ sorted_points) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<int64_t>(rows) * p.max_points) return;
  const int row = static_cast<int>(idx / p.max_points);
  const int i = static_cast<int>(idx % p.max_points);
  const int b = row / p.n_kv_heads;
  int32_t v = -1;
  if (i < p.n_points[row]) {
    v = p.first_token[b] + sorted_points[starts[static_cast<int64_t>(row) * p.max_clusters] + i];
  }
  p.members[idx] = v;
}

// Summary centroid of a kept cluster: fp64 mean of the RAW member keys, as AddClusters.
template <typename T, int D>
__global__ void __launch_bounds__(256)
    MeanKernel(ClusterKvBuildParams p, int rows, const int32_t* __restrict__ counts,
               const int32_t* __restrict__ starts, const int32_t* __restrict__ sorted_points,
               const int32_t* __restrict__ new_id) {
  constexpr int kPer = D / 32;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * 8 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (w >= static_cast<int64_t>(rows) * p.max_clusters) return;
  const int row = static_cast<int>(w / p.max_clusters);
  const int id = new_id[w];
  if (id < 0) return;  // dropped or unused cluster (ZeroPadKernel zeroes the row's tail)
  float* out_row = p.centroids + static_cast<int64_t>(row) * p.max_clusters * D;
  const int b = row / p.n_kv_heads, h = row % p.n_kv_heads;
  const int count = counts[w], start = starts[w];
  const int64_t base = KeyBase(p.keys, b, h, p.n_kv_heads) + lane * kPer;
  double s[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) s[j] = 0.0;
  const int first = p.first_token[b];
  for (int m0 = 0; m0 < count; m0 += 32) {
    const int mine = m0 + lane < count ? sorted_points[start + m0 + lane] : 0;
    const int cnt = min(32, count - m0);
#pragma unroll 4
    for (int m = 0; m < cnt; ++m) {
      const int64_t t = first + __shfl_sync(0xffffffffu, mine, m);
      const int64_t off = base + t * p.keys.token_stride;
#pragma unroll
      for (int j = 0; j < kPer; ++j) s[j] += static_cast<double>(LoadKey<T>(p.keys.data, off + j));
    }
  }
  float* out = out_row + static_cast<int64_t>(id) * D + lane * kPer;
#pragma unroll
  for (int j = 0; j < kPer; ++j) out[j] = static_cast<float>(s[j] / count);
}

// Centroid slots [n_clusters, max_clusters) of every row are zero.
template <int D>
__global__ void ZeroPadKernel(ClusterKvBuildParams p) {
  const int row = blockIdx.x;
  const int nc = p.n_clusters[row];
  float* out = p.centroids + static_cast<int64_t>(row) * p.max_clusters * D;
  for (int64_t i = static_cast<int64_t>(nc) * D + threadIdx.x;
       i < static_cast<int64_t>(p.max_clusters) * D; i += blockDim.x) {
    out[i] = 0.f;
  }
}

absl::Status Validate(const ClusterKvBuildParams& p) {
  constexpr const char* op = "ClusterKvBuild";
  if (p.batch < 1 || p.n_kv_heads < 1) return Invalid(op, "batch and n_kv_heads must be >= 1");
  if (p.head_dim != 64 && p.head_dim != 128) return Invalid(op, "head_dim must be 64 or 128");
  if (p.max_points < 1 || p.max_clusters < 1) {
    return Invalid(op, "max_points and max_clusters must be >= 1 (plan.max_*)");
  }
  if (p.max_iterations < 1) return Invalid(op, "max_iterations must be >= 1");
  if (p.math != AssignMath::kFp32 && p.math != AssignMath::k3xTf32) {
    return Invalid(op, "math must be kFp32 or k3xTf32");
  }
  const int64_t rows = static_cast<int64_t>(p.batch) * p.n_kv_heads;
  if (rows * p.max_clusters >= (int64_t{1} << 31) || rows * p.max_points >= (int64_t{1} << 31)) {
    return Invalid(op, "rows x max_clusters and rows x max_points must be < 2^31");
  }
  if (rows > 65535) return Invalid(op, "batch x n_kv_heads must be <= 65535");
  if (p.max_points >= (1 << 24)) return Invalid(op, "max_points must be < 2^24");
  KVR_RETURN_IF_ERROR(build_internal::CheckKeys(op, p.keys, p.head_dim));
  if (!p.first_token || !p.n_points || !p.n_init || !p.init_points) {
    return Invalid(op, "first_token, n_points, n_init and init_points are required");
  }
  if (!p.centroids || !p.n_clusters || !p.offsets || !p.members) {
    return Invalid(op, "centroids, n_clusters, offsets and members are required");
  }
  if (p.workspace == nullptr || p.workspace_bytes < ClusterKvBuildWorkspaceBytes(p)) {
    return Invalid(op, "workspace missing or smaller than ClusterKvBuildWorkspaceBytes");
  }
  return absl::OkStatus();
}

template <typename T, int D>
absl::Status Run(const ClusterKvBuildParams& p, cudaStream_t stream) {
  const int rows = p.batch * p.n_kv_heads;
  const int64_t items = static_cast<int64_t>(rows) * p.max_points;
  const int64_t ck = static_cast<int64_t>(rows) * p.max_clusters;
  Work w = Carve(p, p.workspace);
  if (p.assignment != nullptr) w.assign = p.assignment;
  if (p.unit_centroids != nullptr) w.unit = p.unit_centroids;
  const int end_bit = SortEndBit(rows, p.max_clusters);

  NormaliseKernel<T, D><<<dim3((p.max_points + 7) / 8, rows), 256, 0, stream>>>(p, w.x);
  KVR_RETURN_IF_ERROR(LaunchStatus("ClusterKvBuild normalise"));
  InitKernel<D><<<rows, 256, 0, stream>>>(p, w.x, w.unit, w.unit_big, w.unit_small, w.assign,
                                          w.changed, w.done);
  KVR_RETURN_IF_ERROR(LaunchStatus("ClusterKvBuild init"));

  ArgmaxGemmArgs a;
  a.rows = rows;
  a.x = w.x;
  a.x_row_stride = static_cast<int64_t>(p.max_points) * D;
  a.n_points = p.n_points;
  a.c = w.unit;
  a.c_big = w.unit_big;
  a.c_small = w.unit_small;
  a.c_row_stride = static_cast<int64_t>(p.max_clusters) * D;
  a.c_mod = rows;
  a.n_c = p.n_init;
  a.skip = w.done;
  a.ids = w.assign;
  a.out_row_stride = p.max_points;
  a.best_dist = w.best_dist;
  a.changed = w.changed;

  const int prep_blocks = static_cast<int>((items + 255) / 256);
  const int warp_blocks = static_cast<int>((ck + 7) / 8);
  // Groups points by (row, cluster) from the current assignment: counts, starts, sorted points.
  auto group = [&]() -> absl::Status {
    KVR_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(w.counts, 0, ck * sizeof(int32_t), stream));
    SortPrepKernel<<<prep_blocks, 256, 0, stream>>>(p, rows, w.assign, w.keys_in, w.vals_in,
                                                    w.counts);
    KVR_RETURN_IF_ERROR(LaunchStatus("ClusterKvBuild sort prep"));
    size_t bytes = w.cub_bytes;
    KVR_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(w.cub_temp, bytes, w.keys_in,
                                                             w.keys_out, w.vals_in, w.vals_out,
                                                             items, 0, end_bit, stream));
    bytes = w.cub_bytes;
    KVR_CUDA_RETURN_IF_ERROR(
        cub::DeviceScan::ExclusiveSum(w.cub_temp, bytes, w.counts, w.starts, ck, stream));
    return absl::OkStatus();
  };

  for (int it = 0; it < p.max_iterations; ++it) {
    // 3xTF32: the pre-split kernel (same sums as LaunchArgmax's 3xTF32 kernel, bit for bit).
    KVR_CUDA_RETURN_IF_ERROR(
        (p.math == AssignMath::k3xTf32
             ? build_internal::LaunchArgmaxGemmTcSplit<D, true, int32_t>(a, p.max_points, stream)
             : build_internal::LaunchArgmax<D, true, int32_t>(p.math, a, p.max_points, stream)));
    ControlKernel<<<(rows + 127) / 128, 128, 0, stream>>>(rows, it, w.changed, w.done);
    KVR_RETURN_IF_ERROR(LaunchStatus("ClusterKvBuild control"));
    KVR_RETURN_IF_ERROR(group());
    UpdateKernel<D><<<warp_blocks, 256, 0, stream>>>(p, rows, w.x, w.counts, w.starts, w.vals_out,
                                                     w.done, w.unit, w.unit_big, w.unit_small);
    KVR_RETURN_IF_ERROR(LaunchStatus("ClusterKvBuild update"));
    ReseedKernel<D><<<rows, 256, 0, stream>>>(p, w.x, w.counts, w.done, w.best_dist, w.unit,
                                              w.unit_big, w.unit_small);
    KVR_RETURN_IF_ERROR(LaunchStatus("ClusterKvBuild reseed"));
  }
  // The update of the last iteration changed only the centroids; the grouping of the last
  // assignment is still in counts / starts / vals_out.
  CompactKernel<<<rows, 1024, 0, stream>>>(p, w.counts, w.starts, w.new_id);
  KVR_RETURN_IF_ERROR(LaunchStatus("ClusterKvBuild compact"));
  MembersKernel<<<prep_blocks, 256, 0, stream>>>(p, rows, w.starts, w.vals_out);
  KVR_RETURN_IF_ERROR(LaunchStatus("ClusterKvBuild members"));
  ZeroPadKernel<D><<<rows, 256, 0, stream>>>(p);
  KVR_RETURN_IF_ERROR(LaunchStatus("ClusterKvBuild zero pad"));
  MeanKernel<T, D>
      <<<warp_blocks, 256, 0, stream>>>(p, rows, w.counts, w.starts, w.vals_out, w.new_id);
  return LaunchStatus("ClusterKvBuild mean");
}

}  // namespace

size_t ClusterKvBuildWorkspaceBytes(const ClusterKvBuildParams& p) {
  if (p.batch < 1 || p.n_kv_heads < 1 || p.max_points < 1 || p.max_clusters < 1) return 0;
  return Carve(p, nullptr).cub_bytes;
}

absl::Status ClusterKvBuild(const ClusterKvBuildParams& p, cudaStream_t stream) {
  KVR_RETURN_IF_ERROR(Validate(p));
  return build_internal::DispatchKeyType(p.keys.dtype, [&]<typename T>() {
    return build_internal::DispatchHeadDim(p.head_dim,
                                           [&]<int D>() { return Run<T, D>(p, stream); });
  });
}

}  // namespace kvr::retrieval::cuda
