// GrpcSecurity and ConfigureServer with real gRPC servers on loopback: which clients a
// mutual-TLS port admits, and what a partial TLS configuration says.

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpc_test_util.h"
#include "gtest/gtest.h"
#include "kvr/common/cert_authority.h"
#include "kvr/common/grpc_server.h"
#include "kvr/common/tls.h"
#include "tls_test_util.h"

namespace kvr {
namespace {

using ::testing::HasSubstr;

// A CA, a server and a client certificate it signed, and a client certificate of another CA,
// as files under a fresh directory.
struct Pki {
  TestCertificates files{"kvr-tls"};
  TlsConfig server, client, ca_only, stranger;
  std::string other_ca_file;

  Pki() {
    const PemCertificate ca = files.Ca("test CA");
    const PemCertificate other = files.Ca("other CA");
    const std::string ca_file = files.WriteCa(ca, "ca");
    other_ca_file = files.WriteCa(other, "other-ca");
    server = files.Issue(ca, "server", ca_file);
    client = files.Issue(ca, "client", ca_file);
    stranger = files.Issue(other, "stranger", ca_file);
    ca_only = TlsConfig{.ca_file = ca_file};
  }
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
  return RawUnaryCall(security->CreateChannel(address), "/grpc.health.v1.Health/Check", "",
                      absl::Seconds(5));
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
  trusts_other.ca_file = pki.other_ca_file;
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
  std::string name;
  const grpc::Status status =
      RawUnaryCall(security->CreateChannel(address, args), "/grpc.health.v1.Health/Check", "",
                   absl::Seconds(5), nullptr, [&](const grpc::ClientContext& ctx) {
                     const std::vector<grpc::string_ref> names =
                         ctx.auth_context()->FindPropertyValues("x509_common_name");
                     if (!names.empty()) name.assign(names[0].data(), names[0].size());
                   });
  return status.ok() ? name : "";
}

// A TLS server reads its files again every reload_interval: a certificate renewed in
// place is what the next handshake presents, without a restart.
TEST(GrpcSecurityTest, ServerPresentsARenewedCertificateWithoutARestart) {
  TestCertificates files("kvr-tls-reload");
  const PemCertificate ca = files.Ca("reload CA");
  const std::string ca_file = files.WriteCa(ca, "ca");
  ASSERT_FALSE(::testing::Test::HasFailure());
  auto write_server = [&](const std::string& common_name) {
    return files.Issue(ca, "server", ca_file, {.common_name = common_name});
  };
  TlsConfig server_tls = write_server("first");
  server_tls.reload_interval = absl::Seconds(1);
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

// A server whose one method answers every call with the common name of the client
// certificate it verified in the handshake ("" without one): what a client presents, seen
// from the other end.
class PeerNameService final : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* context) override {
    class Reactor final : public grpc::ServerGenericBidiReactor {
     public:
      explicit Reactor(grpc::GenericCallbackServerContext* context) {
        const std::vector<grpc::string_ref> names =
            context->auth_context()->FindPropertyValues("x509_common_name");
        const std::string name = names.empty() ? "" : std::string(names[0].data(), names[0].size());
        grpc::Slice slice(name);
        response_ = grpc::ByteBuffer(&slice, 1);
        StartRead(&request_);
      }
      void OnReadDone(bool ok) override {
        if (!ok) return Finish(grpc::Status::OK);
        StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
      }
      void OnDone() override { delete this; }

     private:
      grpc::ByteBuffer request_, response_;
    };
    return new Reactor(context);
  }
};

struct PeerNameServer {
  PeerNameService service;
  std::unique_ptr<grpc::Server> server;
  std::string address;
  explicit PeerNameServer(const TlsConfig& tls) {
    absl::StatusOr<GrpcSecurity> security = GrpcSecurity::Load(tls);
    EXPECT_TRUE(security.ok()) << security.status();
    grpc::ServerBuilder builder;
    int port = 0;
    EXPECT_TRUE(
        ConfigureServer(&builder, "127.0.0.1:0", *security, ClientCertificates::kRequired, &port)
            .ok());
    builder.RegisterCallbackGenericService(&service);
    server = builder.BuildAndStart();
    EXPECT_NE(port, 0);
    address = absl::StrCat("127.0.0.1:", port);
  }
  ~PeerNameServer() { server->Shutdown(absl::ToChronoTime(absl::Now())); }
};

// The client common name that the PeerNameServer at `address` saw on a new connection of
// `security` (a channel of its own, so no connection is reused); "" when the call failed.
std::string ClientCommonNameSeenBy(const std::string& address, const GrpcSecurity& security) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  std::string name;
  const grpc::Status status = RawUnaryCall(security.CreateChannel(address, args),
                                           "/kvr.test.PeerName/Get", "", absl::Seconds(5), &name);
  return status.ok() ? name : "";
}

