#pragma once
// Kernels of the CUDA model's sparse sequences (cuda_model.h, "Sparse sequences"): the decode
// step's RoPE + KV append (host KV, window ring, summaries) and the benchmark fill (resident rows
// and summaries built from the host KV). Selection, gather, hot cache and decode attention are
// retrieval/cuda's (selection.cuh, gather.cuh, hot_cache.cuh, decode_attention.cuh).
//
// Layouts (per layer l, slot s, KV head h; "row" = [K | V] of 2 * head_dim bf16):
//   host KV of a sequence  [n_layers, n_kv_heads, capacity, row]        (mapped pinned memory)
//   resident               [n_layers, slots, n_kv_heads, rcap, row]    rcap = n_sink + window;
//                          token p at p when p < n_sink, else n_sink + (p - n_sink) % window
//   quest bounds           [n_layers, slots, n_pages, n_kv_heads, 2, head_dim] fp32 (min, max)
//   clusterkv centroids    [n_layers, slots, n_kv_heads, max_clusters, head_dim] fp32
//             n_clusters   [n_layers, slots, n_kv_heads]
//             offsets      [n_layers, slots, n_kv_heads, max_clusters + 1]
//             members      [n_layers, slots, n_kv_heads, max_members]

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace kvr::model::cuda {

using sbf16 = __nv_bfloat16;

// One slot of a sparse Forward (row `slot` of the batch's tensors).
struct SparseRow {
  sbf16* host_kv = nullptr;  // device address of the sequence's host KV; null: empty slot
  int64_t capacity = 0;
  int64_t pos = 0;  // position of the new token
};

struct SparseSummaryView {
  int method = 0;  // 0 quest, 1 clusterkv
  int slots = 0;
  // quest
  float* bounds = nullptr;  // layer 0; layer stride below
  int64_t bounds_layer_stride = 0, bounds_slot_stride = 0;
  int page_size = 16;
  // clusterkv
  float* centroids = nullptr;
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
  int slots = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0, layer = 0;
};
[[nodiscard]] absl::Status LaunchSparseRope(const SparseRopeParams& p, cudaStream_t stream);

// Benchmark fill of one slot from the host KV of a sequence holding `length` tokens:
// resident rows, then (quest) page bounds of every page of [0, length) or (clusterkv) clusters of
// `tokens_per_cluster` consecutive candidates of [n_sink, length - window) (the tokens that
// are candidates at the next step), centroid = mean key, n_clusters and offsets.
struct SparseFillParams {
  const sbf16* host_kv = nullptr;
  int64_t capacity = 0, length = 0;
  int slot = 0;
  sbf16* resident = nullptr;
  int64_t resident_layer_stride = 0;
  int rcap = 0, n_sink = 0, window = 0;
  SparseSummaryView sum;
  int tokens_per_cluster = 80;
  int n_layers = 0, n_kv_heads = 0, head_dim = 0;
};
[[nodiscard]] absl::Status LaunchSparseFill(const SparseFillParams& p, cudaStream_t stream);

// Clears a slot's summaries (clusterkv: no clusters) for a new sequence.
[[nodiscard]] absl::Status LaunchSparseClearSlot(const SparseSummaryView& sum, int slot,
                                                 int n_layers, int n_kv_heads, cudaStream_t stream);

// *counter += sum of counts[0 .. n).
[[nodiscard]] absl::Status LaunchSumCounts(const int32_t* counts, int n,
                                           unsigned long long* counter, cudaStream_t stream);

}  // namespace kvr::model::cuda
