#include "kvr/common/metrics.h"

#include <prometheus/collectable.h>
#include <prometheus/exposer.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <exception>
#include <utility>

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

}  // namespace kvr::metrics
