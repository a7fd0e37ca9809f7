#pragma once
// The decode node's Prometheus metric set (DecodeMetrics). Registry, naming and thread
// safety: kvr/common/metrics.h.

#include <cstdint>
#include <memory>
#include <string_view>

#include "kvr/common/metrics.h"

namespace kvr::metrics {

// kvr-decode: the batched decode loop and its retrieval.
class DecodeMetrics {
 public:
  explicit DecodeMetrics(prometheus::Registry& registry);
  ~DecodeMetrics();

  // kvr_decode_step_seconds{model}: one batched decode step (all layers, all sequences).
  void ObserveDecodeStep(std::string_view model, double seconds);
  // kvr_decode_tokens_total{model}: tokens generated (sampled) by this node.
  void AddDecodeTokens(std::string_view model, uint64_t n);
  // kvr_decode_batch_size{model}: sequences in the running batch (gauge, last step).
  void SetBatchSize(std::string_view model, int64_t sequences);
  // kvr_requests_waiting{role="decode"}: handed-off sequences waiting for a batch slot.
  void SetWaiting(int64_t sequences);
  // kvr_kv_fetched_bytes_total{model,method}, kvr_kv_fetched_rows_total{model,method}: KV
  // rows pulled from the store (hot-cache hits excluded).
  void AddFetched(std::string_view model, std::string_view method, uint64_t bytes, uint64_t rows);
  // kvr_kv_fetch_latency_seconds{model}: one gather request to a store (issue -> data ready).
  void ObserveFetchLatency(std::string_view model, double seconds);
  // kvr_kv_offloaded_bytes_total{model}: the decode node's own KV rows written to the store.
  void AddOffloadedBytes(std::string_view model, uint64_t bytes);
  // kvr_hot_cache_hits_total{model,method}, kvr_hot_cache_misses_total{model,method}: selected
  // rows found / not found in the GPU hot cache. kvr_hot_cache_hit_ratio{model,method}: the
  // ratio of the last call's counts (0..1); use rate(hits)/rate(hits+misses) for a window.
  void AddHotCache(std::string_view model, std::string_view method, uint64_t hits, uint64_t misses);
  // kvr_summaries_bytes{model,method}: retrieval summaries resident on the GPU (gauge). Not
  // kvr_summary_bytes: promtool rejects names that contain a metric type ("_summary").
  void SetSummaryBytes(std::string_view model, std::string_view method, int64_t bytes);
  // Retrieval quality on a sampled fraction of decode steps (the decode node's
  // --quality-sample-rate, 0..1, default 0: computing them needs the exact oracle top-k from
  // the full keys, which costs a dense pass over the context):
  // kvr_retrieval_recall{model,method}: |selected ∩ exact top-k| / k, per (step, layer, head)
  //   sample or its mean over one step, 0..1.
  // kvr_retrieval_attention_mass{model,method}: the softmax attention mass of the full
  //   context that the attended set (sink ∪ local ∪ selected) covers, 0..1.
  void ObserveRecall(std::string_view model, std::string_view method, double recall);
  void ObserveAttentionMass(std::string_view model, std::string_view method, double mass);
  // kvr_retrieval_selecting_samples_total{model,method}: sampled (step, sequence, layer) that
  //   selected among more candidates than the budget; each adds one recall and mass
  //   observation unless the read of its candidates failed.
  // kvr_retrieval_nonselecting_samples_total{model,method}: sampled ones with nothing to
  //   select (at most `budget` candidates, `full`): every candidate is attended, so they are
  //   not in the histograms. A method whose samples are all here reads no recall at all,
  //   rather than a recall of 1.
  void AddQualitySampled(std::string_view model, std::string_view method, bool selecting,
                         uint64_t n);
  // kvr_decode_sequences_total{model,outcome}: sequences finished on this node.
  void CountSequence(std::string_view model, std::string_view outcome);

 private:
  struct Families;
  std::unique_ptr<Families> f_;
};

}  // namespace kvr::metrics
