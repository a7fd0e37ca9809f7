#pragma once
// The retrieval index: the compact summary of one sequence's keys at one layer, which decides
// which KV rows a decode step attends to.
//
// One `RetrievalIndex` object serves one (sequence, layer) and is batched over that layer's KV
// heads; every KV head is independent inside (its own clusters, lists, codes...). Token ids are
// absolute positions in the sequence: the index covers positions [0, size()), fed in order by
// `Build` (the prefill tokens) and then `Append` (generated tokens, in position order).
//
// Life of an index:
//   prefill node:  Make -> Build(prefill keys [+ queries]) -> SerializeIndex -> ship bytes
//   decode node:   DeserializeIndex -> {Select per step; Append as tokens leave the local window}
//   single process (`kvr generate`, the evaluator): SparseAttention does all of it.
//
// Keys and queries are float32 and have RoPE applied, exactly as the runtime stores and computes
// them (model/attention.h). Methods that need position-free vectors (A2ATS's windowed RoPE) undo
// the rotation themselves with `IndexShape::rope` and the token positions (see rope.h): this
// keeps one input convention for every method and costs nothing for the others.
//
// GQA: `Select` receives the whole query group of each KV head ([n_heads, head_dim], query head h
// belongs to KV head h / (n_heads / n_kv_heads)) and returns ONE token set per KV head, because
// the fetched rows are per KV head. How scores of the group's heads are combined is
// `IndexParams::gqa` (default: sum over the group of each head's softmax-normalised scores, i.e.
// estimated attention mass, which is what the fetched set is judged by). Each method documents
// how it applies it.
//
// Note for implementers: Debian's Abseil is built with absl::string_view != std::string_view;
// wrap std::string_view in std::string(...) before passing it to absl::StrCat.
//
// Thread safety: an index is not thread-safe; one caller at a time. Different indexes may be used
// concurrently.

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvr {
class ThreadPool;
}  // namespace kvr

namespace kvr::retrieval {

class ByteWriter;
class ByteReader;

// How the runtime rotated keys and queries. Needed by methods that undo or redo RoPE (A2ATS).
enum class RopeStyle : uint8_t {
  kNone = 0,           // no positional rotation
  kAdjacentPairs = 1,  // rotate pairs (2i, 2i+1)  (GPT-J / llama.cpp "normal" rope)
  kHalfSplit = 2,      // rotate pairs (i, i + rotary_dim/2)  (GPT-NeoX / Hugging Face Llama)
};

struct RopeParams {
  RopeStyle style = RopeStyle::kNone;
  float theta = 10000.f;  // base frequency
  int rotary_dim = 0;     // leading dims that are rotated; 0 means head_dim
};

// Shape of one (layer) index. Serialised in every index header so that a decode node can check
// that the bytes it received belong to its model.
struct IndexShape {
  int n_heads = 0;     // query heads
  int n_kv_heads = 0;  // KV heads; n_heads % n_kv_heads == 0
  int head_dim = 0;
  int layer = 0;     // which layer this index serves (A2ATS codebooks are per layer and head)
  int n_layers = 0;  // layers in the model (for codebook compatibility checks); 0 = unknown
  RopeParams rope;

  int group_size() const { return n_kv_heads > 0 ? n_heads / n_kv_heads : 0; }
  [[nodiscard]] absl::Status Validate() const;
};

// A read-only view of per-token, per-head vectors of one layer (keys or queries).
// Token t, head h lives at data + t * row_stride + h * head_dim.
struct TokenTensor {
  const float* data = nullptr;  // [n_tokens, n_heads_of_this_tensor, head_dim]
  int64_t n_tokens = 0;
  int64_t row_stride = 0;  // floats between consecutive tokens (>= n_heads * head_dim)

