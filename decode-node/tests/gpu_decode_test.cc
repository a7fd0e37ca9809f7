// DecodeEngine on the CUDA backend against the same engine on the CPU backend, on a dummy-weight
// model (smollm2 shape, 4 layers; the same host weights for both), each with its own
// FakeKvStoreClient holding the CPU prefill's rows (MakeLocalHandoff: the prefill node's part;
// float32 rows for the CPU engine, bf16 for the CUDA engine, which reads them in place from the
// store's pages), three sequences in two slots (the third joins when one leaves), 32 greedy
// tokens each, n_sink 4 and a window of 16: the first 16 generated rows leave the window and are
// read back from the store, where the CUDA backend appended them.
//
// - Budget 512 >= every context: both engines attend over every row, i.e. both equal dense.
//   The GPU computes in bf16 (weights, GEMM inputs, KV) where the CPU is float32, so the two
//   token streams may part at a near tie. What must hold: every token the CUDA engine chose is
//   a greedy choice of the CPU model (dense, float32) on the CUDA engine's own prefix within
//   the tolerance of model_cuda_model_test (its CPU logit within 0.2 x the logits' RMS of the
//   maximum: 2 x the 0.1 x RMS a GPU logit may be off by). Agreement with the CPU engine's
//   tokens is reported, and until the first parting the streams must be equal.
// - Budget 16 (one quest page): both complete 32 tokens; agreement reported only.
// - A handoff that does not fit the node (another method, a bigger budget) is refused at Admit;
//   every store sequence is released at the end.
// CTest label `gpu`.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <vector>

#include "gtest/gtest.h"
#include "kvr/common/thread_pool.h"
#include "kvr/decode/cuda_backend.h"
#include "kvr/decode/engine.h"
#include "kvr/decode/local_handoff.h"
#include "kvr/model/cuda_model.h"
#include "kvr/model/dense_attention.h"
#include "kvr/model/dummy.h"
#include "kvr/model/sampler.h"
#include "kvr/model/weights.h"
#include "kvr/retrieval/all_methods.h"
#include "kvr/retrieval/codebook.h"
#include "test_util.h"

namespace kvr::decode {
namespace {

constexpr int kSink = 4, kWindow = 16, kSlots = 2;
constexpr uint32_t kMaxTokens = 33;  // the prefill's first token + 32 decoded
constexpr double kTieOverRms = 0.2;

// Sums what the CUDA backend reports per step (what kvr-decode's Prometheus metrics export).
class CountingObserver final : public DecodeObserver {
 public:
  void OnRetrieval(std::string_view, const RetrievalReport& r) override {
    hits += r.hot_cache_hits;
    misses += r.hot_cache_misses;
    bytes_fetched += r.bytes_fetched;
  }
  void OnOffload(int64_t bytes) override { offloaded += bytes; }
  int64_t hits = 0, misses = 0, bytes_fetched = 0, offloaded = 0;
};

// Dense attention that also keeps each layer's queries of the last `n` prompt positions (what a
// prefill node hands the index builds: ctkvr's centroids come from them).
class QueryCapture final : public model::Attention {
 public:
  QueryCapture(model::Attention* inner, int64_t prompt, int64_t n, int n_layers, int64_t q_row)
      : inner_(inner), first_(prompt - std::min(n, prompt)), q_row_(q_row), queries(n_layers) {
    for (auto& q : queries) q.assign(static_cast<size_t>((prompt - first_) * q_row), 0.f);
  }
  absl::Status Attend(const model::AttentionShape& shape,
                      std::span<const model::AttentionRequest> batch) override {
    for (const model::AttentionRequest& r : batch) {
      for (int64_t i = 0; i < r.n_queries; ++i) {
        const int64_t pos = r.first_position + i;
        if (pos < first_) continue;
        std::copy_n(r.q + i * q_row_, q_row_, queries[r.layer].data() + (pos - first_) * q_row_);
      }
    }
    return inner_->Attend(shape, batch);
  }

 private:
  model::Attention* inner_;
  int64_t first_, q_row_;

 public:
  std::vector<std::vector<float>> queries;  // [n_layers][n, n_heads, head_dim]
};

class GpuDecodeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!model::CudaModelAvailable()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
    auto config = model::DummyConfig("smollm2-135m", 4);
    ASSERT_TRUE(config.ok());
    auto weights = model::RandomWeights(*config, 5, &pool_);
    ASSERT_TRUE(weights.ok());
    auto cpu = model::Model::Create(*config, std::move(*weights), &pool_);
    ASSERT_TRUE(cpu.ok());
    cpu_ = std::move(*cpu);
    registry_ = *retrieval::AllMethods();
  }

  std::unique_ptr<DecodeEngine> CpuEngine() {
    auto e = DecodeEngine::Create(cpu_.get(), nullptr, &registry_,
                                  {.batch_slots = kSlots, .hot_cache_bytes = 1 << 20});
    EXPECT_TRUE(e.ok()) << e.status();
    return std::move(*e);
  }

