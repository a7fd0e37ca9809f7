#pragma once
// GPU decode-time selection: score the summaries of every
// (sequence, KV head) of one layer and choose the token ids the decode step fetches.
//
// THE SELECTION CONTRACT (what every selector here writes and what the gather / hot cache /
// decode attention of retrieval/cuda/attend consume):
//   ids    device int32 [batch, n_kv_heads, budget]: for (b, h) the first counts[b, h] entries
//          are distinct absolute token positions of sequence b, ASCENDING; entries
//          [counts[b, h], budget) are -1.
//   counts device int32 [batch, n_kv_heads]: 0 <= counts[b, h] <= budget.
// Candidates of sequence b are [cand_begin[b], cand_end[b]) (sinks before, local window after:
// the caller attends those itself), as SelectRequest's [n_sink, min(local_begin, size)) on the
// CPU (retrieval/include/kvr/retrieval/index.h). Token positions fit in int32 (contexts < 2^31).
//
// GQA: one set per KV head; query head qh belongs to KV head qh / (n_heads / n_kv_heads). The
// group's scores are combined per kvr::retrieval::GqaAggregation, default kSumSoftmax (sum over
// the group of each head's softmax over the candidates), exactly as the CPU reference.
//
// Every launcher is asynchronous on `stream`, validates shapes on the host (InvalidArgument naming
// the field) and returns launch errors as Internal. Scratch memory is caller-owned (`workspace`
// of *WorkspaceBytes(params) bytes, 256-byte aligned) so that a decode step allocates nothing.
// Queries are fp32 (the runtime's RoPE output); keys / summaries as documented per method.
// Accumulation is fp32 everywhere.
//
// CPU references (parity tests in retrieval/cuda/select/tests): `exact` and `quest` of
// retrieval/src/baselines.cc, `clusterkv` of retrieval/src/clusterkv.cc; `pariskv`, `ctkvr` and
// `a2ats` (declared at the end of this file) of retrieval/src/pariskv.cc, ctkvr.cc, a2ats.cc.
//
// Microbenchmark (built here, run on the device machine by scripts/device/kernels-select.sh and
// by the kernels-attend device script):
//   select_cuda_bench [--methods exact,quest,clusterkv,topk,pariskv,ctkvr,a2ats]
//                     [--contexts 8192,32768,131072] [--batches 1,4,16] [--budgets 256,1024]
//                     [--iters 50] [--csv]
// Llama-3-8B attention shape (32 q / 8 kv heads, d = 128; bf16 keys for exact, fp32 page bounds
// for quest, fp32 centroids of L/80 clusters for clusterkv; topk = BatchedTopK alone; pariskv,
// ctkvr, a2ats as documented in the bench, plus pariskv_enc = ParisKvEncode). Prints one
// line per (method, context, batch, budget): us per layer, summary bytes scanned, GB/s and the
// fraction of the 3.0 TB/s HBM ceiling (DESIGN.md 6); --csv prints the same as CSV.

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvr/common/cuda/kv_pool.h"
#include "kvr/retrieval/index.h"

