#pragma once
// What every node binary's main does around its own work, written once: take SIGTERM/SIGINT
// synchronously, start the Prometheus exposer, serve gRPC (health, reflection, the
// undecodable-request interceptor, the port's security) with an optional plaintext health-only
// port (health.h), derive readiness from the cluster view, and shut down gracefully.
//
// A main reads (error handling left out):
//   ShutdownSignals signals;                       // first, before any thread starts
//   auto metrics = StartMetricsServer(...);
//   auto server = NodeServer::Start({.grpc = {...}, .health_address = config.health_address});
//   ... MembershipClient membership(...);
//   signals.Wait();
//   membership.Stop(); (*server)->Shutdown(absl::Now() + grace);

#include <signal.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvr/common/grpc_server.h"
#include "kvr/common/metrics.h"
#include "kvr/node/health.h"

namespace grpc {
class Server;
}  // namespace grpc

namespace kvr::node {

// SIGTERM and SIGINT, blocked in the thread that constructs this and in every thread started
// after it (threads inherit the mask: gRPC's, civetweb's, the pools'), and taken on one thread
// with sigwait, outside any signal handler: no async-signal-safety concerns, no globals.
// Construct it first in main, before any thread starts. Also ignores SIGPIPE, so that a write
// to a peer that has gone away (an HTTP or metrics client) fails with EPIPE rather than ending
// the process.
class ShutdownSignals {
 public:
  ShutdownSignals();
  // Blocks until SIGTERM or SIGINT arrives; returns its number.
  int Wait() const;

 private:
  sigset_t signals_;
};

// The Prometheus /metrics server (kvr/common/metrics.h) on the host of `listen` (host:port of
// the node's gRPC port; an empty host: every interface). `port`: > 0 that port, 0 any free
// port, -1 off (a server that serves nothing; port() is then -1).
[[nodiscard]] absl::StatusOr<std::unique_ptr<metrics::MetricsServer>> StartMetricsServer(
    const std::string& listen, int port, const std::string& role, const std::string& node_name);

// One line on stdout for launchers and tests to parse ("kvr-decode listening on HOST:PORT"),
// written with one call and flushed, so that log lines other threads write to stdout (spdlog's
// default sink) cannot land inside it.
void PrintLine(const std::string& line);

// The host part of a host:port address ("" when it has none).
[[nodiscard]] std::string HostOf(const std::string& address);
// `host`, or loopback for an empty or wildcard host (0.0.0.0, [::]), which is not reachable as
// such: what a node advertises and prints when its listen address names no host.
[[nodiscard]] std::string ReachableHost(const std::string& host);

// For a main whose start failed: prints "<program>: <message>" to stderr and returns the exit
// status, 2 for a configuration the node cannot serve (INVALID_ARGUMENT), 1 otherwise.
[[nodiscard]] int ReportStartFailure(const std::string& program, const absl::Status& status);

// The security of a node's gRPC port and clients (GrpcSecurity::Load of `tls`), for a main: on
// failure prints "<program>: <message>" to stderr and returns nullopt, a configuration the node
// cannot serve (the main exits 2).
[[nodiscard]] std::optional<GrpcSecurity> LoadSecurityOrReport(const std::string& program,
                                                               const TlsConfig& tls);

struct NodeServerOptions {
  GrpcServerOptions grpc;
  // host:port of the plaintext health-only port (health.h); empty: none.
  std::string health_address;
};

// A node's gRPC server and, when asked for, its health-only port, with one set of serving
// statuses for both. Move-only through unique_ptr.
class NodeServer {
 public:
  // INVALID_ARGUMENT when the port's security cannot serve; UNAVAILABLE when a port cannot be
  // bound. The messages name the address and carry no program name.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<NodeServer>> Start(NodeServerOptions options);
  ~NodeServer();  // Shutdown(now)
  NodeServer(const NodeServer&) = delete;
  NodeServer& operator=(const NodeServer&) = delete;

  [[nodiscard]] int port() const { return port_; }
  // The health-only port, 0 when there is none.
  [[nodiscard]] int health_port() const { return health_ ? health_->port() : 0; }
  // Where to set serving statuses: both ports answer with them.
  [[nodiscard]] ServingStatuses& health() { return *statuses_; }
  // Prints "<program> health on <host>:<port>" on stdout (a line for launchers and tests) when
  // there is a health-only port; nothing otherwise.
  void PrintHealthPort(const std::string& program) const;

  // Every status NOT_SERVING on both ports; the main port refuses new calls and lets running
  // ones finish until `deadline`, when gRPC cancels them; then the health-only port stops.
  // Idempotent.
  void Shutdown(absl::Time deadline);

 private:
  NodeServer() = default;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::unique_ptr<ServingStatuses> statuses_;
  std::string health_address_;
  std::unique_ptr<HealthOnlyServer> health_;
  bool shut_down_ = false;
};

// The grpc.health.v1 readiness of a prefill or decode node (kReadinessService of
// membership_client.h): sets it NOT_SERVING now and returns the MembershipClient
// on_cluster_view callback that makes it SERVING while the controller holds a live store.
// `statuses` must outlive the membership client.
[[nodiscard]] std::function<void(uint32_t live_stores)> ReadinessFromClusterView(
    ServingStatuses* statuses);

}  // namespace kvr::node
