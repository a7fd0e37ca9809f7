// Tokens/s of the decode node's engine on the CUDA backend against the raw
// CudaModel steps over the same sparse sequences: what the engine adds (logits back to the host,
// sampling, stop/length checks, output buffering) to the model's decode step.
//
// Model: a dummy shape (default llama3-8b, 32 layers) with random weights made on the GPU.
// Rows: SYNTHETIC (random bf16 values) in an in-process FakeKvStoreClient, ONE store sequence of
// the longest context that every handoff reads (a wrapper maps every sequence id to it and
// ignores releases), so that host memory holds one copy; each running sequence still pulls its
// own copy into its slot's pinned host KV at join (RangeRead, bf16 rows copied as they are).
// Per (context, batch): a fresh CudaModel + backend with `batch` slots (the sparse step's GEMMs
// run over all slots), `batch` handoffs admitted; the first Step joins them (timed: join = pull
// + activate, per sequence), `warmup` steps, then `steps` engine Steps timed (engine tok/s =
// batch x steps / time), between `steps` raw ForwardGreedy (argmax on the GPU, as `kvr bench
// decode` times) before and `steps` raw CudaModel::Forward (logits back and a host argmax, as the
// engine asks) after, over the same sequences, each fed its previous step's tokens.

#include <chrono>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "kvr/decode/cuda_backend.h"
#include "kvr/decode/engine.h"
#include "kvr/kv_store/client.h"
#include "kvr/kv_store/forwarding_client.h"
#include "kvr/model/cuda_model.h"
#include "kvr/model/dummy.h"
#include "kvr/model/sampler.h"
#include "kvr/retrieval/cuda/sparse_decode.h"

