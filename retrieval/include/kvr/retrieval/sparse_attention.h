#pragma once
// Sparse attention on the CPU: a `kvr::model::Attention` that, at decode steps, attends exactly
// (one softmax) over sink ∪ local window ∪ the tokens a retrieval index selects, and stays dense
// for prefill (n_queries > 1).
//
// It keeps one RetrievalIndex per (sequence, layer), built lazily from the KvView at the first
// decode step of that sequence/layer, from all rows before the query's own token (the runtime's
// dense cache makes every row available) and the last `max_prefill_queries` prefill queries,
// which it keeps from the prefill calls (the runtime prefills in chunks, so the last queries are
// only known once decoding starts; CTKVR needs them). Every later decode step appends the tokens
// that became indexable, so the index always covers [0, position of the decode token).
//
// The result is computed as two partials merged by log-sum-exp (partial_attention.h): resident
// rows (sinks + local window) and selected rows; that is the decode node's computation, run here
// in one process so the evaluator can measure it against dense attention.
//
// Thread safety: Attend/Release from one thread at a time (the runtime's forward pass).

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvr/model/attention.h"
#include "kvr/retrieval/index.h"
#include "kvr/retrieval/registry.h"

namespace kvr::retrieval {

// Precision of the rows a decode step reads from the KV store: the selected rows. The decode
// node holds the sinks and the local window itself, as the cache holds them, and builds and
// extends the summaries from its own keys, so only the selected rows' K and V change.
enum class FetchedRowFormat {
  kAsCached,  // the cache's values unchanged
  kBf16,      // rounded to bf16 (the GPU store's dtype)
  kFp8E4m3,   // fp8 e4m3, one float scale per (row, KV head) for K and one for V (common/fp8.h)
};
// "cache", "bf16", "fp8".
const char* FetchedRowFormatName(FetchedRowFormat format);
// The names above; InvalidArgument naming the valid ones otherwise.
[[nodiscard]] absl::StatusOr<FetchedRowFormat> ParseFetchedRowFormat(absl::string_view name);
// Bytes of one fetched [k | v] row of one KV head in `format`; kAsCached counts 2-byte elements
// (the half rows of the CPU model's default cache).
int64_t FetchedRowBytes(FetchedRowFormat format, int head_dim);

struct SparseAttentionOptions {
  std::string method = "exact";
  IndexParams params;  // budget, n_sink, local_window and method knobs
  RopeParams rope;     // the model's RoPE (copied into every index's shape)
  int n_layers = 0;
  // Keep the last `max_prefill_queries` prefill queries per layer for the index's Build (costs
  // max_prefill_queries * n_heads * head_dim floats per layer until the first decode step).
  bool keep_prefill_queries = true;
  // Layers [0, dense_layers) stay dense. Quest/ClusterKV skip the first two layers; default 0.
  int dense_layers = 0;
  // Prefill queries kept for the index (the last N); CTKVR's C must not exceed it.
  int64_t max_prefill_queries = 512;
  // What the selected rows look like after the store (FetchedRowFormat).
  FetchedRowFormat fetched_rows = FetchedRowFormat::kAsCached;
};

// Per-call statistics, accumulated until Reset (the evaluator reads them).
struct SparseAttentionStats {
  int64_t decode_calls = 0;   // (sequence, layer) decode attentions
  int64_t selected_rows = 0;  // summed over calls and KV heads
  int64_t attended_rows = 0;  // sink + local + selected, summed over calls and KV heads
  double select_seconds = 0;  // time in RetrievalIndex::Select
  double build_seconds = 0;   // time in Build/Append
};

class SparseAttention final : public kvr::model::Attention {
 public:
  // `registry` must outlive this object. InvalidArgument for unknown methods or bad params.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<SparseAttention>> Create(
      const MethodRegistry* registry, SparseAttentionOptions options);

  [[nodiscard]] absl::Status Attend(const kvr::model::AttentionShape& shape,
                                    std::span<const kvr::model::AttentionRequest> batch) override;
  void Release(kvr::model::SequenceId sequence) override;

  // Records prefill queries of (sequence, layer) as a prefill Attend call would: `q` holds the
  // queries [n, n_heads, head_dim] of positions [end_position - n, end_position). Lets a caller
  // that ran the prefill elsewhere (the evaluator shares one dense prefill between methods)
  // hand over what CTKVR needs. Keeps the last max_prefill_queries.
  void RememberPrefillQueries(kvr::model::SequenceId sequence, int layer, int n_heads, int head_dim,
                              const float* q, int64_t n, int64_t end_position);

  // The index of (sequence, layer), or null when not built yet. For the evaluator and tests.
  RetrievalIndex* FindIndex(kvr::model::SequenceId sequence, int layer) const;
  // Bytes held by every index of the sequence.
  int64_t IndexBytes(kvr::model::SequenceId sequence) const;

  const SparseAttentionStats& stats() const { return stats_; }
  // The selection of the most recent decode Attend call (of its last request). The rows it
  // attended besides are sinks [0, min(n_sink, p + 1)) and the local window
  // [max(n_sink', p + 1 - local_window), p] (SparseAttentionOptions::params). For the evaluator.
  const Selection& last_selection() const { return selection_; }
  void ResetStats() { stats_ = {}; }
  const SparseAttentionOptions& options() const { return options_; }

 private:
  SparseAttention(const MethodRegistry* registry, SparseAttentionOptions options);

  struct LayerState {
    std::unique_ptr<RetrievalIndex> index;  // null until the first decode step
    std::vector<float> prefill_queries;     // [n, n_heads, head_dim], the last prefill queries
    int64_t prefill_queries_end = 0;        // position after the last kept query
  };
  struct SequenceState {
    std::vector<LayerState> layers;  // [n_layers]
  };

  [[nodiscard]] absl::Status AttendOne(const kvr::model::AttentionShape& shape,
                                       const kvr::model::AttentionRequest& request);

  const MethodRegistry* registry_;
  SparseAttentionOptions options_;
  absl::flat_hash_map<kvr::model::SequenceId, SequenceState> sequences_;
  SparseAttentionStats stats_;
  // Scratch reused across calls (single-threaded use).
  Selection selection_;
  std::vector<int64_t> rows_;
  std::vector<float> scores_;
  std::vector<float> partial_out_;
  std::vector<float> partial_lse_;
  std::vector<float> fetched_k_, fetched_v_;  // [selected rows, head_dim] of one KV head
};

// Dense causal attention reference for one request (every query over positions <= its own).
// Used for prefill and by tests. `kv.positions` must be empty (dense rows).
[[nodiscard]] absl::Status DenseAttention(const kvr::model::AttentionShape& shape,
                                          const kvr::model::AttentionRequest& request);

}  // namespace kvr::retrieval
