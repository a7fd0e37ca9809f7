// End-to-end tests with real processes: `kvr up` starts kvr-controller, kvr-store, kvr-prefill
// and kvr-decode on free ports, and the test talks to the public Generation API as a client.
//
//   FullEqualsSingleProcessAndEveryMethodCompletes  (method `full` token for token
//       equal to dense single-process decoding; every method at a small budget completes and
//       reports its agreement with dense)
//   BadRequestsAndCancellation  (INVALID_ARGUMENT naming the field; a client that cancels
//       mid-stream frees the store pages within a second)
//   KilledDecodeNode  (2 P + 2 D, one D killed during requests: each request completes or
//       fails with a clear error before its deadline; the dead node's orphaned store
//       sequences are released within 10 s of the kill (their renewed 8 s leases lapse))
//   ReadinessFollowsTheStore  (grpc.health.v1: prefill and decode are live ("") and ready
//       ("kvr.ready") once up; killing the only store makes them unready within its lease while
//       they stay live)
//   StoreKilledAndRestartedOnTheSamePort  (kill -9 of the store mid-request: that request ends
//       UNAVAILABLE before its deadline, and one sent while no store runs too; a store
//       restarted on the same port serves a new request within 10 s, through nodes that had
//       connected to the old one; the controller keeps the new store; killed again while idle,
//       a request placed on the dead store fails UNAVAILABLE at once, and a second restart is
//       served again)
//   PrefixReuseGivesTheColdTokensAndSurvivesALostPrefix  (a second turn over a long document
//       is prefilled from the first turn's rows and equals the same prompt prefilled cold, for
//       every method at a full budget, also where a turn's retrieval summaries are the
//       previous turn's extended; after the store is killed and restarted between turns
//       the lost prefix is computed again, with the same tokens; "equal" allows the texts to
//       part at a near tie of the dense model's logits: ExpectSameTokensOrNearTie)
//   CachedPrefixesAreEvictedBeforeAnythingIsRefused  (a small store filled with cached
//       prefixes: every new request is served, the store evicts cached sequences least
//       recently used first, and its pages return to the baseline once the prefixes expire)
//   ControllerKilledAndRestarted  (kill -9 of the controller, restart on the same port: the
//       first request is UNAVAILABLE or served, never INVALID_ARGUMENT; served once the nodes
//       registered again)

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc_test_util.h"
#include "health_test_util.h"
#include "kvr/common/paths.h"
#include "kvr/common/thread_pool.h"
#include "kvr/common/tls.h"
#include "kvr/model/dense_attention.h"
#include "kvr/model/loader.h"
#include "kvr/model/sampler.h"
#include "kvr/node/membership_client.h"
#include "kvr/store/v1/store.grpc.pb.h"
#include "kvr/v1/generation.grpc.pb.h"
#include "kvr_up_cluster.h"
#include "subprocess.h"

namespace kvr::e2e {
namespace {

using ::kvr::controller::testing::Subprocess;

class ModelFixture : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    pool_ = new ThreadPool(2);
    auto loaded = model::LoadModel(TestModelPath(), {}, pool_);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    loaded_ = new model::LoadedModel(std::move(*loaded));
  }

  static std::vector<int32_t> Encode(const std::string& text) {
    auto ids = loaded_->tokenizer->Encode(text);
    EXPECT_TRUE(ids.ok());
    return *ids;
  }

  // A prompt of about `tokens` tokens of varied text.
  static std::vector<int32_t> Prompt(int tokens, int variant) {
    std::string text;
    const char* topics[] = {"rivers and mountains", "the history of printing", "bread baking",
                            "sailing ships"};
    for (int i = 0; static_cast<int>(text.size()) < tokens * 4; ++i) {
      absl::StrAppend(&text, "Paragraph ", i, " is about ", topics[(i + variant) % 4],
                      ", and it mentions the number ", (i * 37 + variant * 11) % 1000, ". ");
    }
    std::vector<int32_t> ids = Encode(text);
    ids.resize(std::min<size_t>(ids.size(), tokens));
    return ids;
  }

  // Greedy single-process dense decoding (what `kvr generate` does), `n` tokens, ignoring EOS.
  static std::vector<int32_t> DenseGreedy(const std::vector<int32_t>& prompt, int n) {
    const model::Model& m = *loaded_->model;
    model::KvCache cache = m.NewCache();
    model::DenseAttention dense(pool_);
    auto logits = m.Prefill(1, cache, prompt, dense, 512);
    EXPECT_TRUE(logits.ok());
    std::vector<int32_t> out;
    std::vector<float> l = *logits;
    for (int i = 0; i < n; ++i) {
      int32_t t = model::ArgMax(l);
      out.push_back(t);
      if (i + 1 == n) break;
      const model::ForwardSequence step{1, &cache, std::span(&t, 1)};
      EXPECT_TRUE(m.Forward(std::span(&step, 1), dense, model::LogitsMode::kLast, l).ok());
    }
    return out;
  }

  // `got` and `want`, both decoded greedily after `prompt`, are the same tokens, or equal up to
  // a first difference that is a near tie: there the dense model (in-process) puts the two
  // chosen tokens' logits within kNearTieOverRms x the logits' RMS. Bit-equal arithmetic gives
  // equal tokens (measured on an AVX-512 host); where the packed kernels and the BLAS round a
  // row by the batch or chunk it is in (an AVX2 host), a near tie may flip and the texts part
  // there. A wrong row, cache or resume point gives a token far from the dense choice.
  static void ExpectSameTokensOrNearTie(const std::vector<int32_t>& prompt,
                                        const std::vector<int32_t>& got,
                                        const std::vector<int32_t>& want, const std::string& what) {
    constexpr double kNearTieOverRms = 0.2;
    size_t i = 0;
    while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
    if (i == got.size() && i == want.size()) return;
    ASSERT_TRUE(i < got.size() && i < want.size())
        << what << ": one stream ends early (" << got.size() << " vs " << want.size() << ")";
    std::vector<int32_t> context = prompt;
    context.insert(context.end(), want.begin(), want.begin() + i);
    const model::Model& m = *loaded_->model;
    model::KvCache cache = m.NewCache();
    model::DenseAttention dense(pool_);
    auto logits = m.Prefill(1, cache, context, dense, 512);
    ASSERT_TRUE(logits.ok()) << logits.status();
    double ss = 0;
    for (float v : *logits) ss += double{v} * v;
    const double rms = std::sqrt(ss / static_cast<double>(logits->size()));
    const double gap = std::abs(double{(*logits)[got[i]]} - (*logits)[want[i]]) / rms;
    std::printf("%s: tokens part at %zu of %zu (%d vs %d), dense logit gap %.4f x rms\n",
                what.c_str(), i, want.size(), got[i], want[i], gap);
    EXPECT_LE(gap, kNearTieOverRms) << what << ": token " << i << " is " << got[i] << ", not "
                                    << want[i] << ", and the dense model does not see a near tie";
  }

