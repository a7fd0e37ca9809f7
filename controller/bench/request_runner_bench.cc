// Controller-side cost of one request: placement over a cluster of N nodes plus the request
// flow (prefill call, token relay, final report) with in-memory node clients, i.e. what the
// controller adds on top of the nodes' own work and the network. Reported as requests/s and
// relayed tokens/s of one controller thread.
//
//   build-*/controller/controller_bench --benchmark_min_time=0.5

#include <benchmark/benchmark.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "kvr/controller/request_runner.h"

namespace kvr::controller {
namespace {

class InstantPrefill final : public PrefillClient {
 public:
  absl::StatusOr<PrefillResult> Prefill(const NodeSnapshot&, const PrefillCall&,
                                        CancellationToken*) override {
    PrefillResult r;
    r.prompt_tokens = 1000;
    r.first_token = 1;
    r.first_text = "a";
    return r;
  }
  absl::Status Cancel(const NodeSnapshot&, absl::string_view, uint64_t, absl::string_view,
                      absl::Time) override {
    return absl::OkStatus();
  }
};

class InstantDecode final : public DecodeClient {
 public:
  explicit InstantDecode(uint32_t tokens) : tokens_(tokens) {}
  absl::StatusOr<Completion> Stream(
      const NodeSnapshot&, absl::string_view, uint64_t, absl::Time, CancellationToken*,
      absl::FunctionRef<absl::Status(const TokenChunk&)> on_chunk) override {
    for (uint32_t i = 1; i < tokens_; ++i) {
      if (absl::Status s = on_chunk(TokenChunk{{i}, "b"}); !s.ok()) return s;
    }
    Completion c;
    c.finish_reason = FinishReason::kLength;
    c.completion_tokens = tokens_;
    return c;
  }
  absl::Status Cancel(const NodeSnapshot&, absl::string_view, uint64_t, absl::string_view,
                      absl::Time) override {
    return absl::OkStatus();
  }

 private:
  uint32_t tokens_;
};

class CountingSink final : public ResponseSink {
 public:
  absl::Status Send(const GenerateEvent& e) override {
    tokens += e.chunk.token_ids.size();
    return absl::OkStatus();
  }
  uint64_t tokens = 0;
};

NodeRegistration Node(NodeRole role, int i) {
  NodeRegistration r;
  r.role = role;
  r.endpoints.grpc_address = absl::StrCat("node-", i, ":50051");
  r.endpoints.ucx_worker_address = "ucx";
  r.capacity.memory_bytes = 1ull << 40;
  r.capacity.batch_slots = 1u << 30;
  r.load.free_memory_bytes = 1ull << 40;
  if (role != NodeRole::kStore) {
    r.capacity.models = {ModelInfo{"m", 1 << 20, 1000, {{"full", 10.0}}}};
  }
  return r;
}

// Arguments: nodes per role, tokens per request.
void BM_PlaceAndRelay(benchmark::State& state) {
  const int nodes = static_cast<int>(state.range(0));
  const uint32_t tokens = static_cast<uint32_t>(state.range(1));
  SystemClock clock;
  // A lease far longer than the benchmark: no node expires, no heartbeat is needed.
  Membership membership(&clock, absl::Hours(1));
  for (NodeRole role : {NodeRole::kPrefill, NodeRole::kDecode, NodeRole::kStore}) {
    for (int i = 0; i < nodes; ++i) (void)membership.Register(Node(role, i));
  }
  Placement placement(&membership);
  InstantPrefill prefill;
  InstantDecode decode(tokens);
  RequestRunner runner(&membership, &placement, &prefill, &decode, &clock, RunnerOptions{});
  GenerateParams params;
  params.request_id = "bench";
  params.model = "m";
  params.prompt = std::string(1000, 'x');
  params.prompt_tokens_bound = 1000;
  params.sampling.max_tokens = tokens;
  params.retrieval.method = "full";
  CountingSink sink;
  for (auto _ : state) {
    CancellationToken cancel;
    absl::Status s = runner.Run(params, clock.Now(), absl::InfiniteFuture(), &cancel, &sink);
    if (!s.ok()) {
      state.SkipWithError(std::string(s.message()).c_str());
      break;
    }
  }
  state.SetItemsProcessed(state.iterations());
  state.counters["tokens_per_s"] =
      benchmark::Counter(static_cast<double>(sink.tokens), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_PlaceAndRelay)->Args({1, 64})->Args({16, 64})->Args({128, 64})->Args({16, 1024});

}  // namespace
}  // namespace kvr::controller

BENCHMARK_MAIN();
