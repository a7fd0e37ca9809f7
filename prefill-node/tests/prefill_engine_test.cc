// PrefillEngine on the real SmolLM2 model with an in-process KV store (FakeKvStoreClient) and a
// recording decode handoff: what reaches the store and D, and every error path.

#include "kvr/prefill_node/prefill_engine.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <optional>

#include "engine_fakes.h"
#include "kvr/common/fp8.h"
#include "kvr/common/half.h"
#include "kvr/common/paths.h"
#include "kvr/common/status.h"
#include "kvr/common/thread_pool.h"
#include "kvr/model/dense_attention.h"
#include "kvr/model/loader.h"
#include "kvr/model/sampler.h"
#include "kvr/prefill_node/summary_snapshot.h"
#include "kvr/retrieval/all_methods.h"
#include "kvr/retrieval/model_shape.h"

namespace kvr::prefill_node {
namespace {

namespace cv1 = ::kvr::cluster::v1;
using ::testing::HasSubstr;

class RecordingSink final : public HandoffSink {
 public:
  explicit RecordingSink(std::vector<cv1::HandoffChunk>* chunks, absl::Status finish)
      : chunks_(chunks), finish_(std::move(finish)) {}
  bool Write(const cv1::HandoffChunk& chunk) override {
    chunks_->push_back(chunk);
    return true;
  }
  absl::StatusOr<cv1::HandoffResponse> Finish() override {
    if (!finish_.ok()) return finish_;
    cv1::HandoffResponse r;
    r.set_accepted(true);
    return r;
  }

 private:
  std::vector<cv1::HandoffChunk>* chunks_;
  absl::Status finish_;
};

class RecordingOpener final : public HandoffOpener {
 public:
  absl::StatusOr<std::unique_ptr<HandoffSink>> Open(const cv1::NodeRef& decode,
                                                    absl::Time) override {
    ++opened;
    return std::make_unique<RecordingSink>(&chunks, finish);
  }
  int opened = 0;
  absl::Status finish;  // what Finish returns
  std::vector<cv1::HandoffChunk> chunks;
};

class PrefillEngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    pool_ = new ThreadPool(2);
    auto loaded = model::LoadModel(TestModelPath(), {}, pool_);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    loaded_ = new model::LoadedModel(std::move(*loaded));
    auto registry = retrieval::AllMethods();
    ASSERT_TRUE(registry.ok());
    registry_ = new retrieval::MethodRegistry(std::move(*registry));
  }

  void SetUp() override {
    kv_store::StoreOptions so;
    so.pool.capacity_bytes = 256ull << 20;
    so.pool.try_huge_pages = false;
    UseStore(so);
  }

  // A fake store of `options` in store_ (replacing the one there), and engine_ over it.
  void UseStore(const kv_store::StoreOptions& options) {
    auto fake = kv_store::FakeKvStoreClient::Create(options);
    ASSERT_TRUE(fake.ok()) << fake.status();
    store_ = std::move(*fake);
    stores_ = std::make_unique<OneStore>(store_.get());
    engine_ =
        std::make_unique<PrefillEngine>(loaded_->model.get(), &*loaded_->tokenizer, registry_,
                                        stores_.get(), &opener_, EngineOptions{.chunk_tokens = 64});
  }

  PrefillJob Job(Prompt prompt, const std::string& method = "clusterkv") {
    PrefillJob job;
    job.request_id = "req-1";
    job.sequence_id = 42;
    job.store_capability = cap_;
    job.model = "smollm2";
    job.prompt = std::move(prompt);
    job.sampling.set_max_tokens(8);
    job.retrieval.set_method(method);
    job.retrieval.set_budget(16);
    job.retrieval.set_n_sink(4);
    job.retrieval.set_local_window(32);
    job.decode.set_node_id("decode-7");
    job.store.set_node_id("store-3");
    job.deadline = absl::Now() + absl::Seconds(60);
    return job;
  }

  // A request for `ids` as sequence `id` that reuses the first `prefix_tokens` tokens of the
  // sequence `prefix`.
  PrefillJob ForkJob(const std::vector<int32_t>& ids, const std::string& method, uint64_t id,
                     const kv_store::SequenceRef& prefix, size_t prefix_tokens) {
    PrefillJob job = Job(TokenPrompt{ids}, method);
    job.sequence_id = id;
    job.prefix = prefix;
    job.prefix_tokens = static_cast<uint32_t>(prefix_tokens);
    return job;
  }

  // `ids` and then the tokens of one more sentence: a later turn's prompt that starts with the
  // prompt of `ids`.
  static std::vector<int32_t> WithMore(const std::vector<int32_t>& ids) {
    std::vector<int32_t> out = ids;
    auto more = loaded_->tokenizer->Encode(" And then the dog jumps back over the fox, twice.");
    EXPECT_TRUE(more.ok()) << more.status();
    if (more.ok()) out.insert(out.end(), more->begin(), more->end());
    return out;
  }

  static std::string Text() {
    std::string s;
    for (int i = 0; i < 12; ++i)
      s += "The quick brown fox jumps over the lazy dog number " + std::to_string(i) + ". ";
    return s;
  }

  // A "quest" request run on an engine that stores rows as some dtype, and its prompt
  // prefilled by the model alone into a float32 cache: the reference the stored rows derive
  // from.
  struct StoreRun {
    PrefillResult result;
    model::KvCache cache;
    int64_t tokens = 0;
  };

  // Runs the request on an engine over store_ that stores rows as `dtype`; `out` is set when
  // nothing failed.
  void RunStoring(kv_store::DType dtype, std::optional<StoreRun>* out) {
    PrefillEngine engine(loaded_->model.get(), &*loaded_->tokenizer, registry_, stores_.get(),
                         &opener_, EngineOptions{.chunk_tokens = 64, .store_dtype = dtype});
    PrefillJob job = Job(TextPrompt{Text()}, "quest");
    auto result = engine.Run(job);
    ASSERT_TRUE(result.ok()) << result.status();
    const model::Model& m = *loaded_->model;
    auto ids = engine.Tokenize(job.prompt);
    ASSERT_TRUE(ids.ok());
    model::KvCache cache = m.NewCache(model::KvDType::kF32);
    model::DenseAttention dense(pool_);
    ASSERT_TRUE(m.Prefill(1, cache, *ids, dense, 64).ok());
    out->emplace(StoreRun{std::move(*result), std::move(cache), static_cast<int64_t>(ids->size())});
  }

