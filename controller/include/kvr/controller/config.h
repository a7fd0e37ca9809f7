#pragma once
// Configuration of kvr-controller: its table of settings for the node settings mechanism
// (kvr/node/settings.h), read from flags, a --config YAML file and KVR_CONTROLLER_*
// environment variables, with precedence flag > file > env > default. Each setting has one
// name in three spellings: flag --lease-seconds, YAML key lease_seconds, environment variable
// KVR_CONTROLLER_LEASE_SECONDS (KVR_LEASE_SECONDS, the older spelling, is still read when the
// new one is unset).

#include <cstdint>
#include <string>

#include "kvr/common/tls.h"
#include "kvr/controller/validation.h"
#include "kvr/node/settings.h"

namespace kvr::controller {
struct ControllerConfig {
  // host:port of the gRPC server; port 0 picks a free port (printed at start).
  std::string listen = "0.0.0.0:50051";
  double lease_seconds = 5;
  double default_timeout_seconds = 600;
  // On SIGTERM: how long running requests may still finish before they are cancelled.
  double shutdown_grace_seconds = 10;
  uint32_t max_in_flight = 1024;
  uint32_t max_attempts = 3;
  // Prefix reuse: how long a store keeps a finished request's KV for later requests that
  // start with the same tokens (0: no reuse), and how many such sequences the controller
  // remembers.
  double prefix_cache_seconds = 300;
  uint32_t prefix_cache_entries = 4096;
  RequestDefaults defaults;
  std::string log_level = "info";
  // Prometheus /metrics port, on the host of `listen`: > 0 that port, 0 any free port (printed
  // at start as "kvr-controller metrics on host:port"), -1 no metrics server.
  int32_t metrics_port = 0;
  // host:port of the plaintext health-only port (kvr/node/health.h); empty: none.
  std::string health_address;
  // host:port of the OpenAI-compatible HTTP API (port 0: any free port, printed at start as
  // "kvr-controller http listening on host:port"); empty or "-1": no HTTP server.
  std::string http_listen = "127.0.0.1:0";
  // When set, the HTTP API's /v1/* requires "Authorization: Bearer <api_key>". Printed
  // redacted.
  std::string api_key;
  // HTTPS of the HTTP API: PEM certificate and key (both empty: plaintext HTTP), and a CA
  // that clients' certificates must chain to (empty: no client certificate asked for).
  std::string http_tls_cert;
  std::string http_tls_key;
  std::string http_tls_client_ca;
  // Transport security of the gRPC port and of this process's channels (kvr/common/tls.h).
  TlsConfig tls;
  // With TLS: a member's certificate must name the node (URI SAN kvr://node/<name>), which
  // registers under that name only and alone renews or removes its node id
  // (MembershipService::Options::require_node_identity). false: any certificate of the CA may
  // register under any name, for certificates that name no node.
  bool require_node_identity = true;
};

const node::SettingTable<ControllerConfig>& ControllerSettings();

}  // namespace kvr::controller
