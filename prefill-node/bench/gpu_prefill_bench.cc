// Prefill time of the prefill node's CUDA backend, random bf16 weights generated
// on the GPU (CreateCudaModelWithRandomWeights: no float32 host copy, so Llama-3-8B fits), one
// sequence at a time, per prompt length:
//   (a) forward only: CudaModel::Forward over the prompt's chunks;
//   (b) forward + the per-layer KV export (every layer's rows [0, L) and last queries converted to
//       float32 on the GPU and copied device-to-host into pinned buffers on the copy stream);
//   (c) the whole PrefillEngine on that backend with an in-process store (FakeKvStoreClient) and
//       a handoff that discards, per method: the CPU index build of each layer from the exported
//       rows on the engine's worker thread, the sink/local packing and the store put (the fake
//       store copies synchronously on the worker thread; a real one is an async UCX put).
//   (d) --prefix-tokens N: each method's request cold and from a kept sequence of the prompt's
//       first N tokens (prefix reuse: the store forks it, the backend loads the reused rows, up
//       to the last whole chunk, and computes the rest), interleaved, best of --reps each.
//       --store discard: puts complete at once without copying (everything else as the fake
//       store), to see the engine's own cost without the fake store's copy.
// Times are wall clock (steady_clock), best of --reps after one untimed warm-up per row (the
// first export pins its host buffer: that time is printed separately). (c) also prints the sum
// of the per-layer index build times (PrefillObserver) and how long after the forward's end the
// last layer was ready (the part of the CPU work that did not overlap the GPU).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "engine_fakes.h"
#include "kvr/common/status.h"
#include "kvr/kv_store/forwarding_client.h"
#include "kvr/model/cuda_model.h"
#include "kvr/model/dummy.h"
#include "kvr/prefill_node/prefill_cuda_backend.h"
#include "kvr/prefill_node/prefill_engine.h"
#include "kvr/retrieval/all_methods.h"

namespace kvr::prefill_node {
namespace {

namespace cv1 = ::kvr::cluster::v1;
using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

class DiscardOpener final : public HandoffOpener {
  class Sink final : public HandoffSink {
    bool Write(const cv1::HandoffChunk&) override { return true; }
    absl::StatusOr<cv1::HandoffResponse> Finish() override {
      cv1::HandoffResponse r;
      r.set_accepted(true);
      return r;
    }
  };

 public:
  absl::StatusOr<std::unique_ptr<HandoffSink>> Open(const cv1::NodeRef&, absl::Time) override {
    return std::make_unique<Sink>();
  }
};

// The fake store, except that a put completes at once without copying the rows.
class DiscardPutStore final : public kv_store::ForwardingKvStoreClient {
 public:
  explicit DiscardPutStore(kv_store::KvStoreClient* inner)
      : ForwardingKvStoreClient(inner, "DiscardPutStore") {}
  std::unique_ptr<kv_store::KvStoreOp> StartPutLayer(const kv_store::LayerRows& rows) override {
    return std::make_unique<DoneOp>(rows.n_rows);
  }

 private:
  class DoneOp final : public kv_store::KvStoreOp {
   public:
    explicit DoneOp(uint64_t rows) : rows_(rows) {}
    bool Done() const override { return true; }
    absl::StatusOr<uint64_t> Wait() override { return rows_; }

   private:
    uint64_t rows_;
  };
};

// Sums index build times and remembers when the last layer was ready.
class Timing final : public PrefillObserver {
 public:
  void OnLayerReady(int, absl::Duration index_build, uint64_t, uint64_t) override {
    std::lock_guard<std::mutex> lock(mu_);
    build_ms_ += absl::ToDoubleMilliseconds(index_build);
    last_ready_ = Clock::now();
  }
  void Reset() {
    std::lock_guard<std::mutex> lock(mu_);
    build_ms_ = 0;
  }
  double build_ms() {
    std::lock_guard<std::mutex> lock(mu_);
    return build_ms_;
  }
  Clock::time_point last_ready() {
    std::lock_guard<std::mutex> lock(mu_);
    return last_ready_;
  }