  // The store holds `run`'s sequence as `dtype` (`row_bytes` a row), every layer committed to
  // the prompt's length, and every row of every head of the first and last layers is
  // `encode(k, v, row)` of that token's float32 k and v (head_dim floats each) in run.cache.
  void ExpectStoredRows(kv_store::DType dtype, size_t row_bytes, const StoreRun& run,
                        const std::function<void(const float*, const float*, uint8_t*)>& encode) {
    const model::ModelConfig& c = loaded_->model->config();
    const int64_t L = run.tokens;
    auto info = store_->GetSequence({42, cap_});
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->shape.dtype, dtype);
    for (uint64_t rows : info->committed_rows) EXPECT_EQ(rows, static_cast<uint64_t>(L));
    ASSERT_EQ(info->shape.RowBytes(), row_bytes);
    for (const int layer : {0, c.n_layers - 1}) {
      const model::KvView view = run.cache.View(layer);
      for (int head = 0; head < c.n_kv_heads; ++head) {
        kv_store::RangeEntry range{{42, cap_},
                                   static_cast<uint32_t>(layer),
                                   static_cast<uint32_t>(head),
                                   0,
                                   static_cast<uint64_t>(L)};
        std::vector<uint8_t> got(L * row_bytes);
        ASSERT_TRUE(store_->RangeRead(std::span(&range, 1), got).ok());
        std::vector<uint8_t> want(got.size());
        for (int64_t t = 0; t < L; ++t) {
          const int64_t at = t * view.row_stride + int64_t{head} * c.head_dim;
          encode(view.k + at, view.v + at, want.data() + t * row_bytes);
        }
        EXPECT_EQ(got, want) << "layer " << layer << " head " << head;
      }
    }
  }

  static inline ThreadPool* pool_ = nullptr;
  static inline model::LoadedModel* loaded_ = nullptr;
  static inline retrieval::MethodRegistry* registry_ = nullptr;
  std::unique_ptr<kv_store::FakeKvStoreClient> store_;
  const kv_store::Capability cap_ = kv_store::Capability::Generate();
  std::unique_ptr<OneStore> stores_;
  RecordingOpener opener_;
  std::unique_ptr<PrefillEngine> engine_;
};

TEST_F(PrefillEngineTest, ShipsEveryLayerToStoreAndDecodeNode) {
  PrefillJob job = Job(TextPrompt{Text()});
  auto result = engine_->Run(job);
  ASSERT_TRUE(result.ok()) << result.status();
  const model::Model& m = *loaded_->model;
  const model::ModelConfig& c = m.config();

  // Reference: single-process dense prefill (chunked the same way) and greedy first token.
  auto ids = engine_->Tokenize(job.prompt);
  ASSERT_TRUE(ids.ok());
  const int64_t L = static_cast<int64_t>(ids->size());
  // Float32 storage (the tests read float rows) of the model's half-rounded values.
  model::KvCache cache = m.NewCache(model::KvDType::kF32);
  model::DenseAttention dense(pool_);
  auto logits = m.Prefill(1, cache, *ids, dense, 64);
  ASSERT_TRUE(logits.ok());
  EXPECT_EQ(result->prompt_tokens, L);
  EXPECT_EQ(result->method, "clusterkv");
  EXPECT_EQ(result->first_token, model::ArgMax(*logits));
  EXPECT_EQ(result->finish_reason, kvr::v1::FINISH_REASON_UNSPECIFIED);
  const uint64_t kv_bytes = uint64_t{2} * L * c.n_kv_heads * c.head_dim * 4 * c.n_layers;
  EXPECT_EQ(result->kv_bytes_shipped, kv_bytes);

  // D got the header first, then each layer once.
  ASSERT_EQ(opener_.chunks.size(), static_cast<size_t>(c.n_layers) + 1);
  ASSERT_TRUE(opener_.chunks[0].has_header());
  const cv1::HandoffHeader& h = opener_.chunks[0].header();
  EXPECT_EQ(h.first_token(), static_cast<uint32_t>(result->first_token));
  EXPECT_EQ(h.prompt_tokens(), L);
  EXPECT_EQ(h.n_layers(), static_cast<uint32_t>(c.n_layers));
  EXPECT_EQ(h.sequence_id(), 42u);
  // D gets the capability it needs for its own store calls of the sequence.
  EXPECT_EQ(h.sequence_capability(), cap_.ToBytes());
  EXPECT_EQ(h.text_so_far(), result->first_text);
  const size_t row_bytes = HandoffRowBytes(c);
  std::vector<bool> seen(c.n_layers, false);
  for (size_t i = 1; i < opener_.chunks.size(); ++i) {
    ASSERT_TRUE(opener_.chunks[i].has_layer());
    const cv1::HandoffLayer& layer = opener_.chunks[i].layer();
    ASSERT_LT(layer.layer(), static_cast<uint32_t>(c.n_layers));
    EXPECT_FALSE(seen[layer.layer()]);
    seen[layer.layer()] = true;
    ASSERT_EQ(layer.sink_positions_size(), 4);
    ASSERT_EQ(layer.local_positions_size(), 32);
    EXPECT_EQ(layer.local_positions(0), L - 32);
    ASSERT_EQ(layer.sink_kv().size(), 4 * row_bytes);
    ASSERT_EQ(layer.local_kv().size(), 32 * row_bytes);
    // Rows equal the dense cache bit for bit ([k | v] per head).
    const model::KvView view = cache.View(layer.layer());
    std::string expected;
    std::vector<int64_t> local(32);
    for (int j = 0; j < 32; ++j) local[j] = L - 32 + j;
    PackRows(view, c.n_kv_heads, c.head_dim, local, &expected);
    EXPECT_EQ(layer.local_kv(), expected) << "layer " << layer.layer();
    // Summaries are a clusterkv index of all L positions.
    auto index = retrieval::DeserializeIndex(
        {reinterpret_cast<const uint8_t*>(layer.summaries().data()), layer.summaries().size()},
        *registry_, retrieval::IndexParams{});
    ASSERT_TRUE(index.ok()) << index.status();
    EXPECT_EQ((*index)->method(), "clusterkv");
    EXPECT_EQ((*index)->size(), L);
  }

  // The store holds every row of every layer, equal to the dense cache.
  auto info = store_->GetSequence({42, cap_});
  // Without the capability the rows are not readable.
  EXPECT_TRUE(absl::IsPermissionDenied(
      store_->GetSequence({42, kv_store::Capability::Generate()}).status()));
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->shape.dtype, kv_store::DType::kF32);  // EngineOptions' default
  for (uint64_t rows : info->committed_rows) EXPECT_EQ(rows, static_cast<uint64_t>(L));
  const int head = 1, layer = c.n_layers - 1;
  std::vector<uint8_t> out(L * row_bytes / c.n_kv_heads);
  kv_store::RangeEntry range{
      {42, cap_}, static_cast<uint32_t>(layer), head, 0, static_cast<uint64_t>(L)};
  ASSERT_TRUE(store_->RangeRead(std::span(&range, 1), out).ok());
  const model::KvView view = cache.View(layer);
  const float* row5 = reinterpret_cast<const float*>(out.data()) + 5 * 2 * c.head_dim;
  EXPECT_EQ(std::memcmp(row5, view.k + 5 * view.row_stride + head * c.head_dim, c.head_dim * 4), 0);
  EXPECT_EQ(std::memcmp(row5 + c.head_dim, view.v + 5 * view.row_stride + head * c.head_dim,
                        c.head_dim * 4),
            0);
}

