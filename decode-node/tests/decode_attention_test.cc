// DecodeAttention against dense attention on synthetic KV: `full` equals dense, a budget
// attends exactly to sink ∪ local ∪ selected, one gather per (step, layer), the hot cache, the
// window overflow into the index and the store, and release.

#include "kvr/decode/decode_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <string>
#include <utility>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvr/common/fp8.h"
#include "kvr/common/half.h"
#include "kvr/common/thread_pool.h"
#include "kvr/kv_store/test_pattern.h"
#include "kvr/model/dense_attention.h"
#include "kvr/retrieval/all_methods.h"
#include "test_util.h"

namespace kvr::decode {
namespace {

using testing::CountingStore;
using testing::RandomTensor;

constexpr int kLayers = 2, kHeads = 4, kKvHeads = 2, kDim = 16;
constexpr int64_t kRow = int64_t{kKvHeads} * kDim;

// The values of `x` rounded to bf16 (so that bf16 store rows hold them exactly).
void RoundToBf16(std::vector<float>& x) {
  for (float& f : x) f = Bf16ToFloat(FloatToBf16(f));
}

// The values of every (token, KV head) row [k | v] replaced by what a reader of its fp8 row
// sees: DecodeFp8Row of EncodeFp8Row.
void RoundTripFp8Rows(std::vector<float>& k, std::vector<float>& v) {
  const Fp8RowLayout layout{2, kDim};
  std::vector<float> row(2 * kDim);
  std::vector<uint8_t> stored(layout.RowBytes());
  for (size_t at = 0; at < k.size(); at += kDim) {
    std::copy_n(k.begin() + at, kDim, row.begin());
    std::copy_n(v.begin() + at, kDim, row.begin() + kDim);
    EncodeFp8Row(layout, row.data(), stored.data());
    DecodeFp8Row(layout, stored.data(), row.data());
    std::copy_n(row.begin(), kDim, k.begin() + at);
    std::copy_n(row.begin() + kDim, kDim, v.begin() + at);
  }
}

// `n` rows of `x` from row `first`, as a store of `dtype` takes them (bf16 for fp8).
std::vector<uint8_t> StoreBytes(const std::vector<float>& x, int64_t first, int64_t n,
                                kv_store::DType dtype) {
  const size_t count = static_cast<size_t>(n * kRow);
  std::vector<uint8_t> out(count * kv_store::WriteElementBytes(dtype));
  if (dtype != kv_store::DType::kF32) {
    FloatsToBf16Bytes(x.data() + first * kRow, count, out.data());
  } else {
    std::memcpy(out.data(), x.data() + first * kRow, out.size());
  }
  return out;
}

// The options of the quality-sampling tests: every decode step sampled.
DecodeAttentionOptions EveryStepSampled() {
  DecodeAttentionOptions options{kLayers, kKvHeads, kDim, 1 << 20};
  options.quality_sample_rate = 1;
  return options;
}

// A synthetic sequence: K/V of every position, the store holding the prompt, a windowed
// cache seeded like a handoff, and one index per layer. With dtype bf16 the K/V values are
// rounded to bf16 first, so that the store holds them exactly and dense attention over them is
// still the reference. With fp8 the store is given the bf16-rounded values and k/v then hold
// what its prompt rows decode to (RoundTripFp8Rows): the reference for rows fetched from the
// prompt.
struct Fixture {
  int64_t prompt = 0;
  int64_t n_sink = 0, window = 0;
  kv_store::DType dtype = kv_store::DType::kF32;
  std::vector<std::vector<float>> k, v;  // [n_layers][positions, n_kv_heads, head_dim]
  std::vector<std::vector<float>> put_k, put_v;  // the values the store was given (as k, v)
  std::unique_ptr<kv_store::FakeKvStoreClient> fake = testing::MakeFakeStore();
  CountingStore store{fake.get()};
  retrieval::MethodRegistry registry = *retrieval::AllMethods();
  model::KvCache cache{1, 1, 1};

