#include "kvr/node/run.h"

#include <grpcpp/grpcpp.h>
#include <pthread.h>

#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvr/node/membership_client.h"

namespace kvr::node {

ShutdownSignals::ShutdownSignals() {
  sigemptyset(&signals_);
  sigaddset(&signals_, SIGTERM);
  sigaddset(&signals_, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals_, nullptr);
  signal(SIGPIPE, SIG_IGN);
}

int ShutdownSignals::Wait() const {
  int received = 0;
  sigwait(&signals_, &received);
  return received;
}

std::string HostOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  return colon == std::string::npos ? std::string() : address.substr(0, colon);
}

std::string ReachableHost(const std::string& host) {
  if (host.empty() || host == "0.0.0.0" || host == "[::]") return "127.0.0.1";
  return host;
}

int ReportStartFailure(const std::string& program, const absl::Status& status) {
  std::cerr << program << ": " << status.message() << "\n";
  return status.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

std::optional<GrpcSecurity> LoadSecurityOrReport(const std::string& program, const TlsConfig& tls) {
  absl::StatusOr<GrpcSecurity> security = GrpcSecurity::Load(tls);
  if (!security.ok()) {
    std::cerr << program << ": " << security.status().message() << "\n";
    return std::nullopt;
  }
  return *std::move(security);
}

absl::StatusOr<std::unique_ptr<metrics::MetricsServer>> StartMetricsServer(
    const std::string& listen, int port, const std::string& role, const std::string& node_name) {
  const std::string host = HostOf(listen);
  return metrics::MetricsServer::Start({.host = host.empty() ? "0.0.0.0" : host,
                                        .port = port,
                                        .role = role,
                                        .node_name = node_name});
}

absl::StatusOr<std::unique_ptr<NodeServer>> NodeServer::Start(NodeServerOptions options) {
  std::unique_ptr<NodeServer> out(new NodeServer());
  absl::StatusOr<StartedGrpcServer> started = StartGrpcServer(options.grpc);
  if (!started.ok()) return started.status();
  out->server_ = std::move(started->server);
  out->port_ = started->port;
  out->statuses_ = std::make_unique<ServingStatuses>(out->server_->GetHealthCheckService());
  if (!options.health_address.empty()) {
    absl::StatusOr<std::unique_ptr<HealthOnlyServer>> health =
        HealthOnlyServer::Start(options.health_address, out->statuses_.get());
    if (!health.ok()) return health.status();  // ~NodeServer stops the main port
    out->health_ = std::move(*health);
    out->health_address_ = options.health_address;
  }
  return out;
}

NodeServer::~NodeServer() { Shutdown(absl::Now()); }

void PrintLine(const std::string& line) {
  const std::string whole = line + "\n";
  std::fwrite(whole.data(), 1, whole.size(), stdout);
  std::fflush(stdout);
}

void NodeServer::PrintHealthPort(const std::string& program) const {
  if (health_ == nullptr) return;
  PrintLine(absl::StrCat(program, " health on ", HostOf(health_address_), ":", health_->port()));
}

void NodeServer::Shutdown(absl::Time deadline) {
  if (shut_down_ || server_ == nullptr) return;
  shut_down_ = true;
  statuses_->Shutdown();
  server_->Shutdown(absl::ToChronoTime(deadline));
  server_->Wait();
  if (health_) health_->Shutdown(absl::Now());
}

std::function<void(uint32_t)> ReadinessFromClusterView(ServingStatuses* statuses) {
  statuses->Set(kReadinessService, false);
  return [statuses](uint32_t live_stores) { statuses->Set(kReadinessService, live_stores > 0); };
}

}  // namespace kvr::node