// Every row of every layer of sequence `id` in the store, in RangeRead order.
std::vector<uint8_t> AllRows(kv_store::KvStoreClient& store, const kv_store::SequenceRef& ref,
                             const model::ModelConfig& c, int64_t rows) {
  std::vector<kv_store::RangeEntry> ranges;
  for (int layer = 0; layer < c.n_layers; ++layer) {
    for (int h = 0; h < c.n_kv_heads; ++h) {
      ranges.push_back({ref, static_cast<uint32_t>(layer), static_cast<uint32_t>(h), 0,
                        static_cast<uint64_t>(rows)});
    }
  }
  std::vector<uint8_t> out(ranges.size() * rows * 2 * c.head_dim * sizeof(float));
  EXPECT_TRUE(store.RangeRead(ranges, out).ok());
  return out;
}

// A request forked from a prefix (`fork`, sequence `fork_ref`) against the same prompt of
// `rows` tokens computed cold (`cold`, `cold_ref`), both in the float32 `store`: the fork
// reused `reused` rows, put only the others, and its first token and rows are the cold ones.
void ExpectForkMatchesCold(kv_store::KvStoreClient& store, const model::ModelConfig& c,
                           const PrefillResult& fork, const kv_store::SequenceRef& fork_ref,
                           const PrefillResult& cold, const kv_store::SequenceRef& cold_ref,
                           int64_t reused, int64_t rows) {
  EXPECT_EQ(fork.cached_tokens, static_cast<uint32_t>(reused));
  EXPECT_EQ(fork.first_token, cold.first_token);
  // Only the computed rows were put.
  EXPECT_EQ(fork.kv_bytes_shipped,
            uint64_t{2} * (rows - reused) * c.n_kv_heads * c.head_dim * 4 * c.n_layers);
  EXPECT_EQ(AllRows(store, fork_ref, c, rows), AllRows(store, cold_ref, c, rows));
}

// A prompt that starts with an earlier request's prompt, prefilled from that request's
// sequence: the cached rows are forked (up to the last whole chunk), only the rest is
// computed and put, and the rows, the first token and the handoff equal a cold prefill's, bit
// for bit. A prefix the store no longer has is computed cold, with the same result.
TEST_F(PrefillEngineTest, APrefixFromTheStoreGivesTheColdPrefillsBits) {
  const model::ModelConfig& c = loaded_->model->config();
  PrefillJob first = Job(TextPrompt{Text()}, "full");
  auto first_ids = engine_->Tokenize(first.prompt);
  ASSERT_TRUE(first_ids.ok());
  ASSERT_TRUE(engine_->Run(first).ok());
  const std::vector<int32_t> ids = WithMore(*first_ids);
  const int64_t L = static_cast<int64_t>(ids.size());
  const int64_t reused = static_cast<int64_t>(first_ids->size()) / 64 * 64;  // chunk_tokens 64
  ASSERT_GT(reused, 0);

  // Cold: the whole prompt computed.
  PrefillJob cold = Job(TokenPrompt{ids}, "full");
  cold.sequence_id = 43;
  opener_.chunks.clear();
  auto cold_result = engine_->Run(cold);
  ASSERT_TRUE(cold_result.ok()) << cold_result.status();
  EXPECT_EQ(cold_result->cached_tokens, 0u);
  const auto cold_chunks = opener_.chunks;

  // From the first request's sequence.
  PrefillJob warm = ForkJob(ids, "full", 44, {42, cap_}, first_ids->size());
  opener_.chunks.clear();
  auto warm_result = engine_->Run(warm);
  ASSERT_TRUE(warm_result.ok()) << warm_result.status();
  ExpectForkMatchesCold(*store_, c, *warm_result, {44, cap_}, *cold_result, {43, cap_}, reused, L);
  ASSERT_EQ(opener_.chunks.size(), cold_chunks.size());
  for (size_t i = 1; i < cold_chunks.size(); ++i) {
    EXPECT_EQ(opener_.chunks[i].layer().local_kv(), cold_chunks[i].layer().local_kv()) << i;
    EXPECT_EQ(opener_.chunks[i].layer().sink_kv(), cold_chunks[i].layer().sink_kv()) << i;
  }
  // The forked rows share the first request's pages.
  auto stats = store_->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_GT(stats->shared_pages, 0u);

  // The cached sequence is gone (released, evicted, its store restarted): computed cold.
  ASSERT_TRUE(store_->Release({42, cap_}, absl::ZeroDuration()).ok());
  PrefillJob lost = ForkJob(ids, "full", 45, {42, cap_}, first_ids->size());
  auto lost_result = engine_->Run(lost);
  ASSERT_TRUE(lost_result.ok()) << lost_result.status();
  EXPECT_EQ(lost_result->cached_tokens, 0u);
  EXPECT_EQ(lost_result->first_token, cold_result->first_token);
  EXPECT_EQ(AllRows(*store_, {45, cap_}, c, L), AllRows(*store_, {43, cap_}, c, L));
}