  Fixture(int64_t prompt_tokens, int64_t total, int64_t sink, int64_t local,
          kv_store::DType row_dtype = kv_store::DType::kF32)
      : prompt(prompt_tokens), n_sink(sink), window(local), dtype(row_dtype) {
    for (int l = 0; l < kLayers; ++l) {
      k.push_back(RandomTensor(total, kKvHeads, kDim, 10 + l));
      v.push_back(RandomTensor(total, kKvHeads, kDim, 20 + l));
      if (dtype != kv_store::DType::kF32) {
        RoundToBf16(k.back());
        RoundToBf16(v.back());
      }
      put_k.push_back(k.back());
      put_v.push_back(v.back());
      if (dtype == kv_store::DType::kFp8E4m3) RoundTripFp8Rows(k.back(), v.back());
    }
    EXPECT_TRUE(store
                    .CreateSequence(kv_store::testing::TestRef(7), {kLayers, kKvHeads, kDim, dtype},
                                    static_cast<uint64_t>(total), absl::ZeroDuration())
                    .ok());
    cache = model::KvCache::Windowed(kLayers, kKvHeads, kDim, sink, local);
    const int64_t n_s = std::min(sink, prompt), n_l = std::min(local, prompt - n_s);
    for (int l = 0; l < kLayers; ++l) {
      const std::vector<uint8_t> k_bytes = StoreBytes(put_k[l], 0, prompt, dtype);
      const std::vector<uint8_t> v_bytes = StoreBytes(put_v[l], 0, prompt, dtype);
      kv_store::LayerRows rows{kv_store::testing::TestRef(7),
                               static_cast<uint32_t>(l),
                               0,
                               static_cast<uint32_t>(prompt),
                               k_bytes,
                               v_bytes};
      EXPECT_TRUE(store.PutLayer(rows).ok());
      EXPECT_TRUE(cache.AppendAt(l, 0, n_s, k[l].data(), v[l].data(), kRow).ok());
      EXPECT_TRUE(cache
                      .AppendAt(l, prompt - n_l, n_l, k[l].data() + (prompt - n_l) * kRow,
                                v[l].data() + (prompt - n_l) * kRow, kRow)
                      .ok());
    }
    store.puts = 0;
  }
  static std::span<const uint8_t> Bytes(const std::vector<float>& x, int64_t first, int64_t n) {
    return {reinterpret_cast<const uint8_t*>(x.data() + first * kRow),
            static_cast<size_t>(n * kRow) * sizeof(float)};
  }
  std::unique_ptr<retrieval::RetrievalIndex> Index(const std::string& method, int layer,
                                                   int64_t budget) {
    retrieval::IndexShape shape{kHeads, kKvHeads, kDim, layer, kLayers, {}};
    retrieval::IndexParams params;
    params.budget = budget;
    params.n_sink = n_sink;
    params.local_window = window;
    auto index = registry.Make(method, shape, params);
    EXPECT_TRUE(index.ok()) << index.status();
    retrieval::BuildInput in;
    in.keys = {k[layer].data(), prompt, kRow};
    EXPECT_TRUE((*index)->Build(in).ok());
    return std::move(*index);
  }
  DecodeSequenceSetup Setup(const std::string& method, int64_t budget, bool null_index = false) {
    DecodeSequenceSetup s;
    s.method = method;
    s.budget = budget;
    s.n_sink = n_sink;
    s.local_window = window;
    for (int l = 0; l < kLayers; ++l) {
      s.indexes.push_back(null_index ? nullptr : Index(method, l, budget));
    }
    s.store = &store;
    s.store_sequence = kv_store::testing::TestRef(7);
    s.row_dtype = dtype;
    s.cache = &cache;
    return s;
  }
};

const model::AttentionShape kShape{kHeads, kKvHeads, kDim, 1.f / std::sqrt(float{kDim})};

// Dense attention of query `q` at position p over the rows `positions` of (k, v).
std::vector<float> Reference(const std::vector<float>& k, const std::vector<float>& v,
                             const float* q, int64_t p, const std::vector<int64_t>& positions) {
  std::vector<float> ks, vs;
  for (int64_t t : positions) {
    ks.insert(ks.end(), k.begin() + t * kRow, k.begin() + (t + 1) * kRow);
    vs.insert(vs.end(), v.begin() + t * kRow, v.begin() + (t + 1) * kRow);
  }
  model::AttentionRequest r;
  r.first_position = p;
  r.n_queries = 1;
  r.q = q;
  r.kv.k = ks.data();
  r.kv.v = vs.data();
  r.kv.n_rows = static_cast<int64_t>(positions.size());
  r.kv.row_stride = kRow;
  r.kv.positions = positions;
  r.kv.total_tokens = p + 1;
  std::vector<float> out(kHeads * kDim);
  r.out = out.data();
  model::DenseAttention dense(nullptr);
  EXPECT_TRUE(dense.Attend(kShape, std::span(&r, 1)).ok());
  return out;
}

// Runs `steps` decode steps (from the cache's end) through DecodeAttention and checks each
// layer's output against `expected_rows(layer, p)`, within `tolerance` (0: bit for bit).
template <typename Expected>
void RunSteps(Fixture& f, DecodeAttention& attention, int steps, Expected expected_rows,
              float tolerance = 2e-5f) {
  for (int s = 0; s < steps; ++s) {
    const int64_t p = f.cache.n_tokens();  // continues where the previous call stopped
    for (int l = 0; l < kLayers; ++l) {
      ASSERT_TRUE(
          f.cache.Append(l, 1, f.k[l].data() + p * kRow, f.v[l].data() + p * kRow, kRow).ok());
      std::vector<float> q = RandomTensor(1, kHeads, kDim, 1000 + p * 10 + l);
      std::vector<float> out(kHeads * kDim);
      model::AttentionRequest r{7, l, p, 1, q.data(), f.cache.View(l), out.data()};
      ASSERT_TRUE(attention.Attend(kShape, std::span(&r, 1)).ok()) << "step " << s;
      const std::vector<int64_t> rows = expected_rows(l, p, q);
      if (rows.empty()) continue;  // the caller checks something else
      const std::vector<float> want = Reference(f.k[l], f.v[l], q.data(), p, rows);
      for (size_t i = 0; i < out.size(); ++i) {
        if (tolerance == 0.f) {
          ASSERT_EQ(out[i], want[i]) << "step " << s << " layer " << l << " i " << i;
        } else {
          ASSERT_NEAR(out[i], want[i], tolerance) << "step " << s << " layer " << l << " i " << i;
        }
      }
    }
    attention.StartOffload();
    ASSERT_TRUE(attention.FinishOffload().ok());
  }
}

std::vector<int64_t> AllUpTo(int64_t p) {
  std::vector<int64_t> rows(p + 1);
  for (int64_t t = 0; t <= p; ++t) rows[t] = t;
  return rows;
}

// `full` attends sinks, fetched rows and the local window in position order through the kernel
// DenseAttention runs over the same rows, so the two agree bit for bit (what lets the cluster
// reproduce single-process greedy decoding token for token), with or without a thread pool.
TEST(DecodeAttentionTest, FullEqualsDenseWithAndWithoutSummaries) {
  ThreadPool pool(2);
  for (bool null_index : {false, true}) {
    Fixture f(/*prompt=*/100, /*total=*/140, /*sink=*/4, /*local=*/16);
    DecodeAttention attention({kLayers, kKvHeads, kDim, 1 << 20}, nullptr,
                              null_index ? &pool : nullptr);
    ASSERT_TRUE(attention.AddSequence(7, f.Setup("full", 8, null_index)).ok());
    RunSteps(
        f, attention, 30, [](int, int64_t p, const std::vector<float>&) { return AllUpTo(p); },
        /*tolerance=*/0.f);
    // One gather per (step, layer): the whole batch's misses go into one request.
    EXPECT_EQ(f.store.gathers.load(), 30 * kLayers);
    EXPECT_EQ(attention.node_counters().gathers, 30 * kLayers);
    // New rows went to the store: the prompt plus every step, every layer.
    auto info = f.store.GetSequence(kv_store::testing::TestRef(7));
    ASSERT_TRUE(info.ok());
    for (uint64_t rows : info->committed_rows) EXPECT_EQ(rows, 130u);
    // With full, consecutive steps select the same rows: after the first step most are hits.
    const RetrievalCounters c = attention.counters(7);
    EXPECT_GT(c.hot_cache_hits, c.hot_cache_misses);
    EXPECT_EQ(c.rows_fetched, c.hot_cache_misses);
    EXPECT_EQ(c.bytes_fetched, c.rows_fetched * 2 * kDim * 4);
    if (!null_index) {
      // The rows that left the window were appended to the index: it covers [0, local_begin).
      // (the index is owned by DecodeAttention; summary bytes of `full` are 0)
      EXPECT_EQ(attention.SummaryBytes(7), 0);
    }
  }
}

TEST(DecodeAttentionTest, BudgetAttendsExactlyToSinkLocalAndSelected) {
  Fixture f(/*prompt=*/120, /*total=*/150, /*sink=*/4, /*local=*/16);
  Fixture shadow(/*prompt=*/120, /*total=*/150, /*sink=*/4, /*local=*/16);  // same data
  std::vector<std::unique_ptr<retrieval::RetrievalIndex>> oracle;
  for (int l = 0; l < kLayers; ++l) oracle.push_back(shadow.Index("exact", l, 8));
  DecodeAttention attention({kLayers, kKvHeads, kDim, 1 << 20}, nullptr);
  ASSERT_TRUE(attention.AddSequence(7, f.Setup("exact", 8)).ok());
  // The same exact index, kept up to date here, gives the expected selection; the heads'
  // selections differ, so the reference is per KV head: check via one head's query group by
  // running the reference with each head's set and comparing that head group's outputs.
  for (int s = 0; s < 20; ++s) {
    const int64_t p = f.prompt + s;
    const int64_t n_sink = 4, local_begin = std::max<int64_t>(n_sink, p + 1 - 16);
    for (int l = 0; l < kLayers; ++l) {
      ASSERT_TRUE(
          f.cache.Append(l, 1, f.k[l].data() + p * kRow, f.v[l].data() + p * kRow, kRow).ok());
      if (local_begin > oracle[l]->size()) {
        retrieval::AppendInput in;
        in.keys = {f.k[l].data() + oracle[l]->size() * kRow, local_begin - oracle[l]->size(), kRow};
        ASSERT_TRUE(oracle[l]->Append(in).ok());
      }
      std::vector<float> q = RandomTensor(1, kHeads, kDim, 5000 + p * 10 + l);
      retrieval::Selection sel;
      ASSERT_TRUE(oracle[l]->Select({q.data(), p, 8, n_sink, local_begin}, &sel).ok());
      std::vector<float> out(kHeads * kDim);
      model::AttentionRequest r{7, l, p, 1, q.data(), f.cache.View(l), out.data()};
      ASSERT_TRUE(attention.Attend(kShape, std::span(&r, 1)).ok());
      for (int kvh = 0; kvh < kKvHeads; ++kvh) {
        std::vector<int64_t> rows;
        for (int64_t t = 0; t < n_sink; ++t) rows.push_back(t);
        rows.insert(rows.end(), sel.per_head[kvh].begin(), sel.per_head[kvh].end());
        for (int64_t t = local_begin; t <= p; ++t) rows.push_back(t);
        ASSERT_EQ(sel.per_head[kvh].size(), 8u);
        const std::vector<float> want = Reference(f.k[l], f.v[l], q.data(), p, rows);
        const int group = kHeads / kKvHeads;
        for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
          for (int i = 0; i < kDim; ++i) {
            ASSERT_NEAR(out[h * kDim + i], want[h * kDim + i], 2e-5f)
                << "step " << s << " layer " << l << " head " << h;
          }
        }
      }
    }
    attention.StartOffload();
    ASSERT_TRUE(attention.FinishOffload().ok());
  }
  EXPECT_EQ(f.store.gathers.load(), 20 * kLayers);
  const RetrievalCounters c = attention.counters(7);
  EXPECT_EQ(c.selected_rows, 20 * kLayers * kKvHeads * 8);
  EXPECT_EQ(c.hot_cache_hits + c.hot_cache_misses, c.selected_rows);
  EXPECT_GT(attention.SummaryBytes(7), 0);  // exact keeps keys
}

// Two `full` sequences, a's (sequence 7) and b's rows put into a's store as sequence 8 in
// `b_dtype`, attended layer by layer in one batch; each output must equal the reference.
// Leaves a's store's gather count for the caller (reset before the batch).
void AttendTwoSequencesFromOneStore(Fixture& a, Fixture& b, kv_store::DType b_dtype,
                                    DecodeAttention& attention) {
  DecodeSequenceSetup sa = a.Setup("full", 8), sb = b.Setup("full", 8);
  ASSERT_TRUE(a.store
                  .CreateSequence(kv_store::testing::TestRef(8), {kLayers, kKvHeads, kDim, b_dtype},
                                  80, absl::ZeroDuration())
                  .ok());
  for (int l = 0; l < kLayers; ++l) {
    const std::vector<uint8_t> k = StoreBytes(b.k[l], 0, 64, b_dtype);
    const std::vector<uint8_t> v = StoreBytes(b.v[l], 0, 64, b_dtype);
    ASSERT_TRUE(
        a.store.PutLayer({kv_store::testing::TestRef(8), static_cast<uint32_t>(l), 0, 64, k, v})
            .ok());
  }
  sb.store = &a.store;
  sb.store_sequence = kv_store::testing::TestRef(8);
  ASSERT_TRUE(attention.AddSequence(7, std::move(sa)).ok());
  ASSERT_TRUE(attention.AddSequence(8, std::move(sb)).ok());
  a.store.gathers = 0;
  for (int l = 0; l < kLayers; ++l) {
    std::vector<float> q = RandomTensor(2, kHeads, kDim, 77 + l);
    std::vector<float> out(2 * kHeads * kDim);
    Fixture* fs[2] = {&a, &b};
    model::AttentionRequest r[2];
    for (int i = 0; i < 2; ++i) {
      ASSERT_TRUE(
          fs[i]
              ->cache
              .Append(l, 1, fs[i]->k[l].data() + 64 * kRow, fs[i]->v[l].data() + 64 * kRow, kRow)
              .ok());
      r[i] = {static_cast<model::SequenceId>(7 + i),
              l,
              64,
              1,
              q.data() + i * kHeads * kDim,
              fs[i]->cache.View(l),
              out.data() + i * kHeads * kDim};
    }
    ASSERT_TRUE(attention.Attend(kShape, r).ok());
    for (int i = 0; i < 2; ++i) {
      const std::vector<float> want = Reference(fs[i]->k[l], fs[i]->v[l], r[i].q, 64, AllUpTo(64));
      for (int j = 0; j < kHeads * kDim; ++j) {
        ASSERT_NEAR(out[i * kHeads * kDim + j], want[j], 2e-5f) << "sequence " << i;
      }
    }
  }
}

TEST(DecodeAttentionTest, OneGatherPerLayerForTheWholeBatch) {
  Fixture a(64, 80, 4, 8), b(64, 80, 4, 8);
  // Both sequences use a's store so that one gather per layer covers both.
  DecodeAttention attention({kLayers, kKvHeads, kDim, 0}, nullptr);
  ASSERT_NO_FATAL_FAILURE(AttendTwoSequencesFromOneStore(a, b, kv_store::DType::kF32, attention));
  EXPECT_EQ(a.store.gathers.load(), kLayers);  // one per layer, both sequences inside
  EXPECT_EQ(b.store.gathers.load(), 0);
}

TEST(DecodeAttentionTest, HotCacheHitsOnSecondStepAndStaysInItsBound) {
  const int64_t row_bytes = 2 * kDim * 4;
  auto all = [](int, int64_t p, const std::vector<float>&) { return AllUpTo(p); };
  {
    // Room for everything: the second step's selection (one more row per head) hits.
    Fixture f(100, 110, 4, 16);
    DecodeAttention attention({kLayers, kKvHeads, kDim, 1000 * row_bytes}, nullptr);
    ASSERT_TRUE(attention.AddSequence(7, f.Setup("full", 8)).ok());
    RunSteps(f, attention, 1, all);
    const RetrievalCounters first = attention.counters(7);
    EXPECT_EQ(first.hot_cache_hits, 0);
    EXPECT_EQ(first.hot_cache_misses, kLayers * kKvHeads * (85 - 4));
    RunSteps(f, attention, 1, all);
    const RetrievalCounters second = attention.counters(7);
    EXPECT_EQ(second.hot_cache_hits - first.hot_cache_hits, kLayers * kKvHeads * 81);
    EXPECT_EQ(second.hot_cache_misses - first.hot_cache_misses, kLayers * kKvHeads * 1);
    EXPECT_EQ(second.rows_fetched, second.hot_cache_misses);
    attention.Release(7);
    EXPECT_EQ(attention.hot_cache().bytes(), 0);  // release drops the sequence's rows
    EXPECT_FALSE(attention.Has(7));
  }
  {
    // A bound of 50 rows: the cache evicts down to it and results stay exact.
    Fixture f(100, 110, 4, 16);
    DecodeAttention attention({kLayers, kKvHeads, kDim, 50 * row_bytes}, nullptr);
    ASSERT_TRUE(attention.AddSequence(7, f.Setup("full", 8)).ok());
    RunSteps(f, attention, 2, all);
    EXPECT_EQ(attention.hot_cache().entries(), 50);
    EXPECT_EQ(attention.hot_cache().bytes(), 50 * row_bytes);
    EXPECT_GT(attention.hot_cache().evictions(), 0);
  }
}

TEST(DecodeAttentionTest, WindowOverflowAppendsToTheIndexAndTheStore) {
  Fixture f(40, 80, 4, 8);
  DecodeAttention attention({kLayers, kKvHeads, kDim, 1 << 20}, nullptr);
  DecodeSequenceSetup setup = f.Setup("exact", 4);
  retrieval::RetrievalIndex* index0 = setup.indexes[0].get();
  ASSERT_TRUE(attention.AddSequence(7, std::move(setup)).ok());
  EXPECT_EQ(index0->size(), 40);
  const int64_t bytes0 = attention.SummaryBytes(7);
  RunSteps(f, attention, 20, [](int, int64_t, const std::vector<float>&) {
    return std::vector<int64_t>();  // contents checked by the budget test
  });
  // Last step p = 59: local window [52, 59], so the index covers [0, 52).
  EXPECT_EQ(index0->size(), 52);
  EXPECT_GT(attention.SummaryBytes(7), bytes0);
  auto info = f.store.GetSequence(kv_store::testing::TestRef(7));
  ASSERT_TRUE(info.ok());
  for (uint64_t rows : info->committed_rows) EXPECT_EQ(rows, 60u);
  EXPECT_EQ(f.store.puts.load(), 20 * kLayers);
  EXPECT_EQ(attention.counters(7).rows_offloaded, 20 * kLayers * kKvHeads);
}

TEST(DecodeAttentionTest, RejectsPrefillAndUnknownSequences) {
  Fixture f(40, 50, 4, 8);
  DecodeAttention attention({kLayers, kKvHeads, kDim, 1 << 20}, nullptr);
  std::vector<float> q(2 * kHeads * kDim), out(2 * kHeads * kDim);
  model::AttentionRequest r{9, 0, 40, 1, q.data(), f.cache.View(0), out.data()};
  EXPECT_TRUE(absl::IsNotFound(attention.Attend(kShape, std::span(&r, 1))));
  ASSERT_TRUE(attention.AddSequence(7, f.Setup("full", 8)).ok());
  r.sequence = 7;
  r.n_queries = 2;
  EXPECT_TRUE(absl::IsInvalidArgument(attention.Attend(kShape, std::span(&r, 1))));
  EXPECT_TRUE(absl::IsAlreadyExists(attention.AddSequence(7, f.Setup("full", 8))));
}

// ---- Store rows in bf16 ----

// Sums the bytes DecodeAttention reports moving.
class ByteRecorder final : public DecodeObserver {
 public:
  void OnFetch(const FetchReport& f) override {
    fetched_rows += f.rows;
    fetched_bytes += f.bytes;
  }
  void OnOffload(int64_t bytes) override { offloaded_bytes += bytes; }
  int64_t fetched_rows = 0, fetched_bytes = 0, offloaded_bytes = 0;
};

// Rows [first, first + n) of KV head `head` of (k, v) as store rows [k | v] of `dtype`.
std::vector<uint8_t> HeadRows(const std::vector<float>& k, const std::vector<float>& v, int head,
                              int64_t first, int64_t n, kv_store::DType dtype) {
  std::vector<float> rows;
  for (int64_t t = first; t < first + n; ++t) {
    rows.insert(rows.end(), k.begin() + t * kRow + head * kDim,
                k.begin() + t * kRow + (head + 1) * kDim);
    rows.insert(rows.end(), v.begin() + t * kRow + head * kDim,
                v.begin() + t * kRow + (head + 1) * kDim);
  }
  std::vector<uint8_t> out(rows.size() * kv_store::DTypeSize(dtype));
  if (dtype == kv_store::DType::kBf16) {
    FloatsToBf16Bytes(rows.data(), rows.size(), out.data());
  } else {
    std::memcpy(out.data(), rows.data(), out.size());
  }
  return out;
}

TEST(DecodeAttentionTest, Bf16RowsAttendAsTheirValuesAndMoveHalfTheBytes) {
  Fixture f(/*prompt=*/100, /*total=*/140, /*sink=*/4, /*local=*/16, kv_store::DType::kBf16);
  ByteRecorder bytes;
  DecodeAttention attention({kLayers, kKvHeads, kDim, 1 << 20}, &bytes);
  ASSERT_TRUE(attention.AddSequence(7, f.Setup("full", 8)).ok());
  // The fetched rows, widened, are the (bf16-exact) values: full equals dense over them.
  RunSteps(f, attention, 30, [](int, int64_t p, const std::vector<float>&) { return AllUpTo(p); });
  const RetrievalCounters c = attention.counters(7);
  EXPECT_GT(c.rows_fetched, 0);
  EXPECT_EQ(c.bytes_fetched, c.rows_fetched * 2 * kDim * 2);
  EXPECT_EQ(bytes.fetched_rows, c.rows_fetched);
  EXPECT_EQ(bytes.fetched_bytes, c.bytes_fetched);
  EXPECT_EQ(bytes.offloaded_bytes, 30 * kLayers * 2 * kRow * 2);
  // The generated rows [100, 130) were appended as bf16 rows.
  auto info = f.store.GetSequence(kv_store::testing::TestRef(7));
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->shape.dtype, kv_store::DType::kBf16);
  for (int l = 0; l < kLayers; ++l) {
    EXPECT_EQ(info->committed_rows[l], 130u);
    for (int h = 0; h < kKvHeads; ++h) {
      kv_store::RangeEntry range{kv_store::testing::TestRef(7), static_cast<uint32_t>(l),
                                 static_cast<uint32_t>(h), 100, 30};
      std::vector<uint8_t> got(30 * 2 * kDim * 2);
      ASSERT_TRUE(f.store.RangeRead(std::span(&range, 1), got).ok());
      EXPECT_EQ(got, HeadRows(f.k[l], f.v[l], h, 100, 30, kv_store::DType::kBf16))
          << "layer " << l << " head " << h;
    }
  }
}

