#pragma once
// Kernels of the GPU sparse decode (sparse_decode.h): the decode step's RoPE + KV append (host
// KV, window ring, summaries) and the benchmark fill (resident rows and summaries built from the
// host KV). Selection, gather, hot cache and decode attention are retrieval/cuda's
// (selection.cuh, gather.cuh, hot_cache.cuh, decode_attention.cuh).
//
// Layouts (per layer l, slot s, KV head h; "row" = [K | V] of 2 * head_dim bf16):
//   host KV of a sequence  [n_layers, n_kv_heads, capacity, row]        (mapped pinned memory),
//                          or the KV store's pages (a row source); both read through the page
//                          tables [n_layers, slots, n_kv_heads, max_pages] (kv_pool.h)
//   resident               [n_layers, slots, n_kv_heads, rcap, row]    rcap = n_sink + window;
//                          token p at p when p < n_sink, else n_sink + (p - n_sink) % window
//   quest bounds           [n_layers, slots, n_pages, n_kv_heads, 2, head_dim] bf16 or fp32
//                          (min, max)
//   clusterkv centroids    [n_layers, slots, n_kv_heads, max_clusters, head_dim] bf16
//             n_clusters   [n_layers, slots, n_kv_heads]
//             offsets      [n_layers, slots, n_kv_heads, max_clusters + 1]
//             members      [n_layers, slots, n_kv_heads, max_members]

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kvr/common/cuda/kv_pool.h"

