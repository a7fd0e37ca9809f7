#pragma once
// Prometheus metrics of kvr nodes (issue 8): an HTTP /metrics server and one small class per
// node role that records what the node tells it. Node code calls plain methods
// (ObserveTimeToFirstToken(seconds), AddFetchedBytes(n), ...) and never touches prometheus-cpp
// types, which this header only forward-declares (the library's headers are heavy).
//
// Ownership: a MetricsServer owns the registry; metric sets are constructed with a reference to
// it (CONVENTIONS.md 9: no global registry) and must not outlive it. Every method of every
// metric set is thread-safe (prometheus-cpp counters/gauges/histograms are atomic or locked),
// never blocks on I/O, and costs a hash lookup plus an atomic add: cheap enough per token.
//
// Naming follows Prometheus conventions: base units (seconds, bytes), counters end in _total,
// ratios are 0..1, no request ids in labels. Labels: `model` (served model name) and `method`
// (retrieval method: full, exact, clusterkv, ctkvr, a2ats, pariskv, quest, streaming, ...)
// where they apply. Every node also exports
//   kvr_build_info{version,compiler}  gauge = 1
//   kvr_node_info{role,name}           gauge = 1; role is controller|prefill|decode|store
// so that dashboards can join a target to its role.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace prometheus {
class Registry;
class Exposer;
class Counter;
class Gauge;
class Histogram;
template <typename T>
class Family;
}  // namespace prometheus

namespace kvr::metrics {

struct MetricsServerOptions {
  // Address the HTTP server binds (no port).
  std::string host = "0.0.0.0";
  // TCP port of /metrics: > 0 that port, 0 any free port (see MetricsServer::port()), < 0 no
  // HTTP server (metrics are still recorded; ScrapeText() renders them).
  int port = -1;
  // For kvr_node_info.
  std::string role;
  std::string node_name;
};

// RAII owner of the registry and, unless disabled, of the HTTP server (prometheus-cpp Exposer,
// civetweb threads) that serves it at http://host:port/metrics. Move-only through unique_ptr.
class MetricsServer {
 public:
  // INVALID_ARGUMENT for a bad port, UNAVAILABLE when the address cannot be bound.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      MetricsServerOptions options);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // Where metric sets register. Valid for the server's lifetime.
  prometheus::Registry& registry();
  // The bound port; 0 when the HTTP server is disabled.
  int port() const;
  bool serving() const { return port() > 0; }

  // Runs `hook` before every scrape (HTTP or ScrapeText), on the scraping thread, to refresh
  // polled values (e.g. StoreMetrics from StoreStats). Hooks must be thread-safe and fast, and
  // whatever they capture must outlive the server (or be cleared with ClearScrapeHooks() first).
  void AddScrapeHook(std::function<void()> hook);
  void ClearScrapeHooks();

  // The text exposition format (version 0.0.4) of everything registered, after running the
  // scrape hooks: what GET /metrics returns.
  std::string ScrapeText();

 private:
  struct Impl;
  explicit MetricsServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Histogram bucket boundaries (seconds or ratios), shared so that tests and dashboards agree.
namespace buckets {
// Time to first token and prefill: 1 ms .. 10 min (long prompts prefill for minutes).
const std::vector<double>& FirstToken();
// Inter-token latency, time per output token, decode step: 0.5 ms .. 80 s.
const std::vector<double>& TokenGap();
// End-to-end and queue time: 10 ms .. ~2 h.
const std::vector<double>& Request();
// KV fetch latency (one gather request): 20 us .. 5 s.
const std::vector<double>& Fetch();
// Ratios in 0..1.
const std::vector<double>& Ratio();
}  // namespace buckets

// Front end (kvr-controller): one request as the client sees it. Implemented as a
// controller::RequestObserver in the controller.
class ControllerMetrics {
 public:
  explicit ControllerMetrics(prometheus::Registry& registry);
  ~ControllerMetrics();