TEST(DecodeAttentionTest, OneGatherMixesF32AndBf16Sequences) {
  Fixture a(64, 80, 4, 8), b(64, 80, 4, 8, kv_store::DType::kBf16);
  // b's rows also go into a's store (bf16, sequence 8): one gather per layer covers both
  // sequences, and the reply holds each one's rows in its own dtype.
  DecodeAttention attention({kLayers, kKvHeads, kDim, 0}, nullptr);
  ASSERT_NO_FATAL_FAILURE(AttendTwoSequencesFromOneStore(a, b, kv_store::DType::kBf16, attention));
  EXPECT_EQ(a.store.gathers.load(), kLayers);
  const int64_t rows = kLayers * kKvHeads * (64 - 4 - 8 + 1);  // [n_sink, local_begin) per head
  EXPECT_EQ(attention.counters(7).rows_fetched, rows);
  EXPECT_EQ(attention.counters(7).bytes_fetched, rows * 2 * kDim * 4);
  EXPECT_EQ(attention.counters(8).rows_fetched, rows);
  EXPECT_EQ(attention.counters(8).bytes_fetched, rows * 2 * kDim * 2);
}

// fp8 rows: what is fetched is decoded (DecodeFp8Row), so `full` equals dense attention over
// the decoded rows bit for bit; a fetched row moves its 40 stored bytes (head_dim 16: 32 codes,
// 2 scales), and generated rows go to the store as bf16, which it encodes.
TEST(DecodeAttentionTest, Fp8RowsAttendAsTheirDecodedValues) {
  Fixture f(/*prompt=*/100, /*total=*/140, /*sink=*/4, /*local=*/16, kv_store::DType::kFp8E4m3);
  ByteRecorder bytes;
  DecodeAttention attention({kLayers, kKvHeads, kDim, 1 << 20}, &bytes);
  ASSERT_TRUE(attention.AddSequence(7, f.Setup("full", 8)).ok());
  // 10 steps: the fetched rows [4, local_begin <= 94] are prompt rows, whose decoded values
  // the fixture holds.
  RunSteps(
      f, attention, 10, [](int, int64_t p, const std::vector<float>&) { return AllUpTo(p); },
      /*tolerance=*/0.f);
  const int64_t fp8_row_bytes = 40;
  ASSERT_EQ(kv_store::RowBytes(kv_store::DType::kFp8E4m3, kDim), 40u);
  const RetrievalCounters c = attention.counters(7);
  EXPECT_GT(c.rows_fetched, 0);
  EXPECT_EQ(c.bytes_fetched, c.rows_fetched * fp8_row_bytes);
  EXPECT_EQ(bytes.fetched_bytes, c.bytes_fetched);
  EXPECT_EQ(bytes.offloaded_bytes, 10 * kLayers * 2 * kRow * 2);  // bf16 K and V
  // The generated rows [100, 110) are stored as the fp8 rows of their bf16 values.
  auto info = f.store.GetSequence(kv_store::testing::TestRef(7));
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->shape.dtype, kv_store::DType::kFp8E4m3);
  const Fp8RowLayout layout{2, kDim};
  for (int l = 0; l < kLayers; ++l) {
    EXPECT_EQ(info->committed_rows[l], 110u);
    for (int h = 0; h < kKvHeads; ++h) {
      kv_store::RangeEntry range{kv_store::testing::TestRef(7), static_cast<uint32_t>(l),
                                 static_cast<uint32_t>(h), 100, 10};
      std::vector<uint8_t> got(10 * fp8_row_bytes);
      ASSERT_TRUE(f.store.RangeRead(std::span(&range, 1), got).ok());
      std::vector<uint8_t> want(got.size());
      std::vector<float> row(2 * kDim);
      for (int64_t t = 100; t < 110; ++t) {
        for (int d = 0; d < kDim; ++d) {
          row[d] = Bf16ToFloat(FloatToBf16(f.k[l][t * kRow + h * kDim + d]));
          row[kDim + d] = Bf16ToFloat(FloatToBf16(f.v[l][t * kRow + h * kDim + d]));
        }
        EncodeFp8Row(layout, row.data(), want.data() + (t - 100) * fp8_row_bytes);
      }
      EXPECT_EQ(got, want) << "layer " << l << " head " << h;
    }
  }
}

