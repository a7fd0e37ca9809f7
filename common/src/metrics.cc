#include "kvr/common/metrics.h"

#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <exception>
#include <initializer_list>
#include <mutex>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

#ifndef KVR_VERSION
#define KVR_VERSION "unknown"
#endif

namespace kvr::metrics {
namespace {

// Runs the scrape hooks when the exposer collects. Registered with the exposer before the
// registry: prometheus-cpp collects collectables in registration order, so the hooks have
// refreshed polled values by the time the registry is read.
class HookCollectable : public prometheus::Collectable {
 public:
  void Add(std::function<void()> hook) {
    absl::MutexLock lock(&mu_);
    hooks_.push_back(std::move(hook));
  }
  void Clear() {
    absl::MutexLock lock(&mu_);
    hooks_.clear();
  }
  void Run() const {
    absl::MutexLock lock(&mu_);
    for (const auto& hook : hooks_) hook();
  }
  std::vector<prometheus::MetricFamily> Collect() const override {
    Run();
    return {};
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<std::function<void()>> hooks_ ABSL_GUARDED_BY(mu_);
};

// One metric family with a fixed list of label names, and a cache from label values to the
// child metric. prometheus::Family::Add would construct (and for histograms allocate buckets
// for) a new child on every call before finding the existing one; the cache avoids that.
template <typename T>
class Labelled {
 public:
  Labelled(prometheus::Family<T>& family, std::vector<std::string> names,
           std::vector<double> buckets = {})
      : family_(family), names_(std::move(names)), buckets_(std::move(buckets)) {}

  T& Get(std::initializer_list<std::string_view> values) {
    std::string key;
    for (std::string_view v : values) absl::StrAppend(&key, std::string(v), "\x1f");
    {
      absl::ReaderMutexLock lock(&mu_);
      auto it = children_.find(key);
      if (it != children_.end()) return *it->second;
    }
    prometheus::Labels labels;
    size_t i = 0;
    for (std::string_view v : values) labels.emplace(names_.at(i++), std::string(v));
    absl::MutexLock lock(&mu_);
    T* child;
    if constexpr (std::is_same_v<T, prometheus::Histogram>) {
      child = &family_.Add(labels, buckets_);
    } else {
      child = &family_.Add(labels);
    }
    children_.emplace(std::move(key), child);
    return *child;
  }

