// GrpcSecurity and ConfigureServer with real gRPC servers on loopback: which clients a
// mutual-TLS port admits, and what a partial TLS configuration says.

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <unistd.h>

#include <filesystem>
#include <future>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvr/common/cert_authority.h"
#include "kvr/common/grpc_server.h"
#include "kvr/common/tls.h"

namespace kvr {
namespace {

using ::testing::HasSubstr;

// A CA, a server and a client certificate it signed, and a client certificate of another CA,
// as files under a fresh directory.
struct Pki {
  std::string dir;
  TlsConfig server, client, ca_only, stranger;

  Pki() {
    dir = absl::StrCat(::testing::TempDir(), "/kvr-tls-", getpid(), "-",
                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir);
    absl::StatusOr<PemCertificate> ca = GenerateCertificateAuthority("test CA", absl::Hours(1));
    absl::StatusOr<PemCertificate> other = GenerateCertificateAuthority("other CA", absl::Hours(1));
    EXPECT_TRUE(ca.ok() && other.ok());
    const std::string ca_file = absl::StrCat(dir, "/ca.pem");
    const std::string other_file = absl::StrCat(dir, "/other-ca.pem");
    EXPECT_TRUE(WriteCertificate(dir, "ca", *ca, ca_file).ok());
    EXPECT_TRUE(WriteCertificate(dir, "other-ca", *other, other_file).ok());
    auto issue = [&](const PemCertificate& by, const std::string& name, const std::string& ca) {
      absl::StatusOr<PemCertificate> c =
          IssueCertificate(by, name, {"127.0.0.1", "localhost"}, absl::Hours(1));
      EXPECT_TRUE(c.ok()) << c.status();
      absl::StatusOr<TlsConfig> files = WriteCertificate(dir, name, *c, ca);
      EXPECT_TRUE(files.ok()) << files.status();
      return *files;
    };
    server = issue(*ca, "server", ca_file);
    client = issue(*ca, "client", ca_file);
    stranger = issue(*other, "stranger", ca_file);
    ca_only = TlsConfig{.ca_file = ca_file};
  }
  ~Pki() { std::filesystem::remove_all(dir); }
};

// A server with the health service on a free loopback port (and reflection: a server needs a
// synchronous service to start).
struct HealthServer {
  std::unique_ptr<grpc::Server> server;
  std::string address;
  HealthServer(const TlsConfig& tls, ClientCertificates client_certificates) {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    absl::StatusOr<GrpcSecurity> security = GrpcSecurity::Load(tls);
    EXPECT_TRUE(security.ok()) << security.status();
    grpc::ServerBuilder builder;
    int port = 0;
    EXPECT_TRUE(
        ConfigureServer(&builder, "127.0.0.1:0", *security, client_certificates, &port).ok());
    server = builder.BuildAndStart();
    EXPECT_NE(port, 0);
    address = absl::StrCat("127.0.0.1:", port);
  }
  ~HealthServer() { server->Shutdown(absl::ToChronoTime(absl::Now())); }
};

// grpc.health.v1.Health/Check with an empty request over a channel of `tls`.
grpc::Status Check(const std::string& address, const TlsConfig& tls) {
  absl::StatusOr<GrpcSecurity> security = GrpcSecurity::Load(tls);
  EXPECT_TRUE(security.ok()) << security.status();
  grpc::GenericStub stub(security->CreateChannel(address));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  grpc::Slice empty;
  grpc::ByteBuffer request(&empty, 1), response;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) { done.set_value(std::move(s)); });
  return done.get_future().get();
}

TEST(GrpcSecurityTest, MutualTlsPortAdmitsOnlyClientsWithACertificateOfTheCa) {
  Pki pki;
  HealthServer server(pki.server, ClientCertificates::kRequired);
  EXPECT_TRUE(Check(server.address, pki.client).ok());
  for (const auto& [what, tls] : {std::pair<const char*, TlsConfig>{"plaintext", TlsConfig{}},
                                  {"no client certificate", pki.ca_only},
                                  {"certificate of another CA", pki.stranger}}) {
    const grpc::Status s = Check(server.address, tls);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << what << ": " << s.error_message();
  }
}