  std::unique_ptr<DecodeEngine> CudaEngine(int budget, const std::string& method = "quest",
                                           DecodeObserver* observer = nullptr,
                                           std::vector<std::string> lanes = {},
                                           const std::string& row_source = "in-place",
                                           double hot_cache_fraction = 0,
                                           int64_t hot_cache_bytes = 1 << 20,
                                           int64_t dense_max_tokens = 0, int64_t dense_bytes = 0) {
    model::CudaModelOptions mo;
    mo.max_batch_tokens = 2 * kSlots;  // a mixed batch: dense rows beside every sparse slot
    mo.max_sequences = kSlots;
    mo.max_logits_rows = kSlots;
    auto gpu = model::CreateCudaModel(cpu_->config(), cpu_->weights(), mo);
    EXPECT_TRUE(gpu.ok()) << gpu.status();
    CudaDecodeBackendOptions o;
    o.slots = kSlots;
    o.budget = budget;
    o.method = method;
    o.n_sink = kSink;
    o.local_window = kWindow;
    o.max_context = 512;
    o.hot_cache_bytes = hot_cache_bytes;
    o.registry = &registry_;
    o.lanes = std::move(lanes);
    o.method_assets = codebooks_;
    o.row_source = row_source;
    o.hot_cache_fraction = hot_cache_fraction;
    o.dense_max_tokens = dense_max_tokens;
    o.dense_bytes = dense_bytes;
    o.row_format = row_format_;
    auto backend = CreateCudaDecodeBackend(*std::move(gpu), o, observer);
    EXPECT_TRUE(backend.ok()) << backend.status();
    EXPECT_EQ((*backend)->name(), "cuda:0");
    auto e = DecodeEngine::Create(*std::move(backend), nullptr, {.batch_slots = kSlots});
    EXPECT_TRUE(e.ok()) << e.status();
    return std::move(*e);
  }

  // a2ats codebooks of this model (64 codewords per head from two 400-token prompts), built
  // once; the engines made after it get them as their method assets.
  std::shared_ptr<const retrieval::MethodAssets> Codebooks() {
    if (codebooks_ != nullptr) return codebooks_;
    auto fingerprint = retrieval::FingerprintOf(*cpu_);
    EXPECT_TRUE(fingerprint.ok()) << fingerprint.status();
    retrieval::CodebookParams params;
    params.codebook_size = 64;
    auto samples = retrieval::CalibrationSamples::Create(*fingerprint, params);
    EXPECT_TRUE(samples.ok()) << samples.status();
    const std::vector<std::vector<int32_t>> text = {Prompt(400, 11), Prompt(400, 12)};
    const absl::Status collected = retrieval::CollectCalibrationSamples(*cpu_, text, *samples);
    EXPECT_TRUE(collected.ok()) << collected;
    auto books = retrieval::BuildCodebooks(*samples, &pool_);
    EXPECT_TRUE(books.ok()) << books.status();
    codebooks_ = *books;
    return codebooks_;
  }

  std::vector<int32_t> Prompt(int n, uint64_t seed) {
    std::vector<int32_t> ids(n);
    uint64_t x = seed;
    for (int32_t& v : ids) {
      x = x * 6364136223846793005ULL + 1442695040888963407ULL;
      v = static_cast<int32_t>((x >> 33) % static_cast<uint64_t>(cpu_->config().vocab));
    }
    return ids;
  }

  Handoff MakeHandoff(kv_store::KvStoreClient& store, uint64_t id,
                      const std::vector<int32_t>& prompt, int budget,
                      const std::string& method = "quest",
                      kv_store::DType dtype = kv_store::DType::kBf16) {
    model::DenseAttention dense(&pool_);
    const model::ModelConfig& c = cpu_->config();
    // The last 64 queries, as a prefill node keeps its last max_prefill_queries.
    QueryCapture capture(&dense, static_cast<int64_t>(prompt.size()), 64, c.n_layers,
                         int64_t{c.n_heads} * c.head_dim);
    model::KvCache cache = cpu_->NewCache();
    auto logits = cpu_->Prefill(id, cache, prompt, capture);
    EXPECT_TRUE(logits.ok());
    LocalHandoffOptions o;
    if (method == "ctkvr") o.queries = std::move(capture.queries);
    o.sequence_id = id;
    o.method = method;
    o.params.budget = budget;
    o.params.n_sink = kSink;
    o.params.local_window = kWindow;
    o.sampling.max_tokens = kMaxTokens;
    o.first_token = model::ArgMax(*logits);
    o.store_dtype = dtype;
    if (method == "a2ats") o.params.assets = Codebooks();
    auto h = MakeLocalHandoff(*cpu_, cache, registry_, store, o);
    EXPECT_TRUE(h.ok()) << h.status();
    return std::move(*h);
  }

  // Runs the prompts through `engine` (handoffs into `store`); tokens after the first.
  std::map<uint64_t, std::vector<int32_t>> Run(DecodeEngine& engine,
                                               kv_store::FakeKvStoreClient& store,
                                               const std::vector<std::vector<int32_t>>& prompts,
                                               int budget, std::vector<int32_t>* first,
                                               const std::vector<std::string>& methods,
                                               kv_store::DType dtype) {
    std::vector<uint64_t> ids;
    first->clear();
    for (size_t i = 0; i < prompts.size(); ++i) {
      Handoff h = MakeHandoff(store, 40 + i, prompts[i], budget, methods[i % methods.size()], dtype);
      first->push_back(h.first_token);
      const absl::Status s = engine.Admit(std::move(h));
      EXPECT_TRUE(s.ok()) << s;
      ids.push_back(40 + i);
    }
    std::map<uint64_t, std::vector<int32_t>> tokens;
    std::map<uint64_t, bool> done;
    for (int guard = 0; guard < 1000 && done.size() < ids.size(); ++guard) {
      engine.Step();
      for (uint64_t id : ids) {
        if (done.contains(id)) continue;
        absl::StatusOr<StreamChunk> chunk = engine.Next(id, absl::Now());
        if (!chunk.ok()) {
          ADD_FAILURE() << "sequence " << id << ": " << chunk.status();
          done[id] = true;
          continue;
        }
        auto& t = tokens[id];
        t.insert(t.end(), chunk->tokens.begin(), chunk->tokens.end());
        if (chunk->completion) {
          EXPECT_EQ(chunk->completion->reason, FinishReason::kLength);
          EXPECT_EQ(chunk->completion->completion_tokens, kMaxTokens);
          done[id] = true;
        }
      }
    }
    EXPECT_EQ(done.size(), ids.size());
    EXPECT_EQ(store.Stats()->sequences, 0u) << "store sequences left";
    return tokens;
  }

