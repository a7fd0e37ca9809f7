// ServingStatuses (the table both health ports answer from) on its own, NodeServer with real
// gRPC servers on 127.0.0.1 (a mutual-TLS main port and its plaintext health-only port), and
// the small helpers of run.h.

#include "kvr/node/health.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "health_test_util.h"
#include "kvr/cluster/v1/cluster.grpc.pb.h"
#include "kvr/common/cert_authority.h"
#include "kvr/common/tls.h"
#include "kvr/node/membership_client.h"
#include "kvr/node/run.h"
#include "tls_test_util.h"

namespace kvr::node {
namespace {

namespace hv1 = ::grpc::health::v1;
using HS = hv1::HealthCheckResponse;

TEST(ServingStatusesTest, OverallServiceStartsServingAndNamedOnesAreUnknownUntilSet) {
  ServingStatuses statuses(nullptr);
  EXPECT_EQ(statuses.Get(""), true);
  EXPECT_EQ(statuses.Get(kReadinessService), std::nullopt);
  statuses.Set(kReadinessService, false);
  EXPECT_EQ(statuses.Get(kReadinessService), false);
  statuses.Set(kReadinessService, true);
  EXPECT_EQ(statuses.Get(kReadinessService), true);
}

TEST(ServingStatusesTest, SetAllChangesEveryKnownService) {
  ServingStatuses statuses(nullptr);
  statuses.Set("a", true);
  statuses.Set("b", false);
  statuses.SetAll(false);
  EXPECT_EQ(statuses.Get(""), false);
  EXPECT_EQ(statuses.Get("a"), false);
  EXPECT_EQ(statuses.Get("b"), false);
  statuses.SetAll(true);
  EXPECT_EQ(statuses.Get("a"), true);
  EXPECT_EQ(statuses.Get("c"), std::nullopt) << "SetAll adds no service";
}

TEST(ServingStatusesTest, ShutdownIsNotServingForGood) {
  ServingStatuses statuses(nullptr);
  statuses.Set("a", true);
  statuses.Shutdown();
  EXPECT_EQ(statuses.Get(""), false);
  EXPECT_EQ(statuses.Get("a"), false);
  statuses.Set("a", true);
  statuses.SetAll(true);
  EXPECT_EQ(statuses.Get("a"), false);
  EXPECT_EQ(statuses.Get(""), false);
}

TEST(ServingStatusesTest, WaitForChangeWakesOnASetAndTimesOutWithout) {
  ServingStatuses statuses(nullptr);
  const uint64_t seen = statuses.version();
  EXPECT_FALSE(statuses.WaitForChange(seen, absl::Milliseconds(20)));
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(20));
    statuses.Set("a", true);
  });
  EXPECT_TRUE(statuses.WaitForChange(seen, absl::Seconds(10)));
  setter.join();
  EXPECT_NE(statuses.version(), seen);
}

// A CA and a server and client certificate it signed, as files under a fresh directory.
struct Pki {
  TestCertificates files{"kvr-health"};
  TlsConfig server, client;
  Pki() {
    const PemCertificate ca = files.Ca("test CA");
    const std::string ca_file = files.WriteCa(ca, "ca");
    server = files.Issue(ca, "server", ca_file);
    client = files.Issue(ca, "client", ca_file);
  }
};

// A Membership service whose Register answers OK: reachable on the main port, so that
// UNIMPLEMENTED on the health port means the port, not the service.
class OkMembership final : public cluster::v1::Membership::Service {
  grpc::Status Register(grpc::ServerContext*, const cluster::v1::RegisterRequest*,
                        cluster::v1::RegisterResponse* response) override {
    response->set_node_id("n1");
    return grpc::Status::OK;
  }
};

grpc::Status CallRegister(const std::shared_ptr<grpc::Channel>& channel) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  cluster::v1::RegisterResponse response;
  return cluster::v1::Membership::NewStub(channel)->Register(&ctx, {}, &response);
}

class NodeServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<GrpcSecurity> security = GrpcSecurity::Load(pki_.server);
    ASSERT_TRUE(security.ok()) << security.status();
    absl::StatusOr<std::unique_ptr<NodeServer>> server =
        NodeServer::Start({.grpc = {.listen = "127.0.0.1:0",
                                    .security = *security,
                                    .client_certificates = ClientCertificates::kRequired,
                                    .services = {&membership_}},
                           .health_address = "127.0.0.1:0"});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    ASSERT_NE(server_->health_port(), 0);
    ASSERT_NE(server_->health_port(), server_->port());
    main_ = LoopbackChannel(server_->port(), pki_.client);
    health_port_ = LoopbackChannel(server_->health_port(), TlsConfig{});
  }

  Pki pki_;
  OkMembership membership_;
  std::unique_ptr<NodeServer> server_;
  std::shared_ptr<grpc::Channel> main_, health_port_;
};

