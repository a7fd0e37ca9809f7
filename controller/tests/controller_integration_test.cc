// The controller with real processes: kvr-controller plus fake prefill/decode/store nodes
// (controller_fake_node) that register over gRPC and produce a known token stream.

#include <grpcpp/grpcpp.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "grpc_test_util.h"
#include "health_test_util.h"
#include "kvr/cluster/v1/cluster.grpc.pb.h"
#include "kvr/common/cert_authority.h"
#include "kvr/common/tls.h"
#include "kvr/v1/generation.grpc.pb.h"
#include "subprocess.h"
#include "tls_test_util.h"

namespace kvr::controller {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::StartsWith;
using testing::Subprocess;

struct StreamResult {
  grpc::Status status;
  std::vector<uint32_t> tokens;
  std::string text;
  std::optional<kvr::v1::Completion> completion;
};

class Cluster {
 public:
  Cluster() {
    controller_ = std::make_unique<Subprocess>(std::vector<std::string>{
        KVR_CONTROLLER_BIN, "--listen", "127.0.0.1:0", "--lease-seconds", "3",
        "--default-max-tokens", "8", "--max-attempts", "3", "--shutdown-grace-seconds", "1"});
    const std::string line = controller_->WaitForLine("kvr-controller listening on ");
    address_ = line.substr(line.rfind(' ') + 1);
    channel_ = grpc::CreateChannel(address_, grpc::InsecureChannelCredentials());
    stub_ = kvr::v1::Generation::NewStub(channel_);
  }

  // Starts a fake node and waits for its registration; returns its node id.
  std::string AddNode(const std::string& role, std::vector<std::string> extra = {}) {
    std::vector<std::string> argv = {KVR_FAKE_NODE_BIN, "--controller", address_, "--role", role};
    argv.insert(argv.end(), extra.begin(), extra.end());
    nodes_.push_back(std::make_unique<Subprocess>(argv));
    const std::string line = nodes_.back()->WaitForLine("registered ");
    std::vector<std::string> parts = absl::StrSplit(line, ' ');
    return parts.size() >= 2 ? parts[1] : "";
  }
  // A prefill, a decode (with `decode_extra` arguments) and a store node, in that order:
  // node(0), node(1) and node(2) of an empty cluster.
  void AddOneOfEach(std::vector<std::string> decode_extra = {}) {
    AddNode("prefill");
    AddNode("decode", std::move(decode_extra));
    AddNode("store");
  }
  Subprocess& node(size_t i) { return *nodes_[i]; }
  Subprocess& controller() { return *controller_; }

  // kill -9 of the controller and a new one on the same address (the nodes keep running and
  // register again when their next heartbeat gets NOT_FOUND). False when it did not start.
  bool RestartController() {
    controller_->Kill();
    controller_ = std::make_unique<Subprocess>(std::vector<std::string>{
        KVR_CONTROLLER_BIN, "--listen", address_, "--lease-seconds", "3", "--default-max-tokens",
        "8", "--max-attempts", "3", "--shutdown-grace-seconds", "1"});
    return !controller_->WaitForLine("kvr-controller listening on ").empty();
  }

  // Runs Generate to its end. `on_token(n)` runs after the n-th token arrived.
  StreamResult Generate(const kvr::v1::GenerateRequest& request,
                        absl::Duration timeout = absl::Seconds(20),
                        std::function<void(size_t, grpc::ClientContext&)> on_token = nullptr) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    auto reader = stub_->Generate(&ctx, request);
    StreamResult out;
    kvr::v1::GenerateResponse msg;
    while (reader->Read(&msg)) {
      for (uint32_t t : msg.token_ids()) out.tokens.push_back(t);
      out.text += msg.text();
      if (msg.has_completion()) out.completion = msg.completion();
      if (on_token && msg.token_ids_size() > 0) on_token(out.tokens.size(), ctx);
    }
    out.status = reader->Finish();
    return out;
  }

  kvr::v1::Generation::Stub& stub() { return *stub_; }
  std::shared_ptr<grpc::Channel> channel() { return channel_; }

 private:
  std::unique_ptr<Subprocess> controller_;
  std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<kvr::v1::Generation::Stub> stub_;
  std::vector<std::unique_ptr<Subprocess>> nodes_;
};

kvr::v1::GenerateRequest Request(uint32_t max_tokens = 6) {
  kvr::v1::GenerateRequest r;
  r.set_model("smollm2");
  r.set_prompt("hello world");
  r.mutable_sampling()->set_max_tokens(max_tokens);
  return r;
}

