// kvr-controller: the cluster's front door. Serves kvr.v1.Generation to clients,
// kvr.cluster.v1.Membership to nodes, gRPC health and server reflection, and the
// OpenAI-compatible HTTP API (http_server.h).

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kvr/common/metrics.h"
#include "kvr/common/tls.h"
#include "kvr/controller/clock.h"
#include "kvr/controller/config.h"
#include "kvr/controller/generator.h"
#include "kvr/controller/grpc_node_clients.h"
#include "kvr/controller/http_server.h"
#include "kvr/controller/membership.h"
#include "kvr/controller/metrics_observer.h"
#include "kvr/controller/placement.h"
#include "kvr/controller/request_runner.h"
#include "kvr/controller/services.h"
#include "kvr/node/run.h"
#include "spdlog/spdlog.h"

namespace kvr::controller {
namespace {

int Serve(const ControllerConfig& config) {
  spdlog::set_level(spdlog::level::from_str(config.log_level));
  // Before any thread starts; also ignores SIGPIPE (a write to an HTTP client that has gone away
  // must fail with EPIPE, not end the process).
  node::ShutdownSignals signals;

  const std::optional<GrpcSecurity> security =
      node::LoadSecurityOrReport("kvr-controller", config.tls);
  if (!security) return 2;
  spdlog::info("gRPC: {}{}", security->Describe(),
               !security->enabled()           ? ""
               : config.require_node_identity ? "; members must present a certificate of the CA "
                                                "that names their node (kvr://node/<name>)"
                                              : "; members must present a certificate of the CA");
  SystemClock clock;
  const std::string host = node::HostOf(config.listen);
  // Declared before everything that reports to it, so it outlives them.
  absl::StatusOr<std::unique_ptr<kvr::metrics::MetricsServer>> metrics_server =
      node::StartMetricsServer(config.listen, config.metrics_port, "controller", "kvr-controller");
  if (!metrics_server.ok()) {
    std::cerr << "kvr-controller: " << metrics_server.status().message() << "\n";
    return 1;
  }
  kvr::metrics::ControllerMetrics controller_metrics((*metrics_server)->registry());
  MetricsObserver metrics_observer(&controller_metrics, &clock);
  Membership membership(&clock, absl::Seconds(config.lease_seconds));
  Placement placement(&membership);
  Admission admission(config.max_in_flight);
  GrpcNodeClients clients(*security);
  PrefixCache prefix_cache({.max_entries = config.prefix_cache_entries});
  RequestRunner runner(
      &membership, &placement, &clients, &clients, &clock,
      RunnerOptions{.max_attempts = config.max_attempts,
                    .observer = &metrics_observer,
                    .prefix_cache = config.prefix_cache_seconds > 0 ? &prefix_cache : nullptr,
                    .prefix_retain = absl::Seconds(config.prefix_cache_seconds)});
  Generator generator(
      &membership, &admission, &runner, &clock,
      GeneratorOptions{.defaults = config.defaults,
                       .default_timeout = absl::Seconds(config.default_timeout_seconds),
                       .observer = &metrics_observer});
  GenerationService generation(&generator);
  // With TLS, only peers whose certificate chains to the cluster CA may join or act as members;
  // public clients share the port without one.
  MembershipService membership_service(
      &membership,
      MembershipService::Options{.require_member_certificate = security->enabled(),
                                 .require_node_identity = config.require_node_identity});
  // The OpenAI-compatible HTTP API, in this process over the same Generator as the gRPC API.
  std::unique_ptr<OpenAiHttpServer> http_server;
  if (!config.http_listen.empty()) {
    // One worker thread per running request (each blocks as a synchronous gRPC call does):
    // enough for max_in_flight up to a bound; more wait in the server's queue.
    const int threads = static_cast<int>(std::clamp<uint32_t>(config.max_in_flight + 4, 8, 256));
    absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> started = OpenAiHttpServer::Start(
        &generator, HttpServerOptions{.listen = config.http_listen,
                                      .api_key = config.api_key,
                                      .threads = threads,
                                      .tls = {
                                          .cert_file = config.http_tls_cert,
                                          .key_file = config.http_tls_key,
                                          .client_ca_file = config.http_tls_client_ca,
                                      }});
    if (!started.ok()) {
      std::cerr << "kvr-controller: " << started.status().message() << "\n";
      return started.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
    }
    http_server = std::move(*started);
    spdlog::info("HTTP API: {}", http_server->tls()
                                     ? (config.http_tls_client_ca.empty()
                                            ? "HTTPS"
                                            : "HTTPS; clients must present a certificate of "
                                              "http_tls_client_ca")
                                     : "plaintext HTTP");
  }

  absl::StatusOr<std::unique_ptr<node::NodeServer>> server =
      node::NodeServer::Start({.grpc = {.listen = config.listen,
                                        .security = *security,
                                        .client_certificates = ClientCertificates::kOptional,
                                        .services = {&generation, &membership_service}},
                               .health_address = config.health_address});
  if (!server.ok()) return node::ReportStartFailure("kvr-controller", server.status());
  if ((*metrics_server)->serving()) {
    // Printed before the "listening on" line, so a launcher that waits for that line knows
    // both ports.
    node::PrintLine(
        absl::StrCat("kvr-controller metrics on ", host, ":", (*metrics_server)->port()));
  }
  node::ServingStatuses* health = &(*server)->health();
  auto reporter = std::make_unique<ReadinessReporter>(&membership, [health](bool ready) {
    for (const char* service : kControllerReadyServices) health->Set(service, ready);
  });
  if (http_server != nullptr) {
    // Printed before the "listening on" line, as the metrics port is; "https listening on"
    // when the API is TLS.
    const std::string http_host = config.http_listen.substr(0, config.http_listen.rfind(':'));
    node::PrintLine(absl::StrCat("kvr-controller ", http_server->tls() ? "https" : "http",
                                 " listening on ", http_host, ":", http_server->port()));
  }
  (*server)->PrintHealthPort("kvr-controller");
  // One parseable line on stdout for scripts and tests (kvr up reads it).
  node::PrintLine(absl::StrCat("kvr-controller listening on ", host, ":", (*server)->port()));

  const int received = signals.Wait();
  spdlog::info("signal {}: shutting down", received);
  reporter.reset();
  health->Shutdown();  // NOT_SERVING on both ports before the grace period starts
  // New calls are refused at once; running streams may finish during the grace period. After
  // it gRPC cancels their contexts, the disconnect watcher sees that and each request cancels
  // its downstream calls, so no node keeps decoding for a controller that is gone.
  const absl::Time grace_end = absl::Now() + absl::Seconds(config.shutdown_grace_seconds);
  // HTTP requests get the same grace period, then are cancelled; new ones get 503.
  std::thread http_stop([&] {
    if (http_server != nullptr) http_server->Shutdown(grace_end);
  });
  (*server)->Shutdown(grace_end);
  http_stop.join();
  http_server.reset();
  spdlog::info("shut down");
  return 0;
}

}  // namespace
}  // namespace kvr::controller

int main(int argc, char** argv) {
  return kvr::node::ServeMain(kvr::controller::ControllerSettings(), argc, argv,
                              &kvr::controller::Serve);
}