  static inline ThreadPool* pool_ = nullptr;
  static inline model::LoadedModel* loaded_ = nullptr;
};

// A small A2ATS codebook file for the test model (`kvr calibrate` on 1K tokens of a licence text
// every Debian system ships; ~5 s), so that the cluster offers every method.
std::string SmallCodebooks() {
  const std::string path = absl::StrCat(::testing::TempDir(), "/kvr-e2e-", getpid(), ".kvrcb");
  const std::string cmd = absl::StrCat(
      KVR_BIN, " calibrate --model ", kModel,
      " --text /usr/share/common-licenses/Apache-2.0 --out ", path,
      " --max-tokens 1024 --sequence-tokens 1024 --codebook-size 256 --iterations 8 >/dev/null");
  return std::system(cmd.c_str()) == 0 ? path : "";
}

TEST_F(ModelFixture, FullEqualsSingleProcessAndEveryMethodCompletes) {
  const std::string codebooks = SmallCodebooks();
  ASSERT_FALSE(codebooks.empty()) << "kvr calibrate failed";
  Cluster cluster(1, 1, {"--a2ats-codebooks", codebooks});
  ASSERT_TRUE(cluster.ready());
  const uint64_t baseline = Cluster::LiveBytes(cluster.StoreStats());
  constexpr int kTokens = 24;
  // (a) full, with a small resident set (4 sinks + 32 local) so that D fetches the rest.
  std::vector<std::vector<int32_t>> prompts = {Prompt(300, 0), Prompt(420, 1)};
  std::vector<std::vector<int32_t>> dense;
  for (const auto& p : prompts) {
    dense.push_back(DenseGreedy(p, kTokens));
    Outcome o = Generate(cluster.stub(), TokenRequest(p, "full", kTokens));
    ASSERT_TRUE(o.status.ok()) << o.status.error_message();
    EXPECT_EQ(o.tokens, dense.back()) << "prompt of " << p.size() << " tokens";
    EXPECT_EQ(o.completion.usage().completion_tokens(), static_cast<uint32_t>(kTokens));
    EXPECT_GT(o.completion.retrieval().bytes_shipped(), 0u);
  }

  // (b) every method the decode nodes offer, budget 24: completes; agreement with dense.
  grpc::ClientContext ctx;
  kvr::v1::ListModelsResponse models;
  ASSERT_TRUE(cluster.stub().ListModels(&ctx, {}, &models).ok());
  ASSERT_EQ(models.models_size(), 1);
  const auto& offered = models.models(0).retrieval_methods();
  for (const char* method : {"full", "exact", "quest", "streaming", "clusterkv", "ctkvr", "keydiff",
                             "pariskv", "a2ats"}) {
    EXPECT_NE(std::find(offered.begin(), offered.end(), method), offered.end())
        << method << " is not offered";
  }
  for (const std::string& method : offered) {
    Outcome o = Generate(cluster.stub(), TokenRequest(prompts[1], method, kTokens));
    ASSERT_TRUE(o.status.ok()) << method << ": " << o.status.error_message();
    ASSERT_EQ(o.tokens.size(), static_cast<size_t>(kTokens)) << method;
    int same = 0, prefix = 0;
    for (int i = 0; i < kTokens; ++i) same += o.tokens[i] == dense[1][i];
    while (prefix < kTokens && o.tokens[prefix] == dense[1][prefix]) ++prefix;
    std::printf(
        "method %-10s budget 24: %2d/%d tokens equal to dense (common prefix %d), %llu "
        "bytes fetched, hot-cache hits %llu / misses %llu\n",
        method.c_str(), same, kTokens, prefix,
        static_cast<unsigned long long>(o.completion.retrieval().bytes_fetched()),
        static_cast<unsigned long long>(o.completion.retrieval().hot_cache_hits()),
        static_cast<unsigned long long>(o.completion.retrieval().hot_cache_misses()));
    if (method == "full" || method == "exact") {
      EXPECT_GE(same, kTokens / 2) << method;
    }
  }
  EXPECT_TRUE(cluster.WaitStoreEmpty(absl::Seconds(2)));
  EXPECT_EQ(Cluster::LiveBytes(cluster.StoreStats()), baseline);
}

TEST_F(ModelFixture, BadRequestsAndCancellation) {
  Cluster cluster(1, 1);
  ASSERT_TRUE(cluster.ready());
  auto expect_invalid = [&](kvr::v1::GenerateRequest r, const std::string& field) {
    Outcome o = Generate(cluster.stub(), r, absl::Seconds(30));
    EXPECT_EQ(o.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << field << ": " << o.status.error_message();
    EXPECT_NE(o.status.error_message().find(field), std::string::npos)
        << "message does not name " << field << ": " << o.status.error_message();
  };
  const std::vector<int32_t> short_prompt = Prompt(40, 2);
  kvr::v1::GenerateRequest r = TokenRequest(short_prompt, "full", 8);
  r.set_model("no-such-model");
  expect_invalid(r, "model");
  r = TokenRequest(short_prompt, "full", 8);
  r.set_prompt("");
  expect_invalid(r, "prompt");
  r = TokenRequest(short_prompt, "full", 8);
  r.mutable_retrieval()->set_budget(0);
  expect_invalid(r, "budget");
  r = TokenRequest(short_prompt, "full", 8);
  r.mutable_retrieval()->set_method("no-such-method");
  expect_invalid(r, "method");
  // Over the context: token ids are checked by the controller, text by the prefill node.
  const int64_t context = loaded_->model->config().context_length;
  r = TokenRequest(std::vector<int32_t>(context + 10, 1000), "full", 8);
  expect_invalid(r, "token_ids");
  r = TokenRequest(short_prompt, "full", 8);
  std::string long_text;
  while (static_cast<int64_t>(long_text.size()) < context * 6) long_text += "lorem ipsum dolor ";
  r.set_prompt(long_text);
  r.mutable_sampling()->clear_max_tokens();
  expect_invalid(r, "prompt");

  // Bytes that are not the request message, sent to every internal service of the cluster
  // (over mutual TLS with kvr up's client certificate): INVALID_ARGUMENT naming the method,
  // not gRPC's bare INTERNAL. A client without a certificate is refused by those ports.
  const std::string garbage = "\xff\xff\xff\xff\x0f garbage";
  for (const auto& [node, method] : std::vector<std::pair<std::string, std::string>>{
           {"store-0", "/kvr.store.v1.KvStore/CreateSequence"},
           {"prefill-0", "/kvr.cluster.v1.PrefillService/Prefill"},
           {"decode-0", "/kvr.cluster.v1.DecodeService/Cancel"},
           {"controller", "/kvr.cluster.v1.Membership/Register"}}) {
    const std::string address = node == "controller" ? cluster.endpoint() : cluster.Find(node).grpc;
    const grpc::Status s =
        RawUnaryCall(cluster.Channel(address), method, garbage, absl::Seconds(10));
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << method << ": " << s.error_message();
    EXPECT_NE(s.error_message().find(method), std::string::npos) << s.error_message();
    if (node == "controller") continue;  // its public API takes clients without a certificate
    const kvr::TlsConfig ca_only{.ca_file = cluster.tls().ca_file};
    absl::StatusOr<kvr::GrpcSecurity> no_certificate = kvr::GrpcSecurity::Load(ca_only);
    ASSERT_TRUE(no_certificate.ok());
    const grpc::Status refused =
        RawUnaryCall(no_certificate->CreateChannel(address), method, "", absl::Seconds(10));
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE)
        << node << " answered a client without a certificate: " << refused.error_message();
  }

  // (d) A client that cancels mid-stream: the store pages are free within a second.
  const uint64_t baseline = Cluster::LiveBytes(cluster.StoreStats());
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    auto reader = cluster.stub().Generate(&ctx, TokenRequest(Prompt(200, 3), "full", 400));
    kvr::v1::GenerateResponse msg;
    int messages = 0;
    while (messages < 3 && reader->Read(&msg)) ++messages;
    ASSERT_EQ(messages, 3);
    EXPECT_GT(cluster.StoreStats().sequences(), 0u);
    ctx.TryCancel();
    const absl::Time cancelled = absl::Now();
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
    EXPECT_TRUE(cluster.WaitStoreEmpty(absl::Seconds(1)))
        << "store still holds the sequence " << absl::Now() - cancelled << " after cancel";
    EXPECT_EQ(Cluster::LiveBytes(cluster.StoreStats()), baseline);
  }
  // The decode slot is free again: a new request runs to completion.
  Outcome o = Generate(cluster.stub(), TokenRequest(short_prompt, "full", 4), absl::Seconds(30));
  EXPECT_TRUE(o.status.ok()) << o.status.error_message();
}

