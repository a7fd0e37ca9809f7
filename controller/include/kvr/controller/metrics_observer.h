#pragma once
// The Prometheus side of RequestObserver: turns a request's hooks into ControllerMetrics
// (kvr/controller/metrics.h, which documents each metric). Thread-safe: one instance serves every
// request; per-request timing state lives in a map keyed by request id under a mutex, held only
// for the map update (metrics are recorded outside it).
//
// Timing: arrival is known from OnFirstToken (now - time_to_first_token). A request that fails
// before its first token has its e2e latency measured from its first attempt (placement), which
// omits only the validation/admission microseconds before it.

#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvr/controller/clock.h"
#include "kvr/controller/metrics.h"
#include "kvr/controller/request_runner.h"

namespace kvr::controller {

class MetricsObserver final : public RequestObserver {
 public:
  // Neither pointer is owned; both must outlive the observer.
  MetricsObserver(metrics::ControllerMetrics* metrics, const Clock* clock);

  void OnRejected(const absl::Status& status) override;
  void OnAttempt(const GenerateParams& params, const PlacementDecision& placement,
                 uint32_t attempt) override;
  void OnNodeFailure(const GenerateParams& params, absl::string_view node_id,
                     const absl::Status& error) override;
  void OnFirstToken(const GenerateParams& params, absl::Duration queue,
                    absl::Duration time_to_first_token) override;
  void OnTokens(const GenerateParams& params, uint32_t n) override;
  void OnEnd(const GenerateParams& params, const absl::Status& outcome,
             const FinalReport* report) override;

  // "ok" or the lower-case canonical code name ("resource_exhausted").
  static std::string OutcomeLabel(const absl::Status& status);

 private:
  struct Timing {
    absl::Time start;                           // first attempt
    absl::Time arrival = absl::InfinitePast();  // known after the first token
    absl::Time last_token = absl::InfinitePast();
    std::string prefill_node, decode_node, store_node;
  };

  metrics::ControllerMetrics* metrics_;
  const Clock* clock_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Timing> timings_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvr::controller