// A cached prefix the store thinned (its least distinctive pages dropped under pressure) is
// reused only up to its first hole, aligned: the rest is computed, and the rows and the first
// token equal a cold prefill's. Nothing reads a dropped row.
TEST_F(PrefillEngineTest, AThinnedPrefixIsReusedOnlyUpToItsFirstHole) {
  const model::ModelConfig& c = loaded_->model->config();
  kv_store::StoreOptions so;
  so.pool.capacity_bytes = 64ull << 20;
  so.pool.page_bytes = 8 << 10;  // 16 f32 rows of head_dim 64 per page
  so.pool.try_huge_pages = false;
  so.cached_eviction = kv_store::CachedEviction::kThin;
  so.thin_policy = {.sink_rows = 64, .recent_rows = 16};
  UseStore(so);
  if (HasFatalFailure()) return;

  PrefillJob first = Job(TextPrompt{Text() + Text()}, "full");
  auto first_ids = engine_->Tokenize(first.prompt);
  ASSERT_TRUE(first_ids.ok());
  ASSERT_TRUE(engine_->Run(first).ok());
  // Handed off; the decode node would release it kept for reuse when done.
  ASSERT_TRUE(store_->Release({42, cap_}, absl::Hours(1)).ok());
  const std::vector<int32_t> ids = WithMore(*first_ids);
  const int64_t L = static_cast<int64_t>(ids.size());

  // Cold first, then a sequence one page larger than what is free: the cached prefix is
  // thinned to make room.
  PrefillJob cold = Job(TokenPrompt{ids}, "full");
  cold.sequence_id = 43;
  auto cold_result = engine_->Run(cold);
  ASSERT_TRUE(cold_result.ok()) << cold_result.status();
  auto before = store_->Stats();
  ASSERT_TRUE(before.ok());
  const kv_store::SequenceShape filler{
      .n_layers = 1, .n_kv_heads = 1, .head_dim = 64, .dtype = kv_store::DType::kF32};
  ASSERT_TRUE(
      store_
          ->CreateSequence({99, cap_}, filler, (before->free_pages + 1) * 16, absl::ZeroDuration())
          .ok());
  auto info = store_->GetSequence({42, cap_});
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_GT(info->thinned_pages, 0u);
  ASSERT_GE(info->intact_rows, 64u);  // the sinks' pages stay
  ASSERT_LT(info->intact_rows, first_ids->size());
  const int64_t reused = static_cast<int64_t>(info->intact_rows) / 64 * 64;
  ASSERT_TRUE(store_->Release({99, cap_}, absl::ZeroDuration()).ok());  // room for the fork

  PrefillJob warm = ForkJob(ids, "full", 44, {42, cap_}, first_ids->size());
  auto warm_result = engine_->Run(warm);
  ASSERT_TRUE(warm_result.ok()) << warm_result.status();
  ExpectForkMatchesCold(*store_, c, *warm_result, {44, cap_}, *cold_result, {43, cap_}, reused, L);
}

// The keys of rows [0, rows) of one layer of a sequence in the (float32) store, laid out as
// the model's cache holds them: [rows, n_kv_heads * head_dim].
std::vector<float> LayerKeys(kv_store::KvStoreClient& store, const kv_store::SequenceRef& ref,
                             const model::ModelConfig& c, int layer, int64_t rows) {
  const int hd = c.head_dim;
  std::vector<float> keys(static_cast<size_t>(rows) * c.n_kv_heads * hd);
  std::vector<float> head_rows(static_cast<size_t>(rows) * 2 * hd);  // [rows, k | v]
  for (int h = 0; h < c.n_kv_heads; ++h) {
    const kv_store::RangeEntry range{ref, static_cast<uint32_t>(layer), static_cast<uint32_t>(h), 0,
                                     static_cast<uint64_t>(rows)};
    EXPECT_TRUE(store
                    .RangeRead(std::span(&range, 1), {reinterpret_cast<uint8_t*>(head_rows.data()),
                                                      head_rows.size() * sizeof(float)})
                    .ok());
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(&keys[(r * c.n_kv_heads + h) * hd], &head_rows[r * 2 * hd], hd * sizeof(float));
    }
  }
  return keys;
}