  // Largest (max logit - logit of the chosen token) / RMS over the steps, the CPU model dense on
  // prompt + first + `tokens` (teacher-forced).
  double WorstGap(const std::vector<int32_t>& prompt, int32_t first,
                  const std::vector<int32_t>& tokens) {
    std::vector<int32_t> all = prompt;
    all.push_back(first);
    all.insert(all.end(), tokens.begin(), tokens.end());
    model::DenseAttention dense(&pool_);
    model::KvCache cache = cpu_->NewCache();
    const int vocab = cpu_->config().vocab;
    auto prefill = cpu_->Prefill(1, cache, std::span(all).first(prompt.size() + 1), dense);
    EXPECT_TRUE(prefill.ok());
    std::vector<float> logits = *prefill;
    double worst = 0;
    for (size_t i = 0; i < tokens.size(); ++i) {
      double ss = 0;
      for (float v : logits) ss += double{v} * v;
      const double rms = std::sqrt(ss / vocab);
      const float top = logits[model::ArgMax(logits)];
      worst = std::max(worst, (top - logits[tokens[i]]) / rms);
      if (i + 1 == tokens.size()) break;
      model::ForwardSequence s{1, &cache, std::span(&tokens[i], 1)};
      EXPECT_TRUE(cpu_->Forward(std::span(&s, 1), dense, model::LogitsMode::kLast, logits).ok());
    }
    return worst;
  }

  ThreadPool pool_{4};
  std::unique_ptr<model::Model> cpu_;
  retrieval::MethodRegistry registry_;
  std::shared_ptr<const retrieval::MethodAssets> codebooks_;  // Codebooks()
  std::string row_format_ = "bf16";  // CudaEngine's CudaDecodeBackendOptions::row_format
};

// clusterkv: the CUDA backend uploads the handed-off clusters (the CPU index's k-means); at
// budget 512 every candidate is selected, so a cluster table that lost or repeated a token
// would show as a wrong attention.
TEST_F(GpuDecodeTest, CudaEngineMatchesCpuEngine) {
  const std::vector<std::vector<int32_t>> prompts = {Prompt(300, 1), Prompt(170, 2),
                                                     Prompt(233, 3)};
  for (const std::string method : {"quest", "clusterkv"})
    for (int budget : {512, 16}) {
      SCOPED_TRACE(method + " " + std::to_string(budget));
      auto cpu_store = testing::MakeFakeStore(256 << 20);
      auto gpu_store = testing::MakeFakeStore(256 << 20);
      auto cpu_engine = CpuEngine();
      CountingObserver observed;
      auto gpu_engine = CudaEngine(budget, method, &observed);
      std::vector<int32_t> first_cpu, first_gpu;
      auto want = Run(*cpu_engine, *cpu_store, prompts, budget, &first_cpu, {method},
                      kv_store::DType::kF32);
      auto got = Run(*gpu_engine, *gpu_store, prompts, budget, &first_gpu, {method},
                     kv_store::DType::kBf16);
      ASSERT_EQ(first_cpu, first_gpu);  // the CPU prefill's, both sides
      for (size_t i = 0; i < prompts.size(); ++i) {
        const uint64_t id = 40 + i;
        ASSERT_EQ(got[id].size(), kMaxTokens - 1) << "sequence " << i;
        ASSERT_EQ(want[id].size(), kMaxTokens - 1) << "sequence " << i;
        size_t agree = 0, prefix = 0;
        for (size_t t = 0; t < want[id].size(); ++t) agree += want[id][t] == got[id][t];
        while (prefix < want[id].size() && want[id][prefix] == got[id][prefix]) ++prefix;
        if (budget >= 512) {
          const double gap = WorstGap(prompts[i], first_gpu[i], got[id]);
          EXPECT_LE(gap, kTieOverRms) << "sequence " << i << ": a CUDA token is not a greedy "
                                      << "choice of the CPU model within the tolerance";
          std::printf(
              "[ engine ] %-9s budget %3d seq %zu (prompt %3zu): %2zu/%zu tokens equal to "
              "the CPU engine, first %zu equal; worst CPU gap of a CUDA token %.4f x rms\n",
              method.c_str(), budget, i, prompts[i].size(), agree, want[id].size(), prefix, gap);
        } else {
          std::printf(
              "[ engine ] %-9s budget %3d seq %zu (prompt %3zu): %2zu/%zu tokens equal to "
              "the CPU engine, first %zu equal (small budget: the selections differ)\n",
              method.c_str(), budget, i, prompts[i].size(), agree, want[id].size(), prefix);
        }
      }
      // Per sequence: every decode step's rows appended to the store (all layers and KV heads);
      // selections split into hot-cache hits and misses, and only misses crossed the link.
      const NodeCounters n = gpu_engine->node_counters();
      const model::ModelConfig& c = cpu_->config();
      EXPECT_EQ(n.retrieval.rows_offloaded,
                int64_t{3} * (kMaxTokens - 1) * c.n_layers * c.n_kv_heads);
      EXPECT_GT(n.retrieval.selected_rows, 0);
      EXPECT_EQ(n.retrieval.hot_cache_hits + n.retrieval.hot_cache_misses,
                n.retrieval.selected_rows);
      EXPECT_GT(n.retrieval.hot_cache_hits, 0) << "consecutive steps select overlapping rows";
      EXPECT_EQ(n.retrieval.rows_fetched, n.retrieval.hot_cache_misses);
      EXPECT_EQ(n.retrieval.bytes_fetched, n.retrieval.rows_fetched * 4 * c.head_dim);
      // The per-step reports add up to the per-sequence counters.
      EXPECT_EQ(observed.hits, n.retrieval.hot_cache_hits);
      EXPECT_EQ(observed.misses, n.retrieval.hot_cache_misses);
      EXPECT_EQ(observed.bytes_fetched, n.retrieval.bytes_fetched);
      EXPECT_EQ(observed.offloaded, n.retrieval.rows_offloaded * 4 * c.head_dim);
      EXPECT_GT(n.attend_calls, 0);
    }
}