TEST_F(ModelFixture, KilledDecodeNode) {
  Cluster cluster(2, 2);
  ASSERT_TRUE(cluster.ready());
  const auto victim = cluster.Find("decode-0");
  ASSERT_GT(victim.pid, 0);
  constexpr int kRequests = 4;
  const absl::Duration deadline = absl::Seconds(20);
  std::vector<Outcome> outcomes(kRequests);
  std::vector<absl::Duration> took(kRequests);
  std::vector<std::thread> clients;
  for (int i = 0; i < kRequests; ++i) {
    clients.emplace_back([&, i] {
      const absl::Time start = absl::Now();
      outcomes[i] =
          Generate(cluster.stub(), TokenRequest(Prompt(150, i), "clusterkv", 48), deadline);
      took[i] = absl::Now() - start;
    });
  }
  // Kill one decode node while the requests decode.
  absl::SleepFor(absl::Seconds(4));
  ASSERT_EQ(kill(victim.pid, SIGKILL), 0);
  const absl::Time killed = absl::Now();
  for (auto& t : clients) t.join();
  int ok = 0;
  for (int i = 0; i < kRequests; ++i) {
    const Outcome& o = outcomes[i];
    std::printf("request %d: %s after %s (%zu tokens)%s%s\n", i, o.status.ok() ? "OK" : "FAILED",
                absl::FormatDuration(took[i]).c_str(), o.tokens.size(), o.status.ok() ? "" : ": ",
                o.status.error_message().c_str());
    EXPECT_LE(took[i], deadline + absl::Seconds(1)) << "request " << i << " hung";
    if (o.status.ok()) {
      ++ok;
      EXPECT_EQ(o.tokens.size(), 48u);
    } else {
      // A clear error: the node failure (or the deadline), with a message.
      EXPECT_TRUE(o.status.error_code() == grpc::StatusCode::UNAVAILABLE ||
                  o.status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED)
          << o.status.error_code() << " " << o.status.error_message();
      EXPECT_FALSE(o.status.error_message().empty());
    }
  }
  std::printf("%d of %d requests completed\n", ok, kRequests);
  // The killed node's sequences are orphans: their store leases (8 s, renewed every 2 s by the
  // nodes that hold them) are no longer renewed, and the store (kvr up starts it with
  // --evict-expired, sweeping every 500 ms) drops them within 8.5 s of the kill, long before
  // the requests' deadlines (20 s + 5 s).
  const absl::Duration last_request_ended = absl::Now() - killed;
  EXPECT_TRUE(
      cluster.WaitStoreEmpty(std::max(absl::Seconds(1), killed + absl::Seconds(10) - absl::Now())))
      << Cluster::LiveSequences(cluster.StoreStats()) << " sequences left in the store";
  std::printf("store empty %s after the kill (the last request ended %s after it)\n",
              absl::FormatDuration(absl::Now() - killed).c_str(),
              absl::FormatDuration(last_request_ended).c_str());
  // The surviving nodes still serve.
  Outcome after =
      Generate(cluster.stub(), TokenRequest(Prompt(60, 5), "full", 4), absl::Seconds(30));
  EXPECT_TRUE(after.status.ok()) << after.status.error_message();
}

// A child that fails to start is explained by kvr up with the child's own words (here: the
// model file is missing), not only with the path of its log.
TEST(KvrUpTest, AChildThatFailsToStartIsExplainedWithItsReason) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "/kvr-e2e-badmodel-", getpid());
  Subprocess up({"/bin/sh", "-c",
                 absl::StrCat(KVR_BIN,
                              " up --model /nonexistent/model.gguf --prefill 1 --decode 1 "
                              "--base-port 0 --ready-timeout 60 --log-dir ",
                              dir, " 2>&1")});
  const std::string line = up.WaitForLine("  | kvr-", absl::Seconds(60));
  EXPECT_NE(line.find("NOT_FOUND"), std::string::npos) << "'" << line << "'";
  EXPECT_NE(line.find("/nonexistent/model.gguf"), std::string::npos) << "'" << line << "'";
}

