#include "kvr/controller/generator.h"

#include <algorithm>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "kvr/controller/ids.h"
#include "spdlog/spdlog.h"

namespace kvr::controller {

Generator::Generator(Membership* membership, Admission* admission, RequestRunner* runner,
                     const Clock* clock, GeneratorOptions options)
    : membership_(membership),
      admission_(admission),
      runner_(runner),
      clock_(clock),
      options_(std::move(options)) {}

absl::Status Generator::Reject(const absl::Status& status) {
  if (options_.observer != nullptr) options_.observer->OnRejected(status);
  return status;
}

absl::Status Generator::Generate(const kvr::v1::GenerateRequest& request,
                                 absl::Time client_deadline, SinkFactory make_sink) {
  const absl::Time arrival = clock_->Now();
  if (absl::Status s = CheckModelAvailable(request.model(), membership_->Presence(request.model()));
      !s.ok()) {
    return Reject(s);
  }
  absl::StatusOr<GenerateParams> params =
      ParseGenerateRequest(request, membership_->Models(), options_.defaults);
  if (!params.ok()) return Reject(params.status());
  // Random (ids.h): a client's id reveals nothing of the cluster or of other requests.
  if (params->request_id.empty()) params->request_id = NewRequestId();

  absl::StatusOr<Admission::Ticket> ticket = admission_->Admit();
  if (!ticket.ok()) return Reject(ticket.status());

  CancellationToken token;
  if (absl::Status s = in_flight_.Add(params->request_id, &token); !s.ok()) return Reject(s);
  absl::Cleanup forget = [&] { in_flight_.Remove(params->request_id); };

  const absl::Time deadline = std::min(arrival + options_.default_timeout, client_deadline);
  // Destroyed before `forget` runs and before the token: it may hold a registration on it.
  std::unique_ptr<ResponseSink> sink = make_sink(*params, &token);
  absl::Status status = runner_->Run(*params, arrival, deadline, &token, sink.get());
  if (!status.ok()) {
    spdlog::info("request {} ended: {}", params->request_id, status.ToString());
  }
  return status;
}

bool Generator::Abort(const std::string& request_id) {
  return in_flight_.Cancel(
      request_id, absl::CancelledError(absl::StrCat("request ", request_id, " aborted by Abort")));
}

}  // namespace kvr::controller
