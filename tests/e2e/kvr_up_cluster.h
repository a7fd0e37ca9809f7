#pragma once
// Test helpers shared by the end-to-end tests: a cluster started by `kvr up` (as a child
// process, with the addresses and pids it prints) and a blocking Generate client.

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kvr/common/tls.h"
#include "kvr/store/v1/store.grpc.pb.h"
#include "kvr/v1/generation.grpc.pb.h"
#include "subprocess.h"

namespace kvr::e2e {

using ::kvr::controller::testing::Subprocess;

inline constexpr char kModel[] = "smollm2-135m-instruct";

// A cluster started by `kvr up`, with the addresses and pids it prints.
class Cluster {
 public:
  Cluster(int prefill, int decode, const std::vector<std::string>& extra = {}) {
    log_dir_ = absl::StrCat(::testing::TempDir(), "/kvr-e2e-", getpid(), "-", prefill, decode);
    const std::string& log_dir = log_dir_;
    // The known name resolves to TestModelPath() in every node and is the served name.
    std::vector<std::string> argv = {KVR_BIN,
                                     "up",
                                     "--model",
                                     kModel,
                                     "--prefill",
                                     std::to_string(prefill),
                                     "--decode",
                                     std::to_string(decode),
                                     "--base-port",
                                     "0",
                                     "--log-dir",
                                     log_dir};
    argv.insert(argv.end(), extra.begin(), extra.end());
    // 1 GiB of store unless the test names its own.
    if (std::find(extra.begin(), extra.end(), "--store-capacity") == extra.end()) {
      argv.insert(argv.end(), {"--store-capacity", "1GiB"});
    }
    up_ = std::make_unique<Subprocess>(argv);
    ready_ = !up_->WaitForLine("kvr up: ready", absl::Seconds(240)).empty();
    for (const std::string& line : up_->Lines()) {
      std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (f.size() >= 4 && f[0] == "public") endpoint_ = f.back();
      // "tls ca PATH", "tls client CERT KEY": kvr up's CA and a client certificate of it.
      if (f.size() >= 3 && f[0] == "tls" && f[1] == "ca") tls_.ca_file = f[2];
      if (f.size() >= 4 && f[0] == "tls" && f[1] == "client") {
        tls_.cert_file = f[2];
        tls_.key_file = f[3];
      }
      if (f.size() >= 5 && f[1] == "pid") {
        Node n{f[0], 0, f[4]};
        if (!absl::SimpleAtoi(f[2], &n.pid)) continue;
        nodes_.push_back(n);
      }
    }
    if (!ready_) {
      for (const std::string& line : up_->Lines())
        std::fprintf(stderr, "kvr up: %s\n", line.c_str());
    }
    absl::StatusOr<kvr::GrpcSecurity> security = kvr::GrpcSecurity::Load(tls_);
    EXPECT_TRUE(security.ok()) << security.status();
    if (security.ok()) security_ = *std::move(security);
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    stub_ = kvr::v1::Generation::NewStub(security_.CreateChannel(endpoint_, args));
    store_ = kvr::store::v1::KvStore::NewStub(Channel(Find("store-0").grpc));
  }

  // A channel to any process of the cluster, with kvr up's client certificate (plaintext
  // under --insecure).
  std::shared_ptr<grpc::Channel> Channel(const std::string& address) const {
    return security_.CreateChannel(address);
  }
  // kvr up's CA and client certificate (empty under --insecure).
  const kvr::TlsConfig& tls() const { return tls_; }
  // The --tls-* flags of the process `name` (kvr up wrote its certificate beside the CA), for
  // a test that starts it again; none under --insecure. The certificate names the node
  // (kvr://node/<name>): a node started again must register under the same name (--name /
  // --node-name), or the controller refuses it.
  std::vector<std::string> TlsFlags(const std::string& name) const {
    if (tls_.ca_file.empty()) return {};
    const std::string dir = tls_.ca_file.substr(0, tls_.ca_file.rfind('/'));
    return {"--tls-ca=" + tls_.ca_file, absl::StrCat("--tls-cert=", dir, "/", name, ".pem"),
            absl::StrCat("--tls-key=", dir, "/", name, "-key.pem")};
  }
  // `argv` with TlsFlags(name) appended.
  std::vector<std::string> WithTls(std::vector<std::string> argv, const std::string& name) const {
    for (std::string& f : TlsFlags(name)) argv.push_back(std::move(f));
    return argv;
  }

