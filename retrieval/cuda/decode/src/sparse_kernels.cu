// Kernels of the GPU sparse decode (sparse_kernels.cuh).

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cfloat>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kvr/common/cuda/cuda_util.h"
#include "kvr/common/status.h"
#include "kvr/retrieval/cuda/sparse_decode.h"
#include "sparse_kernels.cuh"

namespace kvr::retrieval::cuda {
namespace {

__device__ __forceinline__ int64_t RingSlot(int64_t pos, int n_sink, int window) {
  return pos < n_sink ? pos : n_sink + (pos - n_sink) % window;
}

__device__ __forceinline__ sbf16* ResidentRow(sbf16* resident, int64_t layer_stride, int layer,
                                              int slot, int n_kv, int h, int rcap, int64_t r,
                                              int d) {
  return resident + layer * layer_stride + ((int64_t{slot} * n_kv + h) * rcap + r) * 2 * d;
}

// Widens quest's bounds of element i (min at i, max at d + i) of (layer, slot, page, head) to
// [lo, hi], or sets them to it (`first`: the page's first token). bf16 bounds round outward (min
// down, max up), so a page's score stays an upper bound; for bf16 keys that is exact.
__device__ __forceinline__ void WidenBound(const SparseSummaryView& s, int layer, int slot,
                                           int64_t page, int n_kv, int h, int d, int i, float lo,
                                           float hi, bool first) {
  const int64_t o =
      layer * s.bounds_layer_stride + slot * s.bounds_slot_stride + (page * n_kv + h) * 2 * d;
  if (s.bounds_bf16 != nullptr) {
    sbf16* b = s.bounds_bf16 + o;
    const float mn = first ? lo : fminf(__bfloat162float(b[i]), lo);
    const float mx = first ? hi : fmaxf(__bfloat162float(b[d + i]), hi);
    b[i] = __float2bfloat16_rd(mn);
    b[d + i] = __float2bfloat16_ru(mx);
  } else {
    float* b = s.bounds + o;
    b[i] = first ? lo : fminf(b[i], lo);
    b[d + i] = first ? hi : fmaxf(b[d + i], hi);
  }
}

// (layer, slot, head) index of the clusterkv arrays.
__device__ __forceinline__ int64_t CkvHead(const SparseSummaryView& s, int layer, int slot,
                                           int n_kv, int h) {
  return (int64_t{layer} * s.slots + slot) * n_kv + h;
}

// The new row's K (kv = 0) or V (kv = 1) of head h in the step's output of new rows.
__device__ __forceinline__ sbf16* NewRow(const SparseRopeParams& p, int slot, int kv, int h) {
  return p.new_rows +
         (((int64_t{slot} * p.n_layers + p.layer) * 2 + kv) * p.n_kv_heads + h) * p.head_dim;
}

// Row `pos` of (layer, head) of the slot being filled, wherever its pages are.
__device__ __forceinline__ const uint8_t* FillRow(const SparseFillParams& p, int layer, int h,
                                                  int64_t pos) {
  kvr::cuda::KvPoolView v = p.pool;
  v.pages += layer * p.pages_layer_stride;
  const size_t row_bytes =
      p.fp8_rows ? 2 * size_t(p.head_dim) + 2 * sizeof(float) : size_t{4} * p.head_dim;
  return static_cast<const uint8_t*>(
      kvr::cuda::KvPoolRow(v, int64_t{p.slot} * p.n_kv_heads + h, pos, row_bytes));
}

// Element i of a FillRow row (K: i < head_dim, V after it) as a float: a bf16 row's value, or an
// fp8 row's code times its vector's scale (HotCache decodes the gathered rows alike).
__device__ __forceinline__ float RowValue(const SparseFillParams& p, const uint8_t* row, int i) {
  if (!p.fp8_rows) return __bfloat162float(reinterpret_cast<const sbf16*>(row)[i]);
  __nv_fp8_e4m3 code;
  code.__x = row[i];
  return static_cast<float>(code) *
         reinterpret_cast<const float*>(row + 2 * p.head_dim)[i < p.head_dim ? 0 : 1];
}

// One block per slot.
__global__ void SparseRopeKernel(SparseRopeParams p) {
  const int slot = blockIdx.x;
  const SparseRow row = p.rows[slot];
  const int d = p.head_dim, half = d / 2;
  const int q_dim = p.n_heads * d, kv_dim = p.n_kv_heads * d;
  if (!row.active) {  // empty slot: a finite query, nothing written elsewhere
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
      s.centroids[(hh * s.max_clusters + c) * d + i] = key[i];
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
      if (row.host_kv != nullptr) {
        sbf16* host =
            row.host_kv + ((int64_t{p.layer} * p.n_kv_heads + h) * row.capacity + pos) * 2 * d;
        host[i] = b0;
        host[i + half] = b1;
      }
      sbf16* fresh = NewRow(p, slot, 0, h);
      fresh[i] = b0;
      fresh[i + half] = b1;
      sbf16* ring = ResidentRow(p.resident, p.resident_layer_stride, p.layer, slot, p.n_kv_heads, h,
                                p.rcap, rs, d);
      ring[i] = b0;
      ring[i + half] = b1;
      if (s.method == 0) {
        const float f0 = __bfloat162float(b0), f1 = __bfloat162float(b1);
        const int64_t page = pos / s.page_size;
        const bool first = pos % s.page_size == 0;
        WidenBound(s, p.layer, slot, page, p.n_kv_heads, h, d, i, f0, f0, first);
        WidenBound(s, p.layer, slot, page, p.n_kv_heads, h, d, i + half, f1, f1, first);
      }
    }
  }
  for (int j = threadIdx.x; j < kv_dim; j += blockDim.x) {
    const int h = j / d, i = j % d;
    float v = qkv[q_dim + kv_dim + j];
    if (p.bias != nullptr) v += p.bias[q_dim + kv_dim + j];
    const sbf16 b = __float2bfloat16(v);
    if (row.host_kv != nullptr) {
      row.host_kv[((int64_t{p.layer} * p.n_kv_heads + h) * row.capacity + pos) * 2 * d + d + i] = b;
    }
    NewRow(p, slot, 1, h)[i] = b;
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
  const uint8_t* src = FillRow(p, layer, h, pos);
  sbf16* dst = ResidentRow(p.resident, p.resident_layer_stride, layer, p.slot, p.n_kv_heads, h,
                           p.rcap, r, d);
  for (int i = threadIdx.x; i < 2 * d; i += blockDim.x) {
    dst[i] = __float2bfloat16(RowValue(p, src, i));  // exact for bf16 rows
  }
}

// grid (n_layers * n_kv, pages), block head_dim: min/max of the page's keys.
__global__ void FillQuestKernel(SparseFillParams p) {
  const int layer = blockIdx.x / p.n_kv_heads, h = blockIdx.x % p.n_kv_heads;
  const int64_t page = blockIdx.y;
  const int d = p.head_dim, i = threadIdx.x;
  const int ps = p.sum.page_size;
  const int64_t t0 = page * ps, t1 = min(p.length, t0 + ps);
  float mn = FLT_MAX, mx = -FLT_MAX;
  for (int64_t t = t0; t < t1; ++t) {
    const float v = RowValue(p, FillRow(p, layer, h, t), i);
    mn = fminf(mn, v);
    mx = fmaxf(mx, v);
  }
  WidenBound(p.sum, layer, p.slot, page, p.n_kv_heads, h, d, i, mn, mx, /*first=*/true);
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
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    float sum = 0.f;
    for (int64_t t = t0; t < t1; ++t) sum += RowValue(p, FillRow(p, layer, h, t), i);
    s.centroids[(hh * s.max_clusters + c) * d + i] =
        __float2bfloat16(sum / static_cast<float>(t1 - t0));
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

__global__ void SumCountsPerSlotKernel(const int32_t* counts, int n_kv,
                                       unsigned long long* per_slot) {
  if (threadIdx.x != 0) return;
  unsigned long long n = 0;
  for (int h = 0; h < n_kv; ++h) n += static_cast<unsigned>(counts[blockIdx.x * n_kv + h]);
  per_slot[blockIdx.x] += n;
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

absl::Status LaunchSumCountsPerSlot(const int32_t* counts, int slots, int n_kv,
                                    unsigned long long* per_slot, cudaStream_t stream) {
  if (slots == 0) return absl::OkStatus();
  SumCountsPerSlotKernel<<<slots, 32, 0, stream>>>(counts, n_kv, per_slot);
  return kvr::cuda::LastLaunchStatus("SumCountsPerSlotKernel");
}

// One warp per (slot, KV head): ReplayHeadIds with each run's rows written by the lanes (the
// runs themselves stay in order: each starts after the previous one's end).
__global__ void ReplaySelectKernel(ReplaySelectParams p) {
  const int i = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (i >= p.slots * p.n_kv_heads) return;
  const int s = i / p.n_kv_heads, h = i % p.n_kv_heads;
  const int32_t begin = p.cand_begin[s], end = p.cand_end[s];
  if (end <= begin) return;  // nothing to select (empty slot, or selected elsewhere)
  const int64_t head =
      p.rotate_slots ? int64_t{(p.layer + s) % p.n_layers} * p.n_kv_heads + (h + s) % p.n_kv_heads
                     : int64_t{p.layer} * p.n_kv_heads + h;
  const int budget = min(p.budget, p.budgets[s]);
  const int32_t* recorded = p.ids + head * p.trace_budget;
  int32_t* out = p.out_ids + int64_t{i} * p.budget;
  int written = 0;
  if (p.scatter > 0) {
    // k-major: the lanes take 32 recorded positions at a time; the ids are ascending, so those
    // kept (before `end`, `rel < scatter`) are a prefix of each chunk.
    const unsigned lt = (1u << lane) - 1u;
    const int n = p.counts[head];
    for (int k = 0; k < p.run; ++k) {
      bool stop = false;
      for (int base = 0; base < n && !stop; base += 32) {
        const int j = base + lane;
        const int64_t rel =
            j < n ? (recorded[j] > p.trace_begin ? recorded[j] - p.trace_begin : 0) : 0;
        const int64_t t = begin + rel + int64_t{k} * p.scatter;
        const bool ok = j < n && rel < p.scatter && t < end;
        const unsigned ball = __ballot_sync(0xffffffffu, ok);
        const int at = written + __popc(ball & lt);
        if (ok && at < budget) out[at] = static_cast<int32_t>(t);
        written = min(budget, written + __popc(ball));
        // A chunk that kept fewer than its positions hit `end` (or the scatter's bound) or the
        // budget: the reference stops this k there.
        stop = __popc(ball) < min(32, n - base) || written == budget;
      }
    }
    if (lane == 0) p.out_counts[i] = written;
    return;
  }
  int64_t next = begin;
  for (int k = 0; k < p.counts[head] && written < budget; ++k) {
    const int64_t rel = recorded[k] > p.trace_begin ? recorded[k] - p.trace_begin : 0;
    const int64_t start = max(begin + rel * p.run, next);
    if (start >= end) break;
    const int len =
        static_cast<int>(min(min(int64_t{p.run}, end - start), int64_t{budget - written}));
    for (int j = lane; j < len; j += 32) out[written + j] = static_cast<int32_t>(start + j);
    written += len;
    next = start + p.run;
  }
  if (lane == 0) p.out_counts[i] = written;
}

absl::Status LaunchReplaySelect(const ReplaySelectParams& p, cudaStream_t stream) {
  const int64_t threads = int64_t{p.slots} * p.n_kv_heads * 32;
  if (threads == 0) return absl::OkStatus();
  ReplaySelectKernel<<<static_cast<unsigned>((threads + 127) / 128), 128, 0, stream>>>(p);
  return kvr::cuda::LastLaunchStatus("ReplaySelectKernel");
}

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
  if (!p.summaries) return absl::OkStatus();
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

// --- Host KV placement -------------------------------------------------------------------------

namespace {

// <linux/mempolicy.h> values (numaif.h is libnuma-dev's; the raw syscalls need only these).
constexpr int kMpolPreferred = 1;
constexpr int kMaxNodes = 1024;
constexpr size_t kMapAlign = size_t{2} << 20;

// The CPUs of a NUMA node (/sys/devices/system/node/node<N>/cpulist, "0-7,16-23").
std::vector<int> NodeCpus(int node) {
  std::vector<int> cpus;
  std::ifstream f("/sys/devices/system/node/node" + std::to_string(node) + "/cpulist");
  std::string list, range;
  if (!(f >> list)) return cpus;
  std::stringstream ss(list);
  while (std::getline(ss, range, ',')) {
    const size_t dash = range.find('-');
    const int lo = std::atoi(range.substr(0, dash).c_str());
    const int hi = dash == std::string::npos ? lo : std::atoi(range.substr(dash + 1).c_str());
    for (int c = lo; c <= hi && c < CPU_SETSIZE; ++c) cpus.push_back(c);
  }
  return cpus;
}

// Word i of [0, n_words) = pattern * (i + 1), written by up to 16 threads (first touch of a
// fresh mapping: the pages are allocated here, on the node its mbind policy names, or without
// a policy near the touching CPU: `cpus` non-empty pins the threads there).
void FillWords(uint32_t* w, size_t n_words, uint32_t pattern, const std::vector<int>& cpus = {}) {
  const unsigned n_threads = std::clamp(std::thread::hardware_concurrency(), 1u, 16u);
  const size_t per = (n_words + n_threads - 1) / n_threads;
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < n_threads; ++t) {
    threads.emplace_back([=, &cpus] {
      if (!cpus.empty()) {
        cpu_set_t set;
        CPU_ZERO(&set);
        for (int c : cpus) CPU_SET(c, &set);
        sched_setaffinity(0, sizeof(set), &set);  // this thread; best effort
      }
      const size_t begin = std::min(n_words, t * per), end = std::min(n_words, begin + per);
      for (size_t i = begin; i < end; ++i) w[i] = pattern * static_cast<uint32_t>(i + 1);
    });
  }
  for (std::thread& t : threads) t.join();
}

// Fraction of up to 4096 evenly spaced pages of [p, p + len) that move_pages finds on `node`.
double SampleOnNode(void* p, size_t len, int node) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t n_pages = len / page;
  const size_t n = std::min<size_t>(n_pages, 4096);
  if (n == 0) return -1;
  std::vector<void*> pages(n);
  std::vector<int> status(n, -1);
  for (size_t i = 0; i < n; ++i) pages[i] = static_cast<char*>(p) + (i * n_pages / n) * page;
  if (syscall(SYS_move_pages, 0, n, pages.data(), nullptr, status.data(), 0) != 0) return -1;
  size_t on = 0;
  for (int s : status) on += (s == node);
  return static_cast<double>(on) / n;
}

// AnonHugePages of the mapping that starts at p, over its length (/proc/self/smaps); -1: not found.
double HugeFraction(const void* p, size_t len) {
  std::ifstream smaps("/proc/self/smaps");
  std::stringstream want;
  want << std::hex << reinterpret_cast<uintptr_t>(p) << "-";
  std::string line;
  bool in = false;
  while (std::getline(smaps, line)) {
    // A mapping's header starts "<start>-<end> perms ..." (its device field "00:00" has a
    // colon too); its field lines start "Name:".
    const std::string first = line.substr(0, line.find(' '));
    if (first.find('-') != std::string::npos && first.find(':') == std::string::npos) {
      in = line.rfind(want.str(), 0) == 0;
    } else if (in && line.rfind("AnonHugePages:", 0) == 0) {
      return std::atof(line.c_str() + 14) * 1024 / static_cast<double>(len);
    }
  }
  return -1;
}

// The mmap path's end: pins and maps the touched pages for the GPU, then checks where they are.
absl::StatusOr<HostAllocation> Register(void* p, HostAllocation& a) {
  const cudaError_t e =
      cudaHostRegister(p, a.mapped_bytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
  if (e != cudaSuccess) {
    cudaGetLastError();
    munmap(p, a.mapped_bytes);
    return kvr::cuda::CudaStatus(e, "cudaHostRegister");
  }
  a.data = p;
  if (a.numa_node >= 0) a.on_node_fraction = SampleOnNode(p, a.mapped_bytes, a.numa_node);
  if (a.huge_pages) a.huge_fraction = HugeFraction(p, a.mapped_bytes);
  return a;
}

}  // namespace

absl::StatusOr<HostAllocation> AllocateHostOnNode(size_t bytes, int numa_node, bool huge_pages,
                                                  uint32_t pattern) {
  HostAllocation a;
  a.bytes = bytes;
  a.numa_node = numa_node;
  a.huge_pages = huge_pages;
  if (bytes == 0) return a;
  if (numa_node < 0 && !huge_pages) {
    a.how = "cudaHostAlloc";
    const cudaError_t e = cudaHostAlloc(&a.data, bytes, cudaHostAllocMapped);
    if (e != cudaSuccess) {
      cudaGetLastError();  // a failed allocation must not fail the next launch check
      return kvr::cuda::CudaStatus(e, "cudaHostAlloc");
    }
    return a;
  }
  if (numa_node >= kMaxNodes) {
    return absl::InvalidArgumentError(absl::StrCat("NUMA node ", numa_node, " out of range"));
  }
  a.mapped_bytes = (bytes + kMapAlign - 1) / kMapAlign * kMapAlign;
  // 2 MiB aligned (huge pages need it): map one alignment more and trim both ends.
  void* raw = mmap(nullptr, a.mapped_bytes + kMapAlign, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap of ", a.mapped_bytes, " bytes: ", std::strerror(errno)));
  }
  const uintptr_t raw_addr = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (raw_addr + kMapAlign - 1) / kMapAlign * kMapAlign;
  if (aligned > raw_addr) munmap(raw, aligned - raw_addr);
  if (const size_t tail = raw_addr + kMapAlign - aligned; tail > 0) {
    munmap(reinterpret_cast<void*>(aligned + a.mapped_bytes), tail);
  }
  void* p = reinterpret_cast<void*>(aligned);
  a.how = "mmap";
  if (huge_pages) madvise(p, a.mapped_bytes, MADV_HUGEPAGE);  // best effort; measured below
  if (numa_node < 0) {
    FillWords(static_cast<uint32_t*>(p), a.mapped_bytes / 4, pattern);
    return Register(p, a);
  }
  unsigned long mask[kMaxNodes / (8 * sizeof(unsigned long))] = {};
  mask[numa_node / (8 * sizeof(unsigned long))] |= 1ul << (numa_node % (8 * sizeof(unsigned long)));
  // maxnode counts one past the mask's bits (the kernel reads maxnode - 1 bits). Containers
  // without CAP_SYS_NICE may refuse mbind (EPERM): then first touch from threads pinned to the
  // node's CPUs places the pages (the default local policy).
  std::vector<int> cpus;
  a.how = "mbind";
  if (syscall(SYS_mbind, p, a.mapped_bytes, kMpolPreferred, mask, kMaxNodes + 1, 0) != 0) {
    const int err = errno;
    cpus = NodeCpus(numa_node);
    if (cpus.empty()) {
      munmap(p, a.mapped_bytes);
      return absl::InternalError(absl::StrCat("mbind to node ", numa_node, ": ", std::strerror(err),
                                              "; and the node lists no CPUs"));
    }
    a.how = "first-touch";
  }
  FillWords(static_cast<uint32_t*>(p), a.mapped_bytes / 4, pattern, cpus);
  return Register(p, a);
}

void FreeHostAllocation(HostAllocation& a) {
  if (a.data != nullptr) {
    if (a.mapped_bytes == 0) {
      cudaFreeHost(a.data);
    } else {
      cudaHostUnregister(a.data);
      munmap(a.data, a.mapped_bytes);
    }
  }
  a = HostAllocation{};
}

// --- Host link probes --------------------------------------------------------------------------

namespace {

__global__ void ZeroCopyReadKernel(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                   int64_t n) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < n) dst[t] = src[t];
}

__global__ void ZeroCopyRowsKernel(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                   int64_t n_rows, int64_t src_rows, int chunks) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t e = t / chunks;
  if (e >= n_rows) return;
  const int c = static_cast<int>(t - e * chunks);
  dst[t] = src[ProbeRow(e, src_rows) * chunks + c];
}

}  // namespace