namespace kvr::retrieval::cuda {

using sbf16 = __nv_bfloat16;

// One slot of a sparse Forward (row `slot` of the batch's tensors).
struct SparseRow {
  // Device address of the sequence's own host KV, where the new row is written too; null for a
  // sequence whose past is read from a row source (the store's pages: never written here).
  sbf16* host_kv = nullptr;
  int64_t capacity = 0;
  int64_t pos = 0;  // position of the new token
  int active = 0;   // 0: empty slot
};

struct SparseSummaryView {
  int method = 0;  // 0 quest, 1 clusterkv
  int slots = 0;
  // quest
  // Layer 0 (layer stride below): bf16 (bounds_bf16, rounded outward: exact for bf16 keys) or
  // fp32 (bounds); one of the two is set.
  float* bounds = nullptr;
  sbf16* bounds_bf16 = nullptr;
  int64_t bounds_layer_stride = 0, bounds_slot_stride = 0;
  int page_size = 16;
  // clusterkv
  sbf16* centroids = nullptr;  // bf16: the scoring reads them every step (ClusterKvSelect)
  int32_t* n_clusters = nullptr;
  int32_t* offsets = nullptr;
  int32_t* members = nullptr;
  int max_clusters = 0, max_members = 0;
};

struct SparseRopeParams {
  const float* qkv = nullptr;  // [slots, q_dim + 2 kv_dim]
  const float* bias = nullptr;
  const float* inv_freq = nullptr;
  const SparseRow* rows = nullptr;  // [slots]
  sbf16* q = nullptr;               // [slots, n_heads, head_dim]
  float* q_f32 = nullptr;           // [slots, n_heads, head_dim]
  sbf16* resident = nullptr;        // layer 0
  int64_t resident_layer_stride = 0;
  int rcap = 0, n_sink = 0, window = 0;
  SparseSummaryView sum;
  // The new K/V row of every slot and layer, [slots, n_layers, 2 (K, V), n_kv_heads, head_dim]:
  // what a caller appends to the KV store.
  sbf16* new_rows = nullptr;
  int slots = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0, layer = 0, n_layers = 0;
};
[[nodiscard]] absl::Status LaunchSparseRope(const SparseRopeParams& p, cudaStream_t stream);

// Benchmark fill of one slot from the host KV of a sequence holding `length` tokens:
// resident rows, then (quest) page bounds of every page of [0, length) or (clusterkv) clusters of
// `tokens_per_cluster` consecutive candidates of [n_sink, length - window) (the tokens that
// are candidates at the next step), centroid = mean key, n_clusters and offsets.
struct SparseFillParams {
  // Where the slot's rows are (kv_pool.h): tables of layer 0; layer l's pages start
  // pages_layer_stride entries later.
  kvr::cuda::KvPoolView pool;
  int64_t pages_layer_stride = 0;
  int64_t length = 0;
  int slot = 0;
  sbf16* resident = nullptr;
  int64_t resident_layer_stride = 0;
  int rcap = 0, n_sink = 0, window = 0;
  SparseSummaryView sum;
  int tokens_per_cluster = 80;
  int n_layers = 0, n_kv_heads = 0, head_dim = 0;
  // The pages hold fp8 rows (PoolRowFormat::kFp8E4m3) instead of bf16 ones: decoded as read.
  bool fp8_rows = false;
  bool summaries = true;  // false: the ring rows only (the caller uploads the summaries)
};
[[nodiscard]] absl::Status LaunchSparseFill(const SparseFillParams& p, cudaStream_t stream);

// Clears a slot's summaries (clusterkv: no clusters) for a new sequence.
[[nodiscard]] absl::Status LaunchSparseClearSlot(const SparseSummaryView& sum, int slot,
                                                 int n_layers, int n_kv_heads, cudaStream_t stream);

// per_slot[b] += sum of counts[b, 0 .. n_kv) for every slot b < slots (the rows each sequence
// selected this layer).
[[nodiscard]] absl::Status LaunchSumCountsPerSlot(const int32_t* counts, int slots, int n_kv,
                                                  unsigned long long* per_slot,
                                                  cudaStream_t stream);

// Replayed selections (selection_replay.h): for every slot s with candidates (meta begin[s] <
// end[s]) and KV head h, overwrites counts[s, h] and ids[s, h, 0 .. count) with what
// ReplayHeadIds (the CPU reference) gives for the recording's (step, layer, h) (the slot's budget
// from budgets[s]). Device copies of SparseSelectionReplay's counts and ids.
struct ReplaySelectParams {
  const int32_t* counts = nullptr;  // [n_layers, n_kv_heads] of the step
  const int32_t* ids = nullptr;     // [n_layers, n_kv_heads, trace_budget] of the step
  int trace_budget = 0, run = 1, layer = 0, slots = 0, n_kv_heads = 0, budget = 0;
  int32_t trace_begin = 0;
  int32_t scatter = 0;
  bool rotate_slots = false;
  int n_layers = 0;
  const int32_t* cand_begin = nullptr;  // [slots]
  const int32_t* cand_end = nullptr;    // [slots]
  const int32_t* budgets = nullptr;     // [slots]
  int32_t* out_ids = nullptr;           // [slots, n_kv_heads, budget]
  int32_t* out_counts = nullptr;        // [slots, n_kv_heads]
};
[[nodiscard]] absl::Status LaunchReplaySelect(const ReplaySelectParams& p, cudaStream_t stream);

// *counter += sum of counts[0 .. n).
[[nodiscard]] absl::Status LaunchSumCounts(const int32_t* counts, int n,
                                           unsigned long long* counter, cudaStream_t stream);

// --- Host KV placement (NUMA) -------------------------------------------------------------------
// A sparse sequence's host KV is read by the GPU across PCIe, zero-copy; pages on the NUMA node
// far from the GPU cross the socket interconnect too. numa_node < 0: cudaHostAlloc (mapped), the
// kernel's default policy places the pages (what the first issue-7 runs measured). numa_node >=
// 0: anonymous mmap, mbind(MPOL_PREFERRED, node) by raw syscall (libnuma is not assumed on the
// device machine), every page touched (written with `pattern`'s words), then cudaHostRegister
// (mapped, portable); MPOL_PREFERRED rather than MPOL_BIND so that a full node degrades to other
// nodes instead of the OOM killer: on_node_fraction() says where the pages really went
// (move_pages on up to 4096 sampled pages). Where mbind is refused (a container without
// CAP_SYS_NICE), the pages are first touched by threads pinned to the node's CPUs instead.
// huge_pages: the mmap path (also without a node), 2 MiB aligned, madvise(MADV_HUGEPAGE) before
// the touch (transparent huge pages; huge_fraction says how much of it got them): fewer
// translations for the GPU's scattered row reads.
struct HostAllocation {
  void* data = nullptr;
  size_t bytes = 0;         // as asked
  size_t mapped_bytes = 0;  // the mmap path: the mapping's length (2 MiB multiple)
  int numa_node = -1;
  bool huge_pages = false;
  double huge_fraction = -1;     // huge_pages: AnonHugePages / mapped_bytes (/proc/self/smaps)
  double on_node_fraction = -1;  // sampled pages on numa_node; -1: not bound / not checked
  const char* how = "";  // "cudaHostAlloc", "mmap", "mbind" or "first-touch" (mbind refused)
};
// pattern: numa_node >= 0 only, the 32-bit word i is pattern * (i + 1) (0: zeros); numa_node <
// 0 leaves the memory as cudaHostAlloc gives it.
[[nodiscard]] absl::StatusOr<HostAllocation> AllocateHostOnNode(size_t bytes, int numa_node,
                                                                bool huge_pages,
                                                                uint32_t pattern = 0);
void FreeHostAllocation(HostAllocation& a);

// Move-only owner of a mapped pinned host buffer of n T's on a NUMA node (the interface of
// kvr::cuda::PinnedBuffer, which it replaces for the host KV).
template <typename T>
class HostKvBuffer {
 public:
  HostKvBuffer() = default;
  [[nodiscard]] static absl::StatusOr<HostKvBuffer> Create(size_t n, int numa_node,
                                                           bool huge_pages = false) {
    HostKvBuffer b;
    b.a_.numa_node = numa_node;
    b.a_.huge_pages = huge_pages;
    if (n > 0) {
      absl::StatusOr<HostAllocation> a = AllocateHostOnNode(n * sizeof(T), numa_node, huge_pages);
      if (!a.ok()) return a.status();
      b.a_ = *a;
    }
    b.size_ = n;
    return b;
  }
  HostKvBuffer(HostKvBuffer&& o) noexcept
      : a_(std::exchange(o.a_, HostAllocation{})), size_(std::exchange(o.size_, 0)) {}
  HostKvBuffer& operator=(HostKvBuffer&& o) noexcept {
    if (this != &o) {
      FreeHostAllocation(a_);
      a_ = std::exchange(o.a_, HostAllocation{});
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  HostKvBuffer(const HostKvBuffer&) = delete;
  HostKvBuffer& operator=(const HostKvBuffer&) = delete;
  ~HostKvBuffer() { FreeHostAllocation(a_); }

  T* data() const { return static_cast<T*>(a_.data); }
  size_t size() const { return size_; }
  size_t bytes() const { return size_ * sizeof(T); }
  int numa_node() const { return a_.numa_node; }
  bool huge_pages() const { return a_.huge_pages; }
  double on_node_fraction() const { return a_.on_node_fraction; }
  [[nodiscard]] absl::StatusOr<T*> device_pointer() const {
    T* p = nullptr;
    const cudaError_t e = cudaHostGetDevicePointer(reinterpret_cast<void**>(&p), a_.data, 0);
    if (e != cudaSuccess) {
      return absl::InternalError(absl::StrCat("cudaHostGetDevicePointer: ", cudaGetErrorName(e)));
    }
    return p;
  }

 private:
  HostAllocation a_;
  size_t size_ = 0;
};

// --- Host link probes (kvr bench decode's same-run ceilings) -------------------------------------
// Row `e` of the random-row probe: a 64-bit multiplicative hash of e, modulo n_rows (the CPU
// reference checks the copy with the same function).
__host__ __device__ inline int64_t ProbeRow(int64_t e, int64_t n_rows) {
  const uint64_t h = (static_cast<uint64_t>(e) + 1) * 0x9E3779B97F4A7C15ull;
  return static_cast<int64_t>((h >> 17) % static_cast<uint64_t>(n_rows));
}
// dst[i] = src[i] for n16 16-byte chunks, one thread per chunk: src mapped host memory read
// zero-copy, coalesced (a warp reads 512 contiguous bytes).
[[nodiscard]] absl::Status LaunchZeroCopyRead(const void* src, void* dst, int64_t n16,
                                              cudaStream_t stream);
// Gather-shaped zero-copy read: dst row e = src row ProbeRow(e, src_rows) for e < n_rows, rows of
// row_bytes (a multiple of 16), one thread per 16-byte chunk (as HotCacheCopyKernel reads misses);
// src_rows 0: n_rows (a permutation of the buffer), more: n_rows rows spread over src_rows.
[[nodiscard]] absl::Status LaunchZeroCopyRows(const void* src, void* dst, int64_t n_rows,
                                              int row_bytes, cudaStream_t stream,
                                              int64_t src_rows = 0);

}  // namespace kvr::retrieval::cuda