TEST(DecodeAttentionTest, RefusesRowDtypesItCannotRead) {
  Fixture f(40, 50, 4, 8);
  DecodeAttention attention({kLayers, kKvHeads, kDim, 1 << 20}, nullptr);
  DecodeSequenceSetup setup = f.Setup("full", 8);
  setup.row_dtype = kv_store::DType::kF16;
  const absl::Status s = attention.AddSequence(7, std::move(setup));
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_THAT(s.message(), ::testing::HasSubstr("f16"));
  EXPECT_FALSE(attention.Has(7));
}

// ---- Sampled retrieval quality (--quality-sample-rate) ----

// Records OnQuality calls.
class QualityRecorder final : public DecodeObserver {
 public:
  struct Sample {
    std::string method;
    double recall = 0, mass = 0;
  };
  void OnQuality(std::string_view method, double recall, double mass) override {
    samples.push_back({std::string(method), recall, mass});
  }
  void OnQualitySampled(std::string_view method, bool selecting) override {
    ++(selecting ? selecting_by_method : not_selecting_by_method)[std::string(method)];
  }
  std::vector<Sample> samples;
  std::map<std::string, int64_t> selecting_by_method, not_selecting_by_method;
};

// A method that selects given positions (per KV head) whatever the query: the hand-made case.
class FixedIndex final : public retrieval::RetrievalIndex {
 public:
  FixedIndex(const retrieval::IndexShape& shape, std::vector<std::vector<int64_t>> picks,
             int64_t size)
      : RetrievalIndex(shape), picks_(std::move(picks)), size_(size) {}
  std::string_view method() const override { return "fixed"; }
  int64_t size() const override { return size_; }
  absl::Status Build(const retrieval::BuildInput& in) override {
    size_ = in.keys.n_tokens;
    return absl::OkStatus();
  }
  absl::Status Append(const retrieval::AppendInput& in) override {
    size_ += in.keys.n_tokens;
    return absl::OkStatus();
  }
  absl::Status Select(const retrieval::SelectRequest&, retrieval::Selection* out) override {
    out->per_head = picks_;
    return absl::OkStatus();
  }
  int64_t MemoryBytes() const override { return 0; }
  absl::Status SerializePayload(retrieval::ByteWriter&) const override {
    return absl::UnimplementedError("FixedIndex is not serialised");
  }
  std::vector<std::vector<int64_t>> picks_;

