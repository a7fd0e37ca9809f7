#include "kvr/kv_store/server.h"

#include <optional>
#include <thread>

#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "data_plane.h"
#include "grpc_service.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "kvr/common/grpc_server.h"
#include "kvr/common/instance_id.h"
#include "kvr/common/metrics.h"
#include "kvr/common/status.h"
#include "kvr/kv_store/metrics.h"
#include "kvr/transport/ucx.h"
#include "local_pool_socket.h"
#include "work_queue.h"

namespace kvr::kv_store {

struct StoreServer::Impl {
  // Declaration order is construction order; members are torn down explicitly in Shutdown().
  std::unique_ptr<PagedKvStore> store;
  std::unique_ptr<LocalPoolServer> local_pool_server;
  // Outlives the worker: send completions return buffers here.
  std::unique_ptr<ReplyBufferPool> reply_buffers;
  std::optional<transport::Context> context;
  std::optional<transport::MemoryRegion> pool_region;
  std::optional<transport::Worker> worker;
  std::unique_ptr<WorkQueue> queue;
  std::unique_ptr<KvStoreGrpcService> service;
  std::unique_ptr<grpc::Server> grpc_server;
  int port = 0;
  absl::Notification stop_sweeper;
  std::thread sweeper;
  // Metrics: the server's scrape hook reads `store`; Shutdown() stops the server (no scrape
  // runs after it) before anything else is torn down.
  std::unique_ptr<metrics::MetricsServer> metrics_server;
  std::unique_ptr<metrics::StoreMetrics> store_metrics;
  absl::Mutex shutdown_mu;
  bool shut_down ABSL_GUARDED_BY(shutdown_mu) = false;

