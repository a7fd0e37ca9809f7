// The HTTPS API reads its certificate, key and client CA again without a restart: an
// OpenAiHttpServer on loopback, certificates of CAs made here rewritten in place, and new
// handshakes from OpenSSL (to see the certificate presented) and cpp-httplib's client. Only
// handshakes and GET /health: no request reaches the generator.

#include <arpa/inet.h>
#include <httplib.h>
#include <netinet/in.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kvr/common/cert_authority.h"
#include "kvr/common/tls.h"
#include "kvr/controller/http_server.h"
#include "tls_test_util.h"

namespace kvr::controller {
namespace {

// CAs and a directory of certificate files they signed, removed at the end.
class Files : public TestCertificates {
 public:
  Files() : TestCertificates("kvr-https-reload") {}

  // Writes a certificate of `by` for 127.0.0.1 named `common_name` to <dir>/<file>.pem and
  // <dir>/<file>-key.pem.
  TlsConfig Write(const PemCertificate& by, const std::string& file,
                  const std::string& common_name) {
    return Issue(by, file, "", {.common_name = common_name, .hosts = {"127.0.0.1"}});
  }
};

std::unique_ptr<OpenAiHttpServer> StartHttps(const HttpTlsOptions& tls) {
  HttpServerOptions options;
  options.threads = 2;
  options.tls = tls;
  // The generator is never called: the tests make handshakes and ask /health only.
  absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> server =
      OpenAiHttpServer::Start(/*generator=*/nullptr, options);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? std::move(*server) : nullptr;
}

// The common name of the certificate that the server on 127.0.0.1:`port` presents in a new
// handshake, verified against `ca_file`; "" when the handshake fails.
std::string ServerCommonName(int port, const std::string& ca_file) {
  std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> ctx(SSL_CTX_new(TLS_client_method()),
                                                        &SSL_CTX_free);
  if (ctx == nullptr || SSL_CTX_load_verify_locations(ctx.get(), ca_file.c_str(), nullptr) != 1) {
    return "";
  }
  SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER, nullptr);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string name;
  if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0) {
    SSL* ssl = SSL_new(ctx.get());
    SSL_set_fd(ssl, fd);
    if (SSL_connect(ssl) == 1) {
      if (X509* peer = SSL_get1_peer_certificate(ssl)) {
        char cn[256] = {};
        if (X509_NAME_get_text_by_NID(X509_get_subject_name(peer), NID_commonName, cn, sizeof(cn)) >
            0) {
          name = cn;
        }
        X509_free(peer);
      }
      SSL_shutdown(ssl);
    }
    SSL_free(ssl);
  }
  close(fd);
  return name;
}

// A front-door CA, its certificate file, and the files of the server certificate it signed.
class HttpsReloadTest : public ::testing::Test {
 protected:
  // An HTTPS server presenting a certificate of ca_ for "front door 1" (files_ "server", also
  // in first_) and reading its files every `reload_interval`; null after a failed start.
  std::unique_ptr<OpenAiHttpServer> StartFrontDoor(absl::Duration reload_interval) {
    first_ = files_.Write(ca_, "server", "front door 1");
    return StartHttps({.cert_file = first_.cert_file,
                       .key_file = first_.key_file,
                       .reload_interval = reload_interval});
  }

  Files files_;
  const PemCertificate ca_ = files_.Ca("front door CA");
  const std::string ca_file_ = files_.WriteCa(ca_, "ca");
  TlsConfig first_;
};

// GET /health over a new HTTPS connection that presents `client` (cpp-httplib's client);
// true on 200.
bool HealthWithClientCertificate(int port, const std::string& ca_file, const TlsConfig& client) {
  httplib::SSLClient http("127.0.0.1", port, client.cert_file, client.key_file);
  http.set_ca_cert_path(ca_file.c_str());
  http.enable_server_certificate_verification(true);
  http.set_connection_timeout(5);
  http.set_read_timeout(5);
  httplib::Result result = http.Get("/health");
  return result && result->status == 200;
}