std::span<const uint8_t> Bytes(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

// The summaries of the handoff's layer `layer` (chunks [header, layer...] in any layer order).
std::string SummariesOf(const std::vector<cv1::HandoffChunk>& chunks, int layer) {
  for (const cv1::HandoffChunk& chunk : chunks) {
    if (chunk.has_layer() && chunk.layer().layer() == static_cast<uint32_t>(layer)) {
      return chunk.layer().summaries();
    }
  }
  ADD_FAILURE() << "no layer " << layer << " in the handoff";
  return "";
}

// A retained request keeps each layer's summaries at the last aligned boundary of its prompt
// in the store (the handoff's index is that snapshot with the last partial block appended); a
// later request forked from it ships the snapshot extended by Append over its new rows, byte
// for byte what Deserialize(snapshot) + Append done by hand gives, and keeps its own snapshot.
// Without a usable snapshot (another budget, a prefix kept without one) the summaries are
// rebuilt, and equal a cold prefill's.
TEST_F(PrefillEngineTest, AReusedPrefixExtendsTheSnapshotOfItsSummaries) {
  const model::ModelConfig& c = loaded_->model->config();
  retrieval::IndexShape shape = retrieval::IndexShapeOf(c, 0);
  uint64_t base = 0;  // sequence ids base + 1.. per method
  for (const std::string method : {"quest", "clusterkv", "keydiff"}) {
    SCOPED_TRACE(method);
    base += 100;
    const kv_store::SequenceRef first_ref{base + 1, cap_}, warm_ref{base + 2, cap_},
        cold_ref{base + 3, cap_};
    PrefillJob first = Job(TextPrompt{Text()}, method);
    first.sequence_id = first_ref.id;
    first.retain = absl::Minutes(1);
    auto first_ids = engine_->Tokenize(first.prompt);
    ASSERT_TRUE(first_ids.ok());
    const int64_t L1 = static_cast<int64_t>(first_ids->size());
    const int64_t S1 = L1 / 64 * 64;  // CPU backend: 64-row attention query blocks
    ASSERT_GT(S1, 0);
    ASSERT_LT(S1, L1) << "the test wants a prompt that does not end on the alignment";
    opener_.chunks.clear();
    auto first_result = engine_->Run(first);
    ASSERT_TRUE(first_result.ok()) << first_result.status();
    EXPECT_EQ(first_result->summary_layers_extended, 0u);
    EXPECT_EQ(first_result->summary_layers_rebuilt, 0u);
    const std::vector<cv1::HandoffChunk> first_chunks = opener_.chunks;
    retrieval::IndexParams params;
    params.budget = 16;
    params.n_sink = 4;
    params.local_window = 32;
    const std::string key = SnapshotKey(first.model, c, method, params);

    // Its snapshots: the index built over its first S1 rows; that index extended by Append of
    // its last L1 - S1 rows is its handoff.
    std::vector<kv_store::Attachment> snapshots;
    for (int layer = 0; layer < c.n_layers; ++layer) {
      shape.layer = layer;
      auto att = store_->GetAttachment(first_ref, static_cast<uint32_t>(layer));
      ASSERT_TRUE(att.ok()) << att.status();
      EXPECT_EQ(att->rows, static_cast<uint64_t>(S1));
      ASSERT_TRUE(OpenSnapshot(att->bytes, att->rows, key, method, shape, *registry_, params).ok());
      const std::vector<float> keys = LayerKeys(*store_, first_ref, c, layer, L1);
      const int64_t row = int64_t{c.n_kv_heads} * c.head_dim;
      auto index = registry_->Make(method, shape, params);
      ASSERT_TRUE(index.ok()) << index.status();
      retrieval::BuildInput build;
      build.keys = {keys.data(), S1, row};
      ASSERT_TRUE((*index)->Build(build).ok());
      auto at_s1 = retrieval::SerializeIndex(**index);
      ASSERT_TRUE(at_s1.ok());
      EXPECT_EQ(att->bytes, FrameSnapshot(key, *at_s1)) << "layer " << layer;
      retrieval::AppendInput in;
      in.keys = {keys.data() + S1 * row, L1 - S1, row};
      ASSERT_TRUE((*index)->Append(in).ok());
      auto bytes = retrieval::SerializeIndex(**index);
      ASSERT_TRUE(bytes.ok());
      EXPECT_TRUE(std::ranges::equal(*bytes, Bytes(SummariesOf(first_chunks, layer))))
          << "layer " << layer;
      snapshots.push_back(*std::move(att));
    }

    // Turn 2: the first prompt and more, forked from the first request's sequence.
    const std::vector<int32_t> ids = WithMore(*first_ids);
    const int64_t L2 = static_cast<int64_t>(ids.size());
    PrefillJob warm = ForkJob(ids, method, warm_ref.id, first_ref, L1);
    warm.retain = absl::Minutes(1);
    opener_.chunks.clear();
    auto warm_result = engine_->Run(warm);
    ASSERT_TRUE(warm_result.ok()) << warm_result.status();
    EXPECT_EQ(warm_result->cached_tokens, static_cast<uint32_t>(S1));
    EXPECT_EQ(warm_result->summary_layers_extended, static_cast<uint32_t>(c.n_layers));
    EXPECT_EQ(warm_result->summary_layers_rebuilt, 0u);
    const std::vector<cv1::HandoffChunk> warm_chunks = opener_.chunks;
    for (int layer = 0; layer < c.n_layers; ++layer) {
      shape.layer = layer;
      auto index = OpenSnapshot(snapshots[layer].bytes, snapshots[layer].rows, key, method, shape,
                                *registry_, params);
      ASSERT_TRUE(index.ok()) << index.status();
      const std::vector<float> keys = LayerKeys(*store_, warm_ref, c, layer, L2);
      retrieval::AppendInput in;
      in.keys = {keys.data() + S1 * c.n_kv_heads * c.head_dim, L2 - S1,
                 int64_t{c.n_kv_heads} * c.head_dim};
      ASSERT_TRUE((*index)->Append(in).ok());
      auto bytes = retrieval::SerializeIndex(**index);
      ASSERT_TRUE(bytes.ok());
      EXPECT_TRUE(std::ranges::equal(*bytes, Bytes(SummariesOf(warm_chunks, layer))))
          << "layer " << layer;
      // Its own snapshot, at its own last aligned boundary, for the next turn.
      auto own = store_->GetAttachment(warm_ref, static_cast<uint32_t>(layer));
      ASSERT_TRUE(own.ok()) << own.status();
      EXPECT_EQ(own->rows, static_cast<uint64_t>(L2 / 64 * 64));
      EXPECT_TRUE(OpenSnapshot(own->bytes, own->rows, key, method, shape, *registry_, params).ok());
    }

    // Reference: the same prompt cold (kept for nobody: one Build over every row).
    PrefillJob cold = Job(TokenPrompt{ids}, method);
    cold.sequence_id = cold_ref.id;
    opener_.chunks.clear();
    ASSERT_TRUE(engine_->Run(cold).ok());
    const std::vector<cv1::HandoffChunk> cold_chunks = opener_.chunks;

    // Another budget: the snapshot is of other parameters, so every layer is rebuilt, as cold.
    PrefillJob other = ForkJob(ids, method, base + 4, first_ref, L1);
    other.retrieval.set_budget(24);
    PrefillJob other_cold = other;
    other_cold.sequence_id = base + 5;
    other_cold.prefix_tokens = 0;
    opener_.chunks.clear();
    auto other_result = engine_->Run(other);
    ASSERT_TRUE(other_result.ok()) << other_result.status();
    EXPECT_EQ(other_result->cached_tokens, static_cast<uint32_t>(S1));
    EXPECT_EQ(other_result->summary_layers_extended, 0u);
    EXPECT_EQ(other_result->summary_layers_rebuilt, static_cast<uint32_t>(c.n_layers));
    const std::vector<cv1::HandoffChunk> other_chunks = opener_.chunks;
    opener_.chunks.clear();
    ASSERT_TRUE(engine_->Run(other_cold).ok());
    for (int layer = 0; layer < c.n_layers; ++layer) {
      EXPECT_EQ(SummariesOf(other_chunks, layer), SummariesOf(opener_.chunks, layer)) << layer;
    }

    // A prefix kept without snapshots (the cold request was not retained): rebuilt.
    PrefillJob bare = ForkJob(ids, method, base + 6, cold_ref, L2 - 1);
    opener_.chunks.clear();
    auto bare_result = engine_->Run(bare);
    ASSERT_TRUE(bare_result.ok()) << bare_result.status();
    EXPECT_EQ(bare_result->cached_tokens, static_cast<uint32_t>((L2 - 1) / 64 * 64));
    EXPECT_EQ(bare_result->summary_layers_extended, 0u);
    EXPECT_EQ(bare_result->summary_layers_rebuilt, static_cast<uint32_t>(c.n_layers));
    for (int layer = 0; layer < c.n_layers; ++layer) {
      EXPECT_EQ(SummariesOf(opener_.chunks, layer), SummariesOf(cold_chunks, layer)) << layer;
    }
    EXPECT_TRUE(absl::IsNotFound(store_->GetAttachment({base + 6, cap_}, 0).status()));
  }
}

// A store client without attachments (UNIMPLEMENTED): a retained request keeps no snapshot
// and goes on; a request reusing a prefix rebuilds its summaries.
class NoAttachments final : public kv_store::KvStoreClient {
 public:
  explicit NoAttachments(kv_store::KvStoreClient* inner) : inner_(inner) {}
  std::unique_ptr<kv_store::KvStoreOp> StartPutLayer(const kv_store::LayerRows& rows) override {
    return inner_->StartPutLayer(rows);
  }
  std::unique_ptr<kv_store::KvStoreOp> StartGather(std::span<const kv_store::GatherEntry> e,
                                                   std::span<uint8_t> out) override {
    return inner_->StartGather(e, out);
  }
  absl::StatusOr<kv_store::CreateResult> CreateSequence(const kv_store::SequenceRef& ref,
                                                        const kv_store::SequenceShape& shape,
                                                        uint64_t expected,
                                                        absl::Duration lease) override {
    return inner_->CreateSequence(ref, shape, expected, lease);
  }
  absl::StatusOr<kv_store::ForkResult> ForkSequence(const kv_store::SequenceRef& child,
                                                    const kv_store::SequenceRef& parent,
                                                    uint64_t rows, uint64_t expected,
                                                    absl::Duration lease) override {
    return inner_->ForkSequence(child, parent, rows, expected, lease);
  }
  absl::Status RangeRead(std::span<const kv_store::RangeEntry> r, std::span<uint8_t> out) override {
    return inner_->RangeRead(r, out);
  }
  absl::Status Release(const kv_store::SequenceRef& ref, absl::Duration keep) override {
    return inner_->Release(ref, keep);
  }
  absl::Status Lease(const kv_store::SequenceRef& ref, absl::Duration lease) override {
    return inner_->Lease(ref, lease);
  }
  absl::StatusOr<kv_store::SequenceInfo> GetSequence(const kv_store::SequenceRef& ref) override {
    return inner_->GetSequence(ref);
  }
  absl::StatusOr<kv_store::StoreStats> Stats() override { return inner_->Stats(); }
  absl::StatusOr<kv_store::PageTable> ReservePageTable(const kv_store::SequenceRef& ref,
                                                       uint64_t rows) override {
    return inner_->ReservePageTable(ref, rows);
  }
  absl::StatusOr<std::shared_ptr<const kv_store::LocalPoolMapping>> MapLocalPool() override {
    return inner_->MapLocalPool();
  }

 private:
  kv_store::KvStoreClient* inner_;
};

TEST_F(PrefillEngineTest, AStoreWithoutAttachmentsRebuildsTheSummaries) {
  NoAttachments plain(store_.get());
  OneStore stores(&plain);
  PrefillEngine engine(loaded_->model.get(), &*loaded_->tokenizer, registry_, &stores, &opener_,
                       EngineOptions{.chunk_tokens = 64});
  PrefillJob first = Job(TextPrompt{Text()}, "quest");
  first.retain = absl::Minutes(1);
  auto first_ids = engine.Tokenize(first.prompt);
  ASSERT_TRUE(first_ids.ok());
  ASSERT_TRUE(engine.Run(first).ok());
  EXPECT_TRUE(absl::IsNotFound(store_->GetAttachment({42, cap_}, 0).status()));
  std::vector<int32_t> ids = *first_ids;
  ids.push_back(ids.back());
  PrefillJob warm = ForkJob(ids, "quest", 44, {42, cap_}, first_ids->size());
  opener_.chunks.clear();
  auto warm_result = engine.Run(warm);
  ASSERT_TRUE(warm_result.ok()) << warm_result.status();
  EXPECT_GT(warm_result->cached_tokens, 0u);
  EXPECT_EQ(warm_result->summary_layers_extended, 0u);
  EXPECT_EQ(warm_result->summary_layers_rebuilt,
            static_cast<uint32_t>(loaded_->model->config().n_layers));
  auto index = retrieval::DeserializeIndex(Bytes(SummariesOf(opener_.chunks, 0)), *registry_,
                                           retrieval::IndexParams{});
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ((*index)->size(), static_cast<int64_t>(ids.size()));
}

// extend_summaries off: nothing is kept for later requests, and a reused prefix's summaries
// are rebuilt (even where the prefix has a snapshot).
TEST_F(PrefillEngineTest, ExtendSummariesOffKeepsNothingAndRebuilds) {
  PrefillJob first = Job(TextPrompt{Text()}, "clusterkv");
  first.retain = absl::Minutes(1);
  auto first_ids = engine_->Tokenize(first.prompt);
  ASSERT_TRUE(first_ids.ok());
  ASSERT_TRUE(engine_->Run(first).ok());  // the default engine: snapshots kept
  ASSERT_TRUE(store_->GetAttachment({42, cap_}, 0).ok());
  PrefillEngine off(loaded_->model.get(), &*loaded_->tokenizer, registry_, stores_.get(), &opener_,
                    EngineOptions{.chunk_tokens = 64, .extend_summaries = false});
  std::vector<int32_t> ids = *first_ids;
  ids.push_back(ids.back());
  PrefillJob warm = ForkJob(ids, "clusterkv", 44, {42, cap_}, first_ids->size());
  warm.retain = absl::Minutes(1);
  auto warm_result = off.Run(warm);
  ASSERT_TRUE(warm_result.ok()) << warm_result.status();
  EXPECT_GT(warm_result->cached_tokens, 0u);
  EXPECT_EQ(warm_result->summary_layers_extended, 0u);
  EXPECT_EQ(warm_result->summary_layers_rebuilt,
            static_cast<uint32_t>(loaded_->model->config().n_layers));
  // The fork inherited the prefix's snapshot; this engine put none of its own over it.
  auto inherited = store_->GetAttachment({44, cap_}, 0);
  ASSERT_TRUE(inherited.ok()) << inherited.status();
  EXPECT_EQ(inherited->rows, first_ids->size() / 64 * 64);
  PrefillJob fresh = Job(TextPrompt{Text()}, "clusterkv");
  fresh.sequence_id = 45;
  fresh.retain = absl::Minutes(1);
  ASSERT_TRUE(off.Run(fresh).ok());
  EXPECT_TRUE(absl::IsNotFound(store_->GetAttachment({45, cap_}, 0).status()));
}

// A backend that computes in chunks of at most 128 tokens whatever it is asked (as the CUDA
// backend caps chunks to its model's max_batch_tokens) and, like the CUDA backend, reuses only
// whole chunks (PrefixAlignment 0), over the CPU backend. It also reads the
// first and last layers' reused rows through both loaders and counts the values where the bf16
// loader's bits are not the float loader's values rounded to bf16.
class CappedChunkBackend final : public PrefillBackend {
 public:
  explicit CappedChunkBackend(const model::Model* model) : inner_(MakeCpuPrefillBackend(model)) {}
  const model::ModelConfig& config() const override { return inner_->config(); }
  std::string name() const override { return "cpu-capped"; }
  bool SupportsPrefix() const override { return true; }
  int64_t ChunkTokens(int64_t requested) const override {
    return std::min<int64_t>(requested, 128);
  }
  absl::StatusOr<std::vector<float>> Prefill(const PrefillCall& call,
                                             std::unique_ptr<PrefillRows>* rows) override {
    PrefillCall capped = call;
    capped.chunk_tokens = ChunkTokens(call.chunk_tokens);
    if (call.prefix_rows > 0) {
      const model::ModelConfig& c = config();
      const size_t n = static_cast<size_t>(call.prefix_rows) * c.n_kv_heads * c.head_dim;
      std::vector<float> k(n), v(n);
      std::vector<uint16_t> kb(n), vb(n);
      for (const int layer : {0, c.n_layers - 1}) {
        KVR_RETURN_IF_ERROR(call.load_prefix(layer, k, v));
        KVR_RETURN_IF_ERROR(call.load_prefix_bf16(layer, kb, vb));
        for (size_t i = 0; i < n; ++i) {
          bf16_mismatches += (kb[i] != FloatToBf16(k[i])) + (vb[i] != FloatToBf16(v[i]));
        }
        bf16_checked += 2 * n;
      }
    }
    return inner_->Prefill(capped, rows);
  }
  int64_t bf16_mismatches = 0, bf16_checked = 0;

 private:
  std::unique_ptr<PrefillBackend> inner_;
};

// The engine aligns a reused prefix to the chunk the backend really computes in
// (PrefillBackend::ChunkTokens, for a backend whose PrefixAlignment is 0), not to
// EngineOptions::chunk_tokens: asked for chunks of 256, a backend that caps them at 128 reuses
// 128 rows of a longer prefix (aligned to the option it would reuse none), and the rows and
// first token are still the cold prefill's bit for bit (float32 store). The bf16 loader
// (PrefillCall::load_prefix_bf16, the CUDA backend's) gives the float loader's rows in bf16,
// from a float32, a bf16 and an fp8 store (decoded rows).
TEST_F(PrefillEngineTest, APrefixIsAlignedToTheBackendsChunk) {
  for (const kv_store::DType dtype :
       {kv_store::DType::kF32, kv_store::DType::kBf16, kv_store::DType::kFp8E4m3}) {
    SCOPED_TRACE(kv_store::DTypeName(dtype));
    auto owned = std::make_unique<CappedChunkBackend>(loaded_->model.get());
    CappedChunkBackend* backend = owned.get();
    PrefillEngine engine(std::move(owned), &*loaded_->tokenizer, registry_, stores_.get(), &opener_,
                         EngineOptions{.chunk_tokens = 256, .store_dtype = dtype});
    const model::ModelConfig& c = loaded_->model->config();
    const uint64_t base = 100 * static_cast<uint64_t>(dtype);
    PrefillJob first = Job(TextPrompt{Text()}, "full");
    first.sequence_id = base;
    first.sampling.set_max_tokens(1);
    first.retain = absl::Minutes(1);
    auto first_ids = engine.Tokenize(first.prompt);
    ASSERT_TRUE(first_ids.ok());
    ASSERT_GE(first_ids->size(), 128u);
    ASSERT_LT(first_ids->size(), 256u);
    ASSERT_TRUE(engine.Run(first).ok());
    const std::vector<int32_t> ids = WithMore(*first_ids);
    const int64_t L = static_cast<int64_t>(ids.size());

    PrefillJob cold = Job(TokenPrompt{ids}, "quest");
    cold.sequence_id = base + 1;
    auto cold_result = engine.Run(cold);
    ASSERT_TRUE(cold_result.ok()) << cold_result.status();
    PrefillJob warm = ForkJob(ids, "quest", base + 2, {base, cap_}, first_ids->size());
    auto warm_result = engine.Run(warm);
    ASSERT_TRUE(warm_result.ok()) << warm_result.status();
    EXPECT_EQ(warm_result->cached_tokens, 128u);
    EXPECT_EQ(warm_result->first_token, cold_result->first_token);
    std::vector<kv_store::RangeEntry> ranges;
    for (const uint64_t id : {base + 1, base + 2}) {
      for (int layer = 0; layer < c.n_layers; ++layer) {
        for (int h = 0; h < c.n_kv_heads; ++h) {
          ranges.push_back({{id, cap_},
                            static_cast<uint32_t>(layer),
                            static_cast<uint32_t>(h),
                            0,
                            static_cast<uint64_t>(L)});
        }
      }
    }
    const size_t half =
        ranges.size() / 2 * L * kv_store::RowBytes(dtype, static_cast<uint32_t>(c.head_dim));
    std::vector<uint8_t> rows(2 * half);
    ASSERT_TRUE(store_->RangeRead(ranges, rows).ok());
    // The CPU model computes in float32: from a bf16 store it continues from rounded rows, so
    // only a float32 store gives the cold bits (the CUDA model's cache is bf16 itself).
    if (dtype == kv_store::DType::kF32) {
      EXPECT_TRUE(std::equal(rows.begin(), rows.begin() + half, rows.begin() + half))
          << "rows from the prefix differ from the cold prefill's";
    }
    EXPECT_GT(backend->bf16_checked, 0);
    EXPECT_EQ(backend->bf16_mismatches, 0);
  }
}

// The first token ends the request: a sequence that ended well stays readable for `retain`
// (a later request may start from it); one that failed is freed.
TEST_F(PrefillEngineTest, ASequenceThatEndedWellIsKeptForRetain) {
  PrefillJob job = Job(TextPrompt{Text()}, "full");
  job.sampling.set_max_tokens(1);
  job.retain = absl::Minutes(1);
  ASSERT_TRUE(engine_->Run(job).ok());
  auto info = store_->GetSequence({42, cap_});
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->released_kept);
}