// A node with gpu_row_format fp8 over store sequences of the fp8 dtype (the store encodes the
// handoff's bf16 rows and the generated ones): at budget 512 every candidate is attended, and each
// CUDA token must be a greedy choice of the dense CPU model (float32 KV) on its own prefix within
// the same tolerance as bf16 rows (fp8 moves each K and V value by up to ~6%, the logits far
// less); agreement with a bf16 node's tokens is reported. Every missed row crossed the link at
// the fp8 row's 136 bytes (head_dim 64). A bf16 store sequence is refused with the reason.
// (Fetched fp8 rows: FetchedRowsGiveTheTokensOfRowsReadInPlace.)
TEST_F(GpuDecodeTest, Fp8RowsDecodeOnTheNode) {
  const std::vector<std::vector<int32_t>> prompts = {Prompt(300, 1), Prompt(170, 2),
                                                     Prompt(233, 3)};
  const model::ModelConfig& c = cpu_->config();
  const int64_t fp8_row = static_cast<int64_t>(
      kv_store::RowBytes(kv_store::DType::kFp8E4m3, static_cast<uint32_t>(c.head_dim)));
  for (const std::string method : {"quest", "clusterkv"})
    for (int budget : {512, 16}) {
      SCOPED_TRACE(method + " " + std::to_string(budget));
      auto bf16_store = testing::MakeFakeStore(256 << 20);
      auto fp8_store = testing::MakeFakeStore(256 << 20);
      row_format_ = "bf16";
      auto bf16_engine = CudaEngine(budget, method);
      row_format_ = "fp8";
      CountingObserver observed;
      auto fp8_engine = CudaEngine(budget, method, &observed);
      row_format_ = "bf16";
      std::vector<int32_t> first_bf16, first_fp8;
      auto want = Run(*bf16_engine, *bf16_store, prompts, budget, &first_bf16, {method},
                      kv_store::DType::kBf16);
      auto got = Run(*fp8_engine, *fp8_store, prompts, budget, &first_fp8, {method},
                     kv_store::DType::kFp8E4m3);
      ASSERT_EQ(first_bf16, first_fp8);  // the CPU prefill's, both sides
      for (size_t i = 0; i < prompts.size(); ++i) {
        const uint64_t id = 40 + i;
        ASSERT_EQ(got[id].size(), kMaxTokens - 1) << "sequence " << i;
        size_t agree = 0;
        for (size_t t = 0; t < want[id].size(); ++t) agree += want[id][t] == got[id][t];
        const double gap = budget >= 512 ? WorstGap(prompts[i], first_fp8[i], got[id]) : -1;
        if (budget >= 512) {
          EXPECT_LE(gap, kTieOverRms) << "sequence " << i << ": an fp8 token is not a greedy "
                                      << "choice of the CPU model within the tolerance";
        }
        std::printf(
            "[ fp8    ] %-9s budget %3d seq %zu: %2zu/%zu tokens equal to the bf16 node's; "
            "worst CPU gap %.4f x rms\n",
            method.c_str(), budget, i, agree, want[id].size(), gap);
      }
      const NodeCounters n = fp8_engine->node_counters();
      EXPECT_GT(n.retrieval.hot_cache_hits, 0);
      EXPECT_EQ(n.retrieval.rows_fetched, n.retrieval.hot_cache_misses);
      EXPECT_EQ(n.retrieval.bytes_fetched, n.retrieval.rows_fetched * fp8_row);
      EXPECT_EQ(observed.bytes_fetched, n.retrieval.bytes_fetched);
      EXPECT_EQ(n.retrieval.rows_offloaded,
                int64_t{3} * (kMaxTokens - 1) * c.n_layers * c.n_kv_heads);
    }
  // A bf16 sequence on the fp8 node: refused, with the reason.
  auto store = testing::MakeFakeStore(64 << 20);
  row_format_ = "fp8";
  auto engine = CudaEngine(64);
  row_format_ = "bf16";
  const absl::Status s = engine->Admit(MakeHandoff(*store, 9, Prompt(100, 4), 64));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("rows are bf16"), std::string::npos) << s;
  EXPECT_NE(s.message().find("gpu_row_format fp8"), std::string::npos) << s;
}

// The node reads bf16 rows in place: a store sequence of float32 rows, or one whose prompt rows
// are not all in the store, is refused at admission with the reason, and nothing is left held.
TEST_F(GpuDecodeTest, RefusesStoreSequencesItCannotRead) {
  auto store = testing::MakeFakeStore(64 << 20);
  auto engine = CudaEngine(64);
  Handoff h = MakeHandoff(*store, 9, Prompt(100, 4), 64, "quest", kv_store::DType::kF32);
  absl::Status s = engine->Admit(std::move(h));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("rows are f32"), std::string::npos) << s;
  h = MakeHandoff(*store, 10, Prompt(100, 4), 64);
  h.prompt_tokens += 5;  // more than the store holds
  s = engine->Admit(std::move(h));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("prompt_tokens"), std::string::npos) << s;
}