TEST_F(HttpsReloadTest, NewHandshakesGetTheRenewedCertificateAfterAReload) {
  std::unique_ptr<OpenAiHttpServer> server = StartFrontDoor(absl::InfiniteDuration());
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(ServerCommonName(server->port(), ca_file_), "front door 1");
  absl::StatusOr<bool> unchanged = server->ReloadTls();
  ASSERT_TRUE(unchanged.ok()) << unchanged.status();
  EXPECT_FALSE(*unchanged);

  files_.Write(ca_, "server", "front door 2");
  // Until the files are read again, handshakes get the certificate in use.
  EXPECT_EQ(ServerCommonName(server->port(), ca_file_), "front door 1");
  absl::StatusOr<bool> reloaded = server->ReloadTls();
  ASSERT_TRUE(reloaded.ok()) << reloaded.status();
  EXPECT_TRUE(*reloaded);
  EXPECT_EQ(ServerCommonName(server->port(), ca_file_), "front door 2");

  // A certificate whose key is not (yet) there, as a renewal half written: refused by name,
  // and the set in use stays.
  const TlsConfig third = files_.Write(ca_, "third", "front door 3");
  std::filesystem::copy_file(third.cert_file, first_.cert_file,
                             std::filesystem::copy_options::overwrite_existing);
  absl::StatusOr<bool> half = server->ReloadTls();
  EXPECT_FALSE(half.ok());
  EXPECT_NE(std::string(half.status().message()).find("is not the key of http_tls_cert"),
            std::string::npos)
      << half.status();
  EXPECT_EQ(ServerCommonName(server->port(), ca_file_), "front door 2");
  // The key arrives: the next reload takes both.
  std::filesystem::copy_file(third.key_file, first_.key_file,
                             std::filesystem::copy_options::overwrite_existing);
  reloaded = server->ReloadTls();
  ASSERT_TRUE(reloaded.ok()) << reloaded.status();
  EXPECT_TRUE(*reloaded);
  EXPECT_EQ(ServerCommonName(server->port(), ca_file_), "front door 3");
}

// Without being asked: the server's own timer reads the files every reload_interval.
TEST_F(HttpsReloadTest, TheServerReadsItsFilesAgainEveryReloadInterval) {
  std::unique_ptr<OpenAiHttpServer> server = StartFrontDoor(absl::Milliseconds(100));
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(ServerCommonName(server->port(), ca_file_), "front door 1");
  files_.Write(ca_, "server", "front door 2");
  std::string seen;
  for (const absl::Time give_up = absl::Now() + absl::Seconds(10);
       (seen = ServerCommonName(server->port(), ca_file_)) != "front door 2" &&
       absl::Now() < give_up;) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(seen, "front door 2");
}

// A client CA that changes: after the reload, client certificates of the new CA are admitted
// and those of the old one refused.
TEST_F(HttpsReloadTest, ARenewedClientCaDecidesWhichClientsAreAdmitted) {
  const PemCertificate old_clients = files_.Ca("old client CA");
  const PemCertificate new_clients = files_.Ca("new client CA");
  const TlsConfig server_files = files_.Write(ca_, "server", "front door");
  const std::string client_ca_file = files_.WriteCa(old_clients, "client-ca");
  const TlsConfig old_client = files_.Write(old_clients, "old-client", "old client");
  const TlsConfig new_client = files_.Write(new_clients, "new-client", "new client");
  std::unique_ptr<OpenAiHttpServer> server =
      StartHttps({.cert_file = server_files.cert_file,
                  .key_file = server_files.key_file,
                  .client_ca_file = client_ca_file,
                  .reload_interval = absl::InfiniteDuration()});
  ASSERT_NE(server, nullptr);
  EXPECT_TRUE(HealthWithClientCertificate(server->port(), ca_file_, old_client));
  EXPECT_FALSE(HealthWithClientCertificate(server->port(), ca_file_, new_client));

  files_.WriteCa(new_clients, "client-ca");
  absl::StatusOr<bool> reloaded = server->ReloadTls();
  ASSERT_TRUE(reloaded.ok()) << reloaded.status();
  EXPECT_TRUE(*reloaded);
  EXPECT_TRUE(HealthWithClientCertificate(server->port(), ca_file_, new_client));
  EXPECT_FALSE(HealthWithClientCertificate(server->port(), ca_file_, old_client));
}

TEST_F(HttpsReloadTest, PlaintextHasNothingToReload) {
  HttpServerOptions options;
  options.threads = 1;
  absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> server =
      OpenAiHttpServer::Start(/*generator=*/nullptr, options);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ((*server)->ReloadTls().status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace kvr::controller
