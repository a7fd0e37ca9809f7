#include "kvr/controller/services.h"

#include <grpcpp/grpcpp.h>

#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kvr/common/grpc_server.h"
#include "kvr/common/tls.h"
#include "kvr/controller/ids.h"
#include "proto_convert.h"
#include "spdlog/spdlog.h"

namespace kvr::controller {

namespace cv1 = ::kvr::cluster::v1;
namespace v1 = ::kvr::v1;

grpc::Status MembershipService::CheckMember(const grpc::ServerContext& context) const {
  if (!options_.require_member_certificate || PeerHasClusterCertificate(context)) {
    return grpc::Status::OK;
  }
  if (int64_t count = 0; refusals_log_.Allow(absl::Now(), &count)) {
    spdlog::warn("membership call from {} refused: no certificate of the cluster CA ({} such "
                 "refusals since the last line)",
                 context.peer(), count);
  }
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      "membership: the peer presented no certificate of the cluster CA (a node "
                      "needs --tls-ca, --tls-cert and --tls-key)");
}

absl::StatusOr<std::optional<std::string>> MembershipService::CallerIdentity(
    const grpc::ServerContext& context, absl::string_view call) const {
  if (!options_.require_member_certificate || !options_.require_node_identity) {
    return std::optional<std::string>();
  }
  absl::StatusOr<std::string> identity = PeerNodeIdentity(context);
  if (identity.ok()) return std::optional<std::string>(*std::move(identity));
  if (int64_t count = 0; refusals_log_.Allow(absl::Now(), &count)) {
    spdlog::warn("membership {} from {} refused: {} ({} such refusals since the last line)",
                 std::string(call), context.peer(), std::string(identity.status().message()),
                 count);
  }
  return absl::PermissionDeniedError(
      absl::StrCat("membership: ", identity.status().message(),
                   "; the controller checks node identities (require_node_identity)"));
}

namespace {
grpc::Status PermissionDenied(const absl::Status& s) {
  return grpc::Status(grpc::StatusCode::PERMISSION_DENIED, std::string(s.message()));
}
}  // namespace

grpc::Status MembershipService::Register(grpc::ServerContext* context,
                                         const cv1::RegisterRequest* request,
                                         cv1::RegisterResponse* response) {
  if (grpc::Status s = CheckMember(*context); !s.ok()) return s;
  absl::StatusOr<std::optional<std::string>> caller = CallerIdentity(*context, "Register");
  if (!caller.ok()) return PermissionDenied(caller.status());
  if (caller->has_value() && **caller != request->name()) {
    spdlog::warn(
        "membership Register from {} refused: its certificate is for node '{}', the "
        "registration names '{}'",
        context->peer(), **caller, request->name());
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        absl::StrCat("name: the peer's certificate is for node '", **caller, "' (",
                                     NodeIdentityUri(**caller), "); it cannot register as '",
                                     request->name(), "'"));
  }
  if (request->protocol_version() != kClusterProtocolVersion) {
    return grpc::Status(
        grpc::StatusCode::FAILED_PRECONDITION,
        absl::StrCat("protocol_version: ", request->protocol_version(),
                     " is not supported; this controller speaks ", kClusterProtocolVersion));
  }
  if (request->role() == cv1::NODE_ROLE_UNSPECIFIED) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "role: unspecified");
  }
  std::vector<std::string> replaced;
  NodeRegistration registration = FromProto(*request);
  registration.identity = caller->value_or("");
  absl::StatusOr<std::string> id = membership_->Register(std::move(registration), &replaced);
  if (!id.ok()) return ToGrpcStatus(id.status());
  spdlog::info("registered {} node {} '{}' at {} (instance {})",
               cv1::NodeRole_Name(request->role()), *id, request->name(),
               request->endpoints().grpc_address(),
               request->instance_id().empty() ? "unknown" : request->instance_id());
  for (const std::string& old : replaced) {
    spdlog::warn("node {} replaces {} at {}: the address re-registered; what {} held is lost", *id,
                 old, request->endpoints().grpc_address(), old);
  }
  response->set_node_id(*id);
  SetDuration(membership_->lease(), response->mutable_lease());
  // Three heartbeats per lease: one lost heartbeat does not drop a healthy node.
  SetDuration(membership_->lease() / 3, response->mutable_heartbeat_interval());
  response->set_live_stores(static_cast<uint32_t>(membership_->LiveNodes(NodeRole::kStore).size()));
  return grpc::Status::OK;
}

grpc::Status MembershipService::Heartbeat(grpc::ServerContext* context,
                                          const cv1::HeartbeatRequest* request,
                                          cv1::HeartbeatResponse* response) {
  if (grpc::Status s = CheckMember(*context); !s.ok()) return s;
  absl::StatusOr<std::optional<std::string>> caller = CallerIdentity(*context, "Heartbeat");
  if (!caller.ok()) return PermissionDenied(caller.status());
  absl::StatusOr<absl::Time> expiry =
      membership_->Heartbeat(request->node_id(), FromProto(request->load()), *caller);
  if (!expiry.ok()) return ToGrpcStatus(expiry.status());
  SetTimestamp(*expiry, response->mutable_lease_expiry());
  SetDuration(membership_->lease(), response->mutable_lease());
  response->set_live_stores(static_cast<uint32_t>(membership_->LiveNodes(NodeRole::kStore).size()));
  return grpc::Status::OK;
}