 private:
  int64_t size_ = 0;
};

// The evaluator's definitions written out directly on the full K of one layer: per query head
// the softmax over [0, p]; per KV head the oracle top-`budget` of the candidates
// [n_sink, local_begin) by the group's summed, candidate-renormalised probabilities.
struct DirectQuality {
  double recall = 0, mass = 0;
  std::vector<std::vector<int64_t>> oracle;  // [n_kv_heads] the exact top-budget positions
};
DirectQuality Direct(const std::vector<float>& k, const float* q, int64_t p, int64_t n_sink,
                     int64_t local_begin, int64_t budget,
                     const std::vector<std::vector<int64_t>>* picked) {
  const int group = kHeads / kKvHeads;
  const float scale = 1.f / std::sqrt(float{kDim});
  std::vector<std::vector<double>> probs(kHeads, std::vector<double>(p + 1));
  for (int h = 0; h < kHeads; ++h) {
    double m = -1e30, z = 0;
    for (int64_t t = 0; t <= p; ++t) {
      double dot = 0;
      for (int d = 0; d < kDim; ++d) dot += q[h * kDim + d] * k[t * kRow + (h / group) * kDim + d];
      probs[h][t] = scale * dot;
      m = std::max(m, probs[h][t]);
    }
    for (double& x : probs[h]) z += (x = std::exp(x - m));
    for (double& x : probs[h]) x /= z;
  }
  DirectQuality out;
  double hits = 0, total = 0;
  for (int kvh = 0; kvh < kKvHeads; ++kvh) {
    std::vector<double> agg(local_begin - n_sink, 0.0);
    for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
      double z = 0;
      for (int64_t t = n_sink; t < local_begin; ++t) z += probs[h][t];
      for (int64_t t = n_sink; t < local_begin; ++t) agg[t - n_sink] += probs[h][t] / z;
    }
    std::vector<int64_t> order(agg.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return agg[a] > agg[b]; });
    order.resize(std::min<size_t>(order.size(), budget));
    std::vector<int64_t> top;
    for (int64_t i : order) top.push_back(n_sink + i);
    const std::vector<int64_t>& sel = picked != nullptr ? (*picked)[kvh] : top;
    for (int64_t id : sel) hits += std::count(top.begin(), top.end(), id);
    total += static_cast<double>(top.size());
    for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
      double mass = 0;
      for (int64_t t = 0; t < n_sink; ++t) mass += probs[h][t];
      for (int64_t t = local_begin; t <= p; ++t) mass += probs[h][t];
      for (int64_t id : sel) mass += probs[h][id];
      out.mass += mass / kHeads;
    }
    out.oracle.push_back(std::move(top));
  }
  out.recall = hits / total;
  return out;
}

