// kvr-store with mutual TLS and --health-address, as a real process on 127.0.0.1: the
// plaintext health-only port answers grpc.health.v1 (what the kubelet's gRPC probes speak),
// serves nothing else, and goes NOT_SERVING with the store; the gRPC port still refuses a
// client without a certificate of the CA.

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <memory>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "health_test_util.h"
#include "kvr/common/cert_authority.h"
#include "kvr/common/tls.h"
#include "kvr/store/v1/store.grpc.pb.h"
#include "store_process.h"
#include "tls_test_util.h"

namespace kvr::kv_store {
namespace {

using ::kvr::kv_store::testing::StoreProcess;
using HS = ::grpc::health::v1::HealthCheckResponse;

TEST(StoreHealthPortTest, PlaintextHealthPortBesideAMutualTlsPort) {
  TestCertificates files("kvr-store-health");
  const PemCertificate ca = files.Ca("cluster CA");
  const std::string ca_file = files.WriteCa(ca, "ca");
  const TlsConfig store_tls = files.Issue(ca, "store", ca_file);
  const TlsConfig client_tls = files.Issue(ca, "client", ca_file);
  ASSERT_FALSE(::testing::Test::HasFailure());
  absl::StatusOr<StoreProcess> store = StoreProcess::Start(
      {KVR_STORE_BINARY, "--listen", "127.0.0.1:0", "--health-address", "127.0.0.1:0",
       "--capacity-bytes", "16MiB", "--page-bytes", "64KiB", "--metrics-port", "-1", "--tls-ca",
       ca_file, "--tls-cert", store_tls.cert_file, "--tls-key", store_tls.key_file},
      testing::LoopbackUcxEnv(), absl::Seconds(20));
  ASSERT_TRUE(store.ok()) << store.status();
  constexpr char kMarker[] = "kvr-store health port=";
  const size_t at = store->output().find(kMarker);
  ASSERT_NE(at, std::string::npos) << store->output();
  int health_port = 0;
  ASSERT_TRUE(absl::SimpleAtoi(
      store->output().substr(at + sizeof(kMarker) - 1,
                             store->output().find('\n', at) - at - sizeof(kMarker) + 1),
      &health_port))
      << store->output();
  ASSERT_NE(health_port, store->port());

  const auto probe = LoopbackChannel(health_port, TlsConfig{});  // plaintext, as the kubelet
  EXPECT_EQ(HealthStatus(probe), HS::SERVING);
  EXPECT_EQ(HealthStatus(LoopbackChannel(store->port(), client_tls)), HS::SERVING);
  // The gRPC port refuses a plaintext client and a TLS client without a certificate.
  EXPECT_EQ(HealthStatus(LoopbackChannel(store->port(), TlsConfig{})),
            kHealthCallFailed + grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(HealthStatus(LoopbackChannel(store->port(), TlsConfig{.ca_file = ca_file})),
            kHealthCallFailed + grpc::StatusCode::UNAVAILABLE);
  // The store's own service is not on the health port.
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    store::v1::GetDataPlaneInfoResponse info;
    EXPECT_EQ(store::v1::KvStore::NewStub(probe)->GetDataPlaneInfo(&ctx, {}, &info).error_code(),
              grpc::StatusCode::UNIMPLEMENTED);
  }
  // SIGTERM: the store shuts down and the health port goes with it.
  EXPECT_TRUE(WIFEXITED(store->Kill(SIGTERM)));
  EXPECT_EQ(HealthStatus(LoopbackChannel(health_port, TlsConfig{})),
            kHealthCallFailed + grpc::StatusCode::UNAVAILABLE);
}

}  // namespace
}  // namespace kvr::kv_store