TEST_F(PrefillEngineTest, Bf16StoreRowsAreTheRowsRoundedToBf16) {
  std::optional<StoreRun> run;
  ASSERT_NO_FATAL_FAILURE(RunStoring(kv_store::DType::kBf16, &run));
  const model::ModelConfig& c = loaded_->model->config();
  const int64_t L = run->tokens;
  // Half the bytes of f32 rows.
  EXPECT_EQ(run->result.kv_bytes_shipped,
            uint64_t{2} * L * c.n_kv_heads * c.head_dim * 2 * c.n_layers);
  // Every row: FloatToBf16 of the f32 rows.
  ExpectStoredRows(kv_store::DType::kBf16, size_t{2} * c.head_dim * 2, *run,
                   [&](const float* k, const float* v, uint8_t* row) {
                     FloatsToBf16Bytes(k, c.head_dim, row);
                     FloatsToBf16Bytes(v, c.head_dim, row + c.head_dim * 2);
                   });
  // The handoff's sink/local rows stay f32, bit for bit.
  ASSERT_EQ(opener_.chunks.size(), static_cast<size_t>(c.n_layers) + 1);
  const cv1::HandoffLayer& layer = opener_.chunks[1].layer();
  std::vector<int64_t> local(32);
  for (int j = 0; j < 32; ++j) local[j] = L - 32 + j;
  std::string expected;
  PackRows(run->cache.View(layer.layer()), c.n_kv_heads, c.head_dim, local, &expected);
  EXPECT_EQ(layer.local_kv(), expected);
}

