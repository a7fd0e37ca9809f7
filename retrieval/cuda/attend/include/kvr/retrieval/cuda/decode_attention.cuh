#pragma once
// Sparse decode attention on the GPU: one query token per sequence attends, with one softmax,
// over its resident rows (sink + local window, kept on the GPU) and its selected rows (gathered
// into a contiguous buffer by GatherRows / HotCache::Gather, or read straight from the pool by
// id: the fused gather + attend). The CPU reference is kvr::retrieval::AttendPartial +
// MergeAttentionPartial (retrieval/include/kvr/retrieval/partial_attention.h).
//
// GQA: query head qh uses kv head qh / group (group = n_heads / n_kv_heads, at most 8); all query
// heads of a kv head share each loaded row. Split-KV (flash-decoding): the rows of one (b, h) are
// cut into splits, each split writes a partial (o, lse) in fp32 to the workspace and a second
// kernel merges the splits by log-sum-exp. Accumulation is fp32 for every input dtype.
// head_dim 64 or 128; dtype fp32, fp16 or bf16 (q, rows and out share it).

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kvr/retrieval/cuda/gather.cuh"

namespace kvr::retrieval::cuda {

struct DecodeAttentionParams {
  int batch = 0;
  int n_heads = 0;     // query heads
  int n_kv_heads = 0;  // n_heads % n_kv_heads == 0, group <= 8
  int head_dim = 0;    // 64 or 128
  RowDType dtype = RowDType::kBf16;
  float scale = 0.f;  // usually 1 / sqrt(head_dim)

  const void* q = nullptr;  // device [batch, n_heads, head_dim]

  // Resident rows (sink + local window): rows [0, resident_counts[b]) of each (b, h).
  const void* resident = nullptr;  // device [batch, n_kv_heads, resident_capacity, 2*d]
  int resident_capacity = 0;
  const int32_t* resident_counts = nullptr;  // device [batch]; null: no resident rows

  // Selected rows: counts[b, h] of them. Read from `gathered` when it is set, else fused: read
  // row ids[b, h, i] of `pool` (HBM or mapped host memory) directly.
  int budget = 0;
  const int32_t* counts = nullptr;  // device [batch, n_kv_heads]; null: no selected rows
  const void* gathered = nullptr;   // device [batch, n_kv_heads, budget, 2 * head_dim]
  KvPoolView pool;                  // fused path only
  const int32_t* ids = nullptr;     // device [batch, n_kv_heads, budget], fused path only

  // Upper bound of resident + selected rows of any (b, h); sizes the split grid.
  int max_rows = 0;
  int num_splits = 0;  // 0: chosen from the SM count and max_rows

  void* out = nullptr;   // device [batch, n_heads, head_dim], dtype
  float* lse = nullptr;  // device [batch, n_heads], natural log; optional. -inf for no rows.

  // fp32 scratch of DecodeAttentionWorkspaceBytes(p) bytes (partials of every split).
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// Splits the launcher will use for `p` (needs the current device's SM count when
// p.num_splits == 0).
[[nodiscard]] int DecodeAttentionSplits(const DecodeAttentionParams& p);
[[nodiscard]] size_t DecodeAttentionWorkspaceBytes(const DecodeAttentionParams& p);

// Asynchronous on `stream`. Rows with no attended rows at all get out = 0, lse = -inf.
[[nodiscard]] absl::Status DecodeAttention(const DecodeAttentionParams& p, cudaStream_t stream);

}  // namespace kvr::retrieval::cuda
