// kvr-controller's OpenAI-compatible API over HTTPS (--http-tls-cert / --http-tls-key, and
// --http-tls-client-ca), with real processes: kvr-controller plus fake prefill, decode and
// store nodes (controller_fake_node), certificates of CAs made here, and cpp-httplib's
// OpenSSL client.

#include <httplib.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvr/common/cert_authority.h"
#include "kvr/common/tls.h"
#include "subprocess.h"
#include "tls_test_util.h"

namespace kvr::controller {
namespace {

using ::testing::HasSubstr;
using testing::Subprocess;

constexpr char kCompletion[] = R"({"model":"smollm2","prompt":"hi","max_tokens":4})";
constexpr char kStreamedCompletion[] =
    R"({"model":"smollm2","prompt":"hi","max_tokens":4,"stream":true})";

// Two CAs (the cluster's and another) with a certificate each for 127.0.0.1, in a directory
// removed at the end.
class Pki {
 public:
  Pki() {
    const PemCertificate ca = files_.Ca("kvr test CA");
    const PemCertificate other = files_.Ca("another CA");
    ca_file = files_.WriteCa(ca, "ca");
    other_ca_file = files_.WriteCa(other, "other-ca");
    server = files_.Issue(ca, "server", ca_file);
    client = files_.Issue(ca, "client", ca_file);
    other_client = files_.Issue(other, "other-client", other_ca_file);
  }

  std::string ca_file;
  std::string other_ca_file;
  TlsConfig server;
  TlsConfig client;
  TlsConfig other_client;  // of the other CA

 private:
  // Filled in by the constructor's body, which runs after every member is made.
  TestCertificates files_{"kvr-http-tls"};
};

// kvr-controller with `http_args` and one fake node of each role; port() is its HTTP(S) port.
class Cluster {
 public:
  explicit Cluster(const std::vector<std::string>& http_args) {
    // A refused client's request write meets a closed connection: EPIPE, not the end of the
    // test (as kvr-controller itself does).
    signal(SIGPIPE, SIG_IGN);
    std::vector<std::string> argv = {
        KVR_CONTROLLER_BIN, "--listen",       "127.0.0.1:0", "--http-listen",
        "127.0.0.1:0",      "--metrics-port", "-1"};
    argv.insert(argv.end(), http_args.begin(), http_args.end());
    controller_ = std::make_unique<Subprocess>(argv);
    const std::string https = controller_->WaitForLine("kvr-controller https listening on ");
    const std::string grpc = controller_->WaitForLine("kvr-controller listening on ");
    if (https.empty() || grpc.empty()) return;
    port_ = std::stoi(https.substr(https.rfind(':') + 1));
    const std::string address = grpc.substr(grpc.rfind(' ') + 1);
    for (const char* role : {"store", "prefill", "decode"}) {
      nodes_.push_back(std::make_unique<Subprocess>(
          std::vector<std::string>{KVR_FAKE_NODE_BIN, "--controller", address, "--role", role}));
      EXPECT_THAT(nodes_.back()->WaitForLine("registered "), HasSubstr("registered"));
    }
  }
  int port() const { return port_; }