  void Shutdown() {
    absl::MutexLock lock(&shutdown_mu);
    if (shut_down) return;
    shut_down = true;
    if (metrics_server) metrics_server.reset();
    if (grpc_server) grpc_server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
    local_pool_server.reset();
    if (worker) worker->Shutdown();
    if (queue) queue->Stop();
    if (!stop_sweeper.HasBeenNotified()) stop_sweeper.Notify();
    if (sweeper.joinable()) sweeper.join();
  }
};

absl::StatusOr<std::unique_ptr<StoreServer>> StoreServer::Start(StoreServerOptions options) {
  auto impl = std::make_unique<Impl>();
  KVR_ASSIGN_OR_RETURN(impl->store, PagedKvStore::Create(options.store));
  const PagePool& pool = impl->store->pool();

  transport::ContextOptions ctx_options;
  ctx_options.ucx_config = options.ucx_config;
  KVR_ASSIGN_OR_RETURN(transport::Context context, transport::Context::Create(ctx_options));
  impl->context.emplace(std::move(context));
  // With RMA reads the pool is registered once, so remote readers can RMA any page with one
  // rkey; without, it is not registered, so no key to it exists (StoreServerOptions).
  std::string rkey;
  if (options.rma_reads) {
    KVR_ASSIGN_OR_RETURN(transport::MemoryRegion region,
                         impl->context->Register({pool.base(), pool.capacity_bytes()}));
    impl->pool_region.emplace(std::move(region));
    KVR_ASSIGN_OR_RETURN(rkey, impl->pool_region->PackRkey());
  }
  transport::WorkerOptions worker_options;
  worker_options.name = options.name;
  KVR_ASSIGN_OR_RETURN(transport::Worker worker,
                       transport::Worker::Create(*impl->context, worker_options));
  impl->worker.emplace(std::move(worker));
  impl->queue = std::make_unique<WorkQueue>(options.data_plane_threads);
  // Enough idle buffers for every data-plane thread plus replies still being sent.
  impl->reply_buffers = std::make_unique<ReplyBufferPool>(
      2 * options.data_plane_threads + 2, size_t{512} << 20,
      ReplyBufferPool::Limits{.max_reply_bytes = options.max_reply_bytes,
                              .max_outstanding_bytes = options.max_outstanding_reply_bytes});
  KVR_RETURN_IF_ERROR(RegisterDataPlaneHandlers(*impl->worker, *impl->store, *impl->queue,
                                                *impl->reply_buffers, options.rma_reads));

  DataPlaneInfo info{.worker_address = impl->worker->address(),
                     .pool_base = options.rma_reads ? impl->pool_region->address() : 0,
                     .pool_bytes = pool.capacity_bytes(),
                     .pool_rkey = std::move(rkey),
                     .local_socket = options.local_socket,
                     .host_id = "",
                     .pool_id = pool.pool_id(),
                     .instance_id = NewInstanceId()};
  if (absl::StatusOr<std::string> host = ReadHostId(); host.ok()) {
    info.host_id = *std::move(host);
  } else if (!options.local_socket.empty()) {
    // Clients compare host ids before they use the socket; without one none would.
    return host.status();
  }
  if (!options.local_socket.empty()) {
    KVR_ASSIGN_OR_RETURN(impl->local_pool_server,
                         LocalPoolServer::Start(options.local_socket, pool));
  }
  impl->service = std::make_unique<KvStoreGrpcService>(*impl->store, std::move(info));

  absl::StatusOr<GrpcSecurity> security = GrpcSecurity::Load(options.tls);
  if (!security.ok()) {
    impl->Shutdown();
    return security.status();
  }
  absl::StatusOr<StartedGrpcServer> started =
      StartGrpcServer({.listen = options.listen,
                       .security = *security,
                       .client_certificates = ClientCertificates::kRequired,
                       .services = {impl->service.get()},
                       // Appends of a few tokens are small; this bounds what a misbehaving client
                       // can make the store buffer (bulk data goes over UCX).
                       .max_receive_message_bytes = 64 << 20});
  if (!started.ok()) {
    impl->Shutdown();
    return started.status().code() == absl::StatusCode::kUnavailable
               ? absl::UnavailableError(
                     absl::StrFormat("kvr-store: cannot listen for gRPC on '%s'", options.listen))
               : started.status();
  }
  impl->grpc_server = std::move(started->server);
  impl->port = started->port;

  if (options.metrics_port >= 0) {
    const std::string host = options.listen.substr(0, options.listen.rfind(':'));
    absl::StatusOr<std::unique_ptr<metrics::MetricsServer>> metrics_server =
        metrics::MetricsServer::Start({.host = host.empty() ? "0.0.0.0" : host,
                                       .port = options.metrics_port,
                                       .role = "store",
                                       .node_name = options.name});
    if (!metrics_server.ok()) {
      impl->Shutdown();
      return metrics_server.status();
    }
    impl->metrics_server = std::move(*metrics_server);
    impl->store_metrics = std::make_unique<metrics::StoreMetrics>(impl->metrics_server->registry());
    impl->metrics_server->AddScrapeHook([raw = impl.get()] {
      const StoreStats s = raw->store->Stats();
      raw->store_metrics->Update({.capacity_bytes = s.capacity_bytes,
                                  .used_bytes = s.used_bytes,
                                  .total_pages = s.total_pages,
                                  .free_pages = s.free_pages,
                                  .sequences = s.sequences,
                                  .evictions_expired = s.evictions_expired,
                                  .evictions_cached_lru = s.evictions_cached_lru,
                                  .expired_sequences = s.expired_sequences,
                                  .bytes_written = s.bytes_written,
                                  .bytes_read = s.bytes_read,
                                  .shared_pages = s.shared_pages,
                                  .forks = s.forks,
                                  .forked_rows = s.forked_rows,
                                  .cached_sequences = s.cached_sequences,
                                  .cached_bytes = s.cached_bytes,
                                  .evictions_thinned = s.evictions_thinned,
                                  .thinned_pages = s.thinned_pages});
    });
  }

  if (options.store.evict_expired) {
    impl->sweeper = std::thread([raw = impl.get(), interval = options.sweep_interval] {
      while (!raw->stop_sweeper.WaitForNotificationWithTimeout(interval)) {
        raw->store->SweepExpired();
      }
    });
  }
  return std::unique_ptr<StoreServer>(new StoreServer(std::move(impl)));
}

StoreServer::StoreServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

StoreServer::~StoreServer() { Shutdown(); }

int StoreServer::port() const { return impl_->port; }

int StoreServer::metrics_port() const {
  return impl_->metrics_server ? impl_->metrics_server->port() : 0;
}

PagedKvStore& StoreServer::store() { return *impl_->store; }

grpc::HealthCheckServiceInterface* StoreServer::health_check_service() {
  return impl_->grpc_server->GetHealthCheckService();
}

void StoreServer::Shutdown() { impl_->Shutdown(); }

}  // namespace kvr::kv_store
