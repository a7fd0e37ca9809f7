#pragma once
// What the mains of the worker nodes (kvr-prefill, kvr-decode) do around their own service,
// written once: serve it on a port that requires client certificates, print the lines
// launchers read, register with the controller and heartbeat until SIGTERM/SIGINT, then leave.
//
// A worker's main reads (error handling left out):
//   ShutdownSignals signals;
//   ... the model, the metrics server, the engine, the service ...
//   auto worker = StartWorkerServer({.program = "kvr-decode", .service = &service, ...});
//   cluster::v1::RegisterRequest registration = WorkerRegistration(...);  // + capacity
//   ServeUntilSignal("kvr-decode", signals, *worker->server, {...membership options...});

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kvr/cluster/v1/cluster.pb.h"
#include "kvr/common/tls.h"
#include "kvr/node/membership_client.h"
#include "kvr/node/run.h"

namespace grpc {
class Service;
}  // namespace grpc

namespace kvr::node {

struct WorkerServerOptions {
  // The first word of the lines printed on stdout ("kvr-prefill").
  std::string program;
  // host:port of the gRPC port; port 0: any free port.
  std::string listen;
  // The host advertised to the controller; empty: the listen host (loopback for a wildcard).
  std::string advertise_host;
  GrpcSecurity security;
  // The node's service (not owned; must outlive the server).
  grpc::Service* service = nullptr;
  // host:port of the plaintext health-only port; empty: none.
  std::string health_address;
};

struct WorkerServer {
  std::unique_ptr<NodeServer> server;
  // host:port the node advertises: what the controller and the other nodes dial.
  std::string address;
};

// Starts the worker's NodeServer: clients must present a certificate, and received messages
// have no size limit (prompts given as token ids, handoffs of long contexts with their summary
// bytes). Then prints "<program> health on ..." (with a health-only port) and
// "<program> listening on <address>". Errors as NodeServer::Start.
[[nodiscard]] absl::StatusOr<WorkerServer> StartWorkerServer(WorkerServerOptions options);

// The part of a worker's registration every worker fills the same way: role, protocol
// version, name, gRPC address and metrics port (`metrics_port` < 0, metrics off: 0). The
// caller adds its capacity.
[[nodiscard]] cluster::v1::RegisterRequest WorkerRegistration(cluster::v1::NodeRole role,
                                                              const std::string& name,
                                                              const std::string& address,
                                                              int metrics_port);

// Runs a MembershipClient of `membership` (register, heartbeat with its load, re-register on
// NOT_FOUND, retry while the controller is unreachable, on the client's thread) until SIGTERM
// or SIGINT; then deregisters and shuts `server` down, letting running calls finish for 5
// seconds. Sets the options' on_registered to print "<program> registered <id>" and
// on_cluster_view to drive the server's readiness (ReadinessFromClusterView). Returns the
// signal received.
int ServeUntilSignal(const std::string& program, const ShutdownSignals& signals, NodeServer& server,
                     MembershipClient::Options membership);

}  // namespace kvr::node