// Calls `seen` until it returns `want` or 20 s passed (a file watcher reading every second
// picks up a change well within that); returns the last answer.
std::string WaitFor(const std::string& want, const std::function<std::string()>& seen) {
  std::string last;
  for (const absl::Time give_up = absl::Now() + absl::Seconds(20);
       (last = seen()) != want && absl::Now() < give_up;) {
    absl::SleepFor(absl::Milliseconds(200));
  }
  return last;
}

// A client reads its files again every reload_interval too: one GrpcSecurity (as a node keeps
// for its life) presents a certificate renewed in place on its next connection, and a client
// whose CA and certificate both change reaches a server of the new CA that refused it before,
// without a restart.
TEST(GrpcSecurityTest, ClientPresentsARenewedCertificateWithoutARestart) {
  TestCertificates files("kvr-tls-rotation");
  const PemCertificate ca = files.Ca("first CA");
  const PemCertificate next_ca = files.Ca("next CA");
  const std::string ca_file = files.WriteCa(ca, "ca");
  const std::string next_ca_file = files.WriteCa(next_ca, "next-ca");
  ASSERT_FALSE(::testing::Test::HasFailure());
  // Writes a certificate of `by` named `common_name` to <dir>/<file>.pem and its key.
  auto write = [&](const PemCertificate& by, const std::string& file,
                   const std::string& common_name, const std::string& trusts) {
    return files.Issue(by, file, trusts, {.common_name = common_name});
  };
  PeerNameServer server(write(ca, "server", "server", ca_file));
  PeerNameServer next_server(write(next_ca, "next-server", "next server", next_ca_file));

  // The client's CA is a file of its own, so that the test can replace it.
  const std::string client_ca_file = files.WriteCa(ca, "client-ca");
  TlsConfig client_tls = write(ca, "client", "client", client_ca_file);
  client_tls.reload_interval = absl::Seconds(1);
  absl::StatusOr<GrpcSecurity> client = GrpcSecurity::Load(client_tls);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_EQ(ClientCommonNameSeenBy(server.address, *client), "client");
  // The server of the next CA refuses a certificate of the first (and the client refuses it).
  EXPECT_EQ(ClientCommonNameSeenBy(next_server.address, *client), "");

  // A renewed leaf of the same CA, written over the files the client was loaded from.
  write(ca, "client", "client renewed", client_ca_file);
  EXPECT_EQ(
      WaitFor("client renewed", [&] { return ClientCommonNameSeenBy(server.address, *client); }),
      "client renewed");

  // The cluster moves to the next CA: the client's CA and its certificate both change.
  files.WriteCa(next_ca, "client-ca");
  ASSERT_FALSE(::testing::Test::HasFailure());
  write(next_ca, "client", "client of the next CA", client_ca_file);
  EXPECT_EQ(WaitFor("client of the next CA",
                    [&] { return ClientCommonNameSeenBy(next_server.address, *client); }),
            "client of the next CA");
  EXPECT_EQ(ClientCommonNameSeenBy(server.address, *client), "");
}

// Channel credentials check the server's name against the host dialled: a certificate of the
// right CA issued for another address is refused.
TEST(GrpcSecurityTest, ClientRefusesAServerCertificateForAnotherHost) {
  TestCertificates files("kvr-tls-host");
  const PemCertificate ca = files.Ca("host CA");
  const std::string ca_file = files.WriteCa(ca, "ca");
  const TlsConfig server_tls =
      files.Issue(ca, "server", ca_file,
                  {.common_name = "elsewhere", .hosts = {"10.11.12.13", "elsewhere.example"}});
  ASSERT_FALSE(::testing::Test::HasFailure());
  HealthServer server(server_tls, ClientCertificates::kOptional);
  EXPECT_EQ(Check(server.address, TlsConfig{.ca_file = ca_file}).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  // A client told the name the cluster's certificates carry (tls_server_name) checks that name
  // instead of the address it dials; a name the certificate lacks is still refused.
  EXPECT_TRUE(
      Check(server.address, TlsConfig{.ca_file = ca_file, .server_name = "elsewhere.example"})
          .ok());
  EXPECT_EQ(Check(server.address, TlsConfig{.ca_file = ca_file, .server_name = "other.example"})
                .error_code(),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(GrpcSecurity::Load(TlsConfig{.server_name = "elsewhere.example"}).status().code(),
            absl::StatusCode::kInvalidArgument);
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