// A store that fails mid-decode (its appends of the generated rows fail) ends the sequence with
// UNAVAILABLE at the next step; the engine keeps running.
TEST_F(GpuDecodeTest, StoreFailureMidDecodeEndsTheSequenceUnavailable) {
  auto store = testing::MakeFakeStore(64 << 20);
  auto engine = CudaEngine(64);
  ASSERT_TRUE(engine->Admit(MakeHandoff(*store, 11, Prompt(120, 5), 64)).ok());
  for (int i = 0; i < 3; ++i) engine->Step();
  absl::StatusOr<StreamChunk> before = engine->Next(11, absl::Now());
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_FALSE(before->tokens.empty());
  store->InjectFailure(absl::UnavailableError("the store went away"));
  absl::Status end;
  for (int guard = 0; guard < 20 && end.ok(); ++guard) {
    engine->Step();
    absl::StatusOr<StreamChunk> chunk = engine->Next(11, absl::Now());
    if (!chunk.ok()) end = chunk.status();
    ASSERT_FALSE(chunk.ok() && chunk->completion.has_value()) << "finished despite the failure";
  }
  EXPECT_EQ(end.code(), absl::StatusCode::kUnavailable) << end;
  EXPECT_NE(end.message().find("store"), std::string::npos) << end;
}

// Rows fetched through the store client (gpu_row_source fetch: what a store on another host
// gets), against the same sequences with their rows read in place: the same selection over the
// same rows must give the same tokens, for the GPU method from its handed-off clusters
// (clusterkv) and for host-selected methods; quest, whose GPU summaries would read every key,
// is selected on the host by its index when fetched, so at budget 512 (dense) its tokens are
// checked as greedy choices of the dense CPU model. What crossed the link is exactly the sink
// and window rows at activation plus the hot-cache misses, at the stored row's size. Both with
// bf16 and with fp8 store rows (fetched fp8 rows: the ring decoded on the host, the misses by the
// hot cache, as the rows read in place are decoded on the GPU: the same bf16 values).
TEST_F(GpuDecodeTest, FetchedRowsGiveTheTokensOfRowsReadInPlace) {
  const std::vector<std::vector<int32_t>> prompts = {Prompt(300, 1), Prompt(170, 2),
                                                     Prompt(233, 3)};
  const model::ModelConfig& c = cpu_->config();
  int64_t ring_rows = 0;  // sink + window rows of every prompt, layer and KV head
  for (const auto& p : prompts) {
    const int64_t n = static_cast<int64_t>(p.size());
    ring_rows += (std::min<int64_t>(kSink, n) + n - std::max<int64_t>(kSink, n - kWindow)) *
                 c.n_layers * c.n_kv_heads;
  }
  for (const std::string format : {"bf16", "fp8"})
    for (const std::string method : {"clusterkv", "exact", "keydiff", "quest"})
      for (int budget : {512, 16}) {
        SCOPED_TRACE(format + " " + method + " " + std::to_string(budget));
        const kv_store::DType dtype =
            format == "fp8" ? kv_store::DType::kFp8E4m3 : kv_store::DType::kBf16;
        const std::string node_method = method == "clusterkv" ? "clusterkv" : "quest";
        auto place_store = testing::MakeFakeStore(256 << 20);
        auto fetch_store = testing::MakeFakeStore(256 << 20);
        CountingObserver seen;
        row_format_ = format;
        auto in_place = CudaEngine(512, node_method);
        auto fetched = CudaEngine(512, node_method, &seen, {}, "fetch");
        row_format_ = "bf16";
        std::vector<int32_t> first_a, first_b;
        auto want = Run(*in_place, *place_store, prompts, budget, &first_a, {method}, dtype);
        auto got = Run(*fetched, *fetch_store, prompts, budget, &first_b, {method}, dtype);
        for (size_t i = 0; i < prompts.size(); ++i) {
          const uint64_t id = 40 + i;
          ASSERT_EQ(got[id].size(), kMaxTokens - 1) << "sequence " << i;
          if (method == "quest") {
            if (budget >= 512) {
              EXPECT_LE(WorstGap(prompts[i], first_b[i], got[id]), kTieOverRms) << "sequence " << i;
            }
          } else {
            EXPECT_EQ(got[id], want[id]) << "sequence " << i;
          }
        }
        const NodeCounters n = fetched->node_counters();
        EXPECT_GT(n.retrieval.hot_cache_misses, 0);
        EXPECT_EQ(n.retrieval.rows_fetched, ring_rows + n.retrieval.hot_cache_misses);
        EXPECT_EQ(seen.bytes_fetched,
                  n.retrieval.rows_fetched * static_cast<int64_t>(kv_store::RowBytes(
                                                 dtype, static_cast<uint32_t>(c.head_dim))));
        if (method != "quest") {
          const NodeCounters m = in_place->node_counters();
          EXPECT_EQ(n.retrieval.selected_rows, m.retrieval.selected_rows);
          EXPECT_EQ(n.retrieval.hot_cache_hits, m.retrieval.hot_cache_hits);
        }
        std::printf(
            "[ fetched ] %-4s %-9s budget %3d: rows fetched %lld (ring %lld + misses %lld "
            "of %lld selected)\n",
            format.c_str(), method.c_str(), budget,
            static_cast<long long>(n.retrieval.rows_fetched), static_cast<long long>(ring_rows),
            static_cast<long long>(n.retrieval.hot_cache_misses),
            static_cast<long long>(n.retrieval.selected_rows));
      }
}

// A store that fails while a fetched sequence decodes ends that sequence with UNAVAILABLE and
// nothing else: a sequence of another store in the same batch completes.
TEST_F(GpuDecodeTest, FetchFromADeadStoreEndsOnlyItsSequences) {
  auto dying = testing::MakeFakeStore(64 << 20);
  auto healthy = testing::MakeFakeStore(64 << 20);
  auto engine = CudaEngine(64, "quest", nullptr, {}, "fetch");
  ASSERT_TRUE(engine->Admit(MakeHandoff(*dying, 11, Prompt(120, 5), 64, "exact")).ok());
  ASSERT_TRUE(engine->Admit(MakeHandoff(*healthy, 12, Prompt(140, 6), 64, "exact")).ok());
  for (int i = 0; i < 3; ++i) engine->Step();
  dying->InjectFailure(absl::UnavailableError("the store went away"));
  absl::Status end;
  bool completed = false;
  size_t healthy_tokens = 0;
  for (int guard = 0; guard < 100 && !completed; ++guard) {
    engine->Step();
    if (end.ok()) {
      absl::StatusOr<StreamChunk> chunk = engine->Next(11, absl::Now());
      if (!chunk.ok()) end = chunk.status();
      ASSERT_FALSE(chunk.ok() && chunk->completion.has_value()) << "finished despite the failure";
    }
    absl::StatusOr<StreamChunk> other = engine->Next(12, absl::Now());
    ASSERT_TRUE(other.ok()) << other.status();
    healthy_tokens += other->tokens.size();
    completed = other->completion.has_value();
  }
  EXPECT_EQ(end.code(), absl::StatusCode::kUnavailable) << end;
  EXPECT_NE(end.message().find("store"), std::string::npos) << end;
  EXPECT_TRUE(completed);
  EXPECT_EQ(healthy_tokens, kMaxTokens - 1);
}

