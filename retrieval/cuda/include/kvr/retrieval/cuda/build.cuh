#pragma once
// GPU summary building at prefill: the kernels that turn one
// layer's prefill keys of every (sequence, KV head) into the summaries that the decode node's
// selectors (selection.cuh) and capacity policies consume.
//
//   ClusterKvBuild     batched cosine k-means (sinks excluded) + the cluster-sorted layout of
//                      ClusterKvSelectParams (centroids = mean keys, offsets, members)
//   QuestPageBounds    per page and KV head the per-channel min / max key (QuestSelectParams)
//   KeyDiffBuild       cosine of every key to its (sequence, head) mean key
//   A2atsQuantise      WRoPE (un-rotate to pre-RoPE) + query-aware codeword id per key
//   CtkvrBuild         the last C prefill queries as query centroids + the qcIVF lists (top-rho
//                      keys per centroid) in CtkvrSelectParams' layout
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
// CPU references (parity tests in retrieval/cuda/summaries/tests): ClusterKvIndex::Build and
// KMeans (retrieval/src/clusterkv.cc, ops.cc), QuestIndex's bounds (baselines.cc),
// KeyDiffScores (keydiff.cc), A2atsIndex::Build / HeadCodebook::Assign (a2ats.cc, codebook.cc),
// CtkvrIndex::Build (ctkvr.cc).
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
  // Optional, device [batch, n_kv_heads, head_dim]: the mean key float(sum / seq_len) of the fp64
  // sum, as KeyDiffTracker::Mean (what a shipped keydiff index carries); 0 when seq_len is 0.
  float* means = nullptr;
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

// ---------------------------------------------------------------------------------------------
// CTKVR qcIVF build (CtkvrIndex::Build, ctkvr.cc; Algorithm 1 of the paper). Per sequence b:
// C_b query centroids = the last C_b prefill queries; per centroid i and KV head h the list of
// the rho_b listable keys (tokens [n_sink_b, seq_len_b): sinks are never listed) with the highest
//   score(t) = max over the GQA group g of softmax_t(scale * q_{i,h*group+g} . k_{h,t})
// (each group query's softmax over the listable keys, max over the group: the CPU's footnote-3
// choice), ascending token ids. Written in exactly CtkvrSelectParams' layout (selection.cuh), so
// build -> CtkvrSelect runs on the GPU with no host trip:
//   centroids    the C_b queries of the group, each unit-normalised (zero vectors stay 0; all 0
//                when the sequence has no listable key, as the CPU's empty entries)
//   n_centroids  C_b;  list_offsets[c] = min(c, C_b) * list_length_b;  lists padded with -1
// with max_list_entries = max_centroids * max_list_length (every list of b has list_length_b
// entries). CtkvrSelectParams: max_centroids, max_list_length and max_list_entries as the plan's.
// Arithmetic: logits on tensor cores in 3xTF32 (fp32-level accuracy, see AssignMath; bf16 / fp16
// keys are exact tf32 values, so their products need two mma instead of three), softmax in
// the log domain (log-sum-exp per query, then max_g (logit - lse_g): the CPU's order of scores);
// lists equal the CPU's except at near-ties of the rho-th score. Centroid normalisation repeats
// the CPU's Norm (8 partial sums) without FMA contraction: bit-equal centroids.
// Cost: two passes of C * group * listable * head_dim MACs per KV head (log-sum-exp, then
// scores), the scores of `centroid_chunk` centroids at a time written to the workspace and cut
// to the top rho_b by BatchedTopK (selection.cuh).
//
// The host plan: what the CPU index derives from IndexParams (C = ctkvr.n_centroids or
// min(2048, L/16, queries given), rho = ctkvr.list_length or ceil(2.5 * budget), clipped to the
// listable keys) with the same errors (C larger than the context or than the queries given).
struct CtkvrBuildPlan {
  int batch = 0, n_kv_heads = 0, group = 0, head_dim = 0;
  int n_recall = 4;          // C' for CtkvrSelectParams::n_recall
  int max_centroids = 1;     // max over b of C_b (>= 1)
  int max_list_length = 1;   // max over b of list_length_b (>= 1)
  int max_listable = 1;      // max over b of seq_len_b - n_sink_b (>= 1)
  int max_list_entries = 1;  // max_centroids * max_list_length
  // Per sequence, packed [5, batch] (upload as is; CtkvrBuildParams::per_seq):
  //   row 0 first_token   n_sink_b = min(n_sink, seq_len_b)
  //   row 1 n_listable    seq_len_b - n_sink_b
  //   row 2 n_centroids   C_b
  //   row 3 list_length   rho_b (0 when n_listable is 0)
  //   row 4 query_first   index of the first centroid among the queries given (n_queries_b - C_b)
  std::vector<int32_t> per_seq;
};
// shape: n_heads, n_kv_heads, head_dim; params: n_sink, budget, ctkvr.{n_centroids, list_length,
// n_recall}. seq_lens / n_queries: [batch] prefill lengths and prefill queries available.
[[nodiscard]] absl::StatusOr<CtkvrBuildPlan> MakeCtkvrBuildPlan(
    const IndexShape& shape, const IndexParams& params, std::span<const int64_t> seq_lens,
    std::span<const int64_t> n_queries);

