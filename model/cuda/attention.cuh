#pragma once
// Dense causal attention of the CUDA model over the sequences' bf16 KV caches (attention.cu).
// Plain C++ reference: DenseAttention (dense_attention.h); parity test in
// model/tests/cuda_ops_test.cc.
//
// - Prefill (any number of queries per sequence): FlashAttention-2 style, one block (4 warps)
//   per 64 queries of one head of one sequence; K/V tiles of 64 keys double-buffered in shared
//   memory with cp.async; S = Q K^T and O += P V on the tensor cores (mma.sync m16n8k16, bf16
//   in, float32 accumulate) with S, P and O in registers; online softmax in float32.
// - Decode (one query per sequence): split-KV. Each block takes one KV head of one sequence and
//   a slice of its keys, for all query heads of that KV head's group (GQA: the keys are read
//   once per group; the group's heads are the rows of one mma tile), and writes an
//   unnormalised partial output with its max and sum; a merge kernel combines the slices
//   through their log-sum-exp.
// head_dim 64 and 128 are compiled; others answer Unimplemented.

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "ops.cuh"

namespace kvr::model::cuda {

struct AttentionParams {
  const bf16* q = nullptr;      // [n_tokens, n_heads, head_dim], RoPE applied
  bf16* out = nullptr;          // [n_tokens, n_heads, head_dim]
  const SeqKv* seqs = nullptr;  // [n_seqs] (device memory); K/V rows [0, length) are attended
  int n_seqs = 0;
  int max_q = 0;           // largest n_q over the sequences (prefill grid)
  int64_t max_length = 0;  // largest length over the sequences (decode split count)
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int layer = 0;
  float scale = 0.f;  // softmax scale, 1/sqrt(head_dim)
  // Decode scratch, sized for n_seqs * n_heads * max_splits partials.
  float* partial_o = nullptr;   // [n_seqs, n_heads, max_splits, head_dim]
  float* partial_ml = nullptr;  // [n_seqs, n_heads, max_splits, 2] (max in log2 units, sum)
  int max_splits = 0;
  int n_sms = 132;  // multiprocessors, to size the decode grid
};

// Every sequence may have any n_q >= 1; query i of a sequence is at position
// first_position + i and attends to positions <= its own.
[[nodiscard]] absl::Status LaunchPrefillAttention(const AttentionParams& p, cudaStream_t stream);
// Every sequence must have n_q == 1. The kernels read every length from `seqs` (device memory);
// of the host-side fields only the split count depends on the step (DecodeSplits), so a launch
// captured in a CUDA graph stays valid for later steps with the same DecodeSplits and n_seqs.
[[nodiscard]] absl::Status LaunchDecodeAttention(const AttentionParams& p, cudaStream_t stream);
// The number of key splits LaunchDecodeAttention uses for `p` (grid y).
[[nodiscard]] int DecodeSplits(const AttentionParams& p);

// Query heads per KV head that the decode kernel supports.
inline constexpr int kMaxDecodeGroup = 16;  // the rows of an mma tile

}  // namespace kvr::model::cuda
