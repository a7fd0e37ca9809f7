// DecodeEngine on the tiny dummy model with an in-process store: continuous batching gives the
// same greedy tokens as single-process dense decoding with `full`; cancel, deadline and
// errors free the slot, the hot-cache rows and the store sequence.

#include "kvr/decode/engine.h"

#include <atomic>
#include <map>
#include <random>

#include "gtest/gtest.h"
#include "kvr/common/half.h"
#include "kvr/common/thread_pool.h"
#include "kvr/decode/local_handoff.h"
#include "kvr/model/dense_attention.h"
#include "kvr/model/loader.h"
#include "kvr/retrieval/all_methods.h"
#include "test_util.h"

namespace kvr::decode {
namespace {

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model::LoadOptions options;
    options.format = model::LoadFormat::kDummy;
    options.dummy_seed = 3;
    auto loaded = model::LoadModel("tiny", options, &pool_);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    model_ = std::move(loaded->model);
    registry_ = *retrieval::AllMethods();
    fake_ = testing::MakeFakeStore();
    store_ = std::make_unique<testing::CountingStore>(fake_.get());
  }

  std::vector<int32_t> Prompt(int n, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<int32_t> ids(n);
    for (int32_t& id : ids) id = static_cast<int32_t>(rng() % model_->config().vocab);
    return ids;
  }

  // Single-process greedy decoding with dense attention: `n` tokens, the first included.
  std::vector<int32_t> DenseGreedy(const std::vector<int32_t>& prompt, int n) {
    model::DenseAttention dense(&pool_);
    // Float32 storage (the tests read float rows) of the model's half-rounded values.
    model::KvCache cache = model_->NewCache(model::KvDType::kF32);
    auto logits = model_->Prefill(1, cache, prompt, dense);
    EXPECT_TRUE(logits.ok());
    std::vector<int32_t> out{model::ArgMax(*logits)};
    std::vector<float> step(model_->config().vocab);
    while (static_cast<int>(out.size()) < n) {
      model::ForwardSequence s{1, &cache, std::span(&out.back(), 1)};
      EXPECT_TRUE(model_->Forward(std::span(&s, 1), dense, model::LogitsMode::kLast, step).ok());
      out.push_back(model::ArgMax(step));
    }
    return out;
  }

  // The prefill node's part: dense prefill, store rows, summaries, sink/local rows.
  Handoff MakeHandoff(uint64_t id, const std::vector<int32_t>& prompt, const std::string& method,
                      int64_t budget, uint32_t max_tokens) {
    model::DenseAttention dense(&pool_);
    model::KvCache cache = model_->NewCache(model::KvDType::kF32);
    auto logits = model_->Prefill(id, cache, prompt, dense);
    EXPECT_TRUE(logits.ok());
    LocalHandoffOptions o;
    o.sequence_id = id;
    o.method = method;
    o.params.budget = budget;
    o.params.n_sink = 4;
    o.params.local_window = 16;
    o.sampling.max_tokens = max_tokens;
    o.first_token = model::ArgMax(*logits);
    auto h = MakeLocalHandoff(*model_, cache, registry_, *store_, o);
    EXPECT_TRUE(h.ok()) << h.status();
    return std::move(*h);
  }

  std::unique_ptr<DecodeEngine> Engine(int slots) {
    auto engine = DecodeEngine::Create(model_.get(), nullptr, &registry_,
                                       {.batch_slots = slots, .hot_cache_bytes = 1 << 20});
    EXPECT_TRUE(engine.ok());
    return std::move(*engine);
  }

  // Drives the engine until every sequence finished; returns each one's tokens (after the
  // first) and completion.
  void RunToEnd(DecodeEngine& engine, const std::vector<uint64_t>& ids,
                std::map<uint64_t, std::vector<int32_t>>* tokens,
                std::map<uint64_t, absl::StatusOr<CompletionInfo>>* done) {
    for (int guard = 0; guard < 1000 && done->size() < ids.size(); ++guard) {
      engine.Step();
      for (uint64_t id : ids) {
        if (done->contains(id)) continue;
        absl::StatusOr<StreamChunk> chunk = engine.Next(id, absl::Now());
        if (!chunk.ok()) {
          done->emplace(id, chunk.status());
          continue;
        }
        auto& t = (*tokens)[id];
        t.insert(t.end(), chunk->tokens.begin(), chunk->tokens.end());
        if (chunk->completion) done->emplace(id, *chunk->completion);
      }
    }
  }

