#include "kvr/node/worker.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "spdlog/spdlog.h"

namespace kvr::node {

namespace cv1 = ::kvr::cluster::v1;

absl::StatusOr<WorkerServer> StartWorkerServer(WorkerServerOptions options) {
  absl::StatusOr<std::unique_ptr<NodeServer>> server =
      NodeServer::Start({.grpc = {.listen = options.listen,
                                  .security = options.security,
                                  .client_certificates = ClientCertificates::kRequired,
                                  .services = {options.service},
                                  .max_receive_message_bytes = -1},
                         .health_address = options.health_address});
  if (!server.ok()) return server.status();
  const std::string host = ReachableHost(options.advertise_host.empty() ? HostOf(options.listen)
                                                                        : options.advertise_host);
  WorkerServer out{.server = *std::move(server), .address = ""};
  out.address = absl::StrCat(host, ":", out.server->port());
  out.server->PrintHealthPort(options.program);
  PrintLine(absl::StrCat(options.program, " listening on ", out.address));
  return out;
}

cv1::RegisterRequest WorkerRegistration(cv1::NodeRole role, const std::string& name,
                                        const std::string& address, int metrics_port) {
  cv1::RegisterRequest registration;
  registration.set_role(role);
  registration.set_protocol_version(1);
  registration.set_name(name);
  registration.mutable_endpoints()->set_grpc_address(address);
  registration.mutable_endpoints()->set_metrics_port(
      static_cast<uint32_t>(std::max(0, metrics_port)));
  return registration;
}

int ServeUntilSignal(const std::string& program, const ShutdownSignals& signals, NodeServer& server,
                     MembershipClient::Options membership) {
  membership.on_registered = [program](const std::string& id) {
    // One parseable line for launchers and tests.
    PrintLine(absl::StrCat(program, " registered ", id));
  };
  // Ready ("kvr.ready") = the node got here (its model loaded) and a live store in the cluster.
  membership.on_cluster_view = ReadinessFromClusterView(&server.health());
  MembershipClient client(std::move(membership));

  const int received = signals.Wait();
  spdlog::info("signal {}: shutting down", received);
  client.Stop();  // and Deregister
  server.Shutdown(absl::Now() + absl::Seconds(5));
  return received;
}

}  // namespace kvr::node