// Every other method of the registry on a quest node: selected on the host by the method's CPU
// index (the same code the CPU engine runs), gathered and attended on the GPU. At budget 512
// (above every context) full, exact and clusterkv select every candidate: each CUDA token must
// be a greedy choice of the dense CPU model, as for the GPU methods. Every method completes its
// 32 tokens at 512 and at 16; streaming selects nothing; the generated rows that leave the
// window reach each method's index (a gap there fails the step with INTERNAL). ctkvr is not
// here: its index is built from the prefill's queries, which MakeLocalHandoff does not keep (the
// GPU cluster run of scripts/device/gpu-cluster.sh serves it through a real prefill node).
TEST_F(GpuDecodeTest, HostSelectedMethodsRunOnTheGpuStep) {
  const std::vector<std::vector<int32_t>> prompts = {Prompt(300, 1), Prompt(170, 2),
                                                     Prompt(233, 3)};
  for (const std::string method :
       {"full", "exact", "clusterkv", "streaming", "pariskv", "keydiff"})
    for (int budget : {512, 16}) {
      if (method == "full" && budget < 512) continue;  // full has no budget
      SCOPED_TRACE(method + " " + std::to_string(budget));
      auto cpu_store = testing::MakeFakeStore(256 << 20);
      auto gpu_store = testing::MakeFakeStore(256 << 20);
      auto cpu_engine = CpuEngine();
      auto gpu_engine = CudaEngine(512, "quest");
      std::vector<int32_t> first_cpu, first_gpu;
      auto want = Run(*cpu_engine, *cpu_store, prompts, budget, &first_cpu, {method},
                      kv_store::DType::kF32);
      auto got = Run(*gpu_engine, *gpu_store, prompts, budget, &first_gpu, {method},
                     kv_store::DType::kBf16);
      for (size_t i = 0; i < prompts.size(); ++i) {
        const uint64_t id = 40 + i;
        ASSERT_EQ(got[id].size(), kMaxTokens - 1) << "sequence " << i;
        size_t agree = 0;
        for (size_t t = 0; t < want[id].size() && t < got[id].size(); ++t) {
          agree += want[id][t] == got[id][t];
        }
        const bool dense =
            budget >= 512 && method != "streaming" && method != "pariskv" && method != "keydiff";
        const double gap = dense ? WorstGap(prompts[i], first_gpu[i], got[id]) : -1;
        if (dense) {
          EXPECT_LE(gap, kTieOverRms) << "sequence " << i << ": a CUDA token is not a greedy "
                                      << "choice of the CPU model within the tolerance";
        }
        std::printf("[ host-selected ] %-9s budget %3d seq %zu: %2zu/%zu tokens equal to the "
                    "CPU engine%s%.4f\n",
                    method.c_str(), budget, i, agree, want[id].size(),
                    dense ? "; worst CPU gap x rms " : "; not dense, gap not checked ",
                    dense ? gap : 0.0);
      }
      const NodeCounters n = gpu_engine->node_counters();
      const model::ModelConfig& c = cpu_->config();
      EXPECT_EQ(n.retrieval.rows_offloaded,
                int64_t{3} * (kMaxTokens - 1) * c.n_layers * c.n_kv_heads);
      EXPECT_EQ(n.retrieval.hot_cache_hits + n.retrieval.hot_cache_misses,
                n.retrieval.selected_rows);
      if (method == "streaming") {
        EXPECT_EQ(n.retrieval.selected_rows, 0) << "streaming attends sink + window only";
      } else {
        EXPECT_GT(n.retrieval.selected_rows, 0);
      }
      if (method == "full" || (method == "exact" && budget >= 512)) {
        // Every candidate of every step, layer and KV head: sum over the steps of
        // (length - sink - window) per sequence.
        int64_t want_rows = 0;
        for (const auto& p : prompts) {
          for (uint32_t t = 1; t < kMaxTokens; ++t) {
            want_rows += std::max<int64_t>(0, static_cast<int64_t>(p.size()) + t - kSink - kWindow);
          }
        }
        EXPECT_EQ(n.retrieval.selected_rows, want_rows * c.n_layers * c.n_kv_heads);
      }
    }
}

// One batch of sequences with different methods: the GPU method (quest) and two host-selected
// ones, in the node's two slots (the third joins when one leaves); at budget 512 each is dense,
// so each CUDA token must be a greedy choice of the dense CPU model.
TEST_F(GpuDecodeTest, MixesMethodsInOneBatch) {
  const std::vector<std::vector<int32_t>> prompts = {Prompt(300, 1), Prompt(170, 2),
                                                     Prompt(233, 3)};
  auto store = testing::MakeFakeStore(256 << 20);
  auto engine = CudaEngine(512, "quest");
  std::vector<int32_t> first;
  auto got = Run(*engine, *store, prompts, 512, &first, {"exact", "quest", "full"},
                 kv_store::DType::kBf16);
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_EQ(got[40 + i].size(), kMaxTokens - 1) << "sequence " << i;
    EXPECT_LE(WorstGap(prompts[i], first[i], got[40 + i]), kTieOverRms) << "sequence " << i;
  }
}