// A controller whose port is taken: kvr up says so with the controller's own words ("Address
// already in use"), not only with the path of its log.
TEST(KvrUpTest, AControllerPortInUseIsExplainedWithItsReason) {
  // Hold a port on 127.0.0.1 (without SO_REUSEPORT, so gRPC cannot share it).
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const int port = ntohs(addr.sin_port);
  const std::string dir = absl::StrCat(::testing::TempDir(), "/kvr-e2e-portinuse-", getpid());
  // Only kvr up's stderr reaches the pipe: the reason must be in what it prints there.
  Subprocess up({"/bin/sh", "-c",
                 absl::StrCat(KVR_BIN, " up --model ", TestModelPath(),
                              " --prefill 1 --decode 1 --ready-timeout 60 --base-port ", port,
                              " --log-dir ", dir, " 2>&1 >/dev/null")});
  const std::string first = up.WaitForLine("kvr up: ", absl::Seconds(60));
  EXPECT_NE(first.find("kvr-controller did not start"), std::string::npos) << "'" << first << "'";
  // The reason is one of the log lines quoted after it ("  | ...").
  std::string reason;
  for (const absl::Time end = absl::Now() + absl::Seconds(10); reason.empty() && absl::Now() < end;
       absl::SleepFor(absl::Milliseconds(50))) {
    for (const std::string& l : up.Lines()) {
      if (absl::StartsWith(l, "  | ") && absl::StrContains(l, "Address already in use")) reason = l;
    }
  }
  EXPECT_FALSE(reason.empty()) << absl::StrJoin(up.Lines(), "\n");
  close(fd);
}

// The inodes of the sockets process `pid` holds (/proc/PID/fd -> "socket:[INODE]").
std::set<std::string> SocketInodes(int pid) {
  std::set<std::string> out;
  const std::string dir = absl::StrCat("/proc/", pid, "/fd");
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    char target[256];
    const ssize_t n =
        readlink(absl::StrCat(dir, "/", e->d_name).c_str(), target, sizeof(target) - 1);
    if (n <= 0) continue;
    const std::string t(target, static_cast<size_t>(n));
    if (absl::StartsWith(t, "socket:[")) out.insert(t.substr(8, t.size() - 9));
  }
  closedir(d);
  return out;
}

// Listening TCP sockets (/proc/net/tcp, tcp6) by inode: their local address, as hex.
std::vector<std::pair<std::string, std::string>> TcpListeners() {
  std::vector<std::pair<std::string, std::string>> out;  // (inode, local address hex)
  for (const char* path : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(path);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (f.size() < 10 || f[3] != "0A") continue;  // 0A: LISTEN
      out.emplace_back(f[9], f[1].substr(0, f[1].find(':')));
    }
  }
  return out;
}

// 127.0.0.0/8, ::1 or ::ffff:127.x.x.x, in /proc/net's hex (IPv4 words little-endian).
bool IsLoopbackHex(const std::string& a) {
  if (a.size() == 8) return a.substr(6, 2) == "7F";
  if (a.size() == 32) {
    return a == "00000000000000000000000001000000" ||
           (a.substr(0, 24) == "0000000000000000FFFF0000" && a.substr(30, 2) == "7F");
  }
  return false;
}

// Every TCP listener of every process of a `kvr up` cluster (gRPC, /metrics, the HTTP API and
// UCX's own TCP listeners) is on loopback: a local cluster reaches nothing else.
// Run with --insecure, which no other test uses: the plaintext cluster serves as well.
TEST_F(ModelFixture, EveryListenerOfKvrUpIsOnLoopback) {
  Cluster cluster(1, 1, {"--insecure"});
  ASSERT_TRUE(cluster.tls().ca_file.empty()) << "kvr up --insecure printed a CA";
  ASSERT_TRUE(cluster.ready());
  // One request, so the data plane's endpoints exist.
  Outcome o = Generate(cluster.stub(), TokenRequest(Prompt(40, 3), "full", 4), absl::Seconds(60));
  ASSERT_TRUE(o.status.ok()) << o.status.error_message();
  const auto listeners = TcpListeners();
  int checked = 0;
  ASSERT_GE(cluster.nodes().size(), 4u);
  for (const auto& node : cluster.nodes()) {
    const std::set<std::string> mine = SocketInodes(node.pid);
    int n = 0;
    for (const auto& [inode, address] : listeners) {
      if (!mine.contains(inode)) continue;
      ++n;
      EXPECT_TRUE(IsLoopbackHex(address)) << node.name << " (pid " << node.pid << ") listens on "
                                          << address << " (inode " << inode << ")";
    }
    EXPECT_GT(n, 0) << node.name << ": no listener found (is /proc readable?)";
    checked += n;
  }
  std::printf("%d listening sockets of %zu processes checked\n", checked, cluster.nodes().size());
}

// The health status of `service` on a node's gRPC port (HealthStatus).
int Health(const Cluster& cluster, const std::string& address, const std::string& service) {
  return HealthStatus(cluster.Channel(address), service, absl::Seconds(2));
}

TEST_F(ModelFixture, ReadinessFollowsTheStore) {
  using Status = grpc::health::v1::HealthCheckResponse;
  Cluster cluster(1, 1);
  ASSERT_TRUE(cluster.ready());
  const std::string ready = kvr::node::kReadinessService;
  const std::vector<std::string> nodes = {cluster.Find("prefill-0").grpc,
                                          cluster.Find("decode-0").grpc};
  auto wait_for = [&](const std::string& address, const std::string& service,
                      Status::ServingStatus want, absl::Duration timeout) {
    const absl::Time until = absl::Now() + timeout;
    int got;
    while ((got = Health(cluster, address, service)) != want && absl::Now() < until)
      absl::SleepFor(absl::Milliseconds(100));
    return got;
  };
  for (const std::string& node : nodes) {
    ASSERT_FALSE(node.empty());
    EXPECT_EQ(Health(cluster, node, ""), Status::SERVING) << node;
    // Registered with a live store: ready (at registration or the next heartbeat).
    EXPECT_EQ(wait_for(node, ready, Status::SERVING, absl::Seconds(5)), Status::SERVING) << node;
  }
  const auto store = cluster.Find("store-0");
  ASSERT_GT(store.pid, 0);
  ASSERT_EQ(kill(store.pid, SIGKILL), 0);
  // The controller drops the store when its lease (5 s) runs out; the next heartbeat says so.
  for (const std::string& node : nodes) {
    EXPECT_EQ(wait_for(node, ready, Status::NOT_SERVING, absl::Seconds(15)), Status::NOT_SERVING)
        << node;
    EXPECT_EQ(Health(cluster, node, ""), Status::SERVING) << node << " must stay live";
  }
}

// Generate with short requests until one succeeds or `within` passes; the time it took, or
// nullopt. Every failure on the way must be UNAVAILABLE (the cluster is recovering) or
// DEADLINE_EXCEEDED of a request caught by the recovery, never another code.
std::optional<absl::Duration> WaitServed(kvr::v1::Generation::Stub& stub,
                                         const kvr::v1::GenerateRequest& request, absl::Time since,
                                         absl::Duration within,
                                         std::vector<std::string>* failures) {
  while (absl::Now() - since < within) {
    const absl::Duration left = within - (absl::Now() - since);
    Outcome o = Generate(stub, request, std::min(left, absl::Seconds(5)));
    if (o.status.ok()) return absl::Now() - since;
    failures->push_back(absl::StrCat(o.status.error_code(), " ", o.status.error_message()));
    EXPECT_TRUE(o.status.error_code() == grpc::StatusCode::UNAVAILABLE ||
                o.status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED)
        << failures->back();
    absl::SleepFor(absl::Milliseconds(100));
  }
  return std::nullopt;
}