  struct Node {
    std::string name;
    int pid = 0;
    std::string grpc;
  };
  Node Find(const std::string& name) const {
    for (const auto& n : nodes_) {
      if (n.name == name) return n;
    }
    return {};
  }

  bool ready() const { return ready_; }
  const std::vector<Node>& nodes() const { return nodes_; }
  kvr::v1::Generation::Stub& stub() { return *stub_; }
  // The controller's address (public API and membership).
  const std::string& endpoint() const { return endpoint_; }
  const std::string& log_dir() const { return log_dir_; }

  kvr::store::v1::StatsResponse StoreStats() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    kvr::store::v1::StatsResponse stats;
    EXPECT_TRUE(store_->Stats(&ctx, {}, &stats).ok());
    return stats;
  }

  // Sequences of requests (live ones): those the store keeps for prefix reuse aside.
  static uint64_t LiveSequences(const kvr::store::v1::StatsResponse& s) {
    return s.sequences() - s.cached_sequences();
  }
  // Pool bytes in use by live sequences: cached ones' own pages are room (evicted on demand).
  static uint64_t LiveBytes(const kvr::store::v1::StatsResponse& s) {
    return s.used_bytes() - s.cached_bytes();
  }

  // Waits until the store holds no live sequence; false on timeout.
  bool WaitStoreEmpty(absl::Duration timeout) {
    const absl::Time until = absl::Now() + timeout;
    while (absl::Now() < until) {
      if (LiveSequences(StoreStats()) == 0) return true;
      absl::SleepFor(absl::Milliseconds(50));
    }
    return LiveSequences(StoreStats()) == 0;
  }

 private:
  std::unique_ptr<Subprocess> up_;
  std::string log_dir_;
  bool ready_ = false;
  std::string endpoint_;
  kvr::TlsConfig tls_;
  kvr::GrpcSecurity security_;
  std::vector<Node> nodes_;
  std::unique_ptr<kvr::v1::Generation::Stub> stub_;
  std::unique_ptr<kvr::store::v1::KvStore::Stub> store_;
};

struct Outcome {
  grpc::Status status;
  std::vector<int32_t> tokens;
  kvr::v1::Completion completion;
};

inline Outcome Generate(kvr::v1::Generation::Stub& stub, const kvr::v1::GenerateRequest& request,
                 absl::Duration timeout = absl::Seconds(60), bool wait_for_ready = false) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  ctx.set_wait_for_ready(wait_for_ready);
  auto reader = stub.Generate(&ctx, request);
  Outcome out;
  kvr::v1::GenerateResponse msg;
  while (reader->Read(&msg)) {
    out.tokens.insert(out.tokens.end(), msg.token_ids().begin(), msg.token_ids().end());
    if (msg.has_completion()) out.completion = msg.completion();
  }
  out.status = reader->Finish();
  return out;
}

inline kvr::v1::GenerateRequest TokenRequest(const std::vector<int32_t>& ids, const std::string& method,
                                      uint32_t max_tokens) {
  kvr::v1::GenerateRequest r;
  r.set_model(kModel);
  for (int32_t id : ids) r.mutable_token_ids()->add_ids(static_cast<uint32_t>(id));
  r.mutable_sampling()->set_max_tokens(max_tokens);
  r.mutable_sampling()->set_ignore_eos(true);
  r.mutable_retrieval()->set_method(method);
  r.mutable_retrieval()->set_budget(24);
  r.mutable_retrieval()->set_n_sink(4);
  r.mutable_retrieval()->set_local_window(32);
  return r;
}

}  // namespace kvr::e2e
