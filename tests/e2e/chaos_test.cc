// Chaos test with real processes: `kvr up` with 2 prefill, 2 decode and 2 stores under a
// closed-loop load of short greedy requests; one process of each kind (a store, a prefill node,
// a decode node, the controller) is killed with SIGKILL and started again on its address while
// the load runs. It holds:
//   - no request hangs: every one ends within its deadline (+1 s of slack for the client);
//   - every completed request's tokens equal the fault-free run's greedy tokens for its prompt;
//   - failures are UNAVAILABLE only (a node or store lost mid-request, or no controller);
//   - the cluster recovers from every kill within 10 s: the restarted process is registered
//     again and a request begun after the kill completed; after that, no request fails until
//     the next kill;
//   - at the end both stores hold no sequence and their used bytes are back to the baseline
//     (orphans of the killed nodes are released when their leases lapse).
// It prints the figures (requests completed / failed by status / hung, recovery per kill) that
// BENCHMARKS.md records.

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kvr/store/v1/store.grpc.pb.h"
#include "kvr/v1/generation.grpc.pb.h"
#include "kvr_up_cluster.h"

namespace kvr::e2e {
namespace {

constexpr int kPrompts = 6;
constexpr uint32_t kMaxTokens = 8;
constexpr int kClients = 3;
const absl::Duration kDeadline = absl::Seconds(20);
const absl::Duration kRecoveryLimit = absl::Seconds(10);

// Short prompts of token ids (no tokenizer needed; ids well inside SmolLM2's 49152).
std::vector<int32_t> PromptIds(int variant) {
  std::vector<int32_t> ids;
  for (int i = 0; i < 24 + 4 * variant; ++i) ids.push_back(200 + (variant * 7919 + i * 104729) % 30000);
  return ids;
}

kvr::v1::GenerateRequest Request(int prompt) {
  return TokenRequest(PromptIds(prompt), "full", kMaxTokens);
}

struct Record {
  int prompt = 0;
  absl::Time start;
  absl::Time end;
  grpc::StatusCode code = grpc::StatusCode::OK;
  std::string message;
  std::vector<int32_t> tokens;
};

// Clients in a closed loop, each on its own channel to the controller (the channel reconnects
// to a restarted controller by itself).
class Load {
 public:
  Load(const Cluster& cluster, int clients) {
    for (int c = 0; c < clients; ++c) {
      threads_.emplace_back([this, channel = cluster.Channel(cluster.endpoint()), c] {
        auto stub = kvr::v1::Generation::NewStub(channel);
        for (int i = 0; !stop_.load(); ++i) {
          Record r;
          r.prompt = (c + i * kClients) % kPrompts;
          r.start = absl::Now();
          Outcome o = Generate(*stub, Request(r.prompt), kDeadline);
          r.end = absl::Now();
          r.code = o.status.error_code();
          r.message = o.status.error_message();
          r.tokens = std::move(o.tokens);
          const bool failed = r.code != grpc::StatusCode::OK;
          Add(std::move(r));
          // A failure is often immediate (no controller, a dead store): do not spin.
          if (failed) absl::SleepFor(absl::Milliseconds(100));
        }
      });
    }
  }
  ~Load() { Stop(); }

  void Stop() {
    stop_ = true;
    for (auto& t : threads_) {
      if (t.joinable()) t.join();
    }
  }
  void Add(Record r) {
    absl::MutexLock lock(&mu_);
    records_.push_back(std::move(r));
  }
  std::vector<Record> records() {
    absl::MutexLock lock(&mu_);
    return records_;
  }
  // The end of the first successful request begun after `t`, if any.
  std::optional<absl::Time> FirstServedAfter(absl::Time t) {
    absl::MutexLock lock(&mu_);
    std::optional<absl::Time> first;
    for (const Record& r : records_) {
      if (r.code == grpc::StatusCode::OK && r.start > t && (!first || r.end < *first)) {
        first = r.end;
      }
    }
    return first;
  }

