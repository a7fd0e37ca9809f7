#pragma once
// The grpc.health.v1 statuses of a node, and the plaintext port that serves them alone.
//
// Why a second port: Kubernetes' gRPC probes (kubelet) cannot present a client certificate, so
// they fail on a mutual-TLS port. With health_address set, a node also listens there without
// TLS and serves grpc.health.v1.Health and nothing else (no reflection, no kvr service), with
// the statuses of its main port.
//
// ServingStatuses is where a node sets those statuses: each Set goes to the main server's
// health service (gRPC's default one) and into a table that the health-only port reads, so the
// two ports always answer alike.
//
// Thread safety: every method of ServingStatuses may be called from any thread.
// HealthOnlyServer's methods are not meant to race with Shutdown().

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace grpc {
class HealthCheckServiceInterface;
class Server;
class Service;
}  // namespace grpc

namespace kvr::node {

class ServingStatuses {
 public:
  // `main`: the main server's health service, or null (no main server: tests). Not owned; must
  // outlive this object, or Shutdown() must come first. The overall service "" starts SERVING,
  // as gRPC's default service starts.
  explicit ServingStatuses(grpc::HealthCheckServiceInterface* main);
  ServingStatuses(const ServingStatuses&) = delete;
  ServingStatuses& operator=(const ServingStatuses&) = delete;

  // The status of `service` ("" the overall one).
  void Set(const std::string& service, bool serving);
  // Every service known so far, "" included (grpc::HealthCheckServiceInterface's
  // SetServingStatus(bool)).
  void SetAll(bool serving);
  // Every service NOT_SERVING for good: later Sets change nothing (as gRPC's default service
  // after its server's Shutdown). Also detaches the main server's service.
  void Shutdown();

  // SERVING (true) / NOT_SERVING (false) of `service`; nullopt when it was never set.
  [[nodiscard]] std::optional<bool> Get(const std::string& service) const;
  // A counter that changes with every Set/SetAll/Shutdown, and a wait for it to move past
  // `seen` (true) or `timeout` (false): health Watch streams block on it.
  [[nodiscard]] uint64_t version() const;
  [[nodiscard]] bool WaitForChange(uint64_t seen, absl::Duration timeout) const;

 private:
  mutable absl::Mutex mu_;
  grpc::HealthCheckServiceInterface* main_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, bool> serving_ ABSL_GUARDED_BY(mu_);
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t version_ ABSL_GUARDED_BY(mu_) = 0;
};

// A plaintext gRPC server that serves only grpc.health.v1.Health (Check and Watch) from a
// ServingStatuses. An unknown service answers Check with NOT_FOUND and Watch with
// SERVICE_UNKNOWN, as gRPC's default service does; every other method UNIMPLEMENTED.
class HealthOnlyServer {
 public:
  // Listens on `address` (host:port; port 0: any free one) without TLS. `statuses` is not owned
  // and must outlive the server. UNAVAILABLE "cannot listen for health checks on <address>"
  // when the port cannot be bound.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<HealthOnlyServer>> Start(
      const std::string& address, const ServingStatuses* statuses);
  ~HealthOnlyServer();  // Shutdown(now)
  HealthOnlyServer(const HealthOnlyServer&) = delete;
  HealthOnlyServer& operator=(const HealthOnlyServer&) = delete;

  [[nodiscard]] int port() const { return port_; }
  // Refuses new calls; calls still running (Watch streams) end by `deadline`. Idempotent.
  void Shutdown(absl::Time deadline);

 private:
  HealthOnlyServer() = default;
  std::unique_ptr<grpc::Service> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  bool shut_down_ = false;
};

}  // namespace kvr::node