TEST_F(NodeServerTest, HealthPortAnswersInPlaintextWithTheMainPortsStatuses) {
  EXPECT_EQ(HealthStatus(health_port_, ""), HS::SERVING);
  EXPECT_EQ(HealthStatus(main_, ""), HS::SERVING);
  // A named service, as kvr.ready: unknown on both until set, then mirrored at every change.
  EXPECT_EQ(HealthStatus(health_port_, kReadinessService),
            kHealthCallFailed + grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(HealthStatus(main_, kReadinessService),
            kHealthCallFailed + grpc::StatusCode::NOT_FOUND);
  std::function<void(uint32_t)> on_cluster_view = ReadinessFromClusterView(&server_->health());
  EXPECT_EQ(HealthStatus(health_port_, kReadinessService), HS::NOT_SERVING);
  EXPECT_EQ(HealthStatus(main_, kReadinessService), HS::NOT_SERVING);
  on_cluster_view(1);
  EXPECT_EQ(HealthStatus(health_port_, kReadinessService), HS::SERVING);
  EXPECT_EQ(HealthStatus(main_, kReadinessService), HS::SERVING);
  on_cluster_view(0);
  EXPECT_EQ(HealthStatus(health_port_, kReadinessService), HS::NOT_SERVING);
  EXPECT_EQ(HealthStatus(main_, kReadinessService), HS::NOT_SERVING);
  server_->health().SetAll(false);
  EXPECT_EQ(HealthStatus(health_port_, ""), HS::NOT_SERVING);
  EXPECT_EQ(HealthStatus(main_, ""), HS::NOT_SERVING);
}

TEST_F(NodeServerTest, HealthPortServesNothingButHealth) {
  ASSERT_TRUE(CallRegister(main_).ok()) << "the service is up on the main port";
  EXPECT_EQ(CallRegister(health_port_).error_code(), grpc::StatusCode::UNIMPLEMENTED);
  // Server reflection, which the main port serves, is not on the health port either.
  grpc::GenericStub generic(health_port_);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  grpc::CompletionQueue cq;
  // A bidi stream's first Read fails once the server answered UNIMPLEMENTED.
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call = generic.PrepareCall(
      &ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  call->StartCall(reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  ASSERT_TRUE(cq.Next(&tag, &ok));
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(2));
  while (cq.Next(&tag, &ok) && tag != reinterpret_cast<void*>(2)) {
  }
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED) << status.error_message();
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
}

TEST_F(NodeServerTest, MainPortRefusesPlaintextAndHealthPortRefusesTls) {
  EXPECT_EQ(HealthStatus(LoopbackChannel(server_->port(), TlsConfig{}), ""),
            kHealthCallFailed + grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(HealthStatus(LoopbackChannel(server_->health_port(), pki_.client), ""),
            kHealthCallFailed + grpc::StatusCode::UNAVAILABLE);
}

TEST_F(NodeServerTest, WatchOnTheHealthPortSeesChanges) {
  server_->health().Set(kReadinessService, false);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  hv1::HealthCheckRequest request;
  request.set_service(kReadinessService);
  auto reader = hv1::Health::NewStub(health_port_)->Watch(&ctx, request);
  hv1::HealthCheckResponse response;
  ASSERT_TRUE(reader->Read(&response));
  EXPECT_EQ(response.status(), HS::NOT_SERVING);
  server_->health().Set(kReadinessService, true);
  ASSERT_TRUE(reader->Read(&response));
  EXPECT_EQ(response.status(), HS::SERVING);
  ctx.TryCancel();
  (void)reader->Finish();
}

TEST_F(NodeServerTest, ShutdownIsNotServingOnBothPortsThenClosesThem) {
  server_->health().Set(kReadinessService, true);
  // What a probe sees between the statuses going NOT_SERVING and the ports closing.
  server_->health().Shutdown();
  EXPECT_EQ(HealthStatus(health_port_, ""), HS::NOT_SERVING);
  EXPECT_EQ(HealthStatus(health_port_, kReadinessService), HS::NOT_SERVING);
  EXPECT_EQ(HealthStatus(main_, kReadinessService), HS::NOT_SERVING);
  server_->Shutdown(absl::Now() + absl::Seconds(1));
  EXPECT_EQ(HealthStatus(LoopbackChannel(server_->health_port(), TlsConfig{}), ""),
            kHealthCallFailed + grpc::StatusCode::UNAVAILABLE);
}

TEST(HealthOnlyServerTest, AnAddressThatCannotBeBoundIsUnavailableNamingIt) {
  ServingStatuses statuses(nullptr);
  const std::string bad = "192.0.2.1:0";  // TEST-NET-1: no address of this host
  absl::StatusOr<std::unique_ptr<HealthOnlyServer>> server =
      HealthOnlyServer::Start(bad, &statuses);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(server.status().message().find(bad), std::string::npos) << server.status();
}

TEST(RunHelpersTest, HostOfAndReachableHost) {
  EXPECT_EQ(HostOf("10.0.0.5:50051"), "10.0.0.5");
  EXPECT_EQ(HostOf("[::1]:7"), "[::1]");
  EXPECT_EQ(HostOf(":7"), "");
  EXPECT_EQ(HostOf("no-port"), "");
  EXPECT_EQ(ReachableHost(""), "127.0.0.1");
  EXPECT_EQ(ReachableHost("0.0.0.0"), "127.0.0.1");
  EXPECT_EQ(ReachableHost("[::]"), "127.0.0.1");
  EXPECT_EQ(ReachableHost("node-3.kvr"), "node-3.kvr");
}

TEST(RunHelpersTest, StartFailureExitsTwoForAConfigurationAndOneOtherwise) {
  EXPECT_EQ(ReportStartFailure("kvr-test", absl::InvalidArgumentError("no certificate")), 2);
  EXPECT_EQ(ReportStartFailure("kvr-test", absl::UnavailableError("cannot listen on x")), 1);
}

TEST(RunHelpersTest, NodeServerWithoutSecurityToServeIsInvalidArgument) {
  // A CA alone is a client-only configuration: no certificate to serve with.
  Pki pki;
  absl::StatusOr<GrpcSecurity> client_only =
      GrpcSecurity::Load(TlsConfig{.ca_file = pki.client.ca_file});
  ASSERT_TRUE(client_only.ok()) << client_only.status();
  absl::StatusOr<std::unique_ptr<NodeServer>> server =
      NodeServer::Start({.grpc = {.listen = "127.0.0.1:0", .security = *client_only}});
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << server.status();
}

}  // namespace
}  // namespace kvr::node