TEST(GrpcSecurityTest, OptionalClientCertificatesAdmitCertificateLessClientsButNotStrangers) {
  Pki pki;
  HealthServer server(pki.server, ClientCertificates::kOptional);
  EXPECT_TRUE(Check(server.address, pki.client).ok());
  EXPECT_TRUE(Check(server.address, pki.ca_only).ok());
  EXPECT_EQ(Check(server.address, pki.stranger).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Check(server.address, TlsConfig{}).error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST(GrpcSecurityTest, ClientRefusesAServerOfAnotherCa) {
  Pki pki;
  HealthServer server(pki.server, ClientCertificates::kOptional);
  TlsConfig trusts_other = pki.stranger;
  trusts_other.ca_file = absl::StrCat(pki.dir, "/other-ca.pem");
  EXPECT_EQ(Check(server.address, trusts_other).error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST(GrpcSecurityTest, PartialConfigurationsAreErrorsNamingTheSetting) {
  Pki pki;
  auto error = [](const TlsConfig& tls) {
    absl::StatusOr<GrpcSecurity> s = GrpcSecurity::Load(tls);
    EXPECT_FALSE(s.ok());
    return std::string(s.status().message());
  };
  EXPECT_THAT(error({.cert_file = pki.client.cert_file, .key_file = pki.client.key_file}),
              HasSubstr("tls_ca"));
  EXPECT_THAT(error({.ca_file = pki.client.ca_file, .cert_file = pki.client.cert_file}),
              HasSubstr("tls_key"));
  EXPECT_THAT(error({.ca_file = "/nonexistent/ca.pem"}), HasSubstr("/nonexistent/ca.pem"));
  // A file that is not PEM is refused by name.
  EXPECT_THAT(error({.ca_file = "/proc/self/cmdline"}), HasSubstr("not a PEM file"));
  // A server needs its own certificate.
  absl::StatusOr<GrpcSecurity> ca_only = GrpcSecurity::Load(pki.ca_only);
  ASSERT_TRUE(ca_only.ok());
  grpc::ServerBuilder builder;
  int port = 0;
  const absl::Status s =
      ConfigureServer(&builder, "127.0.0.1:0", *ca_only, ClientCertificates::kRequired, &port);
  EXPECT_THAT(std::string(s.message()), HasSubstr("tls_cert"));
  EXPECT_FALSE(GrpcSecurity().enabled());
}

// The common name of the certificate the server at `address` presents in a new handshake (a
// channel of its own, so no connection is reused); "" when the call fails.
std::string ServerCommonName(const std::string& address, const TlsConfig& client) {
  absl::StatusOr<GrpcSecurity> security = GrpcSecurity::Load(client);
  EXPECT_TRUE(security.ok()) << security.status();
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  grpc::GenericStub stub(security->CreateChannel(address, args));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  grpc::Slice empty;
  grpc::ByteBuffer request(&empty, 1), response;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) { done.set_value(std::move(s)); });
  if (!done.get_future().get().ok()) return "";
  const std::vector<grpc::string_ref> names =
      ctx.auth_context()->FindPropertyValues("x509_common_name");
  return names.empty() ? "" : std::string(names[0].data(), names[0].size());
}

// A TLS server reads its files again every server_reload_interval: a certificate renewed in
// place is what the next handshake presents, without a restart.
TEST(GrpcSecurityTest, ServerPresentsARenewedCertificateWithoutARestart) {
  Pki pki;
  absl::StatusOr<PemCertificate> ca = GenerateCertificateAuthority("reload CA", absl::Hours(1));
  ASSERT_TRUE(ca.ok());
  const std::string dir = absl::StrCat(pki.dir, "/reload");
  const std::string ca_file = absl::StrCat(dir, "/ca.pem");
  ASSERT_TRUE(WriteCertificate(dir, "ca", *ca, ca_file).ok());
  auto write_server = [&](const std::string& common_name) {
    absl::StatusOr<PemCertificate> cert =
        IssueCertificate(*ca, common_name, {"127.0.0.1", "localhost"}, absl::Hours(1));
    EXPECT_TRUE(cert.ok()) << cert.status();
    absl::StatusOr<TlsConfig> files = WriteCertificate(dir, "server", *cert, ca_file);
    EXPECT_TRUE(files.ok()) << files.status();
    return *files;
  };
  TlsConfig server_tls = write_server("first");
  server_tls.server_reload_interval = absl::Seconds(1);
  HealthServer server(server_tls, ClientCertificates::kOptional);
  const TlsConfig client{.ca_file = ca_file};
  EXPECT_EQ(ServerCommonName(server.address, client), "first");

  write_server("renewed");
  // The watcher's next read (every second) picks it up; wait for it, at most 20 s.
  std::string seen;
  for (const absl::Time give_up = absl::Now() + absl::Seconds(20);
       absl::Now() < give_up && (seen = ServerCommonName(server.address, client)) != "renewed";) {
    absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_EQ(seen, "renewed");
}

TEST(CertificateAuthorityTest, NodeIdentityIsTheKvrNodeUriSubjectAltName) {
  absl::StatusOr<PemCertificate> ca = GenerateCertificateAuthority("test CA", absl::Hours(1));
  ASSERT_TRUE(ca.ok()) << ca.status();
  absl::StatusOr<PemCertificate> node =
      IssueCertificate(*ca, "decode-0", {"127.0.0.1"}, absl::Hours(1),
                       {NodeIdentityUri("decode-0"), "spiffe://example.org/not-a-kvr-name"});
  ASSERT_TRUE(node.ok()) << node.status();
  absl::StatusOr<std::vector<std::string>> names = NodeIdentitiesOfCertificate(node->cert_pem);
  ASSERT_TRUE(names.ok()) << names.status();
  EXPECT_THAT(*names, ::testing::ElementsAre("decode-0"));

  // A host-only certificate names no node, whatever its common name.
  absl::StatusOr<PemCertificate> plain =
      IssueCertificate(*ca, "decode-0", {"127.0.0.1"}, absl::Hours(1));
  ASSERT_TRUE(plain.ok()) << plain.status();
  names = NodeIdentitiesOfCertificate(plain->cert_pem);
  ASSERT_TRUE(names.ok()) << names.status();
  EXPECT_THAT(*names, ::testing::IsEmpty());

  EXPECT_EQ(NodeIdentitiesOfCertificate("not a certificate").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CertificateAuthorityTest, KeysAreWrittenPrivate) {
  Pki pki;
  EXPECT_EQ(
      std::filesystem::status(pki.client.key_file).permissions() & std::filesystem::perms::all,
      std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
}

}  // namespace
}  // namespace kvr