absl::Status LaunchZeroCopyRead(const void* src, void* dst, int64_t n16, cudaStream_t stream) {
  if (n16 <= 0) return absl::OkStatus();
  const int64_t blocks = (n16 + 255) / 256;
  ZeroCopyReadKernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
      static_cast<const uint4*>(src), static_cast<uint4*>(dst), n16);
  return kvr::cuda::LastLaunchStatus("ZeroCopyReadKernel");
}

absl::Status LaunchZeroCopyRows(const void* src, void* dst, int64_t n_rows, int row_bytes,
                                cudaStream_t stream, int64_t src_rows) {
  if (row_bytes <= 0 || row_bytes % 16 != 0) {
    return absl::InvalidArgumentError("LaunchZeroCopyRows: row_bytes must be a multiple of 16");
  }
  if (n_rows <= 0) return absl::OkStatus();
  const int chunks = row_bytes / 16;
  const int64_t blocks = (n_rows * chunks + 255) / 256;
  ZeroCopyRowsKernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
      static_cast<const uint4*>(src), static_cast<uint4*>(dst), n_rows,
      src_rows > 0 ? src_rows : n_rows, chunks);
  return kvr::cuda::LastLaunchStatus("ZeroCopyRowsKernel");
}

}  // namespace kvr::retrieval::cuda