  ThreadPool pool_{2};
  std::unique_ptr<model::Model> model_;
  retrieval::MethodRegistry registry_;
  std::unique_ptr<kv_store::FakeKvStoreClient> fake_;
  std::unique_ptr<testing::CountingStore> store_;
};

TEST_F(EngineTest, FullEqualsDenseGreedyUnderContinuousBatching) {
  // Three sequences, two slots: the third joins when the shortest leaves.
  const std::vector<int> lengths = {90, 60, 75};
  const std::vector<uint32_t> max_tokens = {10, 30, 25};
  auto engine = Engine(2);
  std::vector<uint64_t> ids;
  std::vector<std::vector<int32_t>> expected;
  for (int i = 0; i < 3; ++i) {
    const std::vector<int32_t> prompt = Prompt(lengths[i], 100 + i);
    expected.push_back(DenseGreedy(prompt, static_cast<int>(max_tokens[i])));
    Handoff h = MakeHandoff(11 + i, prompt, "full", 8, max_tokens[i]);
    if (i == 1) h.layers[0].summaries.clear();  // `full` without summaries works too
    ASSERT_TRUE(engine->Admit(std::move(h)).ok());
    ids.push_back(11 + i);
  }
  EXPECT_EQ(engine->running_sequences(), 3);
  std::map<uint64_t, std::vector<int32_t>> tokens;
  std::map<uint64_t, absl::StatusOr<CompletionInfo>> done;
  RunToEnd(*engine, ids, &tokens, &done);
  ASSERT_EQ(done.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    const absl::StatusOr<CompletionInfo>& c = done.at(ids[i]);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->reason, FinishReason::kLength);
    EXPECT_EQ(c->completion_tokens, max_tokens[i]);
    std::vector<int32_t> want(expected[i].begin() + 1, expected[i].end());
    EXPECT_EQ(tokens[ids[i]], want) << "sequence " << i;
    EXPECT_GT(c->retrieval.rows_fetched, 0);
    EXPECT_GT(c->retrieval.hot_cache_hits, 0);
  }
  // Everything released: store, slots, memory.
  EXPECT_EQ(fake_->Stats()->sequences, 0u);
  EXPECT_EQ(engine->running_sequences(), 0);
  EXPECT_EQ(engine->free_memory_bytes(), engine->options().memory_bytes);
  // One gather per (step, layer) at most, whatever the batch.
  const NodeCounters n = engine->node_counters();
  EXPECT_LE(n.gathers, n.attend_calls);
}

TEST_F(EngineTest, RetrievalMethodAtSmallBudgetCompletes) {
  auto engine = Engine(4);
  for (const char* method : {"exact", "quest", "streaming"}) {
    const uint64_t id = std::string(method) == "exact"   ? 21
                        : std::string(method) == "quest" ? 22
                                                         : 23;
    ASSERT_TRUE(engine->Admit(MakeHandoff(id, Prompt(120, id), method, 8, 20)).ok()) << method;
    std::map<uint64_t, std::vector<int32_t>> tokens;
    std::map<uint64_t, absl::StatusOr<CompletionInfo>> done;
    RunToEnd(*engine, {id}, &tokens, &done);
    ASSERT_TRUE(done.at(id).ok()) << method << ": " << done.at(id).status();
    EXPECT_EQ(tokens[id].size(), 19u) << method;
    EXPECT_EQ(done.at(id)->method, method);
  }
  EXPECT_EQ(fake_->Stats()->sequences, 0u);
}

