// Kernels of the sparse sequences (sparse.cuh).

#include <cuda_bf16.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>

#include "kvr/common/cuda/cuda_util.h"
#include "kvr/common/status.h"
#include "sparse.cuh"

namespace kvr::model::cuda {
namespace {

__device__ __forceinline__ int64_t RingSlot(int64_t pos, int n_sink, int window) {
  return pos < n_sink ? pos : n_sink + (pos - n_sink) % window;
}

__device__ __forceinline__ sbf16* ResidentRow(sbf16* resident, int64_t layer_stride, int layer,
                                              int slot, int n_kv, int h, int rcap, int64_t r,
                                              int d) {
  return resident + layer * layer_stride + ((int64_t{slot} * n_kv + h) * rcap + r) * 2 * d;
}

__device__ __forceinline__ float* QuestBound(const SparseSummaryView& s, int layer, int slot,
                                             int64_t page, int n_kv, int h, int d) {
  return s.bounds + layer * s.bounds_layer_stride + slot * s.bounds_slot_stride +
         (page * n_kv + h) * 2 * d;
}

// (layer, slot, head) index of the clusterkv arrays.
__device__ __forceinline__ int64_t CkvHead(const SparseSummaryView& s, int layer, int slot,
                                           int n_kv, int h) {
  return (int64_t{layer} * s.slots + slot) * n_kv + h;
}

// One block per slot.
__global__ void SparseRopeKernel(SparseRopeParams p) {
  const int slot = blockIdx.x;
  const SparseRow row = p.rows[slot];
  const int d = p.head_dim, half = d / 2;
  const int q_dim = p.n_heads * d, kv_dim = p.n_kv_heads * d;
  if (row.host_kv == nullptr) {  // empty slot: a finite query, nothing written elsewhere
    for (int j = threadIdx.x; j < q_dim; j += blockDim.x) {
      p.q[int64_t{slot} * q_dim + j] = __float2bfloat16(0.f);
      p.q_f32[int64_t{slot} * q_dim + j] = 0.f;
    }
    return;
  }
  const int64_t pos = row.pos;
  const int64_t rs = RingSlot(pos, p.n_sink, p.window);
  const SparseSummaryView& s = p.sum;

  // clusterkv: the token leaving the window (its ring slot is about to be overwritten) becomes a
  // singleton cluster whose centroid is its key, as the CPU index's pending tokens.
  if (s.method == 1 && pos >= p.n_sink + p.window) {
    const int64_t evicted = pos - p.window;
    for (int j = threadIdx.x; j < kv_dim; j += blockDim.x) {
      const int h = j / d, i = j % d;
      const int64_t hh = CkvHead(s, p.layer, slot, p.n_kv_heads, h);
      const int c = s.n_clusters[hh];
      if (c >= s.max_clusters || s.offsets[hh * (s.max_clusters + 1) + c] >= s.max_members) {
        continue;
      }
      const sbf16* key = ResidentRow(p.resident, p.resident_layer_stride, p.layer, slot,
                                     p.n_kv_heads, h, p.rcap, rs, d);
      s.centroids[(hh * s.max_clusters + c) * d + i] = __bfloat162float(key[i]);
    }
    __syncthreads();
    for (int h = threadIdx.x; h < p.n_kv_heads; h += blockDim.x) {
      const int64_t hh = CkvHead(s, p.layer, slot, p.n_kv_heads, h);
      const int c = s.n_clusters[hh];
      int32_t* off = s.offsets + hh * (s.max_clusters + 1);
      if (c >= s.max_clusters || off[c] >= s.max_members) continue;
      s.members[hh * s.max_members + off[c]] = static_cast<int32_t>(evicted);
      off[c + 1] = off[c] + 1;
      s.n_clusters[hh] = c + 1;
    }
    __syncthreads();
  }

  const float* qkv = p.qkv + int64_t{slot} * (q_dim + 2 * kv_dim);
  const int n_pairs = (p.n_heads + p.n_kv_heads) * half;
  for (int j = threadIdx.x; j < n_pairs; j += blockDim.x) {
    const int head = j / half, i = j % half;
    const int col = head * d + i;
    float x0 = qkv[col], x1 = qkv[col + half];
    if (p.bias != nullptr) {
      x0 += p.bias[col];
      x1 += p.bias[col + half];
    }
    const float angle = static_cast<float>(pos) * p.inv_freq[i];  // as ApplyRope / QkvRope
    float sn, cs;
    sincosf(angle, &sn, &cs);
    const float y0 = x0 * cs - x1 * sn, y1 = x1 * cs + x0 * sn;
    const sbf16 b0 = __float2bfloat16(y0), b1 = __float2bfloat16(y1);
    if (head < p.n_heads) {
      const int64_t o = int64_t{slot} * q_dim + col;
      p.q[o] = b0;
      p.q[o + half] = b1;
      // The selector scores with the query the attention uses (bf16-rounded).
      p.q_f32[o] = __bfloat162float(b0);
      p.q_f32[o + half] = __bfloat162float(b1);
    } else {
      const int h = head - p.n_heads;
      sbf16* host =
          row.host_kv + ((int64_t{p.layer} * p.n_kv_heads + h) * row.capacity + pos) * 2 * d;
      host[i] = b0;
      host[i + half] = b1;
      sbf16* ring = ResidentRow(p.resident, p.resident_layer_stride, p.layer, slot, p.n_kv_heads, h,
                                p.rcap, rs, d);
      ring[i] = b0;
      ring[i + half] = b1;
      if (s.method == 0) {
        float* mn = QuestBound(s, p.layer, slot, pos / s.page_size, p.n_kv_heads, h, d);
        float* mx = mn + d;
        const float f0 = __bfloat162float(b0), f1 = __bfloat162float(b1);
        if (pos % s.page_size == 0) {
          mn[i] = mx[i] = f0;
          mn[i + half] = mx[i + half] = f1;
        } else {
          mn[i] = fminf(mn[i], f0);
          mx[i] = fmaxf(mx[i], f0);
          mn[i + half] = fminf(mn[i + half], f1);
          mx[i + half] = fmaxf(mx[i + half], f1);
        }
      }
    }
  }
  for (int j = threadIdx.x; j < kv_dim; j += blockDim.x) {
    const int h = j / d, i = j % d;
    float v = qkv[q_dim + kv_dim + j];
    if (p.bias != nullptr) v += p.bias[q_dim + kv_dim + j];
    const sbf16 b = __float2bfloat16(v);
    row.host_kv[((int64_t{p.layer} * p.n_kv_heads + h) * row.capacity + pos) * 2 * d + d + i] = b;
    ResidentRow(p.resident, p.resident_layer_stride, p.layer, slot, p.n_kv_heads, h, p.rcap, rs,
                d)[d + i] = b;
  }
}

// grid (n_layers * n_kv, rcap): resident ring slot r of (layer, head) from the host KV.
__global__ void FillResidentKernel(SparseFillParams p) {
  const int layer = blockIdx.x / p.n_kv_heads, h = blockIdx.x % p.n_kv_heads;
  const int64_t r = blockIdx.y;
  const int d = p.head_dim;
  int64_t pos;
  if (r < p.n_sink) {
    pos = r;
  } else {
    const int64_t base = max(int64_t{p.n_sink}, p.length - p.window);
    const int64_t k = ((r - p.n_sink) - (base - p.n_sink) % p.window + p.window) % p.window;
    pos = base + k;
  }
  if (pos >= p.length) return;
  const sbf16* src = p.host_kv + ((int64_t{layer} * p.n_kv_heads + h) * p.capacity + pos) * 2 * d;
  sbf16* dst = ResidentRow(p.resident, p.resident_layer_stride, layer, p.slot, p.n_kv_heads, h,
                           p.rcap, r, d);
  for (int i = threadIdx.x; i < 2 * d; i += blockDim.x) dst[i] = src[i];
}

// grid (n_layers * n_kv, pages), block head_dim: min/max of the page's keys.
__global__ void FillQuestKernel(SparseFillParams p) {
  const int layer = blockIdx.x / p.n_kv_heads, h = blockIdx.x % p.n_kv_heads;
  const int64_t page = blockIdx.y;
  const int d = p.head_dim, i = threadIdx.x;
  const int ps = p.sum.page_size;
  const int64_t t0 = page * ps, t1 = min(p.length, t0 + ps);
  const sbf16* k = p.host_kv + (int64_t{layer} * p.n_kv_heads + h) * p.capacity * 2 * d;
  float mn = FLT_MAX, mx = -FLT_MAX;
  for (int64_t t = t0; t < t1; ++t) {
    const float v = __bfloat162float(k[t * 2 * d + i]);
    mn = fminf(mn, v);
    mx = fmaxf(mx, v);
  }
  float* b = QuestBound(p.sum, layer, p.slot, page, p.n_kv_heads, h, d);
  b[i] = mn;
  b[d + i] = mx;
}

// grid (n_layers * n_kv, clusters), block head_dim: cluster c = candidates
// [n_sink + c * tpc, min(end, n_sink + (c + 1) * tpc)), centroid = mean key.
__global__ void FillClusterKernel(SparseFillParams p, int64_t end, int n_clusters) {
  const int layer = blockIdx.x / p.n_kv_heads, h = blockIdx.x % p.n_kv_heads;
  const int c = blockIdx.y;
  const int d = p.head_dim;
  const SparseSummaryView& s = p.sum;
  const int64_t hh = CkvHead(s, layer, p.slot, p.n_kv_heads, h);
  const int64_t t0 = p.n_sink + int64_t{c} * p.tokens_per_cluster;
  const int64_t t1 = min(end, t0 + p.tokens_per_cluster);
  const sbf16* k = p.host_kv + (int64_t{layer} * p.n_kv_heads + h) * p.capacity * 2 * d;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    float sum = 0.f;
    for (int64_t t = t0; t < t1; ++t) sum += __bfloat162float(k[t * 2 * d + i]);
    s.centroids[(hh * s.max_clusters + c) * d + i] = sum / static_cast<float>(t1 - t0);
  }
  int32_t* off = s.offsets + hh * (s.max_clusters + 1);
  for (int64_t t = t0 + threadIdx.x; t < t1; t += blockDim.x) {
    s.members[hh * s.max_members + (t - p.n_sink)] = static_cast<int32_t>(t);
  }
  if (threadIdx.x == 0) {
    off[c + 1] = static_cast<int32_t>(t1 - p.n_sink);
    if (c == 0) {
      off[0] = 0;
      s.n_clusters[hh] = n_clusters;
    }
  }
}

__global__ void ClearClustersKernel(SparseSummaryView s, int slot, int n_layers, int n_kv) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n_layers * n_kv) return;
  const int layer = j / n_kv, h = j % n_kv;
  const int64_t hh = CkvHead(s, layer, slot, n_kv, h);
  s.n_clusters[hh] = 0;
  s.offsets[hh * (s.max_clusters + 1)] = 0;
}