// RunSteps' query of (p, layer).
std::vector<float> StepQuery(int64_t p, int layer) {
  return RandomTensor(1, kHeads, kDim, 1000 + p * 10 + layer);
}
auto NoCheck() {
  return [](int, int64_t, const std::vector<float>&) { return std::vector<int64_t>{}; };
}

TEST(DecodeAttentionQualityTest, ExactHasRecallOneAndTheDirectMass) {
  // bf16 store rows: the oracle reads them (half the bytes) and widens them to the values.
  // fp8 rows likewise, decoded (the fixture's values are the decoded ones).
  for (const kv_store::DType dtype :
       {kv_store::DType::kF32, kv_store::DType::kBf16, kv_store::DType::kFp8E4m3}) {
    SCOPED_TRACE(kv_store::DTypeName(dtype));
    const auto row_bytes = static_cast<int64_t>(kv_store::RowBytes(dtype, kDim));
    constexpr int kSteps = 3;
    Fixture f(/*prompt=*/120, /*total=*/130, /*sink=*/4, /*local=*/16, dtype);
    QualityRecorder recorder;
    DecodeAttention attention(EveryStepSampled(), &recorder);
    ASSERT_TRUE(attention.AddSequence(7, f.Setup("exact", 8)).ok());
    RunSteps(f, attention, kSteps, NoCheck());
    ASSERT_EQ(recorder.samples.size(), size_t{kSteps * kLayers});  // rate 1: every (step, layer)
    int64_t candidates = 0;
    for (int s = 0; s < kSteps; ++s) {
      const int64_t p = f.prompt + s, local_begin = p + 1 - 16;
      candidates += local_begin - 4;
      for (int l = 0; l < kLayers; ++l) {
        const std::vector<float> q = StepQuery(p, l);
        const DirectQuality want = Direct(f.k[l], q.data(), p, 4, local_begin, 8, nullptr);
        const QualityRecorder::Sample& got = recorder.samples[s * kLayers + l];
        EXPECT_EQ(got.method, "exact");
        EXPECT_DOUBLE_EQ(got.recall, 1.0) << "step " << s << " layer " << l;
        EXPECT_NEAR(got.mass, want.mass, 1e-5) << "step " << s << " layer " << l;
        EXPECT_LT(got.mass, 1.0);  // 8 of ~100 candidates do not cover everything
      }
    }
    // The oracle's reads are counted apart from the request's fetches.
    const NodeCounters& node = attention.node_counters();
    EXPECT_EQ(node.quality_samples, kSteps * kLayers);
    EXPECT_EQ(node.quality_rows_fetched, candidates * kLayers * kKvHeads);
    EXPECT_EQ(node.quality_bytes_fetched, node.quality_rows_fetched * row_bytes);
    EXPECT_EQ(f.store.range_reads.load(), kSteps * kLayers);  // one read per sample, all heads
    const RetrievalCounters c = attention.counters(7);
    EXPECT_EQ(c.rows_fetched, c.hot_cache_misses);
    EXPECT_EQ(c.bytes_fetched, c.rows_fetched * row_bytes);
    EXPECT_EQ(node.retrieval.rows_fetched, c.rows_fetched);
  }
}