struct CtkvrBuildParams {
  int batch = 0;
  int n_heads = 0;
  int n_kv_heads = 0;  // group = n_heads / n_kv_heads <= 128
  int head_dim = 0;    // 64 or 128
  float scale = 0.f;   // 1 / sqrt(head_dim) as the CPU
  KeyView keys;        // key (b, h, t), t the position in sequence b
  // Prefill queries (RoPE applied), any of the three dtypes: query j of head qh of sequence b
  // at base(b, qh) + j * token_stride (KeyView addressing with n_heads heads), j in
  // [0, n_queries_b); centroid i of b is query query_first_b + i.
  KeyView queries;
  const int32_t* per_seq = nullptr;  // device [5, batch]: plan.per_seq
  int max_centroids = 0;             // plan.max_centroids
  int max_list_length = 0;           // plan.max_list_length (<= kMaxBudget)
  int max_listable = 0;              // plan.max_listable
  // Centroids scored per pass (0: as many as keep the score buffer near 256 MiB). Sizes the
  // workspace; rounded to whole tiles of 128 / group centroids.
  int centroid_chunk = 0;
  // The summary (layout above).
  float* centroids = nullptr;       // device [batch, n_kv_heads, max_centroids, group, head_dim]
  int32_t* n_centroids = nullptr;   // device [batch, n_kv_heads]
  int32_t* list_offsets = nullptr;  // device [batch, n_kv_heads, max_centroids + 1]
  int32_t* lists = nullptr;         // device [batch, n_kv_heads, max_centroids * max_list_length]
  // Optional, what the CPU index keeps beside each entry for its Append (insertion test):
  //   norms       fp32 [batch, n_kv_heads, max_centroids, group] the queries' norms (Norm's
  //               order, as the centroids' normalisation);
  //   thresholds  fp32 [batch, n_kv_heads, max_centroids] the smallest max-over-group logit
  //               scale * q_g . k of the entry's list (sums in kvr::retrieval::Dot's order; the
  //               CPU's come from a BLAS GEMM, so they may differ in the last bits); 0 for an
  //               entry of a sequence without listable keys, as the CPU's empty entries.
  float* norms = nullptr;
  float* thresholds = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};
// Depends on batch, heads, head_dim, max_centroids, max_list_length, max_listable and
// centroid_chunk.
[[nodiscard]] size_t CtkvrBuildWorkspaceBytes(const CtkvrBuildParams& p);
[[nodiscard]] absl::Status CtkvrBuild(const CtkvrBuildParams& p, cudaStream_t stream);

}  // namespace kvr::retrieval::cuda