grpc::Status MembershipService::Deregister(grpc::ServerContext* context,
                                           const cv1::DeregisterRequest* request,
                                           cv1::DeregisterResponse*) {
  if (grpc::Status s = CheckMember(*context); !s.ok()) return s;
  absl::StatusOr<std::optional<std::string>> caller = CallerIdentity(*context, "Deregister");
  if (!caller.ok()) return PermissionDenied(caller.status());
  absl::Status s = membership_->Deregister(request->node_id(), *caller);
  if (s.ok()) spdlog::info("node {} deregistered", request->node_id());
  return ToGrpcStatus(s);
}

DisconnectWatcher::DisconnectWatcher(absl::Duration period)
    : period_(period), thread_([this] { Loop(); }) {}

DisconnectWatcher::~DisconnectWatcher() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

std::unique_ptr<DisconnectWatcher::Watch> DisconnectWatcher::Add(grpc::ServerContext* context,
                                                                 CancellationToken* token) {
  absl::MutexLock lock(&mu_);
  const uint64_t id = next_id_++;
  entries_.emplace(id, Entry{context, token});
  return std::make_unique<Watch>(this, id);
}

DisconnectWatcher::Watch::~Watch() {
  absl::MutexLock lock(&owner_->mu_);
  owner_->entries_.erase(id_);
}

void DisconnectWatcher::Loop() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    for (auto& [id, e] : entries_) {
      if (e.context->IsCancelled()) e.token->Cancel(absl::CancelledError("client disconnected"));
    }
    // Sleeps for one period, or until Stop. Entries cannot be destroyed while the lock is held,
    // so the contexts above stay valid during the scan.
    mu_.AwaitWithTimeout(absl::Condition(&stop_), period_);
  }
}

ReadinessReporter::ReadinessReporter(const Membership* membership,
                                     std::function<void(bool ready)> set, absl::Duration period)
    : membership_(membership), set_(std::move(set)), period_(period), thread_([this] { Loop(); }) {}

ReadinessReporter::~ReadinessReporter() {
  stop_.Notify();
  thread_.join();
}

void ReadinessReporter::Loop() {
  std::optional<bool> reported;
  do {
    const bool ready = !membership_->Models().empty();
    if (reported != ready) {
      spdlog::info("controller {}", ready ? "ready: a model has a live prefill and decode node"
                                          : "not ready: no model has a live prefill and decode "
                                            "node");
      set_(ready);
      reported = ready;
    }
  } while (!stop_.WaitForNotificationWithTimeout(period_));
}

namespace {

// Writes events to the client's stream; holds the request's disconnect watch.
class WriterSink final : public ResponseSink {
 public:
  WriterSink(grpc::internal::WriterInterface<v1::GenerateResponse>* writer,
             const GenerateParams* params,
             std::unique_ptr<DisconnectWatcher::Watch> watch)
      : writer_(writer), params_(params), watch_(std::move(watch)) {}
  absl::Status Send(const GenerateEvent& event) override {
    if (!writer_->Write(ToGenerateResponse(event, *params_))) {
      return absl::CancelledError("client disconnected");
    }
    return absl::OkStatus();
  }

 private:
  grpc::internal::WriterInterface<v1::GenerateResponse>* writer_;
  const GenerateParams* params_;
  std::unique_ptr<DisconnectWatcher::Watch> watch_;
};

// The answer to a request message that did not decode (Read failed: the bytes are not the
// message, or the client sent none); the same words as every other kvr server's
// (kvr/common/grpc_server.h).
grpc::Status Undecodable(absl::string_view message) { return UndecodableRequestStatus(message); }

}  // namespace

GenerationService::GenerationService(Generator* generator, absl::Duration disconnect_poll_period)
    : generator_(generator), watcher_(disconnect_poll_period) {}

grpc::Status GenerationService::StreamedGenerate(
    grpc::ServerContext* context,
    grpc::ServerSplitStreamer<v1::GenerateRequest, v1::GenerateResponse>* stream) {
  v1::GenerateRequest request;
  if (!stream->Read(&request)) return Undecodable("kvr.v1.GenerateRequest");
  absl::Time deadline = absl::InfiniteFuture();
  const auto client_deadline = context->deadline();
  if (client_deadline != std::chrono::system_clock::time_point::max()) {
    deadline = absl::FromChrono(client_deadline);
  }
  return ToGrpcStatus(generator_->Generate(
      request, deadline, [&](const GenerateParams& params, CancellationToken* token) {
        return std::make_unique<WriterSink>(stream, &params, watcher_.Add(context, token));
      }));
}

grpc::Status GenerationService::StreamedAbort(
    grpc::ServerContext*, grpc::ServerUnaryStreamer<v1::AbortRequest, v1::AbortResponse>* stream) {
  v1::AbortRequest request;
  if (!stream->Read(&request)) return Undecodable("kvr.v1.AbortRequest");
  v1::AbortResponse response;
  response.set_found(generator_->Abort(request.request_id()));
  stream->Write(response);
  return grpc::Status::OK;
}

grpc::Status GenerationService::StreamedListModels(
    grpc::ServerContext*,
    grpc::ServerUnaryStreamer<v1::ListModelsRequest, v1::ListModelsResponse>* stream) {
  v1::ListModelsRequest request;
  if (!stream->Read(&request)) return Undecodable("kvr.v1.ListModelsRequest");
  stream->Write(ToListModelsResponse(generator_->Models()));
  return grpc::Status::OK;
}

}  // namespace kvr::controller