namespace kvr::decode {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Every sequence id reads store sequence `base`; releases are no-ops (the rows stay for the
// next run). Benchmarks only.
class SharedRowsStore final : public kv_store::ForwardingKvStoreClient {
 public:
  SharedRowsStore(kv_store::KvStoreClient* inner, kv_store::SequenceRef base)
      : ForwardingKvStoreClient(inner, "SharedRowsStore"), base_(base) {}
  std::unique_ptr<kv_store::KvStoreOp> StartGather(std::span<const kv_store::GatherEntry> entries,
                                                   std::span<uint8_t> out) override {
    std::vector<kv_store::GatherEntry> e(entries.begin(), entries.end());
    for (auto& x : e) x.sequence = base_;
    return inner()->StartGather(e, out);
  }
  // Every id already reads `base`: there is nothing to fork.
  absl::StatusOr<kv_store::ForkResult> ForkSequence(const kv_store::SequenceRef&,
                                                    const kv_store::SequenceRef&, uint64_t,
                                                    uint64_t, absl::Duration) override {
    return absl::UnimplementedError("SharedRowsStore: no forks");
  }
  absl::Status RangeRead(std::span<const kv_store::RangeEntry> ranges,
                         std::span<uint8_t> out) override {
    std::vector<kv_store::RangeEntry> r(ranges.begin(), ranges.end());
    for (auto& x : r) x.sequence = base_;
    return inner()->RangeRead(r, out);
  }
  absl::Status Release(const kv_store::SequenceRef&, absl::Duration) override {
    return absl::OkStatus();
  }
  absl::Status Lease(const kv_store::SequenceRef&, absl::Duration) override {
    return absl::OkStatus();
  }
  absl::StatusOr<kv_store::SequenceInfo> GetSequence(const kv_store::SequenceRef&) override {
    return inner()->GetSequence(base_);
  }

 private:
  kv_store::SequenceRef base_;
};

std::vector<int64_t> ParseList(const std::string& s) {
  std::vector<int64_t> out;
  for (absl::string_view p : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    int64_t v;
    if (absl::SimpleAtoi(p, &v)) out.push_back(v);
  }
  return out;
}

int Main(int argc, char** argv) {
  CLI::App app{"gpu_decode_bench: the decode engine on the CUDA backend vs raw CudaModel steps"};
  std::string shape = "llama3-8b", contexts_s = "8192,32768", batches_s = "1,4,8";
  int layers = 0, steps = 16, warmup = 2, budget = 1024, sink = 16, window = 256;
  int hot_cache_rows = 1024;
  app.add_option("--shape", shape);
  app.add_option("--layers", layers, "layer count override (0: the shape's)");
  app.add_option("--contexts", contexts_s, "prompt tokens + 256 of room (list)");
  app.add_option("--batches", batches_s, "sequences per step (list)");
  app.add_option("--steps", steps);
  app.add_option("--warmup", warmup);
  app.add_option("--budget", budget);
  app.add_option("--sink", sink);
  app.add_option("--window", window);
  app.add_option("--hot-cache-rows", hot_cache_rows, "per (slot, layer, KV head)");
  CLI11_PARSE(app, argc, argv);
  const std::vector<int64_t> contexts = ParseList(contexts_s), batches = ParseList(batches_s);
  auto config = model::DummyConfig(shape, layers);
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", config.status().ToString().c_str());
    return 1;
  }
  const model::ModelConfig& c = *config;
  int64_t max_ctx = 0;
  for (int64_t x : contexts) max_ctx = std::max(max_ctx, x);

  // The synthetic rows: one bf16 store sequence of max_ctx - 256 prompt tokens.
  kv_store::SequenceShape ss{static_cast<uint32_t>(c.n_layers), static_cast<uint32_t>(c.n_kv_heads),
                             static_cast<uint32_t>(c.head_dim), kv_store::DType::kBf16};
  const int64_t max_prompt = max_ctx - 256;
  kv_store::StoreOptions so;
  so.pool.capacity_bytes =
      static_cast<uint64_t>(max_prompt) * c.n_layers * c.n_kv_heads * ss.RowBytes() +
      (256ull << 20);
  so.pool.page_bytes = 2 << 20;
  so.pool.try_huge_pages = false;
  auto fake = kv_store::FakeKvStoreClient::Create(so);
  if (!fake.ok()) {
    std::fprintf(stderr, "store: %s\n", fake.status().ToString().c_str());
    return 1;
  }
  const kv_store::SequenceRef kBase{1, kv_store::Capability::Generate()};
  const auto t_fill = Clock::now();
  if (auto r = (*fake)->CreateSequence(kBase, ss, max_prompt, absl::ZeroDuration()); !r.ok()) {
    std::fprintf(stderr, "create: %s\n", r.status().ToString().c_str());
    return 1;
  }
  {
    const int64_t chunk = 4096;
    std::vector<uint16_t> k(chunk * c.n_kv_heads * c.head_dim), v(k.size());
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (size_t i = 0; i < k.size(); ++i) {  // bf16 of N(0, 1): the top half of a float
      float a = nd(rng), b = nd(rng);
      uint32_t ua, ub;
      std::memcpy(&ua, &a, 4);
      std::memcpy(&ub, &b, 4);
      k[i] = static_cast<uint16_t>(ua >> 16);
      v[i] = static_cast<uint16_t>(ub >> 16);
    }
    for (int l = 0; l < c.n_layers; ++l) {
      for (int64_t t0 = 0; t0 < max_prompt; t0 += chunk) {
        const int64_t n = std::min(chunk, max_prompt - t0);
        kv_store::LayerRows rows;
        rows.sequence = kBase;
        rows.layer = static_cast<uint32_t>(l);
        rows.start_row = static_cast<uint64_t>(t0);
        rows.n_rows = static_cast<uint32_t>(n);
        const size_t bytes = static_cast<size_t>(n) * c.n_kv_heads * c.head_dim * 2;
        rows.k = std::span(reinterpret_cast<const uint8_t*>(k.data()), bytes);
        rows.v = std::span(reinterpret_cast<const uint8_t*>(v.data()), bytes);
        if (auto p = (*fake)->PutLayer(rows); !p.ok()) {
          std::fprintf(stderr, "put: %s\n", p.status().ToString().c_str());
          return 1;
        }
      }
    }
  }
  SharedRowsStore store(fake->get(), kBase);
  std::printf(
      "# gpu_decode_bench: %s x %d layers, quest budget %d, sink %d, window %d, hot cache "
      "%d rows; SYNTHETIC rows (random bf16) in a FakeKvStoreClient (%.1f GiB, filled in "
      "%.1f s); %d steps after %d warm-up\n",
      shape.c_str(), c.n_layers, budget, sink, window, hot_cache_rows,
      static_cast<double>(so.pool.capacity_bytes) / (1 << 30), Since(t_fill), steps, warmup);
  std::printf(
      "| ctx | batch | join s/seq | raw ForwardGreedy tok/s | raw Forward tok/s | engine "
      "tok/s | engine / raw greedy | engine ms/step |\n|---|---|---|---|---|---|---|---|\n");
  int status = 0;
  for (int64_t ctx : contexts) {
    for (int64_t b : batches) {
      model::CudaModelOptions mo;
      mo.max_batch_tokens = b;
      mo.max_sequences = static_cast<int>(b);
      mo.max_logits_rows = b;
      auto gpu = model::CreateCudaModelWithRandomWeights(c, 11, mo);
      if (!gpu.ok()) {
        std::fprintf(stderr, "model: %s\n", gpu.status().ToString().c_str());
        return 1;
      }
      // Raw steps run the model with the backend's sparse decode (its attention hook).
      auto made = retrieval::cuda::CreateSparseDecodeAttention(**gpu);
      if (!made.ok()) {
        std::fprintf(stderr, "sparse decode: %s\n", made.status().ToString().c_str());
        return 1;
      }
      retrieval::cuda::SparseDecodeAttention* raw = made->get();
      CudaDecodeBackendOptions o;
      o.slots = static_cast<int>(b);
      o.budget = budget;
      o.n_sink = sink;
      o.local_window = window;
      o.max_context = ctx;
      o.hot_cache_bytes =
          int64_t{hot_cache_rows} * b * c.n_layers * c.n_kv_heads * 2 * c.head_dim * 2;
      auto backend = CreateCudaDecodeBackend(*std::move(gpu), *std::move(made), o);
      if (!backend.ok()) {
        std::fprintf(stderr, "backend: %s\n", backend.status().ToString().c_str());
        return 1;
      }
      auto engine =
          DecodeEngine::Create(*std::move(backend), nullptr, {.batch_slots = static_cast<int>(b)});
      if (!engine.ok()) return 1;
      const int64_t prompt = ctx - 256;
      std::vector<uint64_t> ids;
      for (int64_t i = 0; i < b; ++i) {
        Handoff h;
        h.sequence_id = 100 + i;
        h.store = &store;
        h.method = "quest";
        h.budget = budget;
        h.n_sink = sink;
        h.local_window = window;
        h.prompt_tokens = prompt;
        h.first_token = 1;
        h.sampling.max_tokens = 200;  // never reached: 1 + warmup + steps engine steps
        h.sampling.ignore_eos = true;
        h.layers.resize(c.n_layers);
        for (int l = 0; l < c.n_layers; ++l) h.layers[l].layer = l;
        if (absl::Status s = (*engine)->Admit(std::move(h)); !s.ok()) {
          std::fprintf(stderr, "admit: %s\n", s.ToString().c_str());
          return 1;
        }
        ids.push_back(100 + i);
      }
      auto drain = [&] {
        for (uint64_t id : ids) (*engine)->Next(id, absl::Now()).IgnoreError();
      };
      auto t0 = Clock::now();
      (*engine)->Step();  // joins all (pull + activate) and runs one step
      const double join = Since(t0) / static_cast<double>(b);
      drain();
      for (int i = 0; i < warmup; ++i) (*engine)->Step();
      drain();
      // Raw steps over the same sequences (the loop thread is not started: nothing else runs),
      // each fed its previous output as the engine feeds sampled tokens: a repeated token would
      // repeat the queries, hence the selections, and hit the hot cache far more often. Order:
      // raw ForwardGreedy, engine, raw Forward, so that no side runs on a colder hot cache.
      std::vector<int32_t> tok(b, 1);
      std::vector<model::CudaSequence> batch;
      for (int64_t i = 0; i < b; ++i) batch.push_back({ids[i], std::span(&tok[i], 1)});
      std::vector<int32_t> next(b);
      t0 = Clock::now();
      for (int i = 0; i < steps; ++i) {
        if (!raw->ForwardGreedy(batch, next).ok()) status = 1;
        tok = next;
      }
      const double greedy_s = Since(t0);
      t0 = Clock::now();
      for (int i = 0; i < steps; ++i) {
        (*engine)->Step();
        drain();
      }
      const double engine_s = Since(t0);
      if ((*engine)->running_sequences() != static_cast<int>(b)) {
        std::fprintf(stderr, "ctx %lld batch %lld: %d sequences running, expected %lld\n",
                     static_cast<long long>(ctx), static_cast<long long>(b),
                     (*engine)->running_sequences(), static_cast<long long>(b));
        status = 1;
      }
      std::vector<float> logits(b * c.vocab);
      t0 = Clock::now();
      for (int i = 0; i < steps; ++i) {
        if (!raw->Forward(batch, model::LogitsMode::kLast, logits).ok()) status = 1;
        for (int64_t j = 0; j < b; ++j) {
          tok[j] = model::ArgMax(std::span<const float>(logits).subspan(j * c.vocab, c.vocab));
        }
      }
      const double forward_s = Since(t0);
      const double n = static_cast<double>(b) * steps;
      std::printf("| %lldK | %lld | %.2f | %.1f | %.1f | %.1f | %.3f | %.2f |\n",
                  static_cast<long long>(ctx / 1024), static_cast<long long>(b), join, n / greedy_s,
                  n / forward_s, n / engine_s, greedy_s / engine_s, 1e3 * engine_s / steps);
      std::fflush(stdout);
    }
  }
  return status;
}

}  // namespace
}  // namespace kvr::decode

int main(int argc, char** argv) { return kvr::decode::Main(argc, argv); }