__global__ void SumCountsKernel(const int32_t* counts, int n, unsigned long long* counter) {
  __shared__ unsigned long long total;
  if (threadIdx.x == 0) total = 0;
  __syncthreads();
  unsigned long long mine = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) mine += static_cast<unsigned>(counts[i]);
  atomicAdd(&total, mine);
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(counter, total);
}

}  // namespace

absl::Status LaunchSparseRope(const SparseRopeParams& p, cudaStream_t stream) {
  if (p.slots == 0) return absl::OkStatus();
  SparseRopeKernel<<<p.slots, 256, 0, stream>>>(p);
  return kvr::cuda::LastLaunchStatus("SparseRopeKernel");
}

absl::Status LaunchSparseFill(const SparseFillParams& p, cudaStream_t stream) {
  if (p.length <= 0) return absl::OkStatus();
  const unsigned heads = static_cast<unsigned>(p.n_layers * p.n_kv_heads);
  FillResidentKernel<<<dim3(heads, static_cast<unsigned>(p.rcap)), 128, 0, stream>>>(p);
  KVR_RETURN_IF_ERROR(kvr::cuda::LastLaunchStatus("FillResidentKernel"));
  if (p.sum.method == 0) {
    const int64_t pages = (p.length + p.sum.page_size - 1) / p.sum.page_size;
    FillQuestKernel<<<dim3(heads, static_cast<unsigned>(pages)), p.head_dim, 0, stream>>>(p);
    return kvr::cuda::LastLaunchStatus("FillQuestKernel");
  }
  const int64_t end = std::max<int64_t>(p.n_sink, p.length - p.window);
  const int64_t n_cand = end - p.n_sink;
  const int64_t clusters = (n_cand + p.tokens_per_cluster - 1) / p.tokens_per_cluster;
  if (clusters > p.sum.max_clusters || n_cand > p.sum.max_members) {
    return absl::InvalidArgumentError("LaunchSparseFill: more clusters or members than room");
  }
  KVR_RETURN_IF_ERROR(LaunchSparseClearSlot(p.sum, p.slot, p.n_layers, p.n_kv_heads, stream));
  if (clusters == 0) return absl::OkStatus();
  FillClusterKernel<<<dim3(heads, static_cast<unsigned>(clusters)), p.head_dim, 0, stream>>>(
      p, end, static_cast<int>(clusters));
  return kvr::cuda::LastLaunchStatus("FillClusterKernel");
}

absl::Status LaunchSparseClearSlot(const SparseSummaryView& sum, int slot, int n_layers,
                                   int n_kv_heads, cudaStream_t stream) {
  if (sum.method != 1) return absl::OkStatus();
  const int n = n_layers * n_kv_heads;
  ClearClustersKernel<<<(n + 127) / 128, 128, 0, stream>>>(sum, slot, n_layers, n_kv_heads);
  return kvr::cuda::LastLaunchStatus("ClearClustersKernel");
}

absl::Status LaunchSumCounts(const int32_t* counts, int n, unsigned long long* counter,
                             cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  SumCountsKernel<<<1, 256, 0, stream>>>(counts, n, counter);
  return kvr::cuda::LastLaunchStatus("SumCountsKernel");
}

}  // namespace kvr::model::cuda