namespace kvr::retrieval::cuda {

// Element type of keys (values match RowDType of gather.cuh and kvr::kv_store::DType).
enum class KeyDType : uint8_t { kF32 = 1, kF16 = 2, kBf16 = 3 };

// Where the output of a selector goes (the contract above).
struct SelectionOutput {
  int budget = 0;             // 1 .. kMaxBudget
  int32_t* ids = nullptr;     // device [batch, n_kv_heads, budget]
  int32_t* counts = nullptr;  // device [batch, n_kv_heads]
};
inline constexpr int kMaxBudget = 4096;

// Candidate ranges, device int32 [batch] each: candidates of sequence b are
// [cand_begin[b], cand_end[b]) (empty when end <= begin).
struct CandidateRanges {
  const int32_t* begin = nullptr;
  const int32_t* end = nullptr;
};

// ---------------------------------------------------------------------------------------------
// Batched top-k over precomputed scores (the building block of every selector).
// Row r = b * n_kv_heads + h has n_valid[r] scores at scores + r * row_stride; the selected
// entries are written as ids id_offset[r] + i (i = index in the row), ascending. Largest scores
// win; ties go to the lower index (as kvr::retrieval::TopKIndices); NaN scores are never chosen.
struct TopKParams {
  int rows = 0;                        // batch * n_kv_heads
  int64_t row_stride = 0;              // floats between rows
  const float* scores = nullptr;       // device [rows, row_stride]
  const int32_t* n_valid = nullptr;    // device [rows]
  const int32_t* id_offset = nullptr;  // device [rows]; null: 0
  SelectionOutput out;                 // ids [rows, budget], counts [rows]
  // Optional scratch of BatchedTopKWorkspaceBytes(p) bytes: with it, rows longer than 16K are
  // split over several CTAs (two stages) while there are fewer rows than half the SMs; without
  // it one CTA per row (slow at small batch).
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};
// n_valid[r] <= row_stride is assumed (it bounds the segments).
[[nodiscard]] size_t BatchedTopKWorkspaceBytes(const TopKParams& p);
[[nodiscard]] absl::Status BatchedTopK(const TopKParams& p, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// exact: true GQA-aggregated scores q.k over every candidate key, then the top `budget`.
// Keys of (b, h), token t (absolute position) start at element
//   base(b, h) + t * token_stride   of `keys`, with
//   base(b, h) = head_offset ? head_offset[b * n_kv_heads + h] : b * batch_stride + h * head_stride
// (packed [batch, n_kv_heads, max_ctx, head_dim], token-major [batch, max_ctx, n_kv_heads, d], or
// the K half of the store's [k | v] rows with token_stride = 2 * head_dim all fit).
// Or PAGED (pool set; ExactSelect only): key t of (b, h) is the first head_dim elements of row t
// of bh = b * n_kv_heads + h in `pool` (kv_pool.h: the KV store's pages as the decode node reads
// them in place), rows of `row_bytes` ([K | V]); data, strides and head_offset are then unused.
struct KeyView {
  const void* data = nullptr;  // device, dtype KeyDType
  KeyDType dtype = KeyDType::kBf16;
  int64_t token_stride = 0;              // elements
  int64_t head_stride = 0;               // elements
  int64_t batch_stride = 0;              // elements
  const int64_t* head_offset = nullptr;  // device [batch, n_kv_heads] elements, optional
  kvr::cuda::KvPoolView pool;            // paged keys (see above)
  int64_t row_bytes = 0;                 // paged: bytes of one row (16-byte multiple)
};

// The attention shape of a selector's parameters P (any *SelectParams below): batch, heads, KV
// heads, head_dim where P has it (ParisKV's is its codec's) and the CPU reference's scale
// 1 / sqrt(head_dim).
template <typename P>
void SetAttentionShape(P& p, int batch, int n_heads, int n_kv_heads, int head_dim) {
  p.batch = batch;
  p.n_heads = n_heads;
  p.n_kv_heads = n_kv_heads;
  if constexpr (requires { p.head_dim; }) p.head_dim = head_dim;
  p.scale = 1.f / std::sqrt(static_cast<float>(head_dim));
}

struct ExactSelectParams {
  int batch = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;   // 64 or 128
  float scale = 0.f;  // 1 / sqrt(head_dim) as the CPU reference
  GqaAggregation gqa = GqaAggregation::kSumSoftmax;
  const float* query = nullptr;  // device [batch, n_heads, head_dim] fp32
  KeyView keys;
  CandidateRanges cand;
  int max_candidates = 0;  // >= cand_end[b] - cand_begin[b] for every b (sizes the workspace)
  SelectionOutput out;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};
// Depends on batch, heads, max_candidates, gqa and out.budget: set them before asking.
[[nodiscard]] size_t ExactSelectWorkspaceBytes(const ExactSelectParams& p);
[[nodiscard]] absl::Status ExactSelect(const ExactSelectParams& p, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// quest: per page of `page_size` tokens and KV head the per-channel min and max key (fp32). Pages
// are ranked by the GQA-aggregated upper bound scale * sum_d max(q_d min_d, q_d max_d) and their
// candidate tokens taken in rank order until the budget; the last page is trimmed to its first
// tokens (exactly the CPU QuestIndex, baselines.cc).
// Bounds of sequence b: bounds + b * bounds_batch_stride, laid out [n_pages, n_kv_heads, 2,
// head_dim] (min then max): the CPU index's payload array as is. Page p covers tokens
// [p * page_size, (p + 1) * page_size). The bounds may be bf16 (bounds_dtype): half the bytes the
// scoring reads; whoever writes them rounds each min down and each max up (outward), so that
// the page's score stays an upper bound of its tokens' q.k.
struct QuestSelectParams {
  int batch = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;  // 64 or 128
  int page_size = 16;
  float scale = 0.f;
  GqaAggregation gqa = GqaAggregation::kSumSoftmax;
  const float* query = nullptr;     // device [batch, n_heads, head_dim] fp32
  const void* bounds = nullptr;     // device, see above
  KeyDType bounds_dtype = KeyDType::kF32;  // kF32 or kBf16
  int64_t bounds_batch_stride = 0;         // elements
  CandidateRanges cand;
  int max_candidates = 0;  // >= cand_end[b] - cand_begin[b] for every b
  SelectionOutput out;     // ceil(budget / page_size) + 2 must be <= 1024
  // Optional device [batch]: row b selects at most min(budgets[b], out.budget) tokens per KV
  // head (the same selection as a launch with that budget); rows stay out.budget apart.
  const int32_t* budgets = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};
[[nodiscard]] size_t QuestSelectWorkspaceBytes(const QuestSelectParams& p);
[[nodiscard]] absl::Status QuestSelect(const QuestSelectParams& p, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// clusterkv: clusters ranked by the GQA-aggregated q.mu (mu = mean key of the cluster), their
// candidate members taken in rank order (members in stored order) until the budget, the last
// cluster trimmed; output ascending (exactly the CPU ClusterKvIndex, clusterkv.cc). The CPU's
// not-yet-clustered (pending) tokens are singleton clusters whose centroid is the key itself,
// which is how ClusterKvLayoutFromIndexes lays them out.
// Exact as long as fewer than 256 of the top-ranked clusters have no candidate member (the GPU
// ranks only the top min(n_clusters, budget + 256) clusters).
struct ClusterKvSelectParams {
  int batch = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;  // 64 or 128
  float scale = 0.f;
  GqaAggregation gqa = GqaAggregation::kSumSoftmax;
  const float* query = nullptr;         // device [batch, n_heads, head_dim] fp32
  // Device [batch, n_kv_heads, max_clusters, head_dim] in centroid_dtype (kF32 or kBf16). bf16
  // halves the bytes the scoring reads, which is most of this selector's time at long context.
  const void* centroids = nullptr;
  KeyDType centroid_dtype = KeyDType::kF32;
  const int32_t* n_clusters = nullptr;  // device [batch, n_kv_heads]
  const int32_t* offsets = nullptr;     // device [batch, n_kv_heads, max_clusters + 1] into members
  const int32_t* members = nullptr;     // device [batch, n_kv_heads, max_members] token ids
  int max_clusters = 0;
  int max_members = 0;
  CandidateRanges cand;
  SelectionOutput out;  // budget <= 2048
  // Optional device [batch]: per-row budgets, as QuestSelectParams::budgets.
  const int32_t* budgets = nullptr;
  // Clusters ranked first (0: max(64, budget / 8)). A row whose first ranked clusters hold
  // fewer candidate tokens than its budget is ranked again over budget + 256 clusters, so the
  // selection is the same either way; the first pass spares ranking and counting 1,280
  // clusters when ~16 fill the budget.
  int first_pick = 0;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};
// Depends on batch, heads, max_clusters, gqa and out.budget.
[[nodiscard]] size_t ClusterKvSelectWorkspaceBytes(const ClusterKvSelectParams& p);
[[nodiscard]] absl::Status ClusterKvSelect(const ClusterKvSelectParams& p, cudaStream_t stream);

// Host side: the GPU layout of CPU `clusterkv` indexes, one per sequence of the batch (same
// shape), read from their payload (RetrievalIndex::SerializePayload). Upload the vectors as is.
struct ClusterKvHostLayout {
  int batch = 0, n_kv_heads = 0, head_dim = 0, max_clusters = 0, max_members = 0;
  std::vector<float> centroids;     // [batch, n_kv_heads, max_clusters, head_dim]
  std::vector<int32_t> n_clusters;  // [batch, n_kv_heads]
  std::vector<int32_t> offsets;     // [batch, n_kv_heads, max_clusters + 1]
  std::vector<int32_t> members;     // [batch, n_kv_heads, max_members]
};
[[nodiscard]] absl::StatusOr<ClusterKvHostLayout> ClusterKvLayoutFromIndexes(
    std::span<const RetrievalIndex* const> indexes);

// =============================================================================================
// ParisKV, CTKVR and A2ATS. CPU references: retrieval/src/pariskv.cc,
// ctkvr.cc, a2ats.cc; parity tests in retrieval/cuda/select/tests/select_quant_test.cc.

// ---------------------------------------------------------------------------------------------
// pariskv: per token and KV head, P/2 bytes of 4-bit direction codes (P = next pow2 >= head_dim,
// two codes per byte, coordinate 2i in the low nibble) and B = P / m fp16 scale weights, exactly
// the CPU index's payload arrays; plus per KV head the number of indexed tokens per sign-pattern
// centroid ([B, 2^m] uint32, derived from the codes; ParisKvEncode maintains it).
// Device layout of a batch (ParisKvHostLayout, or written by ParisKvEncode):
//   codes   uint8  [batch, n_kv_heads, max_tokens, P / 2]
//   weights uint16 [batch, n_kv_heads, max_tokens, B]   (fp16 bits)
//   counts  uint32 [batch, n_kv_heads, B, 2^m]
//   n_tokens int32 [batch]: tokens indexed per sequence (the CPU index's size()).
// Supported: head_dim 64 or 128, m in {2, 4, 8} with P / m <= 32 (m = 2 needs head_dim 64),
// GQA group <= 8.

// What the codes mean (from the CPU index's payload): the shared rotation and magnitude levels.
struct ParisKvCodec {
  int head_dim = 0;
  int padded_dim = 0;    // P
  int subspace_dim = 8;  // m
  uint64_t rotation_seed = 0;
  float levels[8] = {};  // 3-bit magnitude levels, increasing
};
// The codec of a CPU `pariskv` index (its payload header).
[[nodiscard]] absl::StatusOr<ParisKvCodec> ParisKvCodecFromIndex(const RetrievalIndex& index);
// Whether the kernels below take `codec` (head_dim, m); InvalidArgument naming what they do not.
[[nodiscard]] absl::Status ParisKvCodecSupported(const ParisKvCodec& codec);

// Encode (prefill / offload of generated tokens): keys fp32 or bf16 (bf16 is widened exactly,
// so its codes equal the CPU's over the widened floats) with RoPE applied. Writes token
// first + t of KV head h at codes + h * codes_head_stride + (first + t) * P / 2 (bytes) and weights
// + h * weights_head_stride + (first + t) * B (elements), and adds each token to `counts`
// (optional, [n_kv_heads, B, 2^m] at counts + h * B * 2^m). The arithmetic follows the CPU's
// operation order (sequential dot products, no fused multiply-add), so the bytes equal the CPU's.
struct ParisKvEncodeParams {
  int n_tokens = 0;
  int n_kv_heads = 0;
  ParisKvCodec codec;
  // Token t of this call, KV head h at keys.data + t * token_stride + h * head_stride
  // (elements); dtype kF32 or kBf16; not paged (no pool, no head_offset; batch_stride unused).
  KeyView keys;
  int first = 0;  // position of the first token
  uint8_t* codes = nullptr;
  int64_t codes_head_stride = 0;  // bytes
  uint16_t* weights = nullptr;
  int64_t weights_head_stride = 0;  // elements
  uint32_t* counts = nullptr;       // optional
};
[[nodiscard]] absl::Status ParisKvEncode(const ParisKvEncodeParams& p, cudaStream_t stream);

// Selection (section 4.2.2, exactly the CPU ParisKvIndex::Select): collision voting with the
// multi-tier bonus (summed over the query group), the top C tokens by that integer score
// (bucket top-k over [0, group * tiers * B], ties to the lower position), the fused 4-bit rerank
// of those C candidates (eq. 10, GQA per `gqa`) and the top `budget`. C and rho follow
// ScheduleParisKv (pariskv.h) per sequence, computed on the device from the candidate range.
struct ParisKvSelectParams {
  int batch = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  float scale = 0.f;  // 1 / sqrt(head_dim) as the CPU reference
  GqaAggregation gqa = GqaAggregation::kSumSoftmax;
  ParisKvCodec codec;
  int tiers = 6;                      // ParisKvOptions (pariskv.h)
  double candidate_ratio = 0;         // 0 = scheduled
  double collision_ratio = 0;         // 0 = scheduled
  int min_candidates_per_budget = 16;  // as ParisKvOptions' default
  const float* query = nullptr;  // device [batch, n_heads, head_dim] fp32
  const uint8_t* codes = nullptr;
  const uint16_t* weights = nullptr;
  const uint32_t* counts = nullptr;
  const int32_t* n_tokens = nullptr;  // device [batch]
  int max_tokens = 0;
  CandidateRanges cand;
  int max_candidates = 0;  // >= cand_end[b] - cand_begin[b] for every b
  SelectionOutput out;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};
// Depends on batch, heads, codec, tiers, ratios, max_candidates and out.budget.
[[nodiscard]] size_t ParisKvSelectWorkspaceBytes(const ParisKvSelectParams& p);
[[nodiscard]] absl::Status ParisKvSelect(const ParisKvSelectParams& p, cudaStream_t stream);

// Host side: the layout above from CPU `pariskv` indexes (same shape and codec), one per sequence.
struct ParisKvHostLayout {
  int batch = 0, n_kv_heads = 0, max_tokens = 0;
  ParisKvCodec codec;
  std::vector<uint8_t> codes;     // [batch, n_kv_heads, max_tokens, P / 2]
  std::vector<uint16_t> weights;  // [batch, n_kv_heads, max_tokens, B]
  std::vector<uint32_t> counts;   // [batch, n_kv_heads, B, 2^m]
  std::vector<int32_t> n_tokens;  // [batch]
};
[[nodiscard]] absl::StatusOr<ParisKvHostLayout> ParisKvLayoutFromIndexes(
    std::span<const RetrievalIndex* const> indexes);

// ---------------------------------------------------------------------------------------------
// ctkvr: recall of the C' query centroids with the highest cosine to the decode query (max over
// the group; centroids with an empty qcIVF list never count), the union of their lists inside
// the candidate range, and the rerank of that union by true GQA-aggregated scores q.k to the
// budget (exactly the CPU CtkvrIndex::Select without its FIFO update: the selector reads the
// qcIVF; the GPU decode's ctkvr lane rotates and grows it between selections, as the CPU does).
//   centroids    fp32  [batch, n_kv_heads, max_centroids, group, head_dim] unit query centroids
//   n_centroids  int32 [batch, n_kv_heads]
//   list_offsets int32 [batch, n_kv_heads, max_centroids + 1] into lists (empty list: no recall)
//   lists        int32 [batch, n_kv_heads, max_list_entries] token ids, ascending per list
//   list_lengths int32 [batch, n_kv_heads, max_centroids], optional: list c is then the first
//                list_lengths[c] ids from list_offsets[c] (lists of a fixed capacity that grow
//                in place; empty when 0); without it list c ends at list_offsets[c + 1]
// Keys for the rerank: `keys` as ExactSelect's (16-byte aligned, any of the three dtypes; paged
// through keys.pool as ExactSelect's).
struct CtkvrSelectParams {
  int batch = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;  // 64 or 128
  float scale = 0.f;
  GqaAggregation gqa = GqaAggregation::kSumSoftmax;
  int n_recall = 4;  // C' (<= 32)
  const float* query = nullptr;  // device [batch, n_heads, head_dim] fp32
  const float* centroids = nullptr;
  const int32_t* n_centroids = nullptr;
  const int32_t* list_offsets = nullptr;
  const int32_t* lists = nullptr;
  const int32_t* list_lengths = nullptr;
  int max_centroids = 0;
  int max_list_entries = 0;
  int max_list_length = 0;  // longest single list (sizes the recalled set: n_recall * this)
  int max_tokens = 0;       // > every token id (sizes a bitmap)
  KeyView keys;
  CandidateRanges cand;
  SelectionOutput out;
  // Optional device int32 [batch, n_kv_heads]: how many distinct ids the recall found inside the
  // candidate range (before the rerank cuts them to the budget).
  int32_t* n_recalled = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};
[[nodiscard]] size_t CtkvrSelectWorkspaceBytes(const CtkvrSelectParams& p);
[[nodiscard]] absl::Status CtkvrSelect(const CtkvrSelectParams& p, cudaStream_t stream);

// Host side: the layout above from CPU `ctkvr` indexes, plus the keys the CPU index keeps
// (fp32 [batch, max_tokens, n_kv_heads, head_dim], token-major) and its C'.
struct CtkvrHostLayout {
  int batch = 0, n_kv_heads = 0, group = 0, head_dim = 0;
  int max_centroids = 0, max_list_entries = 0, max_list_length = 0, max_tokens = 0;
  int n_recall = 4;
  std::vector<float> centroids;
  std::vector<int32_t> n_centroids;
  std::vector<int32_t> list_offsets;
  std::vector<int32_t> lists;
  std::vector<float> keys;
};
[[nodiscard]] absl::StatusOr<CtkvrHostLayout> CtkvrLayoutFromIndexes(
    std::span<const RetrievalIndex* const> indexes);

// ---------------------------------------------------------------------------------------------
// a2ats: one codeword id (uint16) per token and KV head against the layer's shared query-aware
// codebooks. Per query head: WRoPE re-rotation of the query from its position to the offset b,
// x = q L^-T (= L^-1 q), codeword scores scale * x . c^z (query x codebook table), each
// token scored by its codeword (A2ATS without sub-spaces: the CPU index keeps one id per token,
// so the "sum over subspaces" is one term); the GQA aggregation of the CPU (kSumSoftmax weighs
// codewords by their selectable token counts); whole codewords in rank order until the budget,
// the boundary codeword trimmed to its most recent tokens (exactly the CPU A2atsIndex::Select).
//   chol_inv  fp32  [n_kv_heads, head_dim, head_dim] L^-1 (lower-triangular, this layer; the CPU
//                   solves with L per query, the GPU multiplies by the host-computed inverse)
//   codewords fp32  [n_kv_heads, codebook_size, head_dim] C^z
//   ids       uint16 [batch, n_kv_heads, max_tokens]
struct A2atsSelectParams {
  int batch = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;  // 64 or 128
  float scale = 0.f;
  GqaAggregation gqa = GqaAggregation::kSumSoftmax;
  RopeParams rope;
  int64_t wrope_offset = 0;
  int codebook_size = 0;  // <= 8192
  const float* chol_inv = nullptr;
  const float* codewords = nullptr;
  const float* query = nullptr;             // device [batch, n_heads, head_dim] fp32, RoPE'd
  const int64_t* query_position = nullptr;  // device [batch]
  const uint16_t* ids = nullptr;
  const int32_t* n_tokens = nullptr;  // device [batch]
  int max_tokens = 0;
  CandidateRanges cand;
  int max_candidates = 0;
  SelectionOutput out;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};
[[nodiscard]] size_t A2atsSelectWorkspaceBytes(const A2atsSelectParams& p);
[[nodiscard]] absl::Status A2atsSelect(const A2atsSelectParams& p, cudaStream_t stream);

// Host side: ids of CPU `a2ats` indexes (payload) and the codebooks of their layer
// (A2atsCodebooks from IndexParams::assets, passed here because the payload holds only a hash).
struct A2atsHostLayout {
  int batch = 0, n_kv_heads = 0, head_dim = 0, codebook_size = 0, max_tokens = 0;
  RopeParams rope;
  int64_t wrope_offset = 0;
  std::vector<float> chol_inv;   // [n_kv_heads, head_dim, head_dim] L^-1 (computed in double)
  std::vector<float> codewords;  // [n_kv_heads, codebook_size, head_dim]
  std::vector<uint16_t> ids;     // [batch, n_kv_heads, max_tokens]
  std::vector<int32_t> n_tokens;
};
[[nodiscard]] absl::StatusOr<A2atsHostLayout> A2atsLayoutFromIndexes(
    std::span<const RetrievalIndex* const> indexes, const MethodAssets& codebooks);

}  // namespace kvr::retrieval::cuda