namespace kvr::retrieval::cuda {

absl::StatusOr<HostTopology> GetHostTopology(int device) {
  HostTopology t;
  char bus[64] = {};
  KVR_CUDA_RETURN_IF_ERROR(cudaDeviceGetPCIBusId(bus, sizeof(bus), device));
  t.gpu_pci_bus_id = bus;
  std::string lower = t.gpu_pci_bus_id;
  for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  // sysfs names the function with a 4-digit domain; CUDA may print 8 ("00000000:1B:00.0").
  if (const size_t colon = lower.find(':'); colon != std::string::npos && colon > 4) {
    lower = lower.substr(colon - 4);
  }
  std::ifstream node_file("/sys/bus/pci/devices/" + lower + "/numa_node");
  if (!(node_file >> t.gpu_numa_node)) t.gpu_numa_node = -1;
  // "0-1,3": ranges of node ids.
  std::ifstream has_memory("/sys/devices/system/node/has_memory");
  std::string list;
  if (has_memory >> list) {
    std::stringstream ss(list);
    std::string range;
    while (std::getline(ss, range, ',')) {
      const size_t dash = range.find('-');
      const int lo = std::atoi(range.substr(0, dash).c_str());
      const int hi = dash == std::string::npos ? lo : std::atoi(range.substr(dash + 1).c_str());
      for (int n = lo; n <= hi; ++n) t.memory_nodes.push_back(n);
    }
  }
  return t;
}

namespace {

// Best GB/s of `repeats` timed calls of `launch` (each moving `bytes`) after an untimed one.
template <typename Launch>
absl::StatusOr<double> BestGbps(cudaStream_t stream, int64_t bytes, int repeats, Launch&& launch) {
  KVR_ASSIGN_OR_RETURN(auto start, kvr::cuda::CudaEvent::Create());
  KVR_ASSIGN_OR_RETURN(auto stop, kvr::cuda::CudaEvent::Create());
  KVR_RETURN_IF_ERROR(launch());
  double best_ms = 1e30;
  for (int r = 0; r < repeats; ++r) {
    KVR_CUDA_RETURN_IF_ERROR(cudaEventRecord(start.get(), stream));
    KVR_RETURN_IF_ERROR(launch());
    KVR_CUDA_RETURN_IF_ERROR(cudaEventRecord(stop.get(), stream));
    KVR_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop.get()));
    float ms = 0;
    KVR_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start.get(), stop.get()));
    best_ms = std::min<double>(best_ms, ms);
  }
  return static_cast<double>(bytes) / (best_ms * 1e-3) / 1e9;
}

