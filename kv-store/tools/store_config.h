#pragma once
// Configuration of the kvr-store binary: its table of settings for the node settings mechanism
// (kvr/node/settings.h): flags, a --config YAML file and KVR_STORE_* environment variables,
// with precedence flag > file > env > default. It sits beside the binary, above the store
// library, because the mechanism lives in the node library.

#include <cstdint>
#include <string>
#include <vector>

#include "kvr/kv_store/server.h"
#include "kvr/node/settings.h"

namespace kvr::kv_store {

struct StoreConfig {
  std::string listen = "0.0.0.0:50070";
  uint64_t capacity_bytes = 1ull << 30;
  uint64_t page_bytes = 64 << 10;
  bool evict_expired = false;
  // Evict released-and-kept sequences, least recently used first, when space runs short
  // (StoreOptions::evict_cached).
  bool evict_cached = true;
  // "lru": cached sequences go whole; "thin": they are first thinned, their least distinctive
  // pages dropped (StoreOptions::cached_eviction), keeping thin_keep_fraction of them.
  std::string cached_eviction = "lru";
  double thin_keep_fraction = 0.5;
  bool huge_pages = true;
  uint64_t data_plane_threads = 2;
  uint64_t sweep_interval_ms = 1000;
  std::string name = "kvr-store";
  // Prometheus /metrics port: 0 any free port (the default, printed at start), -1 off.
  int64_t metrics_port = 0;
  // host:port of the plaintext health-only port (kvr/node/health.h); empty: none.
  std::string health_address;
  // Controller host:port to register with (role STORE) and heartbeat free pool bytes to;
  // empty: not registered (someone else, e.g. `kvr up` of old, must tell the controller).
  std::string controller;
  // host:port the controller and the other nodes reach this store's gRPC server at
  // (Endpoints.grpc_address). Empty: the listen address, with a wildcard host (0.0.0.0, ::
  // or empty) replaced by the address of this machine's hostname, or 127.0.0.1 when it has
  // none. On Kubernetes: the pod IP (downward API).
  std::string advertise_address;
  // Unix socket that hands the pool to same-host decode nodes for zero-copy reads (mode 0600);
  // empty: off. See StoreServerOptions::local_socket.
  std::string local_socket;
  // Hand out the pool's rkey for RMA range reads; off by default. See
  // StoreServerOptions::rma_reads.
  bool rma_reads = false;
  // Memory outside the pool for replies (StoreServerOptions::max_reply_bytes, ...).
  uint64_t max_reply_bytes = uint64_t{512} << 20;
  uint64_t max_outstanding_reply_bytes = uint64_t{2} << 30;
  // The gRPC port's TLS and the certificate presented to the controller (kvr/common/tls.h).
  TlsConfig tls;

  [[nodiscard]] StoreServerOptions ToServerOptions() const;
  // What goes into Endpoints.grpc_address: advertise_address, or the listen host (wildcard
  // resolved as above) with `bound_port` (the port actually bound, for listen port 0).
  [[nodiscard]] std::string AdvertisedAddress(int bound_port) const;
};

const node::SettingTable<StoreConfig>& StoreSettings();

}  // namespace kvr::kv_store
