#pragma once
// The controller's gRPC services. Thin: each handler converts the proto to
// domain types, calls Membership / Admission / RequestRunner, and converts the status back.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "kvr/cluster/v1/cluster.grpc.pb.h"
#include "kvr/common/log_limiter.h"
#include "kvr/controller/cancellation.h"
#include "kvr/controller/clock.h"
#include "kvr/controller/generator.h"
#include "kvr/controller/membership.h"
#include "kvr/controller/placement.h"
#include "kvr/controller/request_runner.h"
#include "kvr/controller/validation.h"
#include "kvr/v1/generation.grpc.pb.h"

namespace grpc {
class ServerContext;
}  // namespace grpc

namespace kvr::controller {

// Version of kvr.cluster.v1 this controller speaks (RegisterRequest.protocol_version).
inline constexpr uint32_t kClusterProtocolVersion = 1;

class MembershipService final : public kvr::cluster::v1::Membership::Service {
 public:
  struct Options {
    // Every call must come from a peer that presented a certificate of the cluster CA
    // (kvr::PeerHasClusterCertificate); others get UNAUTHENTICATED and change nothing. Set
    // when the server's port is TLS: on a plaintext port no peer could pass.
    bool require_member_certificate = false;
    // With require_member_certificate: the certificate must also name the node
    // (kvr::PeerNodeIdentity, URI SAN kvr://node/<name>); Register is admitted only with that
    // name as RegisterRequest.name, and Heartbeat / Deregister of a node id only from the
    // identity that registered it (and a registration cannot replace another identity's
    // entry at its address). Others get PERMISSION_DENIED naming the mismatch. Off: any
    // certificate of the CA may register under any name (certificates without node names).
    bool require_node_identity = false;
  };
  explicit MembershipService(Membership* membership) : membership_(membership) {}
  MembershipService(Membership* membership, Options options)
      : membership_(membership), options_(options) {}

  grpc::Status Register(grpc::ServerContext* context,
                        const kvr::cluster::v1::RegisterRequest* request,
                        kvr::cluster::v1::RegisterResponse* response) override;
  grpc::Status Heartbeat(grpc::ServerContext* context,
                         const kvr::cluster::v1::HeartbeatRequest* request,
                         kvr::cluster::v1::HeartbeatResponse* response) override;
  grpc::Status Deregister(grpc::ServerContext* context,
                          const kvr::cluster::v1::DeregisterRequest* request,
                          kvr::cluster::v1::DeregisterResponse* response) override;

 private:
  // UNAUTHENTICATED unless the peer may act as a member (Options).
  grpc::Status CheckMember(const grpc::ServerContext& context) const;
  // With require_node_identity: the node name the peer's certificate proves, or
  // PERMISSION_DENIED saying what the certificate lacks; std::nullopt when not checked.
  [[nodiscard]] absl::StatusOr<std::optional<std::string>> CallerIdentity(
      const grpc::ServerContext& context, absl::string_view call) const;

  Membership* membership_;
  const Options options_{};
  // Refusals are a peer's doing: logged at most once per 10 s, with their count.
  mutable LogLimiter refusals_log_{absl::Seconds(10)};
};

// Watches the ServerContexts of running Generate calls and cancels a request's token when its
// client goes away. The synchronous gRPC API gives a handler no callback for that while it
// blocks on a downstream call, so one thread polls every context at a short period.
class DisconnectWatcher {
 public:
  explicit DisconnectWatcher(absl::Duration period);
  ~DisconnectWatcher();
  DisconnectWatcher(const DisconnectWatcher&) = delete;
  DisconnectWatcher& operator=(const DisconnectWatcher&) = delete;

  // Watches `context` until the returned handle is destroyed (which must happen before the
  // context and the token are).
  class Watch {
   public:
    Watch(DisconnectWatcher* owner, uint64_t id) : owner_(owner), id_(id) {}
    Watch(const Watch&) = delete;
    Watch& operator=(const Watch&) = delete;
    ~Watch();

   private:
    DisconnectWatcher* owner_;
    uint64_t id_;
  };
  [[nodiscard]] std::unique_ptr<Watch> Add(grpc::ServerContext* context, CancellationToken* token);

 private:
  void Loop();
  struct Entry {
    grpc::ServerContext* context;
    CancellationToken* token;
  };
  const absl::Duration period_;
  absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Entry> entries_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// grpc.health.v1 services of the controller's readiness: SERVING while a request can run
// (some model has a live prefill node and decode node), NOT_SERVING before (just started, nodes
// still registering) and when every such node is gone. "kvr.ready" as on the nodes; the
// Generation service by its full name, as gRPC health checking names services. The overall
// service "" stays SERVING while the process runs (liveness; nodes must reach the controller
// to register, so it must not leave a load balancer's rotation for want of nodes).
inline constexpr const char* kControllerReadyServices[] = {"kvr.ready", "kvr.v1.Generation"};

// Keeps that readiness current: calls `set` with the state at start and on every change,
// polling the membership every `period` (leases lapse lazily: there is no event to wait for).
class ReadinessReporter {
 public:
  // `membership` must outlive the reporter; `set` runs on the reporter's thread.
  ReadinessReporter(const Membership* membership, std::function<void(bool ready)> set,
                    absl::Duration period = absl::Milliseconds(200));
  ~ReadinessReporter();  // stops the thread; `set` is not called after it returns
  ReadinessReporter(const ReadinessReporter&) = delete;
  ReadinessReporter& operator=(const ReadinessReporter&) = delete;

 private:
  void Loop();
  const Membership* membership_;
  const std::function<void(bool)> set_;
  const absl::Duration period_;
  absl::Notification stop_;
  std::thread thread_;  // last: started after everything above
};

// kvr.v1.Generation over a Generator (shared with the OpenAI-compatible HTTP server): converts
// the stream's messages and watches for the client going away.
// The public API. Its methods are the generated "streamed" variants, which read the request
// themselves: bytes that do not decode as the request message (garbage, or a string field
// that is not UTF-8, which proto3 refuses) get INVALID_ARGUMENT with a message, where gRPC's
// own decoding answers INTERNAL with none.
class GenerationService final : public kvr::v1::Generation::StreamedService {
 public:
  // `generator` must outlive the service.
  explicit GenerationService(Generator* generator,
                             absl::Duration disconnect_poll_period = absl::Milliseconds(20));

  grpc::Status StreamedGenerate(
      grpc::ServerContext* context,
      grpc::ServerSplitStreamer<kvr::v1::GenerateRequest, kvr::v1::GenerateResponse>* stream)
      override;
  grpc::Status StreamedAbort(
      grpc::ServerContext* context,
      grpc::ServerUnaryStreamer<kvr::v1::AbortRequest, kvr::v1::AbortResponse>* stream) override;
  grpc::Status StreamedListModels(
      grpc::ServerContext* context,
      grpc::ServerUnaryStreamer<kvr::v1::ListModelsRequest, kvr::v1::ListModelsResponse>* stream)
      override;

 private:
  Generator* generator_;
  DisconnectWatcher watcher_;
};

}  // namespace kvr::controller