TEST_F(EngineTest, CancelAndDeadlineFreeEverythingWithinOneStep) {
  auto engine = Engine(2);
  ASSERT_TRUE(engine->Admit(MakeHandoff(31, Prompt(80, 1), "full", 8, 100)).ok());
  Handoff late = MakeHandoff(32, Prompt(80, 2), "full", 8, 100);
  late.deadline = absl::Now() + absl::Milliseconds(300);
  ASSERT_TRUE(engine->Admit(std::move(late)).ok());
  EXPECT_TRUE(engine->Step());
  EXPECT_TRUE(engine->Step());
  EXPECT_EQ(fake_->Stats()->sequences, 2u);
  EXPECT_TRUE(engine->Cancel(31, "client went away"));
  absl::SleepFor(absl::Milliseconds(350));
  engine->Step();  // both leave before this step
  EXPECT_EQ(fake_->Stats()->sequences, 0u);
  EXPECT_EQ(engine->running_sequences(), 0);
  // Tokens produced before the cancel may come first; the stream then ends with the error.
  absl::StatusOr<StreamChunk> a = engine->Next(31, absl::Now());
  EXPECT_TRUE(absl::IsCancelled(a.status())) << a.status();
  absl::StatusOr<StreamChunk> b = engine->Next(32, absl::Now());
  EXPECT_TRUE(absl::IsDeadlineExceeded(b.status())) << b.status();
  EXPECT_TRUE(absl::IsNotFound(engine->Next(31, absl::Now()).status()));
  EXPECT_FALSE(engine->Cancel(31, "again"));
  EXPECT_EQ(engine->free_memory_bytes(), engine->options().memory_bytes);
}

TEST_F(EngineTest, RejectsBadHandoffs) {
  auto engine = Engine(2);
  Handoff h = MakeHandoff(41, Prompt(50, 4), "full", 8, 10);
  Handoff wrong_layers = h;
  wrong_layers.layers.pop_back();
  EXPECT_TRUE(absl::IsInvalidArgument(engine->Admit(std::move(wrong_layers))));
  Handoff truncated = h;
  truncated.layers[1].local_kv.resize(10);
  EXPECT_TRUE(absl::IsInvalidArgument(engine->Admit(std::move(truncated))));
  Handoff unknown = h;
  unknown.method = "nope";
  EXPECT_TRUE(absl::IsInvalidArgument(engine->Admit(std::move(unknown))));
  ASSERT_TRUE(engine->Admit(h).ok());
  EXPECT_TRUE(absl::IsAlreadyExists(engine->Admit(h)));
  EXPECT_TRUE(absl::IsNotFound(engine->Next(999, absl::Now()).status()));
}