 private:
  std::mutex mu_;
  double build_ms_ = 0;
  Clock::time_point last_ready_;
};

// A PrefillBackend that forwards to another and records when its Prefill returned.
class TimedBackend final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  absl::StatusOr<std::vector<float>> Prefill(const PrefillCall& call,
                                             std::unique_ptr<PrefillRows>* rows) override {
    // The time in the engine's prefix loader (store reads and re-layout), per call.
    PrefillCall timed = call;
    load_ms = 0;
    if (call.load_prefix_bf16) {
      timed.load_prefix_bf16 = [this, &call](int layer, std::span<uint16_t> k,
                                             std::span<uint16_t> v) {
        const auto t = Clock::now();
        absl::Status s = call.load_prefix_bf16(layer, k, v);
        load_ms += Ms(Clock::now() - t);
        return s;
      };
    }
    const auto start = Clock::now();
    auto r = ForwardingBackend::Prefill(timed, rows);
    forward_end = Clock::now();
    prefill_ms = Ms(forward_end - start);
    return r;
  }
  Clock::time_point forward_end;
  double load_ms = 0, prefill_ms = 0;
};

int Main(int argc, char** argv) {
  CLI::App app{"gpu_prefill_bench: CUDA prefill backend, export and engine times"};
  std::string shape = "llama3-8b", prompts = "8192,32768", methods = "full,quest,clusterkv";
  bool gpu_summaries = true;
  int64_t budget = 0;
  int layers = 0, reps = 2;
  int64_t chunk = 2048, max_queries = 512;
  double store_gib = 0;
  std::string store_kind = "fake";
  std::string store_dtype = "f32";
  int64_t prefix_tokens = 0;
  app.add_option("--shape", shape, "dummy shape (model/dummy.h)");
  app.add_option("--layers", layers, "layer count override (0: the shape's)");
  app.add_option("--prompt", prompts, "prompt lengths, comma separated");
  app.add_option("--chunk", chunk, "prompt tokens per forward chunk (= max_batch_tokens)");
  app.add_option("--methods", methods, "methods for (c), comma separated, each method[:option=value;...] (empty: skip (c))");
  app.add_option("--reps", reps, "timed repetitions per row (best is printed)");
  app.add_option("--max-queries", max_queries, "last prefill queries exported per layer");
  app.add_option("--store-gib", store_gib, "fake store pool (0: sized for the longest prompt)");
  app.add_option("--budget", budget,
                 "retrieval budget of (c)'s requests (0: IndexParams' default, 256; clusterkv's C0 "
                 "= max(L/80, 16L/budget))");
  app.add_option("--gpu-summaries", gpu_summaries,
                 "quest and clusterkv summaries built on the GPU (false: on the CPU from the "
                 "exported rows)");
  app.add_option("--store", store_kind, "fake (puts copy into the pool) or discard (no copy)")
      ->check(CLI::IsMember({"fake", "discard"}));
  app.add_option("--store-dtype", store_dtype,
                 "(c)'s store rows: f32, or bf16 (the backend then exports the cache's bf16 rows "
                 "as they lie instead of float32)")
      ->check(CLI::IsMember({"f32", "bf16"}));
  app.add_option("--prefix-tokens", prefix_tokens,
                 "(d): each method's request again, cold and then with its first N tokens' rows "
                 "in the store (a kept sequence of that prefix, reused up to the last whole "
                 "chunk); 0: skip (d)");
  CLI11_PARSE(app, argc, argv);

  auto config = model::DummyConfig(shape, layers);
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", config.status().ToString().c_str());
    return 2;
  }
  const model::ModelConfig& c = *config;
  std::vector<int64_t> lengths;
  for (absl::string_view s : absl::StrSplit(prompts, ',')) {
    int64_t L = 0;
    if (!absl::SimpleAtoi(s, &L) || L < 1) {
      std::fprintf(stderr, "--prompt: '%s' is not a length >= 1\n", std::string(s).c_str());
      return 2;
    }
    lengths.push_back(L);
  }
  // (c)'s rows: "method" or "method:name=value;..." (method options, e.g.
  // clusterkv:clusterkv.max_iterations=3), parsed once; a malformed option is an error, not a
  // row measured without it.
  struct MethodRow {
    std::string label, method;
    std::map<std::string, std::string> options;
  };
  std::vector<MethodRow> method_rows;
  for (absl::string_view m : absl::StrSplit(methods, ',', absl::SkipEmpty())) {
    const std::vector<std::string> parts = absl::StrSplit(m, absl::MaxSplits(':', 1));
    MethodRow row{std::string(m), parts[0], {}};
    if (parts.size() > 1) {
      for (absl::string_view kv : absl::StrSplit(parts[1], ';', absl::SkipEmpty())) {
        const std::vector<std::string> nv = absl::StrSplit(kv, absl::MaxSplits('=', 1));
        if (nv.size() != 2 || nv[0].empty()) {
          std::fprintf(stderr, "--methods: '%s' in '%s' is not name=value\n",
                       std::string(kv).c_str(), row.label.c_str());
          return 2;
        }
        row.options[nv[0]] = nv[1];
      }
    }
    method_rows.push_back(std::move(row));
  }
  model::CudaModelOptions o;
  o.max_batch_tokens = chunk;
  o.max_sequences = 1;
  o.max_logits_rows = 1;
  auto t0 = Clock::now();
  auto created = model::CreateCudaModelWithRandomWeights(c, 1, o);
  if (!created.ok()) {
    std::fprintf(stderr, "%s\n", created.status().ToString().c_str());
    return 1;
  }
  model::CudaModel* gpu = created->get();
  std::printf(
      "# %s x %d layers, %.2f GB bf16 weights on the GPU (%.0f ms), chunks of %lld, "
      "max_queries %lld\n",
      shape.c_str(), c.n_layers, gpu->weight_bytes() / 1e9, Ms(Clock::now() - t0),
      static_cast<long long>(chunk), static_cast<long long>(max_queries));
  auto inner = CreateCudaPrefillBackend(*std::move(created), o.device, chunk, gpu_summaries);
  std::printf("# summaries of quest and clusterkv built on the %s\n",
              gpu_summaries ? "GPU (quest on the main stream, clusterkv on a side stream; "
                              "shipped as the CPU index's bytes)"
                            : "CPU (from the exported rows)");
  if (!inner.ok()) {
    std::fprintf(stderr, "%s\n", inner.status().ToString().c_str());
    return 1;
  }
  auto timed_owned = std::make_unique<TimedBackend>(*std::move(inner));
  TimedBackend* timed = timed_owned.get();