// fp8 store: the engine puts the rows as bf16 (as for a bf16 store: kv_bytes_shipped counts
// those) and the store holds EncodeFp8Row of their values, 136 bytes a row at head_dim 64.
TEST_F(PrefillEngineTest, Fp8StoreRowsAreTheBf16RowsEncoded) {
  std::optional<StoreRun> run;
  ASSERT_NO_FATAL_FAILURE(RunStoring(kv_store::DType::kFp8E4m3, &run));
  const model::ModelConfig& c = loaded_->model->config();
  EXPECT_EQ(run->result.kv_bytes_shipped,
            uint64_t{2} * run->tokens * c.n_kv_heads * c.head_dim * 2 * c.n_layers);
  const Fp8RowLayout layout{2, c.head_dim};
  std::vector<float> kv(2 * c.head_dim);
  ExpectStoredRows(kv_store::DType::kFp8E4m3, layout.RowBytes(), *run,
                   [&](const float* k, const float* v, uint8_t* row) {
                     for (int d = 0; d < c.head_dim; ++d) {
                       kv[d] = Bf16ToFloat(FloatToBf16(k[d]));
                       kv[c.head_dim + d] = Bf16ToFloat(FloatToBf16(v[d]));
                     }
                     EncodeFp8Row(layout, kv.data(), row);
                   });
}