 private:
  prometheus::Family<T>& family_;
  const std::vector<std::string> names_;
  const std::vector<double> buckets_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, T*> children_ ABSL_GUARDED_BY(mu_);
};

prometheus::Family<prometheus::Counter>& CounterFamily(prometheus::Registry& r,
                                                       const std::string& name,
                                                       const std::string& help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(r);
}
prometheus::Family<prometheus::Gauge>& GaugeFamily(prometheus::Registry& r, const std::string& name,
                                                   const std::string& help) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(r);
}
prometheus::Family<prometheus::Histogram>& HistogramFamily(prometheus::Registry& r,
                                                           const std::string& name,
                                                           const std::string& help) {
  return prometheus::BuildHistogram().Name(name).Help(help).Register(r);
}

using CounterL = Labelled<prometheus::Counter>;
using GaugeL = Labelled<prometheus::Gauge>;
using HistogramL = Labelled<prometheus::Histogram>;

}  // namespace

// ---------------------------------------------------------------------------------------------
// MetricsServer

struct MetricsServer::Impl {
  MetricsServerOptions options;
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  std::shared_ptr<HookCollectable> hooks = std::make_shared<HookCollectable>();
  // Declared last: destroyed first, so no scrape runs while the registry goes away.
  std::unique_ptr<prometheus::Exposer> exposer;
  int port = 0;
};

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(MetricsServerOptions options) {
  if (options.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics port ", options.port, " is out of range (-1..65535)"));
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  prometheus::BuildGauge()
      .Name("kvr_build_info")
      .Help("kvr build: version and compiler as labels; value 1")
      .Register(*impl->registry)
      .Add({{"version", KVR_VERSION}, {"compiler", __VERSION__}})
      .Set(1);
  prometheus::BuildGauge()
      .Name("kvr_node_info")
      .Help("This process's role (controller, prefill, decode, store) and name; value 1")
      .Register(*impl->registry)
      .Add({{"role", options.role}, {"name", options.node_name}})
      .Set(1);
  if (options.port >= 0) {
    const std::string address = absl::StrCat(options.host, ":", options.port);
    try {
      // Two civetweb threads: scrapes are rare and cheap.
      impl->exposer = std::make_unique<prometheus::Exposer>(address, 2);
    } catch (const std::exception& e) {
      return absl::UnavailableError(
          absl::StrCat("metrics: cannot serve /metrics on ", address, ": ", e.what()));
    }
    impl->exposer->RegisterCollectable(impl->hooks);
    impl->exposer->RegisterCollectable(impl->registry);
    const std::vector<int> ports = impl->exposer->GetListeningPorts();
    if (ports.empty() || ports.front() <= 0) {
      return absl::UnavailableError(
          absl::StrCat("metrics: no listening port reported for ", address));
    }
    impl->port = ports.front();
  }
  return std::unique_ptr<MetricsServer>(new MetricsServer(std::move(impl)));
}

MetricsServer::MetricsServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MetricsServer::~MetricsServer() = default;

prometheus::Registry& MetricsServer::registry() { return *impl_->registry; }
int MetricsServer::port() const { return impl_->port; }
void MetricsServer::AddScrapeHook(std::function<void()> hook) {
  impl_->hooks->Add(std::move(hook));
}
void MetricsServer::ClearScrapeHooks() { impl_->hooks->Clear(); }

std::string MetricsServer::ScrapeText() {
  impl_->hooks->Run();
  return prometheus::TextSerializer().Serialize(impl_->registry->Collect());
}

// ---------------------------------------------------------------------------------------------
// Buckets

namespace buckets {
const std::vector<double>& FirstToken() {
  static const std::vector<double> kBuckets = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,
                                               0.25,  0.5,   0.75, 1,    2.5,  5,    7.5,  10,
                                               20,    40,    80,   160,  320,  640};
  return kBuckets;
}
const std::vector<double>& TokenGap() {
  static const std::vector<double> kBuckets = {
      0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
      0.2,    0.3,   0.4,    0.5,   0.75, 1,     2.5,  5,     7.5,  10,   20,   40,    80};
  return kBuckets;
}
const std::vector<double>& Request() {
  static const std::vector<double> kBuckets = {0.01, 0.025, 0.05, 0.1, 0.3, 0.5,  0.8, 1,  1.5,
                                               2,    2.5,   5,    10,  15,  20,   30,  40, 50,
                                               60,   120,   240,  480, 960, 1920, 7680};
  return kBuckets;
}
const std::vector<double>& Fetch() {
  static const std::vector<double> kBuckets = {0.00002, 0.00005, 0.0001, 0.00025, 0.0005, 0.001,
                                               0.0025,  0.005,   0.01,   0.025,   0.05,   0.1,
                                               0.25,    0.5,     1,      2.5,     5};
  return kBuckets;
}
const std::vector<double>& Ratio() {
  static const std::vector<double> kBuckets = {0.1, 0.2, 0.3,  0.4,  0.5,  0.6, 0.7,
                                               0.8, 0.9, 0.95, 0.98, 0.99, 1.0};
  return kBuckets;
}
}  // namespace buckets

// ---------------------------------------------------------------------------------------------
// ControllerMetrics

struct ControllerMetrics::Families {
  explicit Families(prometheus::Registry& r)
      : ttft(HistogramFamily(r, "kvr_time_to_first_token_seconds",
                             "Arrival at the controller to first token sent to the client"),
             {"model", "method"}, buckets::FirstToken()),
        queue(HistogramFamily(r, "kvr_request_queue_time_seconds",
                              "Arrival at the controller to prefill dispatched"),
              {"model", "method"}, buckets::Request()),
        itl(HistogramFamily(r, "kvr_inter_token_latency_seconds",
                            "Gap between consecutive tokens reaching the client"),
            {"model", "method"}, buckets::TokenGap()),
        tpot(HistogramFamily(r, "kvr_time_per_output_token_seconds",
                             "(e2e - ttft) / (completion tokens - 1) per finished request"),
             {"model", "method"}, buckets::TokenGap()),
        e2e(HistogramFamily(r, "kvr_e2e_request_latency_seconds",
                            "Arrival at the controller to end of stream, any outcome"),
            {"model", "method"}, buckets::Request()),
        requests(CounterFamily(r, "kvr_requests_total",
                               "Requests ended, by outcome (ok or lower-case gRPC code)"),
                 {"model", "method", "outcome"}),
        success(CounterFamily(r, "kvr_request_success_total",
                              "Requests that ended OK, by finish reason"),
                {"model", "method", "finish_reason"}),
        running(GaugeFamily(r, "kvr_requests_running", "Requests placed on nodes and not yet ended")
                    .Add({})),
        prompt_tokens(
            CounterFamily(r, "kvr_prompt_tokens_total", "Prompt tokens of finished requests"),
            {"model"}),
        generation_tokens(CounterFamily(r, "kvr_generation_tokens_total",
                                        "Completion tokens streamed to clients"),
                          {"model"}),
        attempts(CounterFamily(r, "kvr_request_attempts_total",
                               "Placement attempts (more than requests when retried)"),
                 {"model"}),
        node_failures(CounterFamily(r, "kvr_node_failures_total",
                                    "Node errors seen during request attempts, by node role"),
                      {"role"}) {}
  HistogramL ttft, queue, itl, tpot, e2e;
  CounterL requests, success;
  prometheus::Gauge& running;
  CounterL prompt_tokens, generation_tokens, attempts, node_failures;
};

ControllerMetrics::ControllerMetrics(prometheus::Registry& registry)
    : f_(std::make_unique<Families>(registry)) {
  // Exported at 0 from the start, so that rate() and alerts see the series before the first
  // failure (a labelled counter has no sample until a child exists).
  for (std::string_view role : {"prefill", "decode", "store"}) f_->node_failures.Get({role});
}
ControllerMetrics::~ControllerMetrics() = default;

void ControllerMetrics::ObserveTimeToFirstToken(std::string_view model, std::string_view method,
                                                double seconds) {
  f_->ttft.Get({model, method}).Observe(seconds);
}
void ControllerMetrics::ObserveQueueTime(std::string_view model, std::string_view method,
                                         double seconds) {
  f_->queue.Get({model, method}).Observe(seconds);
}
void ControllerMetrics::ObserveInterTokenLatency(std::string_view model, std::string_view method,
                                                 double seconds, uint32_t n_tokens) {
  if (n_tokens == 0) return;
  prometheus::Histogram& h = f_->itl.Get({model, method});
  const double each = seconds / n_tokens;
  for (uint32_t i = 0; i < n_tokens; ++i) h.Observe(each);
}
void ControllerMetrics::ObserveTimePerOutputToken(std::string_view model, std::string_view method,
                                                  double seconds) {
  f_->tpot.Get({model, method}).Observe(seconds);
}
void ControllerMetrics::ObserveE2eLatency(std::string_view model, std::string_view method,
                                          double seconds) {
  f_->e2e.Get({model, method}).Observe(seconds);
}
void ControllerMetrics::CountRequest(std::string_view model, std::string_view method,
                                     std::string_view outcome) {
  f_->requests.Get({model, method, outcome}).Increment();
}
void ControllerMetrics::CountSuccess(std::string_view model, std::string_view method,
                                     std::string_view finish_reason) {
  f_->success.Get({model, method, finish_reason}).Increment();
}
void ControllerMetrics::RequestStarted() { f_->running.Increment(); }
void ControllerMetrics::RequestEnded() { f_->running.Decrement(); }
void ControllerMetrics::AddPromptTokens(std::string_view model, uint64_t n) {
  f_->prompt_tokens.Get({model}).Increment(static_cast<double>(n));
}
void ControllerMetrics::AddGenerationTokens(std::string_view model, uint64_t n) {
  f_->generation_tokens.Get({model}).Increment(static_cast<double>(n));
}
void ControllerMetrics::CountAttempt(std::string_view model) {
  f_->attempts.Get({model}).Increment();
}
void ControllerMetrics::CountNodeFailure(std::string_view role) {
  f_->node_failures.Get({role}).Increment();
}

// ---------------------------------------------------------------------------------------------
// PrefillMetrics

struct PrefillMetrics::Families {
  explicit Families(prometheus::Registry& r)
      : step(HistogramFamily(r, "kvr_prefill_step_seconds",
                             "One request's prefill: all layers, summaries and KV shipping"),
             {"model", "method"}, buckets::FirstToken()),
        tokens(CounterFamily(r, "kvr_prefill_tokens_total", "Prompt tokens prefilled"), {"model"}),
        shipped(CounterFamily(r, "kvr_kv_shipped_bytes_total",
                              "KV and summary bytes sent by prefill, by destination"),
                {"model", "destination"}),
        waiting(GaugeFamily(r, "kvr_requests_waiting",
                            "Requests queued on a node and not yet running, by node role")
                    .Add({{"role", "prefill"}})),
        queued_tokens(GaugeFamily(r, "kvr_prefill_queued_tokens",
                                  "Prompt tokens queued or running on this prefill node")
                          .Add({})),
        prefills(CounterFamily(r, "kvr_prefill_requests_total",
                               "Prefills finished, by outcome (ok or lower-case gRPC code)"),
                 {"model", "outcome"}) {}
  HistogramL step;
  CounterL tokens, shipped;
  prometheus::Gauge& waiting;
  prometheus::Gauge& queued_tokens;
  CounterL prefills;
};

PrefillMetrics::PrefillMetrics(prometheus::Registry& registry)
    : f_(std::make_unique<Families>(registry)) {}
PrefillMetrics::~PrefillMetrics() = default;

void PrefillMetrics::ObservePrefillStep(std::string_view model, std::string_view method,
                                        double seconds) {
  f_->step.Get({model, method}).Observe(seconds);
}
void PrefillMetrics::AddPrefillTokens(std::string_view model, uint64_t n) {
  f_->tokens.Get({model}).Increment(static_cast<double>(n));
}
void PrefillMetrics::AddShippedBytes(std::string_view model, std::string_view destination,
                                     uint64_t bytes) {
  f_->shipped.Get({model, destination}).Increment(static_cast<double>(bytes));
}
void PrefillMetrics::SetWaiting(int64_t requests) {
  f_->waiting.Set(static_cast<double>(requests));
}
void PrefillMetrics::SetQueuedTokens(int64_t tokens) {
  f_->queued_tokens.Set(static_cast<double>(tokens));
}
void PrefillMetrics::CountPrefill(std::string_view model, std::string_view outcome) {
  f_->prefills.Get({model, outcome}).Increment();
}

// ---------------------------------------------------------------------------------------------
// DecodeMetrics

struct DecodeMetrics::Families {
  explicit Families(prometheus::Registry& r)
      : step(HistogramFamily(r, "kvr_decode_step_seconds",
                             "One batched decode step (all layers, all sequences)"),
             {"model"}, buckets::TokenGap()),
        tokens(CounterFamily(r, "kvr_decode_tokens_total", "Tokens generated by this node"),
               {"model"}),
        batch(GaugeFamily(r, "kvr_decode_batch_size",
                          "Sequences in the running batch at the last step"),
              {"model"}),
        waiting(GaugeFamily(r, "kvr_requests_waiting",
                            "Requests queued on a node and not yet running, by node role")
                    .Add({{"role", "decode"}})),
        fetched_bytes(CounterFamily(r, "kvr_kv_fetched_bytes_total",
                                    "KV bytes pulled from the store (hot-cache hits excluded)"),
                      {"model", "method"}),
        fetched_rows(CounterFamily(r, "kvr_kv_fetched_rows_total",
                                   "KV rows pulled from the store (hot-cache hits excluded)"),
                     {"model", "method"}),
        fetch_latency(HistogramFamily(r, "kvr_kv_fetch_latency_seconds",
                                      "One gather request to a store, issue to data ready"),
                      {"model"}, buckets::Fetch()),
        offloaded(CounterFamily(r, "kvr_kv_offloaded_bytes_total",
                                "The decode node's own KV bytes written to the store"),
                  {"model"}),
        hits(CounterFamily(r, "kvr_hot_cache_hits_total",
                           "Selected KV rows found in the GPU hot cache"),
             {"model", "method"}),
        misses(CounterFamily(r, "kvr_hot_cache_misses_total",
                             "Selected KV rows not in the GPU hot cache (fetched)"),
               {"model", "method"}),
        hit_ratio(GaugeFamily(r, "kvr_hot_cache_hit_ratio",
                              "Hot-cache hit ratio of the last reported step, 0..1"),
                  {"model", "method"}),
        summary_bytes(
            GaugeFamily(r, "kvr_summaries_bytes", "Retrieval summaries resident on the GPU"),
            {"model", "method"}),
        recall(HistogramFamily(r, "kvr_retrieval_recall",
                               "Sampled recall of the selected rows against the exact top-k"),
               {"model", "method"}, buckets::Ratio()),
        mass(HistogramFamily(r, "kvr_retrieval_attention_mass",
                             "Sampled softmax attention mass covered by the attended rows"),
             {"model", "method"}, buckets::Ratio()),
        sequences(CounterFamily(r, "kvr_decode_sequences_total",
                                "Sequences finished on this node, by outcome"),
                  {"model", "outcome"}) {}
  HistogramL step;
  CounterL tokens;
  GaugeL batch;
  prometheus::Gauge& waiting;
  CounterL fetched_bytes, fetched_rows;
  HistogramL fetch_latency;
  CounterL offloaded, hits, misses;
  GaugeL hit_ratio, summary_bytes;
  HistogramL recall, mass;
  CounterL sequences;
};

DecodeMetrics::DecodeMetrics(prometheus::Registry& registry)
    : f_(std::make_unique<Families>(registry)) {}
DecodeMetrics::~DecodeMetrics() = default;

void DecodeMetrics::ObserveDecodeStep(std::string_view model, double seconds) {
  f_->step.Get({model}).Observe(seconds);
}
void DecodeMetrics::AddDecodeTokens(std::string_view model, uint64_t n) {
  f_->tokens.Get({model}).Increment(static_cast<double>(n));
}
void DecodeMetrics::SetBatchSize(std::string_view model, int64_t sequences) {
  f_->batch.Get({model}).Set(static_cast<double>(sequences));
}
void DecodeMetrics::SetWaiting(int64_t sequences) {
  f_->waiting.Set(static_cast<double>(sequences));
}
void DecodeMetrics::AddFetched(std::string_view model, std::string_view method, uint64_t bytes,
                               uint64_t rows) {
  f_->fetched_bytes.Get({model, method}).Increment(static_cast<double>(bytes));
  f_->fetched_rows.Get({model, method}).Increment(static_cast<double>(rows));
}
void DecodeMetrics::ObserveFetchLatency(std::string_view model, double seconds) {
  f_->fetch_latency.Get({model}).Observe(seconds);
}
void DecodeMetrics::AddOffloadedBytes(std::string_view model, uint64_t bytes) {
  f_->offloaded.Get({model}).Increment(static_cast<double>(bytes));
}
void DecodeMetrics::AddHotCache(std::string_view model, std::string_view method, uint64_t hits,
                                uint64_t misses) {
  f_->hits.Get({model, method}).Increment(static_cast<double>(hits));
  f_->misses.Get({model, method}).Increment(static_cast<double>(misses));
  if (hits + misses > 0) {
    f_->hit_ratio.Get({model, method})
        .Set(static_cast<double>(hits) / static_cast<double>(hits + misses));
  }
}
void DecodeMetrics::SetSummaryBytes(std::string_view model, std::string_view method,
                                    int64_t bytes) {
  f_->summary_bytes.Get({model, method}).Set(static_cast<double>(bytes));
}
void DecodeMetrics::ObserveRecall(std::string_view model, std::string_view method, double recall) {
  f_->recall.Get({model, method}).Observe(recall);
}
void DecodeMetrics::ObserveAttentionMass(std::string_view model, std::string_view method,
                                         double mass) {
  f_->mass.Get({model, method}).Observe(mass);
}
void DecodeMetrics::CountSequence(std::string_view model, std::string_view outcome) {
  f_->sequences.Get({model, outcome}).Increment();
}

// ---------------------------------------------------------------------------------------------
// StoreMetrics

struct StoreMetrics::Families {
  explicit Families(prometheus::Registry& r)
      : capacity(
            GaugeFamily(r, "kvr_store_capacity_bytes", "Bytes of the store's page pool").Add({})),
        used(GaugeFamily(r, "kvr_store_used_bytes", "Bytes of the page pool in use").Add({})),
        pages(GaugeFamily(r, "kvr_store_pages", "Pages of the pool, by state (free, used)")),
        sequences(GaugeFamily(r, "kvr_store_sequences", "Sequences held by the store").Add({})),
        evictions(CounterFamily(r, "kvr_store_evictions_total",
                                "Sequences evicted by the capacity policy")
                      .Add({})),
        expired(CounterFamily(r, "kvr_store_expired_sequences_total",
                              "Sequences dropped because their lease expired")
                    .Add({})),
        written(CounterFamily(r, "kvr_store_written_bytes_total", "KV bytes written to the store")
                    .Add({})),
        read(
            CounterFamily(r, "kvr_store_read_bytes_total", "KV bytes read from the store").Add({})),
        free_pages(pages.Add({{"state", "free"}})),
        used_pages(pages.Add({{"state", "used"}})) {}
  prometheus::Gauge& capacity;
  prometheus::Gauge& used;
  prometheus::Family<prometheus::Gauge>& pages;
  prometheus::Gauge& sequences;
  prometheus::Counter& evictions;
  prometheus::Counter& expired;
  prometheus::Counter& written;
  prometheus::Counter& read;
  prometheus::Gauge& free_pages;
  prometheus::Gauge& used_pages;
  // Previous values of the monotonic fields, to turn absolute values into increments.
  std::mutex mu;
  StoreSnapshot last;
};

StoreMetrics::StoreMetrics(prometheus::Registry& registry)
    : f_(std::make_unique<Families>(registry)) {}
StoreMetrics::~StoreMetrics() = default;

namespace {
double Increase(uint64_t now, uint64_t before) {
  return static_cast<double>(now >= before ? now - before : now);
}
}  // namespace

void StoreMetrics::Update(const StoreSnapshot& s) {
  f_->capacity.Set(static_cast<double>(s.capacity_bytes));
  f_->used.Set(static_cast<double>(s.used_bytes));
  f_->free_pages.Set(static_cast<double>(s.free_pages));
  f_->used_pages.Set(static_cast<double>(s.total_pages - std::min(s.free_pages, s.total_pages)));
  f_->sequences.Set(static_cast<double>(s.sequences));
  std::lock_guard<std::mutex> lock(f_->mu);
  f_->evictions.Increment(Increase(s.evictions, f_->last.evictions));
  f_->expired.Increment(Increase(s.expired_sequences, f_->last.expired_sequences));
  f_->written.Increment(Increase(s.bytes_written, f_->last.bytes_written));
  f_->read.Increment(Increase(s.bytes_read, f_->last.bytes_read));
  f_->last = s;
}

}  // namespace kvr::metrics