TEST(DecodeAttentionQualityTest, EmptySelectionHasRecallZeroAndOnlyResidentMass) {
  Fixture f(/*prompt=*/100, /*total=*/110, /*sink=*/4, /*local=*/16);
  QualityRecorder recorder;
  DecodeAttention attention(EveryStepSampled(), &recorder);
  ASSERT_TRUE(attention.AddSequence(7, f.Setup("streaming", 8)).ok());
  RunSteps(f, attention, 1, NoCheck());
  ASSERT_EQ(recorder.samples.size(), size_t{kLayers});
  const std::vector<std::vector<int64_t>> none(kKvHeads);
  for (int l = 0; l < kLayers; ++l) {
    const std::vector<float> q = StepQuery(100, l);
    const DirectQuality want = Direct(f.k[l], q.data(), 100, 4, 101 - 16, 8, &none);
    EXPECT_EQ(recorder.samples[l].method, "streaming");
    EXPECT_DOUBLE_EQ(recorder.samples[l].recall, 0.0);
    EXPECT_NEAR(recorder.samples[l].mass, want.mass, 1e-5);
  }
}

TEST(DecodeAttentionQualityTest, HandMadeSelectionHasHalfRecall) {
  // KV head 0 selects its oracle top-8, KV head 1 eight candidates outside its top-8: recall
  // (8 + 0) / 16 = 0.5.
  Fixture f(/*prompt=*/60, /*total=*/61, /*sink=*/4, /*local=*/8);
  const int64_t p = 60, local_begin = p + 1 - 8;
  const int l = 1;
  const std::vector<float> q = StepQuery(p, l);
  const DirectQuality oracle = Direct(f.k[l], q.data(), p, 4, local_begin, 8, nullptr);
  std::vector<std::vector<int64_t>> picks = {oracle.oracle[0], {}};
  for (int64_t t = 4; t < local_begin && picks[1].size() < 8; ++t) {
    if (std::count(oracle.oracle[1].begin(), oracle.oracle[1].end(), t) == 0) {
      picks[1].push_back(t);
    }
  }
  ASSERT_EQ(picks[1].size(), 8u);
  const DirectQuality want = Direct(f.k[l], q.data(), p, 4, local_begin, 8, &picks);
  ASSERT_DOUBLE_EQ(want.recall, 0.5);

  QualityRecorder recorder;
  DecodeAttention attention(EveryStepSampled(), &recorder);
  DecodeSequenceSetup setup = f.Setup("exact", 8, /*null_index=*/true);
  setup.method = "fixed";
  for (int layer = 0; layer < kLayers; ++layer) {
    setup.indexes[layer] = std::make_unique<FixedIndex>(
        retrieval::IndexShape{kHeads, kKvHeads, kDim, layer, kLayers, {}}, picks, f.prompt);
  }
  ASSERT_TRUE(attention.AddSequence(7, std::move(setup)).ok());
  RunSteps(f, attention, 1, NoCheck());
  ASSERT_EQ(recorder.samples.size(), size_t{kLayers});
  const QualityRecorder::Sample& got = recorder.samples[l];
  EXPECT_EQ(got.method, "fixed");
  EXPECT_DOUBLE_EQ(got.recall, 0.5);
  EXPECT_NEAR(got.mass, want.mass, 1e-5);
  EXPECT_GT(got.mass, 0.0);
  EXPECT_LT(got.mass, 1.0);
}

