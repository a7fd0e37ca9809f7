#pragma once
// Prometheus metrics of kvr nodes: an HTTP /metrics server (MetricsServer, owner of the
// registry) and the bucket boundaries the roles share. Each role's metric set lives beside the
// role (kvr/controller/metrics.h, kvr/prefill_node/metrics.h, kvr/decode/metrics.h,
// kvr/kv_store/metrics.h) and is built with kvr/common/metric_families.h. Node code calls plain
// methods (ObserveTimeToFirstToken(seconds), AddFetchedBytes(n), ...) and never touches
// prometheus-cpp types, which this header only forward-declares (the library's headers are
// heavy).
//
// Ownership: a MetricsServer owns the registry; metric sets are constructed with a reference to
// it (no global registry) and must not outlive it. Every method of every metric set is
// thread-safe (prometheus-cpp counters/gauges/histograms are atomic or locked), never blocks on
// I/O, and costs a hash lookup plus an atomic add: cheap enough per token.
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

}  // namespace kvr::metrics