  const int64_t max_len = *std::max_element(lengths.begin(), lengths.end());
  kv_store::StoreOptions so;
  const double per_token = 2.0 * c.n_layers * c.kv_dim() * (store_dtype == "bf16" ? 2 : 4);
  // (d) keeps the prefix's sequence while a request's own rows are put.
  const double held_tokens = static_cast<double>(max_len) + static_cast<double>(prefix_tokens);
  so.pool.capacity_bytes =
      store_gib > 0 ? static_cast<uint64_t>(store_gib * (1ull << 30))
                    : static_cast<uint64_t>(held_tokens * per_token * 1.1) + (256ull << 20);
  so.pool.try_huge_pages = false;
  auto store = kv_store::FakeKvStoreClient::Create(so);
  if (!store.ok()) {
    std::fprintf(stderr, "%s\n", store.status().ToString().c_str());
    return 1;
  }
  DiscardPutStore discard(store->get());
  OneStore stores(store_kind == "discard" ? static_cast<kv_store::KvStoreClient*>(&discard)
                                          : store->get());
  DiscardOpener opener;
  Timing timing;
  auto registry = retrieval::AllMethods();
  if (!registry.ok()) return 1;
  PrefillEngine engine(
      std::move(timed_owned), nullptr, &*registry, &stores, &opener,
      EngineOptions{
          .chunk_tokens = chunk,
          .max_prefill_queries = max_queries,
          .store_dtype = store_dtype == "bf16" ? kv_store::DType::kBf16 : kv_store::DType::kF32,
          .observer = &timing});