 private:
  std::unique_ptr<Subprocess> controller_;
  std::vector<std::unique_ptr<Subprocess>> nodes_;
  int port_ = 0;
};

std::unique_ptr<httplib::SSLClient> HttpsClient(int port, const std::string& ca_file,
                                                const TlsConfig& client_certificate = {}) {
  auto client =
      client_certificate.cert_file.empty()
          ? std::make_unique<httplib::SSLClient>("127.0.0.1", port)
          : std::make_unique<httplib::SSLClient>("127.0.0.1", port, client_certificate.cert_file,
                                                 client_certificate.key_file);
  if (!ca_file.empty()) client->set_ca_cert_path(ca_file.c_str());
  client->enable_server_certificate_verification(true);
  client->set_connection_timeout(5);
  client->set_read_timeout(10);
  return client;
}

TEST(HttpTlsTest, ServesHttpsToAClientThatTrustsTheCa) {
  Pki pki;
  Cluster cluster({"--http-tls-cert", pki.server.cert_file, "--http-tls-key", pki.server.key_file});
  ASSERT_GT(cluster.port(), 0);
  auto client = HttpsClient(cluster.port(), pki.ca_file);

  httplib::Result models = client->Get("/v1/models");
  ASSERT_TRUE(models) << httplib::to_string(models.error());
  EXPECT_EQ(models->status, 200);
  EXPECT_THAT(models->body, HasSubstr(R"("id":"smollm2")"));

  httplib::Result whole = client->Post("/v1/completions", kCompletion, "application/json");
  ASSERT_TRUE(whole) << httplib::to_string(whole.error());
  EXPECT_EQ(whole->status, 200) << whole->body;
  EXPECT_THAT(whole->body, HasSubstr(R"("completion_tokens":4)"));

  httplib::Result streamed =
      client->Post("/v1/completions", kStreamedCompletion, "application/json");
  ASSERT_TRUE(streamed) << httplib::to_string(streamed.error());
  EXPECT_EQ(streamed->status, 200) << streamed->body;
  EXPECT_EQ(streamed->get_header_value("Content-Type"), "text/event-stream");
  EXPECT_THAT(streamed->body, HasSubstr("data: [DONE]"));

  // Errors keep their status and OpenAI body over TLS.
  httplib::Result unknown =
      client->Post("/v1/completions", R"({"model":"no-such","prompt":"hi"})", "application/json");
  ASSERT_TRUE(unknown);
  EXPECT_EQ(unknown->status, 404);
  EXPECT_THAT(unknown->body, HasSubstr("model_not_found"));
}

TEST(HttpTlsTest, PlaintextAndClientsThatDoNotTrustTheCaAreRefused) {
  Pki pki;
  Cluster cluster({"--http-tls-cert", pki.server.cert_file, "--http-tls-key", pki.server.key_file});
  ASSERT_GT(cluster.port(), 0);

  // Plaintext HTTP to the TLS port: the handshake fails and the server closes the connection.
  httplib::Client plaintext("127.0.0.1", cluster.port());
  plaintext.set_connection_timeout(5);
  plaintext.set_read_timeout(10);
  httplib::Result plain = plaintext.Get("/health");
  EXPECT_FALSE(plain) << "plaintext got HTTP " << plain->status;

  // A client that trusts another CA, or only the system's CAs, does not accept the server.
  for (const std::string& ca : {pki.other_ca_file, std::string()}) {
    auto client = HttpsClient(cluster.port(), ca);
    httplib::Result r = client->Get("/health");
    ASSERT_FALSE(r) << "a client trusting '" << ca << "' got HTTP " << r->status;
    EXPECT_EQ(r.error(), httplib::Error::SSLServerVerification) << httplib::to_string(r.error());
  }
  // The one that trusts the CA still gets through (the refusals left the server serving).
  httplib::Result ok = HttpsClient(cluster.port(), pki.ca_file)->Get("/health");
  ASSERT_TRUE(ok) << httplib::to_string(ok.error());
  EXPECT_EQ(ok->status, 200);
}

TEST(HttpTlsTest, ClientCaRequiresAClientCertificateOfThatCa) {
  Pki pki;
  Cluster cluster({"--http-tls-cert", pki.server.cert_file, "--http-tls-key", pki.server.key_file,
                   "--http-tls-client-ca", pki.ca_file});
  ASSERT_GT(cluster.port(), 0);

  httplib::Result without = HttpsClient(cluster.port(), pki.ca_file)->Get("/v1/models");
  EXPECT_FALSE(without) << "no client certificate got HTTP " << without->status;
  httplib::Result other =
      HttpsClient(cluster.port(), pki.ca_file, pki.other_client)->Get("/v1/models");
  EXPECT_FALSE(other) << "a certificate of another CA got HTTP " << other->status;
  httplib::Result with = HttpsClient(cluster.port(), pki.ca_file, pki.client)->Get("/v1/models");
  ASSERT_TRUE(with) << httplib::to_string(with.error());
  EXPECT_EQ(with->status, 200);
}

// What kvr-controller prints (stdout and stderr) and how it ended, run with `args`.
std::pair<std::string, int> RunController(const std::vector<std::string>& args) {
  std::string command = absl::StrCat("exec ", KVR_CONTROLLER_BIN,
                                     " --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 "
                                     "--metrics-port -1 ",
                                     absl::StrJoin(args, " "), " 2>&1");
  Subprocess controller({"/bin/sh", "-c", command});
  // It exits at once with these arguments; "listening on" would mean it did not.
  EXPECT_EQ(controller.WaitForLine("kvr-controller listening on "), "");
  const std::vector<std::string> lines = controller.Lines();
  return {absl::StrJoin(lines, "\n"), controller.Stop(SIGTERM)};
}

TEST(HttpTlsTest, UnusableTlsFilesStopTheControllerNamingTheProblem) {
  Pki pki;
  const std::string missing = absl::StrCat(::testing::TempDir(), "/no-such-key.pem");
  auto [out, status] =
      RunController({"--http-tls-cert", pki.server.cert_file, "--http-tls-key", missing});
  EXPECT_THAT(out, HasSubstr(absl::StrCat("http_tls_key '", missing, "'")));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 2) << out;

  // A key that is not the certificate's.
  std::tie(out, status) = RunController(
      {"--http-tls-cert", pki.server.cert_file, "--http-tls-key", pki.client.key_file});
  EXPECT_THAT(out, HasSubstr(absl::StrCat("http_tls_key '", pki.client.key_file, "'")));

  std::tie(out, status) = RunController({"--http-tls-cert", pki.server.cert_file});
  EXPECT_THAT(out, HasSubstr("http_tls_key: empty while http_tls_cert is set"));

  std::tie(out, status) = RunController({"--http-tls-client-ca", pki.ca_file});
  EXPECT_THAT(out, HasSubstr("http_tls_client_ca: set without http_tls_cert"));
}

}  // namespace
}  // namespace kvr::controller
