// decode_bench: decode-step time of the decode node's engine (DecodeEngine + DecodeAttention +
// an in-process KV store, FakeKvStoreClient) for a model at a given context, per batch size
// and retrieval method; with KV bytes fetched per generated token and the hot-cache hit rate.
//
//   decode_bench --model smollm2-135m-instruct --context 2048 --batch 1,4
//                --methods full,clusterkv --budget 64 --steps 16
//
// The prompt is random token ids; its prefill (dense, once) plays the prefill node. The store
// is in-process, so fetch time is a memcpy, not a network transfer: the figure isolates the
// node's compute and data path.

#include <chrono>
#include <iostream>
#include <random>

#include "CLI/CLI.hpp"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kvr/common/thread_pool.h"
#include "kvr/decode/engine.h"
#include "kvr/decode/local_handoff.h"
#include "kvr/model/dense_attention.h"
#include "kvr/model/loader.h"
#include "kvr/retrieval/all_methods.h"

using namespace kvr;

int main(int argc, char** argv) {
  std::string model_name = "smollm2-135m-instruct", batches = "1,4", methods = "full,clusterkv";
  int64_t context = 2048, budget = 64, n_sink = 16, window = 256;
  int steps = 16, threads = 0;
  int64_t hot_cache_bytes = 256 << 20;
  CLI::App app{"decode-node step benchmark"};
  app.add_option("--model", model_name);
  app.add_option("--context", context, "prompt tokens");
  app.add_option("--batch", batches, "comma-separated batch sizes");
  app.add_option("--methods", methods, "comma-separated retrieval methods");
  app.add_option("--budget", budget);
  app.add_option("--n-sink", n_sink);
  app.add_option("--local-window", window);
  app.add_option("--steps", steps, "timed decode steps per configuration (after one warm-up)");
  app.add_option("--threads", threads);
  app.add_option("--hot-cache-bytes", hot_cache_bytes);
  CLI11_PARSE(app, argc, argv);

  ThreadPool pool(static_cast<size_t>(threads));
  auto loaded = model::LoadModel(model_name, {}, &pool);
  if (!loaded.ok()) {
    std::cerr << loaded.status() << "\n";
    return 1;
  }
  const model::Model& m = *loaded->model;
  auto registry = retrieval::AllMethods();
  if (!registry.ok()) return 1;
  std::mt19937_64 rng(7);
  std::vector<int32_t> prompt(context);
  for (int32_t& id : prompt) id = static_cast<int32_t>(rng() % m.config().vocab);
  model::DenseAttention dense(&pool);
  model::KvCache cache = m.NewCache();
  const auto t0 = std::chrono::steady_clock::now();
  auto logits = m.Prefill(1, cache, prompt, dense);
  if (!logits.ok()) {
    std::cerr << logits.status() << "\n";
    return 1;
  }
  std::cout << "# model " << loaded->source << ", context " << context << ", prefill "
            << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()
            << " s, threads " << pool.size() << "\n";
  std::cout << "method,batch,budget,ms_per_step,tokens_per_s,bytes_fetched_per_token,"
               "hot_cache_hit_rate,summary_bytes_per_seq\n";
  uint64_t next_id = 100;
  const std::vector<std::string> method_list = absl::StrSplit(methods, ',');
  const std::vector<std::string> batch_list = absl::StrSplit(batches, ',');
  for (const std::string& method : method_list) {
    for (const std::string& b : batch_list) {
      int batch = 0;
      if (!absl::SimpleAtoi(b, &batch) || batch <= 0) return 2;
      kv_store::StoreOptions so;
      so.pool.capacity_bytes = static_cast<uint64_t>(batch) * (context + steps + 8) * 2 *
                                   m.config().n_layers * m.config().kv_dim() * 4 +
                               (64 << 20);
      so.pool.try_huge_pages = false;
      auto store = kv_store::FakeKvStoreClient::Create(so);
      if (!store.ok()) return 1;
      auto engine = decode::DecodeEngine::Create(
          &m, nullptr, &*registry,
          {.batch_slots = batch, .hot_cache_bytes = hot_cache_bytes, .memory_bytes = 1ll << 40});
      if (!engine.ok()) return 1;
      std::vector<uint64_t> ids;
      for (int i = 0; i < batch; ++i) {
        decode::LocalHandoffOptions o;
        o.sequence_id = next_id++;
        o.method = method;
        o.params.budget = budget;
        o.params.n_sink = n_sink;
        o.params.local_window = window;
        o.sampling.max_tokens = static_cast<uint32_t>(steps + 4);
        o.first_token = model::ArgMax(*logits);
        auto h = decode::MakeLocalHandoff(m, cache, *registry, **store, o);
        if (!h.ok()) {
          std::cerr << method << ": " << h.status() << "\n";
          return 1;
        }
        if (absl::Status s = (*engine)->Admit(std::move(*h)); !s.ok()) {
          std::cerr << s << "\n";
          return 1;
        }
        ids.push_back(o.sequence_id);
      }
      (*engine)->Step();  // warm-up: joins the batch, fills the hot cache
      const decode::NodeCounters before = (*engine)->node_counters();
      const auto s0 = std::chrono::steady_clock::now();
      for (int s = 0; s < steps; ++s) (*engine)->Step();
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count();
      const decode::NodeCounters after = (*engine)->node_counters();
      const double tokens = static_cast<double>(steps) * batch;
      const double hits = after.retrieval.hot_cache_hits - before.retrieval.hot_cache_hits;
      const double misses = after.retrieval.hot_cache_misses - before.retrieval.hot_cache_misses;
      const double fetched = after.retrieval.bytes_fetched - before.retrieval.bytes_fetched;
      // Summary bytes of one sequence: its indexes' MemoryBytes over every layer.
      std::cout << method << "," << batch << "," << budget << "," << 1e3 * seconds / steps << ","
                << tokens / seconds << "," << fetched / tokens << ","
                << (hits + misses > 0 ? hits / (hits + misses) : 0.0) << ","
                << (*engine)->SummaryBytes(ids[0]) << std::endl;
    }
  }
  return 0;
}