TEST_F(PrefillEngineTest, StoreDtypeOtherThanF32Bf16OrFp8IsRefused) {
  PrefillEngine engine(loaded_->model.get(), &*loaded_->tokenizer, registry_, stores_.get(),
                       &opener_,
                       EngineOptions{.chunk_tokens = 64, .store_dtype = kv_store::DType::kF16});
  auto r = engine.Run(Job(TextPrompt{"Hello there"}));
  EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("store_dtype f16"));
  EXPECT_EQ(store_->Stats()->sequences, 0u);
}

TEST_F(PrefillEngineTest, FullMethodShipsHeaderOnlySummaries) {
  auto result = engine_->Run(Job(TextPrompt{"Hello there, how are you today?"}, "full"));
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_GT(opener_.chunks.size(), 1u);
  const std::string& bytes = opener_.chunks[1].layer().summaries();
  auto index = retrieval::DeserializeIndex(
      {reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()}, *registry_, {});
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ((*index)->method(), "full");
}

TEST_F(PrefillEngineTest, FirstTokenThatEndsTheRequestSendsNoHandoff) {
  PrefillJob job = Job(TextPrompt{"Hello"});
  job.sampling.set_max_tokens(1);
  auto result = engine_->Run(job);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->finish_reason, kvr::v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(opener_.opened, 0);
  auto stats = store_->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->sequences, 0u);
}

TEST_F(PrefillEngineTest, DecodeFailureNamesTheDecodeNodeAndReleasesTheStore) {
  opener_.finish = absl::UnavailableError("connection refused");
  auto result = engine_->Run(Job(TextPrompt{"Hello there"}));
  ASSERT_FALSE(result.ok());
  EXPECT_TRUE(absl::IsUnavailable(result.status())) << result.status();
  EXPECT_EQ(PrefillEngine::FailedNodeOf(result.status()), "decode-7");
  EXPECT_EQ(store_->Stats()->sequences, 0u);
}

// D could not reach the store the sequence was written to (it restarted meanwhile): D names
// the store, and so does P, so that the controller does not drop the healthy decode node.
TEST_F(PrefillEngineTest, StoreNamedByTheDecodeNodeIsTheFailedNode) {
  opener_.finish = absl::UnavailableError("the KV store at s:1 is another instance");
  opener_.finish.SetPayload("kvr-failed-node", absl::Cord("store-3"));
  auto result = engine_->Run(Job(TextPrompt{"Hello there"}));
  ASSERT_FALSE(result.ok());
  EXPECT_TRUE(absl::IsUnavailable(result.status())) << result.status();
  EXPECT_EQ(PrefillEngine::FailedNodeOf(result.status()), "store-3");
}

TEST_F(PrefillEngineTest, StoreFailureNamesTheStore) {
  store_->InjectFailure(absl::UnavailableError("store down"));
  auto result = engine_->Run(Job(TextPrompt{"Hello there"}));
  ASSERT_FALSE(result.ok());
  EXPECT_TRUE(absl::IsUnavailable(result.status())) << result.status();
  EXPECT_EQ(PrefillEngine::FailedNodeOf(result.status()), "store-3");
  EXPECT_EQ(opener_.opened, 0);
}

TEST_F(PrefillEngineTest, BadRequestsAreInvalidArgumentNamingTheField) {
  auto r = engine_->Run(Job(TextPrompt{""}));
  EXPECT_TRUE(absl::IsInvalidArgument(r.status()));
  EXPECT_THAT(r.status().message(), HasSubstr("prompt"));
  r = engine_->Run(Job(TextPrompt{"Hi"}, "no-such-method"));
  EXPECT_TRUE(absl::IsInvalidArgument(r.status()));
  EXPECT_THAT(r.status().message(), HasSubstr("retrieval.method"));
  TokenPrompt huge;
  huge.ids.assign(loaded_->model->config().context_length, 1);
  r = engine_->Run(Job(huge));
  EXPECT_TRUE(absl::IsInvalidArgument(r.status()));
  EXPECT_THAT(r.status().message(), HasSubstr("token_ids"));
  PrefillJob zero = Job(TextPrompt{"Hi"});
  zero.retrieval.set_budget(0);
  r = engine_->Run(zero);
  EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("budget"));
  EXPECT_EQ(store_->Stats()->sequences, 0u);
}

TEST_F(PrefillEngineTest, CancelledRequestStopsAndReleasesTheStore) {
  auto r = engine_->Run(Job(TextPrompt{Text()}), [] { return true; });
  EXPECT_TRUE(absl::IsCancelled(r.status())) << r.status();
  EXPECT_EQ(opener_.opened, 0);
  EXPECT_EQ(store_->Stats()->sequences, 0u);
  EXPECT_FALSE(engine_->Cancel("unknown-request"));
}

}  // namespace
}  // namespace kvr::prefill_node
