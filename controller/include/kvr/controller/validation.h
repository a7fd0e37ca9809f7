#pragma once
// Turns a public GenerateRequest into GenerateParams: checks every field against the models
// the live nodes registered and applies the controller's defaults. Errors are
// INVALID_ARGUMENT and start with the offending field's path ("retrieval.budget: ..."), so
// that clients can tell what to fix.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kvr/controller/membership.h"
#include "kvr/controller/types.h"
#include "kvr/v1/generation.pb.h"

namespace kvr::controller {

// Defaults for fields a request leaves unset.
struct RequestDefaults {
  uint32_t max_tokens = 256;
  std::string method = "full";
  uint32_t budget = 1024;
  uint32_t n_sink = 64;
  uint32_t local_window = 512;
};

// Limits on what a request may ask for.
inline constexpr size_t kMaxStopStrings = 16;
inline constexpr size_t kMaxRequestIdLength = 128;

// `models` are the models live nodes serve (Membership::Models()); the model's context length
// and its decode nodes' retrieval methods come from there, so a method is valid exactly when
// every decode node serving the model registered it.
[[nodiscard]] absl::StatusOr<GenerateParams> ParseGenerateRequest(
    const kvr::v1::GenerateRequest& request, absl::Span<const ModelSummary> models,
    const RequestDefaults& defaults);

// UNAVAILABLE, with the reason, when `model` cannot run now but may soon, so that the client
// retries rather than gives up: no model is served at all (the controller just started and
// its nodes are still registering, or every node is gone), or nodes registered this model but
// no live prefill node and decode node serve it now. OK otherwise, including for a model no
// node ever registered while others are served: ParseGenerateRequest then answers
// INVALID_ARGUMENT naming the served models.
[[nodiscard]] absl::Status CheckModelAvailable(absl::string_view model,
                                               const ModelPresence& presence);

// Checks a client-supplied request id (empty is valid: one is assigned).
[[nodiscard]] absl::Status ValidateRequestId(absl::string_view id);

}  // namespace kvr::controller