// Row e of `gathered` (n_rows rows of 512 bytes) is row ProbeRow(e, src_rows) of `host`.
absl::Status CheckProbeRows(const uint8_t* gathered, const void* host, int64_t n_rows,
                            int64_t src_rows, const char* what) {
  constexpr int kRowBytes = 512;
  const auto* h = static_cast<const uint8_t*>(host);
  for (int64_t e = 0; e < n_rows; ++e) {
    if (std::memcmp(gathered + e * kRowBytes, h + cuda::ProbeRow(e, src_rows) * kRowBytes,
                    kRowBytes) != 0) {
      return absl::InternalError(
          absl::StrCat(what, ": gathered row ", e, " differs from the host row"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<HostLinkProbe> MeasureHostLink(int device, int numa_node, bool huge_pages,
                                              int64_t bytes, int repeats) {
  constexpr int kRowBytes = 512;  // one [K | V] row of a head_dim 128 KV head, bf16
  bytes = bytes / kRowBytes * kRowBytes;
  if (bytes <= 0 || repeats <= 0) {
    return absl::InvalidArgumentError("MeasureHostLink: bytes >= 512 and repeats >= 1");
  }
  KVR_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  constexpr uint32_t kPattern = 2654435761u;
  KVR_ASSIGN_OR_RETURN(
      cuda::HostAllocation host,
      cuda::AllocateHostOnNode(static_cast<size_t>(bytes), numa_node, huge_pages, kPattern));
  struct Free {
    cuda::HostAllocation& a;
    ~Free() { cuda::FreeHostAllocation(a); }
  } free_host{host};
  auto* words = static_cast<uint32_t*>(host.data);
  if (host.mapped_bytes == 0) {  // cudaHostAlloc: not filled yet
    for (int64_t i = 0; i < bytes / 4; ++i) words[i] = kPattern * static_cast<uint32_t>(i + 1);
  }
  void* mapped = nullptr;
  KVR_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&mapped, host.data, 0));
  KVR_ASSIGN_OR_RETURN(auto dev, kvr::cuda::DeviceBuffer<uint8_t>::Create(bytes));
  KVR_ASSIGN_OR_RETURN(auto stream, kvr::cuda::CudaStream::Create());
  auto best_gbps = [&](auto&& launch) { return BestGbps(stream.get(), bytes, repeats, launch); };
  std::vector<uint8_t> back(static_cast<size_t>(bytes));
  auto copy_back = [&]() -> absl::Status {
    std::memset(back.data(), 0xff, back.size());  // poisoned: a row the kernel skipped shows
    KVR_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(back.data(), dev.data(), bytes, cudaMemcpyDeviceToHost, stream.get()));
    return stream.Synchronize();
  };
  HostLinkProbe p;
  p.numa_node = numa_node;
  p.on_node_fraction = host.on_node_fraction;
  p.how = host.how;
  p.huge_pages = huge_pages;
  p.huge_fraction = host.huge_fraction;
  p.bytes = bytes;
  KVR_ASSIGN_OR_RETURN(
      p.h2d_copy_gbps, best_gbps([&]() -> absl::Status {
        return kvr::cuda::CudaStatus(
            cudaMemcpyAsync(dev.data(), host.data, bytes, cudaMemcpyHostToDevice, stream.get()),
            "cudaMemcpyAsync");
      }));
  KVR_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dev.data(), 0, bytes, stream.get()));
  KVR_ASSIGN_OR_RETURN(p.zero_copy_read_gbps, best_gbps([&] {
                         return cuda::LaunchZeroCopyRead(mapped, dev.data(), bytes / 16,
                                                         stream.get());
                       }));
  KVR_RETURN_IF_ERROR(copy_back());
  if (std::memcmp(back.data(), host.data, back.size()) != 0) {
    return absl::InternalError("MeasureHostLink: the zero-copy read differs from the host buffer");
  }
  KVR_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dev.data(), 0, bytes, stream.get()));
  const int64_t n_rows = bytes / kRowBytes;
  KVR_ASSIGN_OR_RETURN(p.zero_copy_rows_gbps, best_gbps([&] {
                         return cuda::LaunchZeroCopyRows(mapped, dev.data(), n_rows, kRowBytes,
                                                         stream.get());
                       }));
  KVR_RETURN_IF_ERROR(copy_back());
  KVR_RETURN_IF_ERROR(CheckProbeRows(back.data(), host.data, n_rows, n_rows, "MeasureHostLink"));
  return p;
}