 private:
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
  absl::Mutex mu_;
  std::vector<Record> records_ ABSL_GUARDED_BY(mu_);
};

std::optional<kvr::store::v1::StatsResponse> StoreStats(const Cluster& cluster,
                                                        const std::string& address) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  kvr::store::v1::StatsResponse stats;
  if (!kvr::store::v1::KvStore::NewStub(cluster.Channel(address))->Stats(&ctx, {}, &stats).ok()) {
    return std::nullopt;
  }
  return stats;
}

// Prefill and decode nodes of the model in the controller's membership (-1, -1 on failure).
std::pair<int, int> Members(const Cluster& cluster) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  kvr::v1::ListModelsResponse models;
  if (!kvr::v1::Generation::NewStub(cluster.Channel(cluster.endpoint()))
           ->ListModels(&ctx, {}, &models)
           .ok() ||
      models.models_size() != 1) {
    return {-1, -1};
  }
  return {static_cast<int>(models.models(0).prefill_nodes()),
          static_cast<int>(models.models(0).decode_nodes())};
}

std::string CodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    default:
      return absl::StrCat("code ", static_cast<int>(code));
  }
}

struct Kill {
  std::string kind;
  std::string victim;
  absl::Time at;
  absl::Duration registered;  // kill -> the restarted process registered again
  absl::Duration served;      // kill -> the first request begun after the kill completed
  absl::Duration recovered;   // the later of the two
};