  const float* At(int64_t token, int head, int head_dim) const {
    return data + token * row_stride + static_cast<int64_t>(head) * head_dim;
  }
};

// Input of `Build`: the prefill tokens at positions [0, keys.n_tokens).
struct BuildInput {
  TokenTensor keys;  // [n_tokens, n_kv_heads, head_dim], RoPE applied
  // Optional prefill queries ([n_q, n_heads, head_dim], RoPE applied) of the tokens at positions
  // [queries_first_position, queries_first_position + n_q). CTKVR needs the last C of them; other
  // methods ignore them. Passing the last few hundred is enough (the runtime need not keep all).
  TokenTensor queries;  // n_tokens == 0 when absent
  int64_t queries_first_position = 0;
};

// Input of `Append`: generated tokens at positions [size(), size() + keys.n_tokens).
struct AppendInput {
  TokenTensor keys;     // [m, n_kv_heads, head_dim], RoPE applied
  TokenTensor queries;  // [m, n_heads, head_dim] of the same tokens, or n_tokens == 0 (CTKVR FIFO)
};

// One decode step's selection request.
struct SelectRequest {
  const float* query = nullptr;  // [n_heads, head_dim], RoPE applied, the decode token's query
  int64_t query_position = 0;    // position of the decode token (A2ATS re-rotates the query)
  int64_t budget = 0;            // at most this many token ids per KV head (> 0)
  // Tokens the caller already attends to and that must not be returned: sinks [0, n_sink) and
  // the local window [local_begin, ...). Candidates are [n_sink, min(local_begin, size())).
  int64_t n_sink = 0;
  int64_t local_begin = 0;
};

// Output of `Select`: for every KV head, distinct token ids (ascending order), at most `budget`.
// Kept by the caller across steps so that the vectors' storage is reused.
struct Selection {
  std::vector<std::vector<int64_t>> per_head;  // [n_kv_heads][<= budget]
};

// How a method combines the scores of the query heads that share one KV head.
enum class GqaAggregation : uint8_t {
  kSumSoftmax = 0,  // sum over the group of each head's softmax over its candidates (default)
  kMaxLogit = 1,    // max over the group of the (estimated) logits
  kSumLogit = 2,    // sum of logits (= logit of the summed query for linear scorers)
};

// Method resources that are shared by many indexes and are not part of the shipped bytes
// (A2ATS codebooks loaded from a calibration file). Owned by the caller through shared_ptr;
// methods downcast to their own subclass and reject anything else with a clear error.
class MethodAssets {
 public:
  virtual ~MethodAssets() = default;
  virtual std::string_view kind() const = 0;  // e.g. "a2ats-codebooks"
};

// Knobs of the core methods. 0 means "scaled default", chosen from the context length at Build
// time as documented on each field (papers' settings scaled to our context lengths).
struct QuestParams {
  // Tokens per page (Quest's paper and ClusterKV's comparison: 16). 0 -> scaled to the budget:
  // clamp(budget / 16, 1, 16) (QuestPageSize), so that a step takes at least 16 pages as at
  // Quest's smallest budget (256 tokens in pages of 16). Not the default: the GPU decode path
  // (retrieval/cuda/decode, sparse_decode.h) assumes 16-token pages.
  int page_size = 16;
};

struct ClusterKvParams {
  // Prefill clusters C0. ClusterKV uses C0 = L / 80 (400 clusters at 32K), where its 1-2K budgets
  // take 13-25 clusters per step. 0 -> scaled: max(L / 80, clusters_per_budget * L / budget),
  // at most L / 8 (see clusterkv.h).
  int64_t n_clusters = 0;
  // Average clusters a step's budget spans under the scaled C0 (budget / mean cluster size).
  // 16: the paper's 80-token clusters against its 1-2K budgets span 13-25.
  int clusters_per_budget = 16;
  // When a step's last cluster does not fit the budget whole, take its tokens in the order of
  // their own scores (the CPU index then keeps the keys, as ctkvr's rerank does) instead of in
  // position order.
  bool rank_trimmed = false;
  int max_iterations = 10;  // k-means iterations (stops earlier when assignments settle)
  // Incremental clustering: every `append_every` (m) generated tokens are clustered into
  // `append_clusters` (C+) new clusters. Paper: m = 320, C+ = 4. 0 -> scaled from the context.
  int64_t append_every = 0;
  int append_clusters = 4;
};

struct CtkvrParams {
  // C: the last C prefill queries become query centroids. 0 -> scaled default (see ctkvr.h).
  int64_t n_centroids = 0;
  // rho: keys listed per centroid (qcIVF list length). 0 -> scaled default.
  int64_t list_length = 0;
  // C': centroids recalled per decode query before the token rerank. 0 -> scaled default (6).
  int64_t n_recall = 0;
  // Dynamic centroid update: the newest `fifo_size` decode queries replace the oldest centroids
  // (FIFO). 0 disables the update. Default: every centroid of the default C (<= 2048) rotates,
  // as in the paper's update of the whole qcIVF.
  int64_t fifo_size = 2048;
};

struct KeyDiffParams {
  // Fraction of the budget that `keydiff` selection fills with the most distinctive keys; the
  // rest is left empty (the method is query-agnostic: see keydiff.h).
  float fill = 1.f;
};

struct IndexParams {
  // Defaults a caller (SparseAttention, the nodes) applies to Select requests.
  int64_t budget = 256;        // tokens per KV head per step
  int64_t n_sink = 16;         // sink tokens always attended
  int64_t local_window = 256;  // most recent tokens always attended