// Sends `request` (10 s deadline) and expects it to fail UNAVAILABLE in under 5 s: nothing
// waits for a store that is gone. Prints how long it took, as `what`.
void ExpectUnavailableAtOnce(kvr::v1::Generation::Stub& stub,
                             const kvr::v1::GenerateRequest& request, const std::string& what) {
  const absl::Time sent = absl::Now();
  Outcome o = Generate(stub, request, absl::Seconds(10));
  const absl::Duration took = absl::Now() - sent;
  std::printf("%s: failed after %s: %s\n", what.c_str(), absl::FormatDuration(took).c_str(),
              o.status.error_message().c_str());
  EXPECT_EQ(o.status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << what << ": " << o.status.error_message();
  EXPECT_LT(took, absl::Seconds(5)) << what;
}

// The store dies (kill -9) and comes back on the same port. The prefill and decode nodes were
// connected to the old one (a first request ran); they must notice and connect to the new one,
// and the controller must keep the new store rather than drop it again and again.
TEST_F(ModelFixture, StoreKilledAndRestartedOnTheSamePort) {
  Cluster cluster(1, 1);
  ASSERT_TRUE(cluster.ready());
  const auto store = cluster.Find("store-0");
  ASSERT_GT(store.pid, 0);
  ASSERT_FALSE(store.grpc.empty());
  const std::vector<int32_t> prompt = Prompt(60, 4);
  Outcome warm = Generate(cluster.stub(), TokenRequest(prompt, "full", 4), absl::Seconds(30));
  ASSERT_TRUE(warm.status.ok()) << warm.status.error_message();

  // A request in flight at the kill: decoding ("full" gathers from the store every step).
  const absl::Duration deadline = absl::Seconds(20);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  auto reader = cluster.stub().Generate(&ctx, TokenRequest(Prompt(200, 5), "full", 400));
  kvr::v1::GenerateResponse msg;
  int messages = 0;
  while (messages < 3 && reader->Read(&msg)) ++messages;
  ASSERT_EQ(messages, 3);
  ASSERT_EQ(kill(store.pid, SIGKILL), 0);
  const absl::Time killed = absl::Now();
  while (reader->Read(&msg)) {
  }
  const grpc::Status in_flight = reader->Finish();
  const absl::Duration in_flight_took = absl::Now() - killed;
  std::printf("request in flight at the kill: %s after %s: %s\n", in_flight.ok() ? "OK" : "failed",
              absl::FormatDuration(in_flight_took).c_str(), in_flight.error_message().c_str());
  EXPECT_EQ(in_flight.error_code(), grpc::StatusCode::UNAVAILABLE)
      << in_flight.error_code() << " " << in_flight.error_message();
  EXPECT_LT(in_flight_took, deadline - absl::Seconds(5)) << "it should fail fast, not time out";

  // While no store runs: a new request fails at once with UNAVAILABLE (no store to place it
  // on), it does not wait for one.
  ExpectUnavailableAtOnce(cluster.stub(), TokenRequest(prompt, "full", 4),
                          "request while the store is down");
  // Down for a moment longer: the nodes' connections to the old store are broken for good.
  absl::SleepFor(absl::Seconds(2) - std::min(absl::Seconds(2), absl::Now() - killed));

  // The same store again, on the same port.
  const std::string port = store.grpc.substr(store.grpc.rfind(':') + 1);
  Subprocess restarted(cluster.WithTls(
      {KVR_STORE_BIN, "--listen", store.grpc, "--capacity-bytes", "1GiB", "--evict-expired", "true",
       "--sweep-interval-ms", "500", "--controller", cluster.endpoint(), "--name", "store-0"},
      "store-0"));
  const absl::Time restart = absl::Now();
  ASSERT_FALSE(restarted.WaitForLine("kvr-store listening port=" + port, absl::Seconds(20)).empty())
      << "the store did not start on port " << port;
  ASSERT_FALSE(restarted.WaitForLine("kvr-store registered", absl::Seconds(10)).empty());
  std::vector<std::string> failures;
  std::optional<absl::Duration> recovered = WaitServed(
      cluster.stub(), TokenRequest(prompt, "full", 4), restart, absl::Seconds(10), &failures);
  std::printf("store restart: a new request served %s after the restart (%zu failed before)\n",
              recovered ? absl::FormatDuration(*recovered).c_str() : "NOT", failures.size());
  for (const std::string& f : failures) std::printf("  failed: %s\n", f.c_str());
  ASSERT_TRUE(recovered.has_value()) << "no request served within 10 s of the store restart";
  EXPECT_LE(*recovered, absl::Seconds(10));

  // It stays served, and the controller kept the store: one registration, not one per request.
  for (int i = 0; i < 3; ++i) {
    Outcome o =
        Generate(cluster.stub(), TokenRequest(Prompt(80, i), "clusterkv", 8), absl::Seconds(30));
    EXPECT_TRUE(o.status.ok()) << o.status.error_message();
  }
  int registrations = 0;
  for (const std::string& line : restarted.Lines()) {
    registrations += absl::StartsWith(line, "kvr-store registered") ? 1 : 0;
  }
  EXPECT_EQ(registrations, 1) << "the controller dropped the restarted store";
  // Nothing is left behind in the new store.
  EXPECT_TRUE(cluster.WaitStoreEmpty(absl::Seconds(2)));

  // Killed again while idle: no request fails to tell the controller, which still places new
  // ones on the dead store until its lease runs out. They fail UNAVAILABLE, without waiting.
  restarted.Kill();
  absl::SleepFor(absl::Milliseconds(200));  // the nodes' transports see the process exit
  ExpectUnavailableAtOnce(cluster.stub(), TokenRequest(prompt, "full", 4),
                          "request placed on the idle-killed store");
  Subprocess again(
      cluster.WithTls({KVR_STORE_BIN, "--listen", store.grpc, "--capacity-bytes", "1GiB",
                       "--controller", cluster.endpoint(), "--name", "store-0"},
                      "store-0"));
  const absl::Time second_restart = absl::Now();
  ASSERT_FALSE(again.WaitForLine("kvr-store registered", absl::Seconds(20)).empty());
  failures.clear();
  recovered = WaitServed(cluster.stub(), TokenRequest(prompt, "full", 4), second_restart,
                         absl::Seconds(10), &failures);
  std::printf("second store restart: served %s after the restart (%zu failed before)\n",
              recovered ? absl::FormatDuration(*recovered).c_str() : "NOT", failures.size());
  EXPECT_TRUE(recovered.has_value()) << "no request served within 10 s of the second restart";
}

// Prefix reuse on the real model. Turn 2 resends turn 1 (a long document and a question) with
// turn 1's answer and a new question: the controller finds turn 1's sequence, the prefill node
// forks from it and computes only the rest, and the tokens equal those of the same prompt
// prefilled cold (prefix_cache off), for `full` and for every method at a budget that covers
// the context. Then the store is killed and restarted: the cached prefix is gone, and the next
// turn is prefilled cold, with the same tokens as a cold run, never a wrong answer.
TEST_F(ModelFixture, PrefixReuseGivesTheColdTokensAndSurvivesALostPrefix) {
  Cluster cluster(1, 1);
  ASSERT_TRUE(cluster.ready());
  constexpr uint32_t kTokens = 12;
  const auto append = [](std::vector<int32_t> a, const std::vector<int32_t>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  const auto request = [](const std::vector<int32_t>& ids, const std::string& method,
                          bool reuse) {
    kvr::v1::GenerateRequest r = TokenRequest(ids, method, kTokens);
    r.mutable_retrieval()->set_budget(4096);  // more than the context: every row selected
    if (!reuse) r.set_prefix_cache(false);
    return r;
  };
  // The prefill node reuses a cached prefix in whole attention query blocks (64 tokens): from
  // such a boundary the rest comes out as the cold prefill's bits.
  const auto aligned = [](size_t n) { return static_cast<uint32_t>(n / 64 * 64); };
  const auto seconds = [](const google::protobuf::Duration& d) {
    return static_cast<double>(d.seconds()) + d.nanos() * 1e-9;
  };
  const std::vector<int32_t> turn1 =
      append(Prompt(1200, 2), Encode(" Question: what is paragraph 3 about? Answer:"));
  Outcome first = Generate(cluster.stub(), request(turn1, "full", true));
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_EQ(first.completion.usage().cached_tokens(), 0u);
  const std::vector<int32_t> turn2 =
      append(append(turn1, first.tokens),
             Encode(" Question: which number does paragraph 5 mention? Answer:"));
  Outcome reused = Generate(cluster.stub(), request(turn2, "full", true));
  ASSERT_TRUE(reused.status.ok()) << reused.status.error_message();
  Outcome cold = Generate(cluster.stub(), request(turn2, "full", false));
  ASSERT_TRUE(cold.status.ok()) << cold.status.error_message();
  EXPECT_EQ(reused.completion.usage().cached_tokens(), aligned(turn1.size()));
  EXPECT_EQ(cold.completion.usage().cached_tokens(), 0u);
  ExpectSameTokensOrNearTie(turn2, reused.tokens, cold.tokens, "full, turn 2");
  std::printf("turn 2 (%zu tokens, %u reused): prefill %.3f s reused vs %.3f s cold; TTFT %.3f s "
              "vs %.3f s\n",
              turn2.size(), reused.completion.usage().cached_tokens(),
              seconds(reused.completion.timings().prefill()),
              seconds(cold.completion.timings().prefill()),
              seconds(reused.completion.timings().time_to_first_token()),
              seconds(cold.completion.timings().time_to_first_token()));

  // Every method the decode node offers, at a budget over the context: reused == cold. The
  // prefix (turn 2's prompt) is the same for all: prefill rows do not depend on the method.
  // Its summaries were kept for `full`, so the method's first turn rebuilds them (and keeps
  // its own); the method's second turn extends that snapshot by Append (summary_snapshot.h).
  grpc::ClientContext ctx;
  kvr::v1::ListModelsResponse models;
  ASSERT_TRUE(cluster.stub().ListModels(&ctx, {}, &models).ok());
  int question = 0;
  for (const std::string& method : models.models(0).retrieval_methods()) {
    ++question;
    const std::vector<int32_t> next =
        append(turn2, Encode(absl::StrCat(" Question ", question, ": and paragraph ",
                                          question + 6, "? Answer:")));
    kvr::v1::GenerateRequest first_turn = request(next, method, true);
    first_turn.set_request_id(absl::StrCat("reuse-", method));
    Outcome r = Generate(cluster.stub(), first_turn);
    Outcome c = Generate(cluster.stub(), request(next, method, false));
    ASSERT_TRUE(r.status.ok()) << method << ": " << r.status.error_message();
    ASSERT_TRUE(c.status.ok()) << method << ": " << c.status.error_message();
    EXPECT_GE(r.completion.usage().cached_tokens(), aligned(turn2.size())) << method;
    ExpectSameTokensOrNearTie(next, r.tokens, c.tokens, method);
    const std::vector<int32_t> after =
        append(append(next, r.tokens), Encode(" Thanks. And the paragraph after it?"));
    kvr::v1::GenerateRequest second_turn = request(after, method, true);
    second_turn.set_request_id(absl::StrCat("extend-", method));
    Outcome r2 = Generate(cluster.stub(), second_turn);
    Outcome c2 = Generate(cluster.stub(), request(after, method, false));
    ASSERT_TRUE(r2.status.ok()) << method << ": " << r2.status.error_message();
    ASSERT_TRUE(c2.status.ok()) << method << ": " << c2.status.error_message();
    EXPECT_EQ(r2.completion.usage().cached_tokens(), aligned(next.size())) << method;
    ExpectSameTokensOrNearTie(after, r2.tokens, c2.tokens, method + " (summaries extended)");
  }
  // The prefill node logs each request that reused a prefix but rebuilt its summaries: the
  // methods' first turns did (their prefix's snapshot is another method's), their second
  // turns extended their own.
  {
    std::ifstream log(absl::StrCat(cluster.log_dir(), "/prefill-0.log"));
    int first_turns_rebuilt = 0;
    for (std::string line; std::getline(log, line);) {
      if (line.find("summaries rebuilt over the reused prefix") == std::string::npos) continue;
      if (line.find("request reuse-") != std::string::npos) ++first_turns_rebuilt;
      EXPECT_EQ(line.find("request extend-"), std::string::npos) << line;
    }
    EXPECT_GT(first_turns_rebuilt, 0) << "no rebuild logged: is prefill-0.log read?";
  }

  // The store dies between turns and comes back empty on the same port.
  const auto store = cluster.Find("store-0");
  ASSERT_GT(store.pid, 0);
  ASSERT_EQ(kill(store.pid, SIGKILL), 0);
  absl::SleepFor(absl::Seconds(1));
  Subprocess restarted(cluster.WithTls(
      {KVR_STORE_BIN, "--listen", store.grpc, "--capacity-bytes", "1GiB", "--evict-expired", "true",
       "--sweep-interval-ms", "500", "--controller", cluster.endpoint(), "--name", "store-0"},
      "store-0"));
  ASSERT_FALSE(restarted.WaitForLine("kvr-store registered", absl::Seconds(20)).empty());
  std::vector<std::string> failures;
  ASSERT_TRUE(WaitServed(cluster.stub(), TokenRequest(Prompt(40, 1), "full", 2), absl::Now(),
                         absl::Seconds(10), &failures)
                  .has_value());
  const std::vector<int32_t> turn3 =
      append(turn2, Encode(" Question: what is paragraph 1 about? Answer:"));
  Outcome lost = Generate(cluster.stub(), request(turn3, "full", true));
  ASSERT_TRUE(lost.status.ok()) << lost.status.error_message();
  EXPECT_EQ(lost.completion.usage().cached_tokens(), 0u) << "the prefix died with the store";
  Outcome lost_cold = Generate(cluster.stub(), request(turn3, "full", false));
  ASSERT_TRUE(lost_cold.status.ok()) << lost_cold.status.error_message();
  ExpectSameTokensOrNearTie(turn3, lost.tokens, lost_cold.tokens, "full, after the lost prefix");
  // turn 3's own prompt is cached again in the new store.
  Outcome again =
      Generate(cluster.stub(), request(append(turn3, Encode(" Thanks.")), "full", true));
  ASSERT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_EQ(again.completion.usage().cached_tokens(), aligned(turn3.size()));
}

// A store far smaller than the prefixes the requests leave cached (128 MiB; a 700-token
// SmolLM2 sequence holds ~32 MiB of f32 rows, and ~5 requests finish within a keep of 30 s even on
// a loaded machine): no new request is refused while cached prefixes can be evicted, the store
// evicts them (cached_lru), and once the prefixes' keep has passed every page is free again.
TEST_F(ModelFixture, CachedPrefixesAreEvictedBeforeAnythingIsRefused) {
  Cluster cluster(1, 1,
                  {"--store-capacity", "128MiB", "--controller-arg=--prefix-cache-seconds=30"});
  ASSERT_TRUE(cluster.ready());
  const kvr::store::v1::StatsResponse before = cluster.StoreStats();
  uint64_t most_cached = 0;
  for (int i = 0; i < 10; ++i) {
    Outcome o = Generate(cluster.stub(), TokenRequest(Prompt(700, i), "full", 4));
    ASSERT_TRUE(o.status.ok()) << "request " << i << ": " << o.status.error_message();
    most_cached = std::max<uint64_t>(most_cached, cluster.StoreStats().cached_sequences());
  }
  const kvr::store::v1::StatsResponse full = cluster.StoreStats();
  std::printf("10 requests of 700 tokens in a 128 MiB store: %llu cached at most, %llu evicted "
              "(cached_lru), %llu expired, %llu of %llu bytes used\n",
              static_cast<unsigned long long>(most_cached),
              static_cast<unsigned long long>(full.evictions_cached_lru()),
              static_cast<unsigned long long>(full.evictions_expired()),
              static_cast<unsigned long long>(full.used_bytes()),
              static_cast<unsigned long long>(full.capacity_bytes()));
  EXPECT_GE(most_cached, 2u);
  EXPECT_GT(full.evictions_cached_lru(), 0u);
  EXPECT_EQ(Cluster::LiveSequences(full), 0u);
  // The keep runs out; the store sweeps expired sequences every 500 ms. (The keep outlasts
  // three requests on a loaded machine, ~10 s each: a shorter one let cached prefixes expire
  // before the store filled, and nothing was left for LRU to evict.)
  const absl::Time until = absl::Now() + absl::Seconds(45);
  while (cluster.StoreStats().used_bytes() != before.used_bytes() && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(200));
  }
  const kvr::store::v1::StatsResponse after = cluster.StoreStats();
  EXPECT_EQ(after.used_bytes(), before.used_bytes());
  EXPECT_EQ(after.sequences(), 0u);
}

// Thinning on real processes (kvr-store --cached-eviction thin): in a store too small for the
// prefixes the requests leave cached (128 MiB; a 700-token SmolLM2 sequence holds ~34 MiB of
// f32 rows in 64 KiB pages), the least recently used cached prefix, turn 1's, is thinned
// rather than evicted. Its turn 2 reuses it only up to its first hole (more than nothing: the
// sinks' page stays; less than the whole prompt) and streams the same tokens as a cold
// prefill: a thinned prefix is never read as if it were whole.
TEST_F(ModelFixture, AThinnedPrefixGivesTheColdTokens) {
  Cluster cluster(1, 1,
                  {"--store-capacity", "128MiB", "--store-arg=--cached-eviction=thin",
                   "--controller-arg=--prefix-cache-seconds=300"});
  ASSERT_TRUE(cluster.ready());
  constexpr uint32_t kTokens = 8;
  const auto append = [](std::vector<int32_t> a, const std::vector<int32_t>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  const auto aligned = [](size_t n) { return static_cast<uint32_t>(n / 64 * 64); };
  const std::vector<int32_t> turn1 =
      append(Prompt(700, 20), Encode(" Question: what is paragraph 2 about? Answer:"));
  Outcome first = Generate(cluster.stub(), TokenRequest(turn1, "full", kTokens));
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  // Other conversations until the store has to make room. Their prompts share less than one
  // 16-token block with turn 1's (variants that start on another topic): a request matched to
  // turn 1 by a few tokens would not reuse it, and the controller would then forget it.
  const int others[] = {21, 22, 23, 25, 26, 27};
  for (int variant : others) {
    if (cluster.StoreStats().evictions_thinned() > 0) break;
    Outcome o = Generate(cluster.stub(), TokenRequest(Prompt(700, variant), "full", kTokens));
    ASSERT_TRUE(o.status.ok()) << "variant " << variant << ": " << o.status.error_message();
  }
  const kvr::store::v1::StatsResponse thinned = cluster.StoreStats();
  std::printf("thinned %llu cached sequences (%llu pages), evicted %llu whole\n",
              static_cast<unsigned long long>(thinned.evictions_thinned()),
              static_cast<unsigned long long>(thinned.thinned_pages()),
              static_cast<unsigned long long>(thinned.evictions_cached_lru()));
  ASSERT_GT(thinned.evictions_thinned(), 0u);
  EXPECT_EQ(thinned.evictions_cached_lru(), 0u);

  const std::vector<int32_t> turn2 =
      append(append(turn1, first.tokens), Encode(" Question: and paragraph 4? Answer:"));
  Outcome reused = Generate(cluster.stub(), TokenRequest(turn2, "full", kTokens));
  ASSERT_TRUE(reused.status.ok()) << reused.status.error_message();
  kvr::v1::GenerateRequest cold_request = TokenRequest(turn2, "full", kTokens);
  cold_request.set_prefix_cache(false);
  Outcome cold = Generate(cluster.stub(), cold_request);
  ASSERT_TRUE(cold.status.ok()) << cold.status.error_message();
  std::printf("turn 2 (%zu tokens): %u reused of the %u a whole prefix gives\n", turn2.size(),
              reused.completion.usage().cached_tokens(), aligned(turn1.size()));
  EXPECT_GT(reused.completion.usage().cached_tokens(), 0u);
  EXPECT_LT(reused.completion.usage().cached_tokens(), aligned(turn1.size()));
  ExpectSameTokensOrNearTie(turn2, reused.tokens, cold.tokens,
                            "full, turn 2 over a thinned prefix");
}

// A request with resume_on_failure whose store is killed (SIGKILL) while it streams: the
// controller prefills prompt + the N tokens sent on the other store and the stream goes on;
// the client gets OK and 64 tokens: the N of the fault-free run, then exactly what the cluster
// answers to prompt + those N (nothing repeated, nothing lost). Not the fault-free run's
// tokens after N: on the CPU runtime prefill computes in float and a decode step with 8-bit
// activations, so the token after the resume point can differ where the model is near a tie.
TEST_F(ModelFixture, ResumeOnFailureSurvivesTheStoreKilledMidStream) {
  Cluster cluster(1, 1, {"--stores", "2"});
  ASSERT_TRUE(cluster.ready());
  const std::vector<int32_t> prompt = Prompt(120, 5);
  kvr::v1::GenerateRequest request = TokenRequest(prompt, "full", 64);
  request.set_resume_on_failure(true);
  const Outcome reference = Generate(cluster.stub(), request, absl::Seconds(60));
  ASSERT_TRUE(reference.status.ok()) << reference.status.error_message();
  ASSERT_EQ(reference.tokens.size(), 64u);

  auto sequences = [&](const std::string& store) -> uint64_t {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
    kvr::store::v1::StatsResponse stats;
    const grpc::Status s =
        kvr::store::v1::KvStore::NewStub(cluster.Channel(store))->Stats(&ctx, {}, &stats);
    return s.ok() ? Cluster::LiveSequences(stats) : 0;
  };
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(90)));
  auto reader = cluster.stub().Generate(&ctx, request);
  std::vector<int32_t> tokens;
  kvr::v1::GenerateResponse msg;
  std::string killed;
  while (reader->Read(&msg)) {
    tokens.insert(tokens.end(), msg.token_ids().begin(), msg.token_ids().end());
    if (killed.empty() && tokens.size() >= 4) {
      for (const char* name : {"store-0", "store-1"}) {
        if (sequences(cluster.Find(name).grpc) > 0) {
          ASSERT_EQ(kill(cluster.Find(name).pid, SIGKILL), 0);
          killed = name;
          break;
        }
      }
      ASSERT_FALSE(killed.empty()) << "no store held the sequence";
    }
    if (msg.has_completion()) {
      EXPECT_EQ(msg.completion().usage().completion_tokens(), 64u);
      EXPECT_EQ(msg.completion().usage().prompt_tokens(), 120u);
    }
  }
  const grpc::Status status = reader->Finish();
  ASSERT_TRUE(status.ok()) << "killed " << killed << " after " << tokens.size()
                           << " tokens: " << status.error_message();
  ASSERT_EQ(tokens.size(), 64u);
  // The controller logs how many tokens the client had when it resumed.
  std::ifstream log(absl::StrCat(cluster.log_dir(), "/controller.log"));
  size_t sent = 0;
  for (std::string line; std::getline(log, line);) {
    const size_t at = line.find("resuming after ");
    if (at != std::string::npos) {
      ASSERT_TRUE(
          absl::SimpleAtoi(line.substr(at + 15, line.find(' ', at + 15) - (at + 15)), &sent));
    }
  }
  ASSERT_GT(sent, 0u) << "the controller did not resume (" << killed << " killed)";
  ASSERT_LT(sent, 64u);
  std::printf("store %s killed: resumed after %zu of 64 tokens\n", killed.c_str(), sent);
  EXPECT_EQ(std::vector<int32_t>(tokens.begin(), tokens.begin() + sent),
            std::vector<int32_t>(reference.tokens.begin(), reference.tokens.begin() + sent));
  std::vector<int32_t> context = prompt;
  context.insert(context.end(), tokens.begin(), tokens.begin() + sent);
  const Outcome rest =
      Generate(cluster.stub(), TokenRequest(context, "full", 64 - sent), absl::Seconds(60));
  ASSERT_TRUE(rest.status.ok()) << rest.status.error_message();
  // After the resume point the stream is the cluster's answer to prompt + sent.
  ExpectSameTokensOrNearTie(context, std::vector<int32_t>(tokens.begin() + sent, tokens.end()),
                            rest.tokens, "resumed stream");
}