TEST_F(EngineTest, Bf16StoreRowsDecodeAsF32RowsRoundedToBf16) {
  // Two CPU backends decode the same prompt, whose prefill rows were rounded to bf16 values:
  // one from a store sequence of f32 rows, one from bf16 rows. Fewer steps than the local
  // window, so every fetched row is a prompt row (the same values in both): the logits must
  // be equal bit for bit. The generated rows each appends to its store must then be the same
  // values, the bf16 ones rounded to nearest even.
  const model::ModelConfig& c = model_->config();
  const std::vector<int32_t> prompt = Prompt(90, 7);
  const int64_t L = static_cast<int64_t>(prompt.size());
  model::DenseAttention dense(&pool_);
  model::KvCache cache = model_->NewCache(model::KvDType::kF32);
  auto prefill_logits = model_->Prefill(1, cache, prompt, dense);
  ASSERT_TRUE(prefill_logits.ok());
  const model::KvCache rounded = testing::RoundedToBf16(cache);
  constexpr int kSteps = 12;
  uint64_t id = 80;
  for (const char* method : {"full", "quest"}) {
    SCOPED_TRACE(method);
    const uint64_t f32_id = ++id, bf16_id = ++id;
    LocalHandoffOptions o;
    o.method = method;
    o.params.budget = 8;
    o.params.n_sink = 4;
    o.params.local_window = 16;
    o.sampling.max_tokens = kSteps + 1;
    o.first_token = model::ArgMax(*prefill_logits);
    o.sequence_id = f32_id;
    auto f32_handoff = MakeLocalHandoff(*model_, rounded, registry_, *store_, o);
    ASSERT_TRUE(f32_handoff.ok()) << f32_handoff.status();
    o.sequence_id = bf16_id;
    o.store_dtype = kv_store::DType::kBf16;
    auto bf16_handoff = MakeLocalHandoff(*model_, rounded, registry_, *store_, o);
    ASSERT_TRUE(bf16_handoff.ok()) << bf16_handoff.status();
    const kv_store::SequenceRef f32_ref = f32_handoff->store_ref();
    const kv_store::SequenceRef bf16_ref = bf16_handoff->store_ref();
    ASSERT_EQ(fake_->GetSequence(bf16_ref)->shape.dtype, kv_store::DType::kBf16);

    std::unique_ptr<DecodeBackend> f32 =
        MakeCpuDecodeBackend(model_.get(), &registry_, {.hot_cache_bytes = 1 << 20}, nullptr);
    std::unique_ptr<DecodeBackend> bf16 =
        MakeCpuDecodeBackend(model_.get(), &registry_, {.hot_cache_bytes = 1 << 20}, nullptr);
    auto f32_state = f32->Prepare(*f32_handoff);
    ASSERT_TRUE(f32_state.ok()) << f32_state.status();
    ASSERT_TRUE(f32->Join(*f32_handoff, std::move(*f32_state)).ok());
    auto bf16_state = bf16->Prepare(*bf16_handoff);
    ASSERT_TRUE(bf16_state.ok()) << bf16_state.status();
    ASSERT_TRUE(bf16->Join(*bf16_handoff, std::move(*bf16_state)).ok());

    int32_t token = o.first_token;
    std::vector<float> f32_logits(c.vocab), bf16_logits(c.vocab);
    for (int s = 0; s < kSteps; ++s) {
      ASSERT_TRUE(f32->Step(std::span(&f32_id, 1), std::span(&token, 1), f32_logits).ok());
      ASSERT_TRUE(bf16->Step(std::span(&bf16_id, 1), std::span(&token, 1), bf16_logits).ok());
      ASSERT_EQ(f32_logits, bf16_logits) << "step " << s;
      f32->AfterStep();
      bf16->AfterStep();
      token = model::ArgMax(f32_logits);
    }
    const RetrievalCounters f32_counters = f32->Leave(f32_id);  // waits for the appends
    const RetrievalCounters bf16_counters = bf16->Leave(bf16_id);
    EXPECT_GT(f32_counters.rows_fetched, 0);
    EXPECT_EQ(bf16_counters.rows_fetched, f32_counters.rows_fetched);
    EXPECT_EQ(2 * bf16_counters.bytes_fetched, f32_counters.bytes_fetched);
    EXPECT_EQ(bf16_counters.rows_offloaded, f32_counters.rows_offloaded);

    // The generated rows [L, L + kSteps): bf16 = FloatToBf16 of the f32 run's rows.
    const int64_t floats = kSteps * 2 * int64_t{c.head_dim};
    bool any_rounded = false;
    for (int l = 0; l < c.n_layers; ++l) {
      for (int h = 0; h < c.n_kv_heads; ++h) {
        kv_store::RangeEntry range{f32_ref, static_cast<uint32_t>(l), static_cast<uint32_t>(h),
                                   static_cast<uint64_t>(L), kSteps};
        std::vector<float> f32_rows(floats);
        ASSERT_TRUE(fake_
                        ->RangeRead(std::span(&range, 1),
                                    std::span(reinterpret_cast<uint8_t*>(f32_rows.data()),
                                              f32_rows.size() * sizeof(float)))
                        .ok());
        range.sequence = bf16_ref;
        std::vector<uint8_t> bf16_rows(floats * 2);
        ASSERT_TRUE(fake_->RangeRead(std::span(&range, 1), bf16_rows).ok());
        std::vector<uint8_t> want(floats * 2);
        FloatsToBf16Bytes(f32_rows.data(), f32_rows.size(), want.data());
        EXPECT_EQ(bf16_rows, want) << "layer " << l << " head " << h;
        for (float x : f32_rows) any_rounded |= Bf16ToFloat(FloatToBf16(x)) != x;
      }
    }
    EXPECT_TRUE(any_rounded) << "the generated rows should not all be bf16 values already";
    ASSERT_TRUE(fake_->Release(f32_ref, absl::ZeroDuration()).ok());
    ASSERT_TRUE(fake_->Release(bf16_ref, absl::ZeroDuration()).ok());
  }
}