TEST(DecodeAttentionQualityTest, RateZeroNeverReadsAndStepsThatDidNotChooseAreNotSampled) {
  {
    Fixture f(/*prompt=*/100, /*total=*/110, /*sink=*/4, /*local=*/16);
    QualityRecorder recorder;
    DecodeAttention attention({kLayers, kKvHeads, kDim, 1 << 20}, &recorder);  // rate 0
    ASSERT_TRUE(attention.AddSequence(7, f.Setup("exact", 8)).ok());
    RunSteps(f, attention, 5, NoCheck());
    EXPECT_TRUE(recorder.samples.empty());
    EXPECT_EQ(f.store.range_reads.load(), 0);
    EXPECT_EQ(attention.node_counters().quality_samples, 0);
    EXPECT_EQ(attention.node_counters().quality_bytes_fetched, 0);
  }
  // Steps that chose nothing are not sampled at rate 1 (their recall would read 1 by
  // definition): `full` attends every candidate, and `exact` with a budget of at least the
  // candidates (~80 here) selects them all. Nothing is read for them either.
  for (const auto& [method, budget] :
       std::vector<std::pair<std::string, int64_t>>{{"full", 8}, {"exact", 100}}) {
    SCOPED_TRACE(method);
    Fixture f(/*prompt=*/100, /*total=*/110, /*sink=*/4, /*local=*/16);
    QualityRecorder recorder;
    DecodeAttention attention(EveryStepSampled(), &recorder);
    ASSERT_TRUE(attention.AddSequence(7, f.Setup(method, budget)).ok());
    RunSteps(f, attention, 2, NoCheck());
    EXPECT_TRUE(recorder.samples.empty());
    EXPECT_EQ(attention.node_counters().quality_samples, 0);
    EXPECT_EQ(f.store.range_reads.load(), 0);
    // ...but they are counted as sampled with nothing to select, so that no recall for a
    // method reads as "nothing to select" and not as "perfect".
    EXPECT_EQ(attention.node_counters().quality_not_selecting, 2 * kLayers);
    EXPECT_EQ(attention.node_counters().quality_selecting, 0);
    EXPECT_EQ(recorder.not_selecting_by_method[method], 2 * kLayers);
    EXPECT_EQ(recorder.selecting_by_method[method], 0);
  }
  // The same sequence with a budget below its candidates chose, and is sampled every step.
  {
    Fixture f(/*prompt=*/100, /*total=*/110, /*sink=*/4, /*local=*/16);
    QualityRecorder recorder;
    DecodeAttention attention(EveryStepSampled(), &recorder);
    ASSERT_TRUE(attention.AddSequence(7, f.Setup("exact", 8)).ok());
    RunSteps(f, attention, 2, NoCheck());
    EXPECT_EQ(recorder.samples.size(), size_t{2 * kLayers});
    EXPECT_EQ(attention.node_counters().quality_samples, 2 * kLayers);
    EXPECT_EQ(attention.node_counters().quality_selecting, 2 * kLayers);
    EXPECT_EQ(attention.node_counters().quality_not_selecting, 0);
    EXPECT_EQ(recorder.selecting_by_method["exact"], 2 * kLayers);
    EXPECT_EQ(recorder.not_selecting_by_method["exact"], 0);
  }
}

TEST(DecodeAttentionQualityTest, PartialRateSamplesSomeStepsDeterministically) {
  auto run = [](uint64_t seed) {
    Fixture f(/*prompt=*/40, /*total=*/60, /*sink=*/4, /*local=*/8);
    DecodeAttentionOptions options{kLayers, kKvHeads, kDim, 1 << 20};
    options.quality_sample_rate = 0.5;
    options.quality_seed = seed;
    DecodeAttention attention(options, nullptr);
    EXPECT_TRUE(attention.AddSequence(7, f.Setup("exact", 4)).ok());
    RunSteps(f, attention, 20, NoCheck());
    EXPECT_EQ(f.store.range_reads.load(), attention.node_counters().quality_samples);
    EXPECT_EQ(attention.node_counters().quality_selecting,
              attention.node_counters().quality_samples);
    EXPECT_EQ(attention.node_counters().quality_not_selecting, 0);
    return attention.node_counters().quality_samples;
  };
  const int64_t samples = run(1);
  EXPECT_GT(samples, 0);
  EXPECT_LT(samples, 20 * kLayers);
  EXPECT_EQ(run(1), samples);  // same seed, same samples
}

}  // namespace
}  // namespace kvr::decode