// The controller dies (kill -9) and comes back on the same port with an empty membership.
TEST_F(ModelFixture, ControllerKilledAndRestarted) {
  Cluster cluster(1, 1);
  ASSERT_TRUE(cluster.ready());
  const auto controller = cluster.Find("controller");
  ASSERT_GT(controller.pid, 0);
  const std::vector<int32_t> prompt = Prompt(60, 6);
  Outcome warm = Generate(cluster.stub(), TokenRequest(prompt, "full", 4), absl::Seconds(30));
  ASSERT_TRUE(warm.status.ok()) << warm.status.error_message();

  ASSERT_EQ(kill(controller.pid, SIGKILL), 0);
  Subprocess restarted(
      cluster.WithTls({KVR_CONTROLLER_BIN, "--listen", cluster.endpoint()}, "controller"));
  ASSERT_FALSE(restarted.WaitForLine("kvr-controller listening on", absl::Seconds(10)).empty());
  const absl::Time restart = absl::Now();
  // At once, on a new channel that waits for the connection (the old one may still report the
  // dead controller's closed socket): the nodes have not registered again yet (they heartbeat
  // every lease/3), so this reaches a controller without nodes.
  auto fresh = kvr::v1::Generation::NewStub(cluster.Channel(cluster.endpoint()));
  Outcome first = Generate(*fresh, TokenRequest(prompt, "full", 4), absl::Seconds(10),
                           /*wait_for_ready=*/true);
  std::printf("first request after the controller restart: %s %s\n",
              first.status.ok() ? "OK" : "failed", first.status.error_message().c_str());
  EXPECT_TRUE(first.status.ok() || first.status.error_code() == grpc::StatusCode::UNAVAILABLE)
      << first.status.error_code() << " " << first.status.error_message();
  std::vector<std::string> failures;
  std::optional<absl::Duration> served = WaitServed(cluster.stub(), TokenRequest(prompt, "full", 4),
                                                    restart, absl::Seconds(15), &failures);
  std::printf("controller restart: served %s after the restart (%zu failed before)\n",
              served ? absl::FormatDuration(*served).c_str() : "NOT", failures.size());
  ASSERT_TRUE(served.has_value()) << "no request served within 15 s of the controller restart";
  EXPECT_EQ(Health(cluster, cluster.endpoint(), kvr::node::kReadinessService),
            grpc::health::v1::HealthCheckResponse::SERVING);
}

}  // namespace
}  // namespace kvr::e2e