TEST_F(EngineTest, RefusesStoreSequencesOfAnotherRowDtype) {
  // A store sequence of f16 rows (no prefill node writes them): the CPU backend names the
  // dtype.
  auto engine = Engine(1);
  Handoff h = MakeHandoff(91, Prompt(40, 9), "full", 8, 10);
  ASSERT_TRUE(fake_->Release(h.store_ref(), absl::ZeroDuration()).ok());
  const model::ModelConfig& c = model_->config();
  ASSERT_TRUE(
      fake_
          ->CreateSequence(h.store_ref(),
                           {static_cast<uint32_t>(c.n_layers), static_cast<uint32_t>(c.n_kv_heads),
                            static_cast<uint32_t>(c.head_dim), kv_store::DType::kF16},
                           50, absl::ZeroDuration())
          .ok());
  const absl::Status s = engine->Admit(std::move(h));
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("f16"), std::string_view::npos) << s;
}

// Counts what the engine reports (the metrics helper's Prometheus observer plugs in here).
class RecordingObserver final : public DecodeObserver {
 public:
  void OnStep(const StepReport& s) override {
    ++steps;
    tokens += s.tokens;
  }
  void OnFetch(const FetchReport& f) override { fetched_bytes += f.bytes; }
  void OnRetrieval(std::string_view method, const RetrievalReport& r) override {
    if (method == "full") full_hits += r.hot_cache_hits;
  }
  void OnOffload(int64_t bytes) override { offloaded += bytes; }
  void OnSequenceEnd(std::string_view outcome, int64_t n) override {
    outcomes.push_back(std::string(outcome));
  }
  std::atomic<int64_t> steps{0}, tokens{0}, fetched_bytes{0}, full_hits{0}, offloaded{0};
  std::vector<std::string> outcomes;
};

TEST_F(EngineTest, ReportsStepsFetchesAndOutcomesToTheObserver) {
  RecordingObserver observer;
  auto engine = DecodeEngine::Create(model_.get(), nullptr, &registry_,
                                     {.batch_slots = 2, .hot_cache_bytes = 1 << 20}, &observer);
  ASSERT_TRUE(engine.ok());
  ASSERT_TRUE((*engine)->Admit(MakeHandoff(61, Prompt(60, 6), "full", 8, 6)).ok());
  std::map<uint64_t, std::vector<int32_t>> tokens;
  std::map<uint64_t, absl::StatusOr<CompletionInfo>> done;
  RunToEnd(**engine, {61}, &tokens, &done);
  EXPECT_EQ(observer.steps.load(), 5);  // max_tokens 6, the first from the prefill node
  EXPECT_EQ(observer.tokens.load(), 5);
  EXPECT_GT(observer.fetched_bytes.load(), 0);
  EXPECT_GT(observer.full_hits.load(), 0);
  // 5 steps x 2 layers x (K + V of 2 heads x 16 floats).
  EXPECT_EQ(observer.offloaded.load(), 5 * 2 * 2 * 2 * 16 * 4);
  EXPECT_EQ(observer.outcomes, std::vector<std::string>{"length"});
}

TEST_F(EngineTest, LoopThreadStreamsUntilTheCompletion) {
  auto engine = Engine(2);
  const std::vector<int32_t> prompt = Prompt(70, 9);
  const std::vector<int32_t> expected = DenseGreedy(prompt, 12);
  ASSERT_TRUE(engine->Admit(MakeHandoff(51, prompt, "full", 8, 12)).ok());
  engine->Start();
  std::vector<int32_t> got;
  for (int i = 0; i < 1000; ++i) {
    absl::StatusOr<StreamChunk> chunk = engine->Next(51, absl::Now() + absl::Seconds(5));
    ASSERT_TRUE(chunk.ok()) << chunk.status();
    got.insert(got.end(), chunk->tokens.begin(), chunk->tokens.end());
    if (chunk->completion) break;
  }
  engine->Stop();
  EXPECT_EQ(got, std::vector<int32_t>(expected.begin() + 1, expected.end()));
}

}  // namespace
}  // namespace kvr::decode