TEST(ControllerIntegrationTest, StreamsTheClusterTokens) {
  Cluster c;
  const std::string p = c.AddNode("prefill");
  const std::string d = c.AddNode("decode");
  const std::string s = c.AddNode("store");
  ASSERT_FALSE(p.empty() || d.empty() || s.empty());

  grpc::ClientContext ctx;
  kvr::v1::ListModelsResponse models;
  ASSERT_TRUE(c.stub().ListModels(&ctx, {}, &models).ok());
  ASSERT_EQ(models.models_size(), 1);
  EXPECT_EQ(models.models(0).name(), "smollm2");
  EXPECT_EQ(models.models(0).context_length(), 256u);
  EXPECT_THAT(models.models(0).retrieval_methods(), ElementsAre("full", "clusterkv"));

  StreamResult r = c.Generate(Request(6));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_THAT(r.tokens, ElementsAre(100, 101, 102, 103, 104, 105));
  EXPECT_EQ(r.text, "t100 t101 t102 t103 t104 t105 ");
  ASSERT_TRUE(r.completion.has_value());
  EXPECT_EQ(r.completion->finish_reason(), kvr::v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(r.completion->usage().completion_tokens(), 6u);
  EXPECT_EQ(r.completion->usage().prompt_tokens(), 11u);
  EXPECT_EQ(r.completion->retrieval().bytes_fetched(), 512u * 6);
  EXPECT_EQ(r.completion->retrieval().method(), "full");
  EXPECT_EQ(r.completion->prefill_node(), p);
  EXPECT_EQ(r.completion->decode_node(), d);
  EXPECT_EQ(r.completion->store_node(), s);
  EXPECT_EQ(r.completion->attempts(), 1u);
  EXPECT_GT(r.completion->timings().time_to_first_token().nanos() +
                r.completion->timings().time_to_first_token().seconds(),
            0);
}

TEST(ControllerIntegrationTest, ServesHealthAndReflection) {
  Cluster c;
  grpc::ClientContext health_ctx;
  grpc::health::v1::HealthCheckResponse health;
  ASSERT_TRUE(grpc::health::v1::Health::NewStub(c.channel())
                  ->Check(&health_ctx, grpc::health::v1::HealthCheckRequest(), &health)
                  .ok());
  EXPECT_EQ(health.status(), grpc::health::v1::HealthCheckResponse::SERVING);

  grpc::ClientContext reflection_ctx;
  auto stream = grpc::reflection::v1alpha::ServerReflection::NewStub(c.channel())
                    ->ServerReflectionInfo(&reflection_ctx);
  grpc::reflection::v1alpha::ServerReflectionRequest list;
  list.set_list_services("");
  ASSERT_TRUE(stream->Write(list));
  stream->WritesDone();
  grpc::reflection::v1alpha::ServerReflectionResponse response;
  ASSERT_TRUE(stream->Read(&response));
  std::vector<std::string> services;
  for (const auto& s : response.list_services_response().service()) services.push_back(s.name());
  EXPECT_THAT(services, ::testing::IsSupersetOf({"kvr.v1.Generation", "kvr.cluster.v1.Membership",
                                                 "grpc.health.v1.Health"}));
  EXPECT_TRUE(stream->Finish().ok());
}

TEST(ControllerIntegrationTest, BadRequestsAreInvalidArgumentNamingTheField) {
  Cluster c;
  c.AddOneOfEach();
  auto expect_invalid = [&](const kvr::v1::GenerateRequest& r, const std::string& field) {
    StreamResult out = c.Generate(r);
    EXPECT_EQ(out.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << field;
    EXPECT_THAT(out.status.error_message(), StartsWith(field + ":"));
    EXPECT_TRUE(out.tokens.empty());
  };
  kvr::v1::GenerateRequest r = Request();
  r.set_model("gpt-5");
  expect_invalid(r, "model");
  r = Request();
  r.set_prompt("");
  expect_invalid(r, "prompt");
  r = Request();
  for (int i = 0; i < 300; ++i) r.mutable_token_ids()->add_ids(i);  // context is 256
  expect_invalid(r, "token_ids");
  r = Request();
  r.mutable_retrieval()->set_budget(0);
  expect_invalid(r, "retrieval.budget");
  r = Request();
  r.mutable_retrieval()->set_method("oracle-of-delphi");
  expect_invalid(r, "retrieval.method");
}

// Bytes that are not the request message (garbage, or a prompt that is not UTF-8, which proto3
// refuses to parse) are INVALID_ARGUMENT with a message, on every public method, and the
// controller keeps serving.
TEST(ControllerIntegrationTest, UndecodableRequestsAreInvalidArgumentWithAMessage) {
  Cluster c;
  c.AddOneOfEach();
  auto call = [&](const std::string& method, const std::string& bytes) {
    return RawUnaryCall(c.channel(), method, bytes, absl::Seconds(10));
  };
  // Field 1 (model) "smollm2", field 2 (prompt) two bytes that are not UTF-8.
  const std::string bad_utf8("\x0a\x07smollm2\x12\x02\xff\xfe", 13);
  const std::string garbage = "\xff\xff\xff\xff\x0f garbage";
  for (const std::string& bytes : {bad_utf8, garbage}) {
    const grpc::Status s = call("/kvr.v1.Generation/Generate", bytes);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("kvr.v1.GenerateRequest"));
  }
  for (const char* method : {"/kvr.v1.Generation/Abort", "/kvr.v1.Generation/ListModels"}) {
    const grpc::Status s = call(method, garbage);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << method;
    EXPECT_THAT(s.error_message(), HasSubstr("not a valid")) << method;
  }
  // The internal Membership service answers the same way (the interceptor every kvr server
  // installs), naming the method.
  for (const char* method :
       {"/kvr.cluster.v1.Membership/Register", "/kvr.cluster.v1.Membership/Heartbeat"}) {
    const grpc::Status s = call(method, garbage);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << method;
    EXPECT_THAT(s.error_message(), HasSubstr(method));
  }
  // A well-formed ListModels through the same raw path still answers.
  EXPECT_TRUE(call("/kvr.v1.Generation/ListModels", "").ok());
  // Still serving.
  EXPECT_TRUE(c.Generate(Request()).status.ok());
}

TEST(ControllerIntegrationTest, FullClusterIsResourceExhaustedNamingTheResource) {
  Cluster c;
  c.AddNode("prefill");
  c.AddNode("decode");
  // 100 kB of store: 20 prompt + 100 tokens need 120 kB at 1000 B/token.
  c.AddNode("store", {"--memory-bytes", "100000"});
  kvr::v1::GenerateRequest r = Request(100);
  for (int i = 0; i < 20; ++i) r.mutable_token_ids()->add_ids(i);
  StreamResult out = c.Generate(r);
  EXPECT_EQ(out.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(out.status.error_message(), HasSubstr("store memory"));
  // A request that fits still runs.
  StreamResult small = c.Generate(Request(4));
  EXPECT_TRUE(small.status.ok()) << small.status.error_message();
}

TEST(ControllerIntegrationTest, DecodeNodeKilledMidStreamEndsWithClearError) {
  Cluster c;
  c.AddOneOfEach({"--token-delay-ms", "50"});
  StreamResult out =
      c.Generate(Request(200), absl::Seconds(20), [&](size_t n, grpc::ClientContext&) {
        if (n == 3) c.node(1).Kill();
      });
  // Ends well before the 20 s deadline with an error that says what happened.
  EXPECT_EQ(out.status.error_code(), grpc::StatusCode::UNAVAILABLE) << out.status.error_message();
  EXPECT_THAT(out.status.error_message(), HasSubstr("decode node decode-2"));
  EXPECT_THAT(out.status.error_message(),
              HasSubstr("not retried because tokens were already sent"));
  EXPECT_GE(out.tokens.size(), 3u);
  EXPECT_LT(out.tokens.size(), 200u);

  // The dead node left the cluster at once (not only when its lease lapses): the next request
  // runs on the other decode node.
  const std::string other = c.AddNode("decode");
  StreamResult next = c.Generate(Request(3));
  ASSERT_TRUE(next.status.ok()) << next.status.error_message();
  EXPECT_EQ(next.completion->decode_node(), other);
}

// SIGTERM: the controller stops taking calls and exits 0 within its grace period (1 s here).
// Seen with gRPC 1.51: while a client keeps its (idle) connection open, as this test's channel
// does, Shutdown(deadline) waits out the whole grace period even with no call running; with
// no client connected it returns in ~10 ms.
TEST(ControllerIntegrationTest, SigtermShutsDownGracefully) {
  Cluster c;
  c.AddOneOfEach();
  ASSERT_TRUE(c.Generate(Request(2)).status.ok());
  const int status = c.controller().Stop(SIGTERM);
  EXPECT_TRUE(WIFEXITED(status)) << status << "\n" << absl::StrJoin(c.controller().Lines(), "\n");
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(ControllerIntegrationTest, PrefillNodeKilledBeforeAnyTokenIsRetriedOnTheOther) {
  Cluster c;
  // Registered first, so an idle cluster places the request on it (ties go to the earliest).
  const std::string slow = c.AddNode("prefill", {"--prefill-delay-ms", "30000"});
  const std::string fast = c.AddNode("prefill");
  c.AddNode("decode");
  c.AddNode("store");
  auto killer = std::async(std::launch::async, [&] {
    const std::string line = c.node(0).WaitForLine("prefill-started ");
    c.node(0).Kill();
    return line;
  });
  StreamResult out = c.Generate(Request(5));
  EXPECT_THAT(killer.get(), StartsWith("prefill-started "));
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  EXPECT_THAT(out.tokens, ElementsAre(100, 101, 102, 103, 104));
  ASSERT_TRUE(out.completion.has_value());
  EXPECT_EQ(out.completion->attempts(), 2u);
  EXPECT_EQ(out.completion->prefill_node(), fast);
  EXPECT_NE(fast, slow);
}

TEST(ControllerIntegrationTest, DeadDecodeNamedByPrefillIsAvoidedOnRetry) {
  Cluster c;
  c.AddNode("prefill");
  const std::string dead = c.AddNode("decode");
  const std::string alive = c.AddNode("decode");
  c.AddNode("store");
  // Killed while its lease still runs: the controller still places on it, P's handoff fails,
  // P names it in "kvr-failed-node", and the retry goes to the other decode node.
  c.node(1).Kill();
  StreamResult out = c.Generate(Request(4));
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  EXPECT_THAT(out.tokens, ElementsAre(100, 101, 102, 103));
  EXPECT_EQ(out.completion->decode_node(), alive);
  EXPECT_EQ(out.completion->attempts(), 2u);
  EXPECT_NE(alive, dead);
}

TEST(ControllerIntegrationTest, ConcurrentRequestsWithANodeKilledEachCompleteOrFailClearly) {
  Cluster c;
  c.AddNode("prefill");
  c.AddNode("prefill");
  c.AddNode("decode", {"--token-delay-ms", "20"});
  c.AddNode("decode", {"--token-delay-ms", "20"});
  c.AddNode("store");
  std::vector<std::future<StreamResult>> results;
  for (int i = 0; i < 6; ++i) {
    results.push_back(std::async(std::launch::async, [&c, i] {
      return c.Generate(Request(40), absl::Seconds(15), [&c, i](size_t n, grpc::ClientContext&) {
        if (i == 0 && n == 5) c.node(2).Kill();
      });
    }));
  }
  int completed = 0, failed = 0;
  for (auto& f : results) {
    StreamResult r = f.get();
    if (r.status.ok()) {
      ++completed;
      EXPECT_EQ(r.tokens.size(), 40u);
    } else {
      ++failed;
      // Never a hang into the deadline: a clear node-failure error.
      EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE) << r.status.error_message();
      EXPECT_THAT(r.status.error_message(), HasSubstr("decode node"));
    }
  }
  EXPECT_EQ(completed + failed, 6);
  EXPECT_GE(failed, 1) << "requests streaming from the killed node failed";
  EXPECT_GE(completed, 1) << "requests on the other decode node completed";
}

TEST(ControllerIntegrationTest, ClientCancellationReachesTheDecodeNode) {
  Cluster c;
  c.AddOneOfEach({"--token-delay-ms", "50"});
  kvr::v1::GenerateRequest r = Request(200);
  r.set_request_id("cancel-me");
  StreamResult out = c.Generate(r, absl::Seconds(20), [&](size_t n, grpc::ClientContext& ctx) {
    if (n == 2) ctx.TryCancel();
  });
  EXPECT_EQ(out.status.error_code(), grpc::StatusCode::CANCELLED);
  // The controller noticed the disconnect and told the decode node.
  EXPECT_EQ(c.node(1).WaitForLine("cancelled cancel-me"), "cancelled cancel-me");
}

TEST(ControllerIntegrationTest, AbortEndsTheStreamAndDeadlinePropagates) {
  Cluster c;
  c.AddOneOfEach({"--token-delay-ms", "50"});
  kvr::v1::GenerateRequest r = Request(200);
  r.set_request_id("abort-me");
  StreamResult out = c.Generate(r, absl::Seconds(20), [&](size_t n, grpc::ClientContext&) {
    if (n != 2) return;
    grpc::ClientContext ctx;
    kvr::v1::AbortRequest abort;
    abort.set_request_id("abort-me");
    kvr::v1::AbortResponse response;
    EXPECT_TRUE(c.stub().Abort(&ctx, abort, &response).ok());
    EXPECT_TRUE(response.found());
  });
  EXPECT_EQ(out.status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_THAT(out.status.error_message(), HasSubstr("aborted"));
  EXPECT_EQ(c.node(1).WaitForLine("cancelled abort-me"), "cancelled abort-me");

  // A client deadline shorter than the generation ends it with DEADLINE_EXCEEDED, and the
  // decode node's stream (which carried that deadline) stops too.
  r.set_request_id("too-slow");
  StreamResult late = c.Generate(r, absl::Milliseconds(600));
  EXPECT_EQ(late.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(c.node(1).WaitForLine("stream-cancelled too-slow"), "stream-cancelled too-slow");
}

// grpc.health.v1 status of `service` on the controller (HealthStatus).
int Health(Cluster& c, const std::string& service) {
  return HealthStatus(c.channel(), service, absl::Seconds(2));
}

// Polls `service` until it reports `want` (true) or `timeout` passes.
bool WaitHealth(Cluster& c, const std::string& service,
                grpc::health::v1::HealthCheckResponse::ServingStatus want, absl::Duration timeout) {
  const absl::Time until = absl::Now() + timeout;
  while (Health(c, service) != want) {
    if (absl::Now() > until) return false;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return true;
}

// Before any prefill+decode pair registered, the model cannot be judged: UNAVAILABLE (retry),
// not INVALID_ARGUMENT "unknown model; served: []", and the controller is live but not ready.
TEST(ControllerIntegrationTest, NoNodesYetIsUnavailableAndNotReady) {
  using HS = grpc::health::v1::HealthCheckResponse;
  Cluster c;
  StreamResult r = c.Generate(Request(), absl::Seconds(5));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE) << r.status.error_message();
  EXPECT_THAT(r.status.error_message(), HasSubstr("no model is served yet"));
  EXPECT_EQ(Health(c, ""), HS::SERVING) << "live";
  EXPECT_TRUE(WaitHealth(c, "kvr.ready", HS::NOT_SERVING, absl::Seconds(2)));
  EXPECT_EQ(Health(c, "kvr.v1.Generation"), HS::NOT_SERVING);
  // Half a pair is still not enough.
  c.AddNode("prefill");
  c.AddNode("store");
  r = c.Generate(Request(), absl::Seconds(5));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE) << r.status.error_message();
  EXPECT_EQ(Health(c, "kvr.ready"), HS::NOT_SERVING);
  c.AddNode("decode");
  EXPECT_TRUE(WaitHealth(c, "kvr.ready", HS::SERVING, absl::Seconds(2)));
  EXPECT_EQ(Health(c, "kvr.v1.Generation"), HS::SERVING);
  r = c.Generate(Request(3));
  EXPECT_TRUE(r.status.ok()) << r.status.error_message();
  // A name no node ever registered, while another model is served: the client's mistake.
  kvr::v1::GenerateRequest bad = Request();
  bad.set_model("gpt-5");
  r = c.Generate(bad);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

// kill -9 of the controller and a restart on the same port: the first request gets UNAVAILABLE
// or succeeds (never INVALID_ARGUMENT), and requests succeed once the nodes registered again.
TEST(ControllerIntegrationTest, ControllerRestartServesOnceNodesReturn) {
  using HS = grpc::health::v1::HealthCheckResponse;
  Cluster c;
  c.AddOneOfEach();
  ASSERT_TRUE(c.Generate(Request(3)).status.ok());
  ASSERT_TRUE(c.RestartController());
  const absl::Time restarted = absl::Now();
  StreamResult first = c.Generate(Request(3), absl::Seconds(5));
  EXPECT_TRUE(first.status.ok() || first.status.error_code() == grpc::StatusCode::UNAVAILABLE)
      << first.status.error_code() << " " << first.status.error_message();
  EXPECT_NE(first.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // The nodes heartbeat every lease/3 = 1 s, get NOT_FOUND and register again.
  std::optional<absl::Duration> served_after;
  int unavailable = 0;
  while (absl::Now() - restarted < absl::Seconds(15)) {
    StreamResult r = c.Generate(Request(3), absl::Seconds(5));
    if (r.status.ok()) {
      served_after = absl::Now() - restarted;
      break;
    }
    ASSERT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE) << r.status.error_message();
    ++unavailable;
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_TRUE(served_after.has_value()) << "no request served within 15 s of the restart";
  std::printf(
      "controller restart: first answer %s, served %s after the restart (%d UNAVAILABLE "
      "before)\n",
      first.status.ok() ? "OK" : "UNAVAILABLE", absl::FormatDuration(*served_after).c_str(),
      unavailable);
  // Readiness follows membership by a poll (every 200 ms): SERVING within a second of serving.
  const absl::Time served = absl::Now();
  while (Health(c, "kvr.ready") != HS::SERVING && absl::Now() - served < absl::Seconds(1)) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(Health(c, "kvr.ready"), HS::SERVING);
}

// A controller with TLS (a CA made here) admits as a member only a peer that presents a
// certificate of that CA. A "rogue node" without one cannot Register, nor Heartbeat or
// Deregister a real member's id; one with a certificate of another CA does not get past the
// handshake; a plaintext one neither. Public clients share the port with the CA alone.
TEST(ControllerIntegrationTest, RogueNodeWithoutAClusterCertificateCannotJoin) {
  TestCertificates files("kvr-rogue");
  const PemCertificate ca = files.Ca("cluster CA");
  const PemCertificate other = files.Ca("rogue CA");
  const std::string ca_file = files.WriteCa(ca, "ca");
  auto issue = [&](const PemCertificate& by, const std::string& name) {
    return files.Issue(by, name, ca_file, {.uris = {NodeIdentityUri(name)}});
  };
  const TlsConfig controller_tls = issue(ca, "controller");
  const TlsConfig member_tls = issue(ca, "member");
  const TlsConfig rogue_ca_tls = issue(other, "rogue");
  ASSERT_FALSE(::testing::Test::HasFailure());
  Subprocess controller({KVR_CONTROLLER_BIN, "--listen", "127.0.0.1:0", "--tls-ca", ca_file,
                         "--tls-cert", controller_tls.cert_file, "--tls-key",
                         controller_tls.key_file});
  const std::string line = controller.WaitForLine("kvr-controller listening on ");
  ASSERT_FALSE(line.empty());
  const std::string address = line.substr(line.rfind(' ') + 1);

  auto stub = [&](const TlsConfig& tls) {
    absl::StatusOr<GrpcSecurity> security = GrpcSecurity::Load(tls);
    EXPECT_TRUE(security.ok()) << security.status();
    return kvr::cluster::v1::Membership::NewStub(security->CreateChannel(address));
  };
  kvr::cluster::v1::RegisterRequest registration;
  registration.set_role(kvr::cluster::v1::NODE_ROLE_PREFILL);
  registration.set_protocol_version(1);
  registration.set_name("member");
  registration.mutable_endpoints()->set_grpc_address("127.0.0.1:1");
  kvr::cluster::v1::ModelInfo* model = registration.mutable_capacity()->add_models();
  model->set_name("smollm2");
  model->set_context_length(2048);
  model->set_kv_bytes_per_token(1000);
  auto register_with = [&](const TlsConfig& tls, kvr::cluster::v1::RegisterResponse* response) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    return stub(tls)->Register(&ctx, registration, response);
  };

  kvr::cluster::v1::RegisterResponse response;
  const grpc::Status no_certificate = register_with(TlsConfig{.ca_file = ca_file}, &response);
  EXPECT_EQ(no_certificate.error_code(), grpc::StatusCode::UNAUTHENTICATED)
      << no_certificate.error_message();
  EXPECT_THAT(no_certificate.error_message(), HasSubstr("certificate of the cluster CA"));
  const grpc::Status other_ca = register_with(rogue_ca_tls, &response);
  EXPECT_EQ(other_ca.error_code(), grpc::StatusCode::UNAVAILABLE) << other_ca.error_message();
  const grpc::Status plaintext = register_with(TlsConfig{}, &response);
  EXPECT_EQ(plaintext.error_code(), grpc::StatusCode::UNAVAILABLE) << plaintext.error_message();

  // A real member joins; the rogue can neither renew nor remove it.
  const grpc::Status member = register_with(member_tls, &response);
  ASSERT_TRUE(member.ok()) << member.error_message();
  const std::string member_id = response.node_id();
  // And a decode node beside it, so that the model is served (ListModels below).
  registration.set_role(kvr::cluster::v1::NODE_ROLE_DECODE);
  registration.mutable_endpoints()->set_grpc_address("127.0.0.1:2");
  registration.mutable_capacity()->set_batch_slots(4);
  registration.mutable_capacity()->set_memory_bytes(1 << 30);
  kvr::cluster::v1::RetrievalMethodInfo* method = model->add_retrieval_methods();
  method->set_name("full");
  method->set_summary_bytes_per_token(1);
  const grpc::Status decode_member = register_with(member_tls, &response);
  ASSERT_TRUE(decode_member.ok()) << decode_member.error_message();
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    kvr::cluster::v1::DeregisterRequest request;
    request.set_node_id(member_id);
    kvr::cluster::v1::DeregisterResponse ignored;
    EXPECT_EQ(stub(TlsConfig{.ca_file = ca_file})->Deregister(&ctx, request, &ignored).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    kvr::cluster::v1::HeartbeatRequest request;
    request.set_node_id(member_id);
    kvr::cluster::v1::HeartbeatResponse ignored;
    EXPECT_EQ(stub(TlsConfig{.ca_file = ca_file})->Heartbeat(&ctx, request, &ignored).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  // The public API answers a client that has the CA and no certificate; the members are still
  // there (one prefill node of smollm2: the rogue's registrations never counted).
  absl::StatusOr<GrpcSecurity> public_client = GrpcSecurity::Load({.ca_file = ca_file});
  ASSERT_TRUE(public_client.ok());
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  kvr::v1::ListModelsResponse models;
  const grpc::Status listed = kvr::v1::Generation::NewStub(public_client->CreateChannel(address))
                                  ->ListModels(&ctx, {}, &models);
  ASSERT_TRUE(listed.ok()) << listed.error_message();
  ASSERT_EQ(models.models_size(), 1);
  EXPECT_EQ(models.models(0).prefill_nodes(), 1u);
}

// With mutual TLS on the gRPC port and --health-address, kvr-controller also answers
// grpc.health.v1 in plaintext on the health port (what kubelet's gRPC probes need), with the
// gRPC port's statuses, the named readiness services included and as they change; that port
// serves nothing else, and the gRPC port still refuses a plaintext client.
TEST(ControllerIntegrationTest, HealthPortAnswersProbesInPlaintextBesideAMutualTlsPort) {
  using HS = grpc::health::v1::HealthCheckResponse;
  TestCertificates files("kvr-health-port");
  const PemCertificate ca = files.Ca("cluster CA");
  const std::string ca_file = files.WriteCa(ca, "ca");
  auto issue = [&](const std::string& name) {
    return files.Issue(ca, name, ca_file, {.uris = {NodeIdentityUri(name)}});
  };
  const TlsConfig controller_tls = issue("controller");
  const TlsConfig member_tls = issue("member");
  ASSERT_FALSE(::testing::Test::HasFailure());
  Subprocess controller({KVR_CONTROLLER_BIN, "--listen", "127.0.0.1:0", "--health-address",
                         "127.0.0.1:0", "--tls-ca", ca_file, "--tls-cert", controller_tls.cert_file,
                         "--tls-key", controller_tls.key_file});
  const std::string health_line = controller.WaitForLine("kvr-controller health on ");
  const std::string line = controller.WaitForLine("kvr-controller listening on ");
  ASSERT_FALSE(health_line.empty());
  ASSERT_FALSE(line.empty());
  const std::string health_address = health_line.substr(health_line.rfind(' ') + 1);
  const std::string address = line.substr(line.rfind(' ') + 1);
  ASSERT_NE(health_address, address);

  auto channel = [](const std::string& to, const TlsConfig& tls) {
    absl::StatusOr<GrpcSecurity> security = GrpcSecurity::Load(tls);
    EXPECT_TRUE(security.ok()) << security.status();
    return security->CreateChannel(to);
  };
  const auto probe = channel(health_address, TlsConfig{});  // plaintext, as kubelet
  const auto member = channel(address, member_tls);
  // The status of `service`, or 100 + the code of a failed call.
  auto check = [](const std::shared_ptr<grpc::Channel>& ch, const std::string& service) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    grpc::health::v1::HealthCheckResponse response;
    const grpc::Status s = grpc::health::v1::Health::NewStub(ch)->Check(&ctx, request, &response);
    return s.ok() ? static_cast<int>(response.status()) : 100 + s.error_code();
  };
  auto wait_for = [&](const std::shared_ptr<grpc::Channel>& ch, const std::string& service,
                      int want) {
    const absl::Time until = absl::Now() + absl::Seconds(3);
    while (check(ch, service) != want && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(50));
    }
    return check(ch, service);
  };

  EXPECT_EQ(check(probe, ""), HS::SERVING);
  // No nodes yet: live, not ready, on both ports.
  EXPECT_EQ(wait_for(probe, "kvr.ready", HS::NOT_SERVING), HS::NOT_SERVING);
  EXPECT_EQ(check(member, "kvr.ready"), HS::NOT_SERVING);
  EXPECT_EQ(check(probe, "kvr.v1.Generation"), HS::NOT_SERVING);
  EXPECT_EQ(check(probe, "no.such.Service"), 100 + grpc::StatusCode::NOT_FOUND);

  // Only health on the health port: Membership (served on the gRPC port) is UNIMPLEMENTED there.
  kvr::cluster::v1::RegisterRequest registration;
  registration.set_protocol_version(1);
  registration.set_name("member");
  kvr::cluster::v1::ModelInfo* model = registration.mutable_capacity()->add_models();
  model->set_name("smollm2");
  model->set_context_length(2048);
  model->set_kv_bytes_per_token(1000);
  auto register_as = [&](const std::shared_ptr<grpc::Channel>& ch, kvr::cluster::v1::NodeRole role,
                         const std::string& grpc_address) {
    registration.set_role(role);
    registration.mutable_endpoints()->set_grpc_address(grpc_address);
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    kvr::cluster::v1::RegisterResponse response;
    return kvr::cluster::v1::Membership::NewStub(ch)->Register(&ctx, registration, &response);
  };
  EXPECT_EQ(register_as(probe, kvr::cluster::v1::NODE_ROLE_PREFILL, "127.0.0.1:1").error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
  // Nor server reflection, which the gRPC port serves.
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    auto stream =
        grpc::reflection::v1alpha::ServerReflection::NewStub(probe)->ServerReflectionInfo(&ctx);
    grpc::reflection::v1alpha::ServerReflectionRequest list;
    list.set_list_services("");
    stream->Write(list);
    stream->WritesDone();
    grpc::reflection::v1alpha::ServerReflectionResponse response;
    EXPECT_FALSE(stream->Read(&response));
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::UNIMPLEMENTED);
  }
  // The gRPC port refuses a plaintext client.
  EXPECT_EQ(check(channel(address, TlsConfig{}), ""), 100 + grpc::StatusCode::UNAVAILABLE);

  // A prefill, a decode and a store join: ready, on the health port as on the gRPC port.
  ASSERT_TRUE(register_as(member, kvr::cluster::v1::NODE_ROLE_PREFILL, "127.0.0.1:1").ok());
  registration.mutable_capacity()->set_batch_slots(4);
  registration.mutable_capacity()->set_memory_bytes(1 << 30);
  kvr::cluster::v1::RetrievalMethodInfo* method = model->add_retrieval_methods();
  method->set_name("full");
  method->set_summary_bytes_per_token(1);
  ASSERT_TRUE(register_as(member, kvr::cluster::v1::NODE_ROLE_DECODE, "127.0.0.1:2").ok());
  registration.mutable_endpoints()->set_ucx_worker_address("fake-ucx-address");
  ASSERT_TRUE(register_as(member, kvr::cluster::v1::NODE_ROLE_STORE, "127.0.0.1:3").ok());
  EXPECT_EQ(wait_for(probe, "kvr.ready", HS::SERVING), HS::SERVING);
  EXPECT_EQ(check(member, "kvr.ready"), HS::SERVING);
  EXPECT_EQ(check(probe, "kvr.v1.Generation"), HS::SERVING);
}

// With TLS a member's certificate names its node (URI SAN kvr://node/<name>): a node with a
// valid cluster certificate for "node-a" cannot register as "node-b", nor renew, remove or
// take the address of another certificate's node; a certificate that names no node is refused
// unless the controller runs with --require-node-identity=false.
TEST(ControllerIntegrationTest, ACertificateForOneNodeCannotActAsAnother) {
  TestCertificates files("kvr-identity");
  const PemCertificate ca = files.Ca("cluster CA");
  const std::string ca_file = files.WriteCa(ca, "ca");
  auto issue = [&](const std::string& file, std::vector<std::string> uris) {
    return files.Issue(ca, file, ca_file, {.uris = std::move(uris)});
  };
  const TlsConfig controller_tls = issue("controller", {NodeIdentityUri("controller")});
  const TlsConfig node_a = issue("node-a", {NodeIdentityUri("node-a")});
  const TlsConfig node_b = issue("node-b", {NodeIdentityUri("node-b")});
  const TlsConfig nameless = issue("nameless", {});
  ASSERT_FALSE(::testing::Test::HasFailure());

  auto start = [&](std::vector<std::string> extra) {
    std::vector<std::string> argv = {KVR_CONTROLLER_BIN,
                                     "--listen",
                                     "127.0.0.1:0",
                                     "--tls-ca",
                                     ca_file,
                                     "--tls-cert",
                                     controller_tls.cert_file,
                                     "--tls-key",
                                     controller_tls.key_file,
                                     "--metrics-port",
                                     "-1",
                                     "--http-listen",
                                     "-1"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return std::make_unique<Subprocess>(argv);
  };
  auto address_of = [](Subprocess& controller) {
    const std::string line = controller.WaitForLine("kvr-controller listening on ");
    return line.substr(line.rfind(' ') + 1);
  };
  auto stub = [](const std::string& address, const TlsConfig& tls) {
    absl::StatusOr<GrpcSecurity> security = GrpcSecurity::Load(tls);
    EXPECT_TRUE(security.ok()) << security.status();
    return kvr::cluster::v1::Membership::NewStub(security->CreateChannel(address));
  };
  auto registration = [](const std::string& name, const std::string& grpc_address) {
    kvr::cluster::v1::RegisterRequest r;
    r.set_role(kvr::cluster::v1::NODE_ROLE_PREFILL);
    r.set_protocol_version(1);
    r.set_name(name);
    r.mutable_endpoints()->set_grpc_address(grpc_address);
    kvr::cluster::v1::ModelInfo* model = r.mutable_capacity()->add_models();
    model->set_name("smollm2");
    model->set_context_length(2048);
    model->set_kv_bytes_per_token(1000);
    return r;
  };
  auto register_as = [&](const std::string& address, const TlsConfig& tls,
                         const kvr::cluster::v1::RegisterRequest& request,
                         std::string* node_id = nullptr) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    kvr::cluster::v1::RegisterResponse response;
    const grpc::Status status = stub(address, tls)->Register(&ctx, request, &response);
    if (node_id != nullptr) *node_id = response.node_id();
    return status;
  };
  auto heartbeat = [&](const std::string& address, const TlsConfig& tls, const std::string& id) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    kvr::cluster::v1::HeartbeatRequest request;
    request.set_node_id(id);
    kvr::cluster::v1::HeartbeatResponse ignored;
    return stub(address, tls)->Heartbeat(&ctx, request, &ignored);
  };
  auto deregister = [&](const std::string& address, const TlsConfig& tls, const std::string& id) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    kvr::cluster::v1::DeregisterRequest request;
    request.set_node_id(id);
    kvr::cluster::v1::DeregisterResponse ignored;
    return stub(address, tls)->Deregister(&ctx, request, &ignored);
  };

  std::unique_ptr<Subprocess> controller = start({});
  std::string address = address_of(*controller);
  ASSERT_FALSE(address.empty());

  const grpc::Status as_b = register_as(address, node_a, registration("node-b", "127.0.0.1:1"));
  EXPECT_EQ(as_b.error_code(), grpc::StatusCode::PERMISSION_DENIED) << as_b.error_message();
  EXPECT_THAT(as_b.error_message(), HasSubstr("'node-a'"));
  EXPECT_THAT(as_b.error_message(), HasSubstr("cannot register as 'node-b'"));

  std::string id_a;
  const grpc::Status as_a =
      register_as(address, node_a, registration("node-a", "127.0.0.1:1"), &id_a);
  ASSERT_TRUE(as_a.ok()) << as_a.error_message();

  const grpc::Status b_renews_a = heartbeat(address, node_b, id_a);
  EXPECT_EQ(b_renews_a.error_code(), grpc::StatusCode::PERMISSION_DENIED)
      << b_renews_a.error_message();
  EXPECT_THAT(b_renews_a.error_message(), HasSubstr("'node-a'"));
  EXPECT_EQ(deregister(address, node_b, id_a).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  // Nor may node-b register itself at node-a's address, which would evict node-a.
  const grpc::Status b_takes_address =
      register_as(address, node_b, registration("node-b", "127.0.0.1:1"));
  EXPECT_EQ(b_takes_address.error_code(), grpc::StatusCode::PERMISSION_DENIED)
      << b_takes_address.error_message();
  EXPECT_THAT(b_takes_address.error_message(), HasSubstr("grpc_address"));

  const grpc::Status no_name = register_as(address, nameless, registration("x", "127.0.0.1:2"));
  EXPECT_EQ(no_name.error_code(), grpc::StatusCode::PERMISSION_DENIED) << no_name.error_message();
  EXPECT_THAT(no_name.error_message(), HasSubstr("kvr://node/"));

  // node-a itself still renews and leaves.
  EXPECT_TRUE(heartbeat(address, node_a, id_a).ok());
  EXPECT_TRUE(deregister(address, node_a, id_a).ok());

  // The documented opt-out: certificates that name no node, any name.
  controller = start({"--require-node-identity=false"});
  address = address_of(*controller);
  ASSERT_FALSE(address.empty());
  std::string id;
  const grpc::Status opted_out =
      register_as(address, nameless, registration("x", "127.0.0.1:2"), &id);
  EXPECT_TRUE(opted_out.ok()) << opted_out.error_message();
  EXPECT_TRUE(heartbeat(address, node_b, id).ok());
}

}  // namespace
}  // namespace kvr::controller
