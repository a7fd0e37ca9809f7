// kvr-store: the CPU-memory KV store service. See kvr/kv_store/server.h.
// With --controller it registers itself (role STORE) and heartbeats its free pool bytes
// through kvr::node::MembershipClient.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kvr/common/tls.h"
#include "kvr/kv_store/server.h"
#include "kvr/node/health.h"
#include "kvr/node/membership_client.h"
#include "kvr/node/run.h"
#include "kvr/store/v1/store.grpc.pb.h"
#include "store_config.h"

namespace {

// The UCX worker address and instance id, asked of our own gRPC service (GetDataPlaneInfo) so
// that the registration carries exactly what clients are told.
absl::StatusOr<kvr::store::v1::GetDataPlaneInfoResponse> OwnDataPlaneInfo(
    int port, const kvr::GrpcSecurity& security, const std::string& advertised) {
  // Dialled on loopback; with TLS the certificate is checked against the host this store
  // advertises, which its certificate names (as every peer that dials it needs), rather than
  // against "127.0.0.1", which an operator's certificate need not name.
  grpc::ChannelArguments args;
  if (security.enabled()) {
    args.SetSslTargetNameOverride(advertised.substr(0, advertised.rfind(':')));
  }
  auto stub = kvr::store::v1::KvStore::NewStub(
      security.CreateChannel(absl::StrCat("127.0.0.1:", port), args));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  kvr::store::v1::GetDataPlaneInfoResponse info;
  const grpc::Status s = stub->GetDataPlaneInfo(&ctx, {}, &info);
  if (!s.ok()) {
    return absl::UnavailableError(
        absl::StrCat("GetDataPlaneInfo on our own port ", port, ": ", s.error_message()));
  }
  return info;
}

}  // namespace

int main(int argc, char** argv) {
  int exit_code = 0;
  std::optional<kvr::kv_store::StoreConfig> config =
      kvr::node::LoadConfigOrExit(kvr::kv_store::StoreSettings(), argc, argv, &exit_code);
  if (!config) return exit_code;
  // Before any thread starts: shutdown then runs on the main thread, outside any signal
  // handler.
  kvr::node::ShutdownSignals signals;

  absl::StatusOr<std::unique_ptr<kvr::kv_store::StoreServer>> server =
      kvr::kv_store::StoreServer::Start(config->ToServerOptions());
  if (!server.ok()) {
    std::fprintf(stderr, "kvr-store: %s\n", std::string(server.status().message()).c_str());
    return 1;
  }
  if ((*server)->metrics_port() > 0) {
    std::printf("kvr-store metrics port=%d\n", (*server)->metrics_port());
  }
  // The statuses of the gRPC port, mirrored on the plaintext health-only port when asked for.
  kvr::node::ServingStatuses health((*server)->health_check_service());
  std::unique_ptr<kvr::node::HealthOnlyServer> health_server;
  if (!config->health_address.empty()) {
    absl::StatusOr<std::unique_ptr<kvr::node::HealthOnlyServer>> started =
        kvr::node::HealthOnlyServer::Start(config->health_address, &health);
    if (!started.ok()) {
      std::fprintf(stderr, "kvr-store: %s\n", std::string(started.status().message()).c_str());
      health.Shutdown();
      return 1;
    }
    health_server = std::move(*started);
    std::printf("kvr-store health port=%d\n", health_server->port());
  }
  const kvr::kv_store::StoreStats stats = (*server)->store().Stats();
  // Tests and launchers read the port from this line.
  std::printf("kvr-store listening port=%d capacity_bytes=%llu pages=%llu page_backing=%s\n",
              (*server)->port(), static_cast<unsigned long long>(stats.capacity_bytes),
              static_cast<unsigned long long>(stats.total_pages), stats.page_backing.c_str());
  std::fflush(stdout);

  std::unique_ptr<kvr::node::MembershipClient> membership;
  if (!config->controller.empty()) {
    // Loaded once more (StoreServer::Start loaded it for the port): cannot fail differently.
    absl::StatusOr<kvr::GrpcSecurity> security = kvr::GrpcSecurity::Load(config->tls);
    if (!security.ok()) {
      std::fprintf(stderr, "kvr-store: %s\n", std::string(security.status().message()).c_str());
      return 1;
    }
    const std::string advertised = config->AdvertisedAddress((*server)->port());
    absl::StatusOr<kvr::store::v1::GetDataPlaneInfoResponse> info =
        OwnDataPlaneInfo((*server)->port(), *security, advertised);
    if (!info.ok()) {
      std::fprintf(stderr, "kvr-store: %s\n", std::string(info.status().message()).c_str());
      return 1;
    }
    namespace cv1 = ::kvr::cluster::v1;
    kvr::node::MembershipClient::Options o;
    o.controller = config->controller;
    o.security = *security;
    o.registration.set_role(cv1::NODE_ROLE_STORE);
    o.registration.set_protocol_version(1);
    // Its name alone: with TLS the controller admits the registration only under the node
    // name its certificate carries (kvr://node/<name>); the address is in the endpoints.
    o.registration.set_name(config->name);
    o.registration.mutable_endpoints()->set_grpc_address(advertised);
    o.registration.mutable_endpoints()->set_ucx_worker_address(info->worker_address());
    // Clients compare it with the instance they are connected to (a restart on the same
    // address has a new one), and the controller replaces this address's old entry.
    o.registration.set_instance_id(info->instance_id());
    o.registration.mutable_endpoints()->set_metrics_port(
        static_cast<uint32_t>(std::max((*server)->metrics_port(), 0)));
    o.registration.mutable_capacity()->set_memory_bytes(stats.capacity_bytes);
    // The store outlives `membership` (reset below before Shutdown); Stats() is thread-safe.
    o.load = [store = &(*server)->store()] {
      const kvr::kv_store::StoreStats now = store->Stats();
      cv1::NodeLoad load;
      // Cached sequences give their pages up before anything is refused (evict_cached): their
      // bytes are room for new work, and they are not running.
      load.set_free_memory_bytes(now.capacity_bytes - now.used_bytes + now.cached_bytes);
      // The controller's placement spreads sequences over stores by this count.
      load.set_running_sequences(static_cast<uint32_t>(now.sequences - now.cached_sequences));
      return load;
    };
    o.on_registered = [](const std::string& id) {
      // One parseable line for launchers and tests.
      std::printf("kvr-store registered %s\n", id.c_str());
      std::fflush(stdout);
    };
    std::printf("kvr-store registering with controller %s as %s\n", config->controller.c_str(),
                advertised.c_str());
    std::fflush(stdout);
    membership = std::make_unique<kvr::node::MembershipClient>(std::move(o));
  }

  const int sig = signals.Wait();
  std::printf("kvr-store: signal %d, shutting down\n", sig);
  std::fflush(stdout);
  membership.reset();  // Deregister first: no new requests are placed here
  health.Shutdown();   // both ports NOT_SERVING, before the gRPC server goes
  (*server)->Shutdown();
  if (health_server) health_server->Shutdown(absl::Now());
  server->reset();
  std::printf("kvr-store: stopped\n");
  return 0;
}
