#pragma once
// GPU summary building at prefill (issue 6, part "kernels-build"): the kernels that turn one
// layer's prefill keys of every (sequence, KV head) into the summaries that the decode node's
// selectors (selection.cuh) and capacity policies consume.
//
//   ClusterKvBuild     batched cosine k-means (sinks excluded) + the cluster-sorted layout of
//                      ClusterKvSelectParams (centroids = mean keys, offsets, members)
//   QuestPageBounds    per page and KV head the per-channel min / max key (QuestSelectParams)
//   KeyDiffBuild       cosine of every key to its (sequence, head) mean key
//   A2atsQuantise      WRoPE (un-rotate to pre-RoPE) + query-aware codeword id per key
//
// Conventions as selection.cuh: every launcher is asynchronous on `stream`, validates shapes on
// the host (InvalidArgument naming the field) and returns launch errors as Internal; scratch is
// caller-owned (`workspace` of *WorkspaceBytes(params) bytes, 256-byte aligned). Keys are read
// through selection.cuh's KeyView (fp32, fp16 or bf16; RoPE applied, as the runtime stores them);
// key (b, h, t) is at base(b, h) + t * token_stride with t the position in sequence b. Sequences
// of a batch may have different lengths: seq_len (device int32 [batch]) with max_tokens >= every
// seq_len[b] sizing grids and outputs. Accumulation is fp32 in the GEMM-like parts and fp64 where
// the CPU reference sums in double (means, KeyDiff), so results match it to rounding.
//
// CPU references (parity tests in retrieval/cuda/build/tests): ClusterKvIndex::Build and
// KMeans (retrieval/src/clusterkv.cc, ops.cc), QuestIndex's bounds (baselines.cc),
// KeyDiffScores (keydiff.cc), A2atsIndex::Build / HeadCodebook::Assign (a2ats.cc, codebook.cc).
//
// Microbenchmark (built here, run on the device by scripts/device/kernels-build.sh):
//   build_cuda_bench [--contexts 8192,32768,131072] [--batch 1] [--iters 5] [--codebook 1024]
// Llama-3-8B layer (8 KV heads, d = 128, bf16 keys): us per layer of each build, GFLOP/s or
// GB/s against the ceilings.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvr/retrieval/cuda/selection.cuh"
#include "kvr/retrieval/index.h"

namespace kvr::retrieval {
class A2atsCodebooks;
}  // namespace kvr::retrieval