// The GPU lanes select what the method's CPU index selects when it runs on the host of the
// same node (the same bf16-valued queries and keys), in a batch with a quest sequence, at a
// budget that selects among more candidates than it takes (16) and one above them (512). Tokens
// leave the window (16) during the run, so pariskv's GPU encode and keydiff's GPU scoring are
// exercised.
// - pariskv (ParisKvSelect over the handed-off codes, extended by ParisKvEncode): integer scores,
//   so the same 32 tokens at both budgets.
// - keydiff (the handed-off scores, generated keys scored on the GPU in the host's order and
//   roundings): the same 32 tokens at both budgets.
// - exact (ExactSelect over the store's pages): fp32 sums in another order than the CPU's, so a
//   near-tie may resolve differently at budget 16 (agreement reported); at 512 every candidate is
//   selected: the same tokens. The selected-row counts are the same for both at both budgets.
// - a2ats (A2atsSelect over the handed-off codeword ids, leaving tokens assigned on the GPU):
//   the codeword scores and the assignment's distances are fp32 sums in another order than the
//   CPU's, so as exact: agreement reported at 16, the same tokens at 512.
// - ctkvr (CtkvrSelect over the handed-off qcIVF, its lists grown by the leaving tokens and its
//   oldest entry rotated by the FIFO update on the GPU): the rerank's softmax sums run in another
//   order than the CPU's, so as exact: agreement reported at 16, the same tokens at 512.
TEST_F(GpuDecodeTest, GpuLanesSelectAsTheHostIndex) {
  const std::vector<std::vector<int32_t>> prompts = {Prompt(300, 1), Prompt(170, 2),
                                                     Prompt(233, 3)};
  Codebooks();  // before the engines: they take the codebooks as their method assets
  for (const std::string method : {"pariskv", "keydiff", "exact", "a2ats", "ctkvr"})
    for (int budget : {16, 512}) {
      SCOPED_TRACE(method + " " + std::to_string(budget));
      auto host_store = testing::MakeFakeStore(256 << 20);
      auto lane_store = testing::MakeFakeStore(256 << 20);
      auto host_engine = CudaEngine(512, "quest");
      auto lane_engine =
          CudaEngine(512, "quest", nullptr, {"exact", "pariskv", "keydiff", "a2ats", "ctkvr"});
      std::vector<int32_t> first_host, first_lane;
      auto want = Run(*host_engine, *host_store, prompts, budget, &first_host,
                      {method, "quest", method}, kv_store::DType::kBf16);
      auto got = Run(*lane_engine, *lane_store, prompts, budget, &first_lane,
                     {method, "quest", method}, kv_store::DType::kBf16);
      size_t agree = 0, total = 0;
      for (size_t i = 0; i < prompts.size(); ++i) {
        ASSERT_EQ(got[40 + i].size(), kMaxTokens - 1) << "sequence " << i;
        for (size_t t = 0; t < got[40 + i].size(); ++t) agree += got[40 + i][t] == want[40 + i][t];
        total += got[40 + i].size();
        if ((method != "exact" && method != "a2ats" && method != "ctkvr") || budget >= 512) {
          EXPECT_EQ(got[40 + i], want[40 + i]) << "sequence " << i;
        }
      }
      const NodeCounters a = host_engine->node_counters(), b = lane_engine->node_counters();
      EXPECT_EQ(a.retrieval.selected_rows, b.retrieval.selected_rows);
      // The comparison means something only if the lane ran: two sequences in it, none fell
      // back to the host; none in a lane on the node without lanes.
      EXPECT_EQ(b.lane_sequences, 2);
      EXPECT_EQ(b.lane_fallbacks, 0);
      EXPECT_EQ(a.lane_sequences, 0);
      std::printf("[ gpu lane ] %-7s budget %3d: %zu/%zu tokens equal to the host index's, "
                  "%lld rows selected (host %lld)\n",
                  method.c_str(), budget, agree, total,
                  static_cast<long long>(b.retrieval.selected_rows),
                  static_cast<long long>(a.retrieval.selected_rows));
    }
}

// A clusterkv node reserves room for the clusters its own budget makes (16 per head here, at
// budget 512 over 512 tokens); a request at budget 16 brings 37 per head (L/8 of ~300 tokens),
// so it is selected on the host by the handed-off index, as a quest node selects a clusterkv
// request: both give the same tokens.
TEST_F(GpuDecodeTest, ClusterKvRequestsWithMoreClustersThanRoomAreSelectedOnTheHost) {
  const std::vector<std::vector<int32_t>> prompts = {Prompt(300, 1), Prompt(170, 2),
                                                     Prompt(233, 3)};
  auto over_store = testing::MakeFakeStore(256 << 20);
  auto host_store = testing::MakeFakeStore(256 << 20);
  auto over_engine = CudaEngine(512, "clusterkv");
  auto host_engine = CudaEngine(512, "quest");
  std::vector<int32_t> first_over, first_host;
  auto got = Run(*over_engine, *over_store, prompts, 16, &first_over, {"clusterkv"},
                 kv_store::DType::kBf16);
  auto want = Run(*host_engine, *host_store, prompts, 16, &first_host, {"clusterkv"},
                  kv_store::DType::kBf16);
  ASSERT_EQ(first_over, first_host);
  for (size_t i = 0; i < prompts.size(); ++i) {
    const uint64_t id = 40 + i;
    ASSERT_EQ(got[id].size(), kMaxTokens - 1) << "sequence " << i;
    EXPECT_EQ(got[id], want[id]) << "sequence " << i;
  }
  EXPECT_EQ(over_engine->node_counters().cluster_fallbacks, 3);
  EXPECT_EQ(host_engine->node_counters().cluster_fallbacks, 0);
  // At the node's own budget the clusters fit: the GPU selects them.
  auto fit_store = testing::MakeFakeStore(256 << 20);
  auto fit_engine = CudaEngine(512, "clusterkv");
  std::vector<int32_t> first_fit;
  auto fit =
      Run(*fit_engine, *fit_store, prompts, 512, &first_fit, {"clusterkv"}, kv_store::DType::kBf16);
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(fit[40 + i].size(), kMaxTokens - 1);
  EXPECT_EQ(fit_engine->node_counters().cluster_fallbacks, 0);
}