absl::StatusOr<double> MeasureMappedRows(const void* host, const void* device_src,
                                         int64_t src_bytes, int64_t sample_bytes, int repeats) {
  constexpr int kRowBytes = 512;
  const int64_t src_rows = src_bytes / kRowBytes;
  const int64_t n_rows = std::min(src_rows, sample_bytes / kRowBytes);
  if (n_rows <= 0 || repeats <= 0 || host == nullptr || device_src == nullptr) {
    return absl::InvalidArgumentError(
        "MeasureMappedRows: a mapped region of >= 512 bytes, a sample >= 512 bytes, repeats >= 1");
  }
  const int64_t bytes = n_rows * kRowBytes;
  KVR_ASSIGN_OR_RETURN(auto dev, kvr::cuda::DeviceBuffer<uint8_t>::Create(bytes));
  KVR_ASSIGN_OR_RETURN(auto stream, kvr::cuda::CudaStream::Create());
  KVR_ASSIGN_OR_RETURN(const double gbps, BestGbps(stream.get(), bytes, repeats, [&] {
                         return cuda::LaunchZeroCopyRows(device_src, dev.data(), n_rows, kRowBytes,
                                                         stream.get(), src_rows);
                       }));
  std::vector<uint8_t> back(static_cast<size_t>(bytes));
  KVR_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(back.data(), dev.data(), bytes, cudaMemcpyDeviceToHost, stream.get()));
  KVR_RETURN_IF_ERROR(stream.Synchronize());
  KVR_RETURN_IF_ERROR(CheckProbeRows(back.data(), host, n_rows, src_rows, "MeasureMappedRows"));
  return gbps;
}

}  // namespace kvr::retrieval::cuda