  uint64_t next_id = 1000;
  for (int64_t L : lengths) {
    std::vector<int32_t> ids(L);
    for (int64_t i = 0; i < L; ++i) ids[i] = static_cast<int32_t>((i * 7919 + 13) % c.vocab);
    std::vector<float> logits(c.vocab);
    // (a) and (b): the model alone.
    auto run = [&](bool do_export, double* pin_ms) -> absl::StatusOr<double> {
      const model::SequenceId id = next_id++;
      KVR_RETURN_IF_ERROR(gpu->AddSequence(id, L));
      std::atomic<int> layers_seen{0};
      const auto start = Clock::now();
      if (do_export) {
        model::KvExportOptions eo;
        eo.length = L;
        eo.max_queries = max_queries;
        eo.on_layer = [&layers_seen](const model::KvExportLayer&) { ++layers_seen; };
        KVR_RETURN_IF_ERROR(gpu->BeginKvExport(id, eo));
        if (pin_ms != nullptr) *pin_ms = Ms(Clock::now() - start);
      }
      const auto fwd = Clock::now();
      for (int64_t b = 0; b < L; b += chunk) {
        const model::CudaSequence s{id, std::span(ids).subspan(b, std::min(chunk, L - b))};
        KVR_RETURN_IF_ERROR(gpu->Forward(std::span(&s, 1), model::LogitsMode::kLast, logits));
      }
      const double ms = Ms(Clock::now() - fwd);
      KVR_RETURN_IF_ERROR(gpu->ReleaseSequence(id));
      if (do_export && layers_seen != c.n_layers) {
        return absl::InternalError(absl::StrCat(layers_seen.load(), " layers exported"));
      }
      return ms;
    };
    auto best = [&](bool do_export, double* first_pin) -> absl::StatusOr<double> {
      double b = 1e30;
      for (int r = 0; r <= reps; ++r) {
        double pin = 0;
        KVR_ASSIGN_OR_RETURN(double ms, run(do_export, &pin));
        if (r == 0 && first_pin != nullptr) *first_pin = pin;
        if (r > 0) b = std::min(b, ms);
      }
      return b;
    };
    double first_pin = 0;
    absl::StatusOr<double> fa = best(false, nullptr);
    absl::StatusOr<double> fb = best(true, &first_pin);
    if (!fa.ok() || !fb.ok()) {
      std::fprintf(stderr, "L %lld: %s %s\n", static_cast<long long>(L),
                   fa.status().ToString().c_str(), fb.status().ToString().c_str());
      return 1;
    }
    const double d2h_gb =
        c.n_layers * (2.0 * L * c.kv_dim() + std::min(max_queries, L) * c.q_dim()) * 4 / 1e9;
    std::printf(
        "L %6lld  (a) forward %9.1f ms  (b) +export %9.1f ms  overhead %+6.2f%%  "
        "D2H %.2f GB (%.1f GB/s over (b))  first export pinned %.2f GB in %.0f ms\n",
        static_cast<long long>(L), *fa, *fb, 100 * (*fb / *fa - 1), d2h_gb, d2h_gb / (*fb / 1e3),
        gpu->export_pinned_bytes() / 1e9, first_pin);
    std::fflush(stdout);

    // (c) the engine per method.
    for (const MethodRow& m : method_rows) {
      double best_ms = 1e30, build_ms = 0, tail_ms = 0;
      for (int r = 0; r <= reps; ++r) {
        PrefillJob job;
        job.request_id = absl::StrCat("bench-", next_id);
        job.sequence_id = next_id++;
        job.store_capability = kv_store::Capability::Generate();
        job.prompt = TokenPrompt{ids};
        job.sampling.set_max_tokens(1);  // no handoff: the store sequence is released at once
        job.retrieval.set_method(m.method);
        if (budget > 0) job.retrieval.set_budget(static_cast<uint32_t>(budget));
        for (const auto& [name, value] : m.options) {
          (*job.retrieval.mutable_options())[name] = value;
        }
        timing.Reset();
        auto result = engine.Run(job);
        if (!result.ok()) {
          std::fprintf(stderr, "L %lld %s: %s\n", static_cast<long long>(L), m.label.c_str(),
                       result.status().ToString().c_str());
          return 1;
        }
        const double ms = absl::ToDoubleMilliseconds(result->prefill_time);
        if (r > 0 && ms < best_ms) {
          best_ms = ms;
          build_ms = timing.build_ms();
          tail_ms = Ms(timing.last_ready() - timed->forward_end);
        }
        // One slow method at a long prompt would take the device call's time: one rep then.
        if (r == 0 && ms > 20000) {
          best_ms = ms;
          build_ms = timing.build_ms();
          tail_ms = Ms(timing.last_ready() - timed->forward_end);
          std::printf("  (%s: warm-up took %.1f s; printing it, no further reps)\n",
                      m.label.c_str(), ms / 1e3);
          break;
        }
      }
      std::printf(
          "L %6lld  (c) engine %-36s store %-7s %9.1f ms  overhead over (a) %+7.2f%%  "
          "index builds (sum of layers) %9.1f ms  last layer ready %+8.1f ms after the "
          "forward\n",
          static_cast<long long>(L), m.label.c_str(), store_kind.c_str(), best_ms,
          100 * (best_ms / *fa - 1), build_ms, tail_ms);
      std::fflush(stdout);
    }

    // (d) prefix reuse: a request for the prompt's first prefix_tokens tokens ends well and
    // its sequence is kept; then each method's request for the whole prompt, cold and from
    // that sequence, interleaved. Times: Run's wall time (with max_tokens 1, the time to the
    // first token: the store fork and the prefix's reads included) and the engine's
    // prefill_time.
    if (prefix_tokens <= 0 || prefix_tokens >= L) continue;
    const uint64_t parent_id = next_id++;
    const kv_store::Capability parent_cap = kv_store::Capability::Generate();
    auto make_job = [&](uint64_t id, std::span<const int32_t> prompt, const MethodRow& m) {
      PrefillJob job;
      job.request_id = absl::StrCat("bench-", id);
      job.sequence_id = id;
      job.store_capability = kv_store::Capability::Generate();
      job.prompt = TokenPrompt{std::vector<int32_t>(prompt.begin(), prompt.end())};
      job.sampling.set_max_tokens(1);
      job.retrieval.set_method(m.method);
      if (budget > 0) job.retrieval.set_budget(static_cast<uint32_t>(budget));
      for (const auto& [name, value] : m.options) (*job.retrieval.mutable_options())[name] = value;
      return job;
    };
    {
      PrefillJob parent =
          make_job(parent_id, std::span(ids).first(static_cast<size_t>(prefix_tokens)),
                   MethodRow{"full", "full", {}});
      parent.store_capability = parent_cap;
      parent.retain = absl::Hours(1);
      auto made = engine.Run(parent);
      if (!made.ok()) {
        std::fprintf(stderr, "prefix of %lld: %s\n", static_cast<long long>(prefix_tokens),
                     made.status().ToString().c_str());
        return 1;
      }
    }
    for (const MethodRow& m : method_rows) {
      double cold_run = 1e30, cold_prefill = 1e30, warm_run = 1e30, warm_prefill = 1e30;
      uint32_t cached = 0;
      int32_t cold_token = -1, warm_token = -2;
      double warm_load = 0, warm_backend = 0;  // of the best warm run
      for (int r = 0; r <= reps; ++r) {
        for (const bool warm : {false, true}) {
          PrefillJob job = make_job(next_id++, ids, m);
          if (warm) {
            job.prefix = {parent_id, parent_cap};
            job.prefix_tokens = static_cast<uint32_t>(prefix_tokens);
          }
          const auto start = Clock::now();
          auto result = engine.Run(job);
          const double run_ms = Ms(Clock::now() - start);
          if (!result.ok()) {
            std::fprintf(stderr, "L %lld %s (d) %s: %s\n", static_cast<long long>(L),
                         m.label.c_str(), warm ? "warm" : "cold",
                         result.status().ToString().c_str());
            return 1;
          }
          const double prefill_ms = absl::ToDoubleMilliseconds(result->prefill_time);
          (warm ? warm_token : cold_token) = result->first_token;
          if (warm) cached = result->cached_tokens;
          if (r == 0) continue;  // warm-up
          double& best_run = warm ? warm_run : cold_run;
          double& best_prefill = warm ? warm_prefill : cold_prefill;
          if (warm && run_ms < best_run) {
            warm_load = timed->load_ms;
            warm_backend = timed->prefill_ms;
          }
          best_run = std::min(best_run, run_ms);
          best_prefill = std::min(best_prefill, prefill_ms);
        }
      }
      std::printf(
          "L %6lld  (d) %-10s prefix %lld cached %u: cold run %9.1f ms (prefill %9.1f)  "
          "from the prefix run %9.1f ms (prefill %9.1f; backend %7.1f, of which loading the "
          "rows %7.1f)  = %.1f%% of cold  first token %s\n",
          static_cast<long long>(L), m.label.c_str(), static_cast<long long>(prefix_tokens), cached,
          cold_run, cold_prefill, warm_run, warm_prefill, warm_backend, warm_load,
          100 * warm_run / cold_run, cold_token == warm_token ? "equal" : "DIFFERS");
      std::fflush(stdout);
    }
    if (absl::Status s = store->get()->Release({parent_id, parent_cap}, absl::ZeroDuration());
        !s.ok()) {
      std::fprintf(stderr, "release of the prefix: %s\n", s.ToString().c_str());
    }
  }
  return 0;
}

}  // namespace
}  // namespace kvr::prefill_node

int main(int argc, char** argv) { return kvr::prefill_node::Main(argc, argv); }