namespace kvr::retrieval::cuda {

// How the GEMM-like assignment steps (k-means assignment, A2ATS codeword search) multiply:
//   kFp32     fp32 FMA on the CUDA cores;
//   k3xTf32   tensor cores, each fp32 operand split into two tf32 parts and three products
//             summed (x.c ~= big.big + big.small + small.big): fp32-level accuracy (the dropped
//             term is ~2^-22 relative), faster.
// Both accumulate in fp32 in an order other than the CPU's BLAS; ids may differ from the CPU's
// only where two candidates' scores are within rounding of each other (near-ties). Default
// k3xTf32: on the H100 it was 1.05-1.15x faster (BENCHMARKS.md) with the same parity results.
enum class AssignMath : uint8_t { kFp32 = 0, k3xTf32 = 1 };

// ---------------------------------------------------------------------------------------------
// ClusterKV. Per row r = b * n_kv_heads + h the points are the keys of tokens
// [first_token[b], first_token[b] + n_points[r]) (the sinks [0, n_sink) are not clustered),
// normalised; cosine k-means (Lloyd, max_iterations, stopping early per row when no assignment
// changes, empty clusters re-seeded with the point farthest from its centroid) starts from the
// points init_points[r, 0..n_init[r]) exactly as kvr::retrieval::KMeans (ops.cc). The summary is
// then the CPU ClusterKvIndex's: clusters in id order with empty ones dropped, members of a
// cluster in ascending token order, centroid = MEAN of the raw member keys.
//
// The host plan: what the CPU index derives from IndexParams and the context length (C0,
// iterations, seeds -> initial points). Upload its vectors as is and point the params at them.
struct ClusterKvBuildPlan {
  int batch = 0, n_kv_heads = 0, head_dim = 0;
  int max_points = 0;    // max over rows of n_points (>= 1)
  int max_clusters = 0;  // max over rows of n_init (>= 1)
  int max_iterations = 0;
  std::vector<int32_t> first_token;  // [batch] = min(n_sink, seq_len)
  std::vector<int32_t> n_points;     // [batch, n_kv_heads] seq_len - first_token
  std::vector<int32_t> n_init;       // [batch, n_kv_heads] k-means k (0 when no points)
  std::vector<int32_t> init_points;  // [batch, n_kv_heads, max_clusters] point indices (-1 pad)
};
// shape: n_kv_heads, head_dim, layer (seeds); params: n_sink, budget, clusterkv.{n_clusters,
// max_iterations}, seed. seq_lens: [batch] prefill lengths.
[[nodiscard]] absl::StatusOr<ClusterKvBuildPlan> MakeClusterKvBuildPlan(
    const IndexShape& shape, const IndexParams& params, std::span<const int64_t> seq_lens);

struct ClusterKvBuildParams {
  int batch = 0;
  int n_kv_heads = 0;
  int head_dim = 0;  // 64 or 128
  KeyView keys;
  int max_points = 0;    // plan.max_points
  int max_clusters = 0;  // plan.max_clusters
  int max_iterations = 10;
  AssignMath math = AssignMath::k3xTf32;
  const int32_t* first_token = nullptr;  // device [batch]
  const int32_t* n_points = nullptr;     // device [batch, n_kv_heads]
  const int32_t* n_init = nullptr;       // device [batch, n_kv_heads]
  const int32_t* init_points = nullptr;  // device [batch, n_kv_heads, max_clusters]
  // The summary, in ClusterKvSelectParams' layout (max_clusters / max_members of the selector =
  // max_clusters / max_points here). Rows with fewer clusters are padded: centroids 0, offsets
  // repeat the member count, members -1.
  float* centroids = nullptr;     // device [batch, n_kv_heads, max_clusters, head_dim]
  int32_t* n_clusters = nullptr;  // device [batch, n_kv_heads]
  int32_t* offsets = nullptr;     // device [batch, n_kv_heads, max_clusters + 1]
  int32_t* members = nullptr;     // device [batch, n_kv_heads, max_points] token ids
  // Optional k-means outputs (tests): the unit centroids after the last update and the cluster
  // id of every point (k-means ids, before empty clusters are dropped). Null: not written.
  float* unit_centroids = nullptr;  // device [batch, n_kv_heads, max_clusters, head_dim]
  int32_t* assignment = nullptr;    // device [batch, n_kv_heads, max_points]
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};
// Depends on batch, n_kv_heads, head_dim, max_points and max_clusters.
[[nodiscard]] size_t ClusterKvBuildWorkspaceBytes(const ClusterKvBuildParams& p);
[[nodiscard]] absl::Status ClusterKvBuild(const ClusterKvBuildParams& p, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// Quest: page p of sequence b covers tokens [p * page_size, (p + 1) * page_size) (the last page
// of a sequence may be partial); bounds of (b, p, h) are the per-channel min then max over its
// tokens, written at bounds + b * bounds_batch_stride in the CPU QuestIndex payload layout
// [n_pages, n_kv_heads, 2, head_dim] fp32. Pages past ceil(seq_len[b] / page_size) are not
// written. Exact (min / max of the same floats; NaN keys propagate as std::min / std::max do).
struct QuestBoundsParams {
  int batch = 0;
  int n_kv_heads = 0;
  int head_dim = 0;  // <= 256, n_kv_heads * head_dim <= 4096
  int page_size = 16;
  KeyView keys;
  const int32_t* seq_len = nullptr;  // device [batch]
  int max_tokens = 0;
  float* bounds = nullptr;          // device, see above
  int64_t bounds_batch_stride = 0;  // floats, >= ceil(max_tokens / page_size) * n_kv_heads * 2 * d
};
[[nodiscard]] absl::Status QuestPageBounds(const QuestBoundsParams& p, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// KeyDiff: scores[(b * n_kv_heads + h) * score_stride + t] = cos(k_t, sum of the keys of (b, h))
// for t < seq_len[b] (0 when either norm is 0), as kvr::retrieval::KeyDiffScores (fp64 sums).
struct KeyDiffBuildParams {
  int batch = 0;
  int n_kv_heads = 0;
  int head_dim = 0;  // 64 or 128
  KeyView keys;
  const int32_t* seq_len = nullptr;  // device [batch]
  int max_tokens = 0;
  float* scores = nullptr;   // device [batch, n_kv_heads, score_stride]
  int64_t score_stride = 0;  // >= max_tokens
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};
[[nodiscard]] size_t KeyDiffBuildWorkspaceBytes(const KeyDiffBuildParams& p);
[[nodiscard]] absl::Status KeyDiffBuild(const KeyDiffBuildParams& p, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// A2ATS: the codebooks of ONE layer on the device (kvr calibrate's file, codebook.h), per KV head
// the Cholesky factor L and the whitened codewords C^z. Build the host copy with
// A2atsLayerCodebooksFromHost and upload the vectors as is.
struct A2atsHostCodebooks {
  int n_kv_heads = 0, head_dim = 0, size = 0;  // size: codewords per head (the same for all)
  RopeParams rope;
  std::vector<float> chol;        // [n_kv_heads, head_dim, head_dim] row-major lower-triangular
  std::vector<float> codewords;   // [n_kv_heads, size, head_dim]
  std::vector<float> half_norms;  // [n_kv_heads, size] 0.5 |c^z|^2
};
[[nodiscard]] absl::StatusOr<A2atsHostCodebooks> A2atsLayerCodebooksFromHost(
    const A2atsCodebooks& books, int layer);

// ids[(b * n_kv_heads + h) * id_stride + t] = argmin_c |k' L - c^z|^2 (= argmax z.c^z - |c^z|^2/2,
// ties to the lower id) with k' the key of token t un-rotated by its position
// first_position[b] + t (RoPE of `rope`, angles in fp64 as rope.cc), for t < seq_len[b]. Exactly
// A2atsIndex::Build except near-ties (GEMM summation order).
struct A2atsQuantiseParams {
  int batch = 0;
  int n_kv_heads = 0;
  int head_dim = 0;  // 64 or 128
  KeyView keys;
  const int32_t* seq_len = nullptr;         // device [batch]
  const int32_t* first_position = nullptr;  // device [batch]; null: 0
  int max_tokens = 0;
  RopeParams rope;
  int codebook_size = 0;              // <= 65536
  const float* chol = nullptr;        // device [n_kv_heads, head_dim, head_dim]
  const float* codewords = nullptr;   // device [n_kv_heads, codebook_size, head_dim]
  const float* half_norms = nullptr;  // device [n_kv_heads, codebook_size]
  AssignMath math = AssignMath::k3xTf32;
  uint16_t* ids = nullptr;  // device [batch, n_kv_heads, id_stride]
  int64_t id_stride = 0;    // >= max_tokens
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};
[[nodiscard]] size_t A2atsQuantiseWorkspaceBytes(const A2atsQuantiseParams& p);
[[nodiscard]] absl::Status A2atsQuantise(const A2atsQuantiseParams& p, cudaStream_t stream);

}  // namespace kvr::retrieval::cuda
