#include "kvr/controller/request_state.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvr::controller {

absl::string_view RequestPhaseName(RequestPhase phase) {
  switch (phase) {
    case RequestPhase::kQueued:
      return "queued";
    case RequestPhase::kPrefilling:
      return "prefilling";
    case RequestPhase::kStreaming:
      return "streaming";
    case RequestPhase::kFinished:
      return "finished";
    case RequestPhase::kFailed:
      return "failed";
    case RequestPhase::kCancelled:
      return "cancelled";
  }
  return "unknown";
}

absl::Status RequestStateMachine::BeginAttempt() {
  if (phase_ != RequestPhase::kQueued) {
    return absl::FailedPreconditionError(
        absl::StrCat("BeginAttempt in phase ", RequestPhaseName(phase_)));
  }
  if (attempts_ >= max_attempts_) {
    return absl::FailedPreconditionError(absl::StrCat("all ", max_attempts_, " attempts used"));
  }
  ++attempts_;
  phase_ = RequestPhase::kPrefilling;
  return absl::OkStatus();
}

absl::Status RequestStateMachine::OnTokensSent(uint32_t n) {
  if (phase_ != RequestPhase::kPrefilling && phase_ != RequestPhase::kStreaming) {
    return absl::FailedPreconditionError(
        absl::StrCat("tokens sent in phase ", RequestPhaseName(phase_)));
  }
  tokens_sent_ += n;
  if (tokens_sent_ > 0) phase_ = RequestPhase::kStreaming;
  return absl::OkStatus();
}

RequestStateMachine::FailureAction RequestStateMachine::OnNodeFailure() {
  if (phase_ == RequestPhase::kPrefilling && tokens_sent_ == 0 && attempts_ < max_attempts_) {
    phase_ = RequestPhase::kQueued;
    return FailureAction::kRetry;
  }
  phase_ = RequestPhase::kFailed;
  return FailureAction::kFail;
}

bool IsNodeFailure(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kCancelled:
      return true;
    default:
      return false;
  }
}

}  // namespace kvr::controller