// A hot cache sized by the GPU's free memory (hot_cache_fraction) instead of a 64 KiB byte
// budget (a few rows per slot, layer and KV head) holds every row the sequences select (up to
// max_context rows): the same tokens, and more of the selected rows come from it.
TEST_F(GpuDecodeTest, HotCacheSizedByFreeGpuMemoryServesMoreRows) {
  const std::vector<std::vector<int32_t>> prompts = {Prompt(300, 1), Prompt(170, 2),
                                                     Prompt(233, 3)};
  auto small_store = testing::MakeFakeStore(256 << 20);
  auto large_store = testing::MakeFakeStore(256 << 20);
  auto small = CudaEngine(64, "quest", nullptr, {}, "in-place", 0, /*hot_cache_bytes=*/64 << 10);
  auto large = CudaEngine(64, "quest", nullptr, {}, "in-place", /*hot_cache_fraction=*/0.01,
                          /*hot_cache_bytes=*/64 << 10);
  std::vector<int32_t> first_small, first_large;
  auto want = Run(*small, *small_store, prompts, 64, &first_small, {"quest"},
                  kv_store::DType::kBf16);
  auto got = Run(*large, *large_store, prompts, 64, &first_large, {"quest"},
                 kv_store::DType::kBf16);
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(got[40 + i], want[40 + i]) << "sequence " << i;
  }
  const NodeCounters a = small->node_counters(), b = large->node_counters();
  EXPECT_EQ(a.retrieval.selected_rows, b.retrieval.selected_rows);
  EXPECT_GT(b.retrieval.hot_cache_hits, a.retrieval.hot_cache_hits);
  std::printf("[ hot cache ] 64 KiB: %lld of %lld selected rows hit; sized by free memory: %lld\n",
              static_cast<long long>(a.retrieval.hot_cache_hits),
              static_cast<long long>(a.retrieval.selected_rows),
              static_cast<long long>(b.retrieval.hot_cache_hits));
}

// Dense when it pays: a short sequence (170 + 33 tokens <= 210) and a `full` request whose rows
// exceed the budget (300 + 33) run densely, their KV in HBM, in the same batches as a sparse
// one (233 + 33 tokens, quest at budget 16). The dense ones' tokens are greedy choices of the
// CPU model running densely (within the tolerance); the sparse one's rows are offloaded as
// before, the dense ones' are not; the dense room comes back when they leave.
TEST_F(GpuDecodeTest, ShortSequencesAndFullRunDenselyBesideSparseOnes) {
  const std::vector<std::vector<int32_t>> prompts = {Prompt(300, 1), Prompt(170, 2),
                                                     Prompt(233, 3)};
  const model::ModelConfig& c = cpu_->config();
  const int64_t per_token = int64_t{c.n_layers} * c.n_kv_heads * c.head_dim * 4;
  auto store = testing::MakeFakeStore(256 << 20);
  // Room for the two dense sequences at once (333 + 203 tokens), not for a third.
  auto engine = CudaEngine(16, "quest", nullptr, {}, "in-place", 0, 1 << 20, 210, 540 * per_token);
  std::vector<int32_t> first;
  auto got =
      Run(*engine, *store, prompts, 16, &first, {"full", "quest", "quest"}, kv_store::DType::kBf16);
  for (size_t i = 0; i < 2; ++i) {
    const uint64_t id = 40 + i;
    ASSERT_EQ(got[id].size(), kMaxTokens - 1) << "sequence " << i;
    const double gap = WorstGap(prompts[i], first[i], got[id]);
    EXPECT_LE(gap, kTieOverRms) << "sequence " << i << " (dense): a token is not a greedy "
                                << "choice of the CPU model";
    std::printf("[ engine ] dense seq %zu (prompt %3zu): worst CPU gap %.4f x rms\n", i,
                prompts[i].size(), gap);
  }
  ASSERT_EQ(got[42].size(), kMaxTokens - 1);
  const NodeCounters n = engine->node_counters();
  EXPECT_EQ(n.dense_sequences, 2);
  EXPECT_EQ(n.retrieval.rows_offloaded, int64_t{kMaxTokens - 1} * c.n_layers * c.n_kv_heads)
      << "only the sparse sequence's generated rows go to the store";
  EXPECT_GT(n.retrieval.selected_rows, 0);
  // The room came back: the same two dense sequences again.
  got = Run(*engine, *store, {prompts[0], prompts[1]}, 16, &first, {"full", "quest"},
            kv_store::DType::kBf16);
  EXPECT_EQ(engine->node_counters().dense_sequences, 4);
}

TEST_F(GpuDecodeTest, RefusesHandoffsThatDoNotFitTheNode) {
  auto store = testing::MakeFakeStore(64 << 20);
  auto engine = CudaEngine(64);
  Handoff h = MakeHandoff(*store, 7, Prompt(100, 9), 128);  // budget above the node's 64
  absl::Status s = engine->Admit(std::move(h));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("gpu_budget 64"), std::string::npos) << s;
  h = MakeHandoff(*store, 8, Prompt(100, 9), 32);
  h.method = "nosuch";
  s = engine->Admit(std::move(h));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("retrieval.method 'nosuch'"), std::string::npos) << s;
}

}  // namespace
}  // namespace kvr::decode