  GqaAggregation gqa = GqaAggregation::kSumSoftmax;
  uint64_t seed = 0x6b7672;  // for k-means initialisation and random rotations (deterministic)

  QuestParams quest;
  ClusterKvParams clusterkv;
  CtkvrParams ctkvr;
  KeyDiffParams keydiff;

  // Knobs of methods outside the core (ParisKV, A2ATS): "name" -> "value". Each method parses
  // the ones it knows and rejects unknown names with a message listing the valid ones.
  std::map<std::string, std::string, std::less<>> options;
  // Shared read-only resources (A2ATS codebooks). May be null for methods that need none.
  std::shared_ptr<const MethodAssets> assets;
  // Worker threads for Build/Select over heads. Not owned; must outlive the index. May be null
  // (single-threaded). The core methods do not use it yet (they run heads in sequence and rely
  // on SGEMM for the heavy parts); callers parallelise across (sequence, layer) indexes.
  ThreadPool* pool = nullptr;

  // Checks method-independent fields (budget > 0, n_sink >= 0, local_window >= 0).
  [[nodiscard]] absl::Status Validate() const;
};

// quest's page size for these params: quest.page_size, or when 0 clamp(budget / 16, 1, 16).
int QuestPageSize(const IndexParams& params);

class RetrievalIndex {
 public:
  virtual ~RetrievalIndex() = default;
  RetrievalIndex(const RetrievalIndex&) = delete;
  RetrievalIndex& operator=(const RetrievalIndex&) = delete;

  // Registered name, e.g. "clusterkv". Written into the serialised header.
  virtual std::string_view method() const = 0;
  const IndexShape& shape() const { return shape_; }
  // Tokens indexed so far: the index covers positions [0, size()).
  virtual int64_t size() const = 0;

  // Indexes the prefill tokens. Called once, on an empty index. Context-dependent parameter
  // checks happen here (e.g. CTKVR's C larger than the context -> InvalidArgument).
  [[nodiscard]] virtual absl::Status Build(const BuildInput& input) = 0;
  // Indexes generated tokens (positions continue from size()). May be called before Build
  // only if the method allows an empty start (most do not: FailedPrecondition).
  [[nodiscard]] virtual absl::Status Append(const AppendInput& input) = 0;
  // Chooses at most `request.budget` candidate tokens per KV head. Clears and fills `out`.
  [[nodiscard]] virtual absl::Status Select(const SelectRequest& request, Selection* out) = 0;

  // Bytes held by the summary (what a decode node keeps resident), excluding scratch buffers.
  // For `exact`, which keeps full keys, that is the keys.
  virtual int64_t MemoryBytes() const = 0;

  // Writes/reads the method payload (everything after the common header; see registry.h for
  // SerializeIndex/DeserializeIndex, which add and check the header).
  [[nodiscard]] virtual absl::Status SerializePayload(ByteWriter& writer) const = 0;

 protected:
  explicit RetrievalIndex(const IndexShape& shape) : shape_(shape) {}

 private:
  IndexShape shape_;
};

}  // namespace kvr::retrieval