TEST(ChaosTest, EveryKindKilledOnceUnderLoad) {
  Cluster cluster(2, 2, {"--stores", "2"});
  ASSERT_TRUE(cluster.ready());
  const std::string endpoint = cluster.endpoint();
  const std::vector<std::string> stores = {cluster.Find("store-0").grpc,
                                           cluster.Find("store-1").grpc};
  ASSERT_FALSE(stores[0].empty());
  ASSERT_FALSE(stores[1].empty());
  std::vector<uint64_t> baseline;
  for (const std::string& s : stores) {
    auto stats = StoreStats(cluster, s);
    ASSERT_TRUE(stats.has_value()) << s;
    baseline.push_back(Cluster::LiveBytes(*stats));
  }

  // The fault-free run: every prompt once, the reference tokens (greedy: deterministic).
  std::vector<std::vector<int32_t>> reference(kPrompts);
  {
    std::vector<std::thread> t;
    std::vector<grpc::Status> status(kPrompts);
    for (int p = 0; p < kPrompts; ++p) {
      t.emplace_back([&, p] {
        Outcome o = Generate(cluster.stub(), Request(p), kDeadline);
        status[p] = o.status;
        reference[p] = o.tokens;
      });
    }
    for (auto& th : t) th.join();
    for (int p = 0; p < kPrompts; ++p) {
      ASSERT_TRUE(status[p].ok()) << "fault-free prompt " << p << ": " << status[p].error_message();
      ASSERT_EQ(reference[p].size(), kMaxTokens);
    }
  }
  // Both stores took sequences of the fault-free run (placement spreads them).
  for (const std::string& s : stores) {
    auto stats = StoreStats(cluster, s);
    ASSERT_TRUE(stats.has_value());
    EXPECT_GT(stats->bytes_written(), 0u) << s << " was never used";
  }

  Load load(cluster, kClients);
  std::vector<std::unique_ptr<Subprocess>> restarted;
  std::vector<Kill> kills;
  struct Victim {
    std::string kind, name;
  };
  for (const Victim& v : {Victim{"store", "store-1"}, Victim{"prefill", "prefill-0"},
                          Victim{"decode", "decode-0"}, Victim{"controller", "controller"}}) {
    absl::SleepFor(absl::Milliseconds(2500));  // requests in flight on every node
    const Cluster::Node node = cluster.Find(v.name);
    ASSERT_GT(node.pid, 0) << v.name;
    if (v.kind == "store") {
      // Killed while it holds a sequence of a request in flight.
      const absl::Time until = absl::Now() + absl::Seconds(10);
      std::optional<kvr::store::v1::StatsResponse> stats;
      while ((!(stats = StoreStats(cluster, node.grpc)) || Cluster::LiveSequences(*stats) == 0) &&
             absl::Now() < until) {
        absl::SleepFor(absl::Milliseconds(10));
      }
      ASSERT_TRUE(stats.has_value() && Cluster::LiveSequences(*stats) > 0) << v.name << " never held one";
    }
    ASSERT_EQ(kill(node.pid, SIGKILL), 0) << v.name;
    const absl::Time killed = absl::Now();
    // Started again at once on the same address, as a supervisor would.
    std::vector<std::string> argv;
    std::string registered_line;
    if (v.kind == "store") {
      argv = {KVR_STORE_BIN, "--listen",        node.grpc, "--capacity-bytes",
              "1GiB",        "--evict-expired", "true",    "--sweep-interval-ms",
              "500",         "--controller",    endpoint,  "--name",
              v.name};
      registered_line = "kvr-store registered";
    } else if (v.kind == "prefill" || v.kind == "decode") {
      argv = {v.kind == "prefill" ? KVR_PREFILL_BIN : KVR_DECODE_BIN, "--model", kModel,
              "--controller", endpoint, "--listen", node.grpc, "--device=cpu",
              // The name its certificate carries (kvr://node/<name>), which the controller
              // admits it under.
              v.kind == "prefill" ? "--node-name" : "--name", v.name};
      registered_line = absl::StrCat("kvr-", v.kind, " registered");
    } else {
      argv = {KVR_CONTROLLER_BIN, "--listen", endpoint};
      registered_line = "kvr-controller listening on";
    }
    restarted.push_back(std::make_unique<Subprocess>(cluster.WithTls(argv, v.name)));
    Subprocess& process = *restarted.back();
    std::optional<absl::Time> registered;
    std::optional<absl::Time> served;
    while (absl::Now() - killed < kRecoveryLimit + absl::Seconds(5) && !(registered && served)) {
      if (!registered && !process.WaitForLine(registered_line, absl::ZeroDuration()).empty()) {
        // The controller is whole once every node has registered with the new one.
        if (v.kind != "controller" || Members(cluster) == std::make_pair(2, 2)) {
          registered = absl::Now();
        }
      }
      if (!served) served = load.FirstServedAfter(killed);
      absl::SleepFor(absl::Milliseconds(50));
    }
    if (!registered.has_value()) {
      // What to look at: the restarted process's last lines and, for the controller, which
      // members it has.
      const std::vector<std::string> lines = process.Lines();
      std::string tail;
      for (size_t i = lines.size() > 10 ? lines.size() - 10 : 0; i < lines.size(); ++i) {
        absl::StrAppend(&tail, "\n  ", lines[i]);
      }
      const std::pair<int, int> members = Members(cluster);
      FAIL() << v.name << " did not register again (\"" << registered_line << "\" "
             << (process.WaitForLine(registered_line, absl::ZeroDuration()).empty() ? "not " : "")
             << "seen; members " << members.first << ", " << members.second
             << "); its last lines:" << tail;
    }
    ASSERT_TRUE(served.has_value()) << "no request served after the kill of " << v.name;
    Kill k{v.kind, v.name, killed, *registered - killed, *served - killed,
           std::max(*registered, *served) - killed};
    std::printf("kill -9 %-10s registered again %s, first request served %s after the kill\n",
                v.name.c_str(), absl::FormatDuration(k.registered).c_str(),
                absl::FormatDuration(k.served).c_str());
    std::fflush(stdout);
    EXPECT_LT(k.recovered, kRecoveryLimit) << v.name;
    kills.push_back(k);
  }
  absl::SleepFor(absl::Seconds(2));  // load on the whole, recovered cluster
  load.Stop();

  // Every request ended within its deadline; completed ones match the fault-free run; the
  // failed ones are UNAVAILABLE.
  const std::vector<Record> records = load.records();
  int completed = 0, hung = 0, wrong = 0;
  std::map<std::string, int> failed;
  for (const Record& r : records) {
    if (r.end - r.start > kDeadline + absl::Seconds(1)) ++hung;
    if (r.code == grpc::StatusCode::OK) {
      ++completed;
      if (r.tokens != reference[r.prompt]) ++wrong;
      EXPECT_EQ(r.tokens, reference[r.prompt]) << "prompt " << r.prompt;
    } else {
      ++failed[CodeName(r.code)];
      EXPECT_EQ(r.code, grpc::StatusCode::UNAVAILABLE)
          << r.code << " " << r.message << " after " << absl::FormatDuration(r.end - r.start);
      EXPECT_FALSE(r.message.empty());
    }
  }
  EXPECT_EQ(hung, 0);
  EXPECT_GT(completed, 0);

  // The stores are back to their baseline: orphans of the killed nodes were released when
  // their leases (8 s, no longer renewed) lapsed.
  const absl::Time drain = absl::Now();
  bool empty = false;
  std::vector<std::optional<kvr::store::v1::StatsResponse>> end(stores.size());
  while (!empty && absl::Now() - drain < absl::Seconds(12)) {
    empty = true;
    for (size_t i = 0; i < stores.size(); ++i) {
      end[i] = StoreStats(cluster, stores[i]);
      empty = empty && end[i].has_value() && Cluster::LiveSequences(*end[i]) == 0 &&
              Cluster::LiveBytes(*end[i]) == baseline[i];
    }
    if (!empty) absl::SleepFor(absl::Milliseconds(200));
  }
  for (size_t i = 0; i < stores.size(); ++i) {
    ASSERT_TRUE(end[i].has_value()) << stores[i];
    EXPECT_EQ(Cluster::LiveSequences(*end[i]), 0u) << stores[i];
    EXPECT_EQ(Cluster::LiveBytes(*end[i]), baseline[i]) << stores[i];
  }

  std::printf("chaos: %zu requests: %d completed (%d wrong), %d hung, failed:", records.size(),
              completed, wrong, hung);
  for (const auto& [code, n] : failed) std::printf(" %d with status %s", n, code.c_str());
  std::printf("\nchaos: stores back to baseline %s after the load stopped\n",
              absl::FormatDuration(absl::Now() - drain).c_str());
  for (size_t i = 0; i < kills.size(); ++i) {
    const Kill& k = kills[i];
    // The failures this kill caused: requests that ended after it and before the next one.
    std::map<std::string, int> messages;
    int n = 0;
    for (const Record& r : records) {
      if (r.code == grpc::StatusCode::OK || r.end < k.at) continue;
      if (i + 1 < kills.size() && r.end >= kills[i + 1].at) continue;
      ++n;
      ++messages[absl::StrCat(CodeName(r.code), ": ", r.message.substr(0, 100))];
    }
    // Once recovered, the cluster serves every request again until the next kill (a restarted
    // node must not be left unreachable, e.g. behind a stale connection to its address).
    for (const Record& r : records) {
      if (r.code == grpc::StatusCode::OK || r.start < k.at + k.recovered) continue;
      if (i + 1 < kills.size() && r.end >= kills[i + 1].at) continue;
      ADD_FAILURE() << "after recovering from the kill of " << k.victim << ": " << CodeName(r.code)
                    << " " << r.message;
    }
    std::printf("chaos: %-10s recovered in %s (registered %s, served %s); %d failed\n",
                k.kind.c_str(), absl::FormatDuration(k.recovered).c_str(),
                absl::FormatDuration(k.registered).c_str(),
                absl::FormatDuration(k.served).c_str(), n);
    for (const auto& [m, count] : messages) std::printf("    %3d x %s\n", count, m.c_str());
  }
}

}  // namespace
}  // namespace kvr::e2e
