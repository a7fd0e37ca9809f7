#pragma once
// The life of one request in the controller and its retry rule:
//
//   kQueued --BeginAttempt--> kPrefilling --OnTokensSent--> kStreaming --Finish--> kFinished
//      ^                         |                              |
//      +---- OnNodeFailure ------+  (no token sent yet and      +--OnNodeFailure--> kFailed
//            returns kRetry          attempts left)
//
// A node failure is retried from prefill, on other nodes, only while no token has reached
// the client: once one has, a retry could send a different continuation (sampling, or a
// different method's approximation), so the stream ends with an error instead. Not
// thread-safe: one request is driven by one thread.

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvr::controller {

enum class RequestPhase { kQueued, kPrefilling, kStreaming, kFinished, kFailed, kCancelled };
absl::string_view RequestPhaseName(RequestPhase phase);

class RequestStateMachine {
 public:
  explicit RequestStateMachine(uint32_t max_attempts) : max_attempts_(max_attempts) {}

  // kQueued -> kPrefilling. FAILED_PRECONDITION from any other phase.
  [[nodiscard]] absl::Status BeginAttempt();
  // Tokens reached the client: kPrefilling/kStreaming -> kStreaming.
  [[nodiscard]] absl::Status OnTokensSent(uint32_t n);

  enum class FailureAction { kRetry, kFail };
  // A node of the current attempt failed. kRetry (back to kQueued) when no token was sent and
  // attempts are left; otherwise kFail (-> kFailed).
  FailureAction OnNodeFailure();

  void Finish() { phase_ = RequestPhase::kFinished; }
  void Fail() { phase_ = RequestPhase::kFailed; }
  void Cancel() { phase_ = RequestPhase::kCancelled; }

  RequestPhase phase() const { return phase_; }
  uint32_t attempts() const { return attempts_; }
  uint32_t tokens_sent() const { return tokens_sent_; }
  uint32_t max_attempts() const { return max_attempts_; }

 private:
  const uint32_t max_attempts_;
  RequestPhase phase_ = RequestPhase::kQueued;
  uint32_t attempts_ = 0;
  uint32_t tokens_sent_ = 0;
};

// Whether a downstream error means "this node failed; another node may succeed" (UNAVAILABLE,
// INTERNAL, RESOURCE_EXHAUSTED of a node filled since its heartbeat, ...) rather than a verdict
// on the request itself (INVALID_ARGUMENT, DEADLINE_EXCEEDED, ...).
bool IsNodeFailure(const absl::Status& status);

}  // namespace kvr::controller
