#pragma once
// StoreServer: a running KV store: the PagedKvStore core, its pool registered with UCX, the
// UCX data-plane handlers (wire.h messages) and the gRPC control service
// (kvr.store.v1.KvStore + grpc.health.v1.Health + server reflection). The kvr-store binary is
// this plus configuration; tests start it in-process too.
//
// Threads: the transport's progress thread only parses and enqueues data-plane requests;
// `data_plane_threads` workers run them against the store (copies of large gathers must not
// stall UCX progress); gRPC runs its own pool; one sweeper thread evicts expired leases; with
// `local_socket`, one thread hands the pool's fd to same-host readers.
//
// Lifetime: Shutdown() (or destruction) stops gRPC first (no new control work), then the local
// socket (mappings already handed out stay valid: the kernel keeps the memory), then the UCX
// worker (pending data-plane requests fail on the client side as CANCELLED/UNAVAILABLE), then
// the work queue and the sweeper, and last the store and its pool.

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvr/common/tls.h"
#include "kvr/kv_store/store.h"

namespace grpc {
class HealthCheckServiceInterface;
}  // namespace grpc

namespace kvr::kv_store {

struct StoreServerOptions {
  StoreOptions store;
  // gRPC listen address; port 0 picks a free port (see StoreServer::port()).
  std::string listen = "127.0.0.1:0";
  size_t data_plane_threads = 2;
  // UCX configuration overrides (transport::ContextOptions::ucx_config); empty: UCX_* env.
  std::vector<std::pair<std::string, std::string>> ucx_config;
  // How often expired leases are swept when StoreOptions::evict_expired is set.
  absl::Duration sweep_interval = absl::Seconds(1);
  std::string name = "kvr-store";
  // Prometheus /metrics port on the host of `listen` (kvr::metrics::StoreMetrics, refreshed from
  // PagedKvStore::Stats() at every scrape): > 0 that port, 0 any free port, -1 none.
  int metrics_port = -1;
  // Unix socket path on which the pool's memfd is handed to processes on this host for
  // zero-copy reads (local_pool.h); created with mode 0600, removed at shutdown. Empty: off.
  std::string local_socket;
  // Registers the pool with UCX and hands its packed rkey out in GetDataPlaneInfo, so that
  // clients read committed ranges by RMA get (after a capability-checked locate message).
  // Off by default: whoever holds the rkey can read every page of the pool, whatever
  // sequence it belongs to, and GetDataPlaneInfo answers anyone; with it off the pool is not
  // registered at all, no rkey exists, and every read goes through a checked message.
  bool rma_reads = false;
  // Memory the store spends outside its pool on replies: one gather or range read may answer
  // at most max_reply_bytes (RESOURCE_EXHAUSTED naming it: split the request), and the replies
  // being filled or sent may hold at most max_outstanding_reply_bytes together
  // (RESOURCE_EXHAUSTED "busy": retry). A request naming millions of rows costs its sender an
  // error, not the store its memory.
  uint64_t max_reply_bytes = uint64_t{512} << 20;
  uint64_t max_outstanding_reply_bytes = uint64_t{2} << 30;
  // The gRPC port: mutual TLS when set (every client must present a certificate of the
  // cluster CA), plaintext when empty (kvr/common/tls.h).
  TlsConfig tls;
};

class StoreServer {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<StoreServer>> Start(
      StoreServerOptions options);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  // The bound gRPC port.
  int port() const;
  // The bound /metrics port; 0 when metrics are off.
  int metrics_port() const;
  PagedKvStore& store();
  // The gRPC server's grpc.health.v1 service (gRPC's default one), for a health-only port to
  // mirror (kvr/node/health.h). Valid until Shutdown().
  grpc::HealthCheckServiceInterface* health_check_service();
  // Idempotent; safe from any thread except gRPC/UCX callbacks.
  void Shutdown();

 private:
  struct Impl;
  explicit StoreServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvr::kv_store
