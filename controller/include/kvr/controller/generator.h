#pragma once
// The Generate path shared by every front end (the gRPC kvr.v1.Generation service and the
// OpenAI-compatible HTTP server): model availability, validation, request id, admission, the
// in-flight registry (Abort, duplicate ids), the deadline, then RequestRunner. Plain class; the
// front ends only convert their wire format to kvr.v1.GenerateRequest and events back, and tell
// the request's CancellationToken when their client goes away. Thread-safe.

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kvr/controller/cancellation.h"
#include "kvr/controller/clock.h"
#include "kvr/controller/membership.h"
#include "kvr/controller/placement.h"
#include "kvr/controller/request_runner.h"
#include "kvr/controller/validation.h"
#include "kvr/v1/generation.pb.h"

namespace kvr::controller {

struct GeneratorOptions {
  RequestDefaults defaults;
  // Deadline of requests whose client set none.
  absl::Duration default_timeout = absl::Minutes(10);
  // Told about requests refused before they run; not owned; may be null.
  RequestObserver* observer = nullptr;
};

class Generator {
 public:
  // All pointers must outlive the generator.
  Generator(Membership* membership, Admission* admission, RequestRunner* runner, const Clock* clock,
            GeneratorOptions options);
  Generator(const Generator&) = delete;
  Generator& operator=(const Generator&) = delete;

  // Makes the sink of an admitted request, just before it runs. It may register on `token`
  // (e.g. a disconnect watch that cancels it); the sink is destroyed before the token, when
  // Generate returns.
  using SinkFactory = absl::FunctionRef<std::unique_ptr<ResponseSink>(const GenerateParams& params,
                                                                      CancellationToken* token)>;

  // Runs one request to its end. `client_deadline` is the client's own (InfiniteFuture: none);
  // the configured default timeout caps it. OK after the final event was sent; otherwise the
  // status that ends the request (see kvr.v1.Generation.Generate for the codes).
  [[nodiscard]] absl::Status Generate(const kvr::v1::GenerateRequest& request,
                                      absl::Time client_deadline, SinkFactory make_sink);

  // Cancels an in-flight request; false when no such request is in flight.
  bool Abort(const std::string& request_id);

  std::vector<ModelSummary> Models() const { return membership_->Models(); }
  [[nodiscard]] ModelPresence Presence(absl::string_view model) const {
    return membership_->Presence(model);
  }

 private:
  absl::Status Reject(const absl::Status& status);

  Membership* membership_;
  Admission* admission_;
  RequestRunner* runner_;
  const Clock* clock_;
  const GeneratorOptions options_;
  InFlightRequests in_flight_;
};

}  // namespace kvr::controller