  // kvr_time_to_first_token_seconds{model,method}: arrival at the controller -> first token
  // sent to the client (queue and every retry included).
  void ObserveTimeToFirstToken(std::string_view model, std::string_view method, double seconds);
  // kvr_request_queue_time_seconds{model,method}: arrival -> prefill dispatched (placement,
  // admission, retries of placement).
  void ObserveQueueTime(std::string_view model, std::string_view method, double seconds);
  // kvr_inter_token_latency_seconds{model,method}: gap between consecutive tokens reaching
  // the client. A chunk of n tokens arriving `seconds` after the previous chunk counts as n
  // observations of seconds / n (tokens inside a chunk were produced between the two).
  void ObserveInterTokenLatency(std::string_view model, std::string_view method, double seconds,
                                uint32_t n_tokens = 1);
  // kvr_time_per_output_token_seconds{model,method}: per finished request, (e2e - ttft) /
  // (completion tokens - 1).
  void ObserveTimePerOutputToken(std::string_view model, std::string_view method, double seconds);
  // kvr_e2e_request_latency_seconds{model,method}: arrival -> end of stream, any outcome.
  void ObserveE2eLatency(std::string_view model, std::string_view method, double seconds);
  // kvr_requests_total{model,method,outcome}: every request that ended, rejected ones
  // included. outcome is "ok" or the lower-case gRPC code that ended it (resource_exhausted,
  // deadline_exceeded, cancelled, unavailable, invalid_argument, ...). Rejected requests whose
  // model is unknown carry model="" and method="".
  // kvr_request_success_total{model,method,finish_reason}: OK requests by finish reason
  // (eos, stop, length, unspecified).
  void CountRequest(std::string_view model, std::string_view method, std::string_view outcome);
  void CountSuccess(std::string_view model, std::string_view method,
                    std::string_view finish_reason);
  // kvr_requests_running: requests placed on nodes and not yet ended (cluster-wide, as seen by
  // the controller).
  void RequestStarted();
  void RequestEnded();
  // kvr_prompt_tokens_total{model}, kvr_generation_tokens_total{model}: prompt tokens of
  // finished requests; completion tokens streamed to clients (also of failed requests).
  void AddPromptTokens(std::string_view model, uint64_t n);
  void AddGenerationTokens(std::string_view model, uint64_t n);
  // kvr_request_attempts_total{model}: placement attempts (> requests when retried).
  // kvr_node_failures_total{role}: node errors seen during attempts.
  void CountAttempt(std::string_view model);
  void CountNodeFailure(std::string_view role);

 private:
  struct Families;
  std::unique_ptr<Families> f_;
};

// kvr-prefill.
class PrefillMetrics {
 public:
  explicit PrefillMetrics(prometheus::Registry& registry);
  ~PrefillMetrics();

  // kvr_prefill_step_seconds{model,method}: one prefill (all layers, summaries, shipping) of
  // one request's prompt.
  void ObservePrefillStep(std::string_view model, std::string_view method, double seconds);
  // kvr_prefill_tokens_total{model}: prompt tokens prefilled.
  void AddPrefillTokens(std::string_view model, uint64_t n);
  // kvr_kv_shipped_bytes_total{model,destination}: KV rows sent to the store
  // (destination="store") and summaries + sink/local KV sent to decode nodes
  // (destination="decode").
  void AddShippedBytes(std::string_view model, std::string_view destination, uint64_t bytes);
  // kvr_requests_waiting{role="prefill"}: requests queued on this node, not yet running.
  // kvr_prefill_queued_tokens: prompt tokens queued or running.
  void SetWaiting(int64_t requests);
  void SetQueuedTokens(int64_t tokens);
  // kvr_prefill_requests_total{model,outcome}: prefills finished, outcome "ok" or a gRPC code.
  void CountPrefill(std::string_view model, std::string_view outcome);

 private:
  struct Families;
  std::unique_ptr<Families> f_;
};

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
  // kvr_decode_sequences_total{model,outcome}: sequences finished on this node.
  void CountSequence(std::string_view model, std::string_view outcome);

 private:
  struct Families;
  std::unique_ptr<Families> f_;
};

// kvr-store: its StoreStats, as absolute values polled on scrape.
struct StoreSnapshot {
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;
  uint64_t total_pages = 0;
  uint64_t free_pages = 0;
  uint64_t sequences = 0;
  uint64_t evictions = 0;          // monotonic since start
  uint64_t expired_sequences = 0;  // monotonic since start
  uint64_t bytes_written = 0;      // monotonic since start
  uint64_t bytes_read = 0;         // monotonic since start
};

class StoreMetrics {
 public:
  explicit StoreMetrics(prometheus::Registry& registry);
  ~StoreMetrics();

  // Sets every store metric from `s`. Monotonic fields feed counters by their increase since
  // the previous call (a decrease, i.e. a restarted store core, is counted from zero).
  //   kvr_store_capacity_bytes, kvr_store_used_bytes, kvr_store_pages{state="free|used"},
  //   kvr_store_sequences (gauges);
  //   kvr_store_evictions_total, kvr_store_expired_sequences_total,
  //   kvr_store_written_bytes_total, kvr_store_read_bytes_total (counters).
  void Update(const StoreSnapshot& s);

 private:
  struct Families;
  std::unique_ptr<Families> f_;
};

}  // namespace kvr::metrics
