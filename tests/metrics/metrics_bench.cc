// Cost of recording kvr metrics (the controller's and the decode node's metric sets) on the
// paths that call them per token or per (step, layer), and of one scrape. Single-threaded and
// 4-thread (contended) runs.
//   build/tests/metrics/metrics_bench --benchmark_min_time=0.3
#include <benchmark/benchmark.h>

#include "kvr/common/metrics.h"
#include "kvr/controller/metrics.h"
#include "kvr/decode/metrics.h"

namespace kvr::metrics {
namespace {

struct Fixture {
  std::unique_ptr<MetricsServer> server = *MetricsServer::Start({.port = -1, .role = "bench"});
  ControllerMetrics controller{server->registry()};
  DecodeMetrics decode{server->registry()};
};

Fixture& Shared() {
  static Fixture* fixture = new Fixture();  // shared by the threads of one benchmark
  return *fixture;
}

// One token reaching the client: ITL histogram (labelled) + generation-token counter.
void BM_TokenToClient(benchmark::State& state) {
  Fixture& f = Shared();
  for (auto _ : state) {
    f.controller.ObserveInterTokenLatency("smollm2", "clusterkv", 0.012);
    f.controller.AddGenerationTokens("smollm2", 1);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_TokenToClient)->Threads(1)->Threads(4)->UseRealTime();

// One (step, layer) of the decode loop: fetch bytes/rows + latency + hot cache.
void BM_DecodeLayerStep(benchmark::State& state) {
  Fixture& f = Shared();
  for (auto _ : state) {
    f.decode.AddFetched("smollm2", "clusterkv", 4 << 20, 8192);
    f.decode.ObserveFetchLatency("smollm2", 0.0008);
    f.decode.AddHotCache("smollm2", "clusterkv", 700, 300);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_DecodeLayerStep)->Threads(1)->Threads(4)->UseRealTime();

// One scrape of a registry holding the controller and decode sets with data.
void BM_Scrape(benchmark::State& state) {
  Fixture& f = Shared();
  f.controller.ObserveTimeToFirstToken("smollm2", "clusterkv", 0.2);
  f.decode.ObserveRecall("smollm2", "clusterkv", 0.9);
  size_t bytes = 0;
  for (auto _ : state) {
    std::string text = f.server->ScrapeText();
    bytes = text.size();
    benchmark::DoNotOptimize(text);
  }
  state.counters["bytes"] = static_cast<double>(bytes);
}
BENCHMARK(BM_Scrape);

}  // namespace
}  // namespace kvr::metrics

BENCHMARK_MAIN();
