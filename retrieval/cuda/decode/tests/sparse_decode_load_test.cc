// A real past loaded into a sequence of the GPU sparse decode (sparse_decode.h: HostKv +
// ActivateSequence; the decode node's path) against the dense sequence it came from.
//
// A dense sequence runs a prompt on the GPU with its KV exported (BeginKvExport: the bf16 rows
// widened to float32, exactly); those rows are narrowed back to bf16 (exact) and written into a
// sparse sequence's host KV, which ActivateSequence turns into ring rows and quest bounds.
// Then 32 decode steps on both, fed the dense path's greedy tokens: with a budget that covers
// every candidate the sparse sequence attends over exactly the dense one's rows, so logits must
// agree within the tolerance of sparse_decode_test.cc (the two decode attention kernels round P
// differently) and the greedy tokens must be equal (a near tie would be reported and fails).
// A second sparse sequence loaded alike at a small budget must run and stay finite. Misuse
// answers the documented errors. Clusterkv: ActivateSequenceWithClusters given the clustering
// ActivateSequence builds decodes the same logits. fp8 row sources decode the same logits as
// bf16 row sources of the values they decode to. CTest label `gpu`.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "cuda_test_util.h"
#include "gtest/gtest.h"
#include "kvr/common/fp8.h"
#include "kvr/common/half.h"
#include "kvr/model/cuda_model.h"
#include "kvr/model/dummy.h"
#include "kvr/model/sampler.h"
#include "kvr/retrieval/cuda/sparse_decode.h"
#include "sparse_test_util.h"

namespace kvr::model {
namespace {

using namespace cuda_test;
using namespace retrieval::cuda;  // SparseDecodeOptions, SparseClusterHead ...

uint16_t Bf16Bits(float f) {  // f is a widened bf16 value: the top half is exact
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return static_cast<uint16_t>(u >> 16);
}

// Writes the exported rows [0, L) of every layer into a host KV in HostKv's layout.
void Fill(std::span<uint16_t> host, const ModelConfig& c, int64_t capacity, int64_t L,
          const std::vector<KvView>& layers) {
  const int kv = c.n_kv_heads, d = c.head_dim;
  ASSERT_EQ(static_cast<int64_t>(host.size()), int64_t{c.n_layers} * kv * capacity * 2 * d);
  for (int l = 0; l < c.n_layers; ++l) {
    const KvView& v = layers[l];
    ASSERT_NE(v.k, nullptr) << "layer " << l << " not exported";
    for (int h = 0; h < kv; ++h) {
      for (int64_t t = 0; t < L; ++t) {
        uint16_t* row = host.data() + ((int64_t{l} * kv + h) * capacity + t) * 2 * d;
        const float* k = v.k + t * v.row_stride + h * d;
        const float* vv = v.v + t * v.row_stride + h * d;
        for (int i = 0; i < d; ++i) {
          row[i] = Bf16Bits(k[i]);
          row[d + i] = Bf16Bits(vv[i]);
        }
      }
    }
  }
}

void Load(retrieval::cuda::SparseDecodeAttention& sp, SequenceId id, const ModelConfig& c,
          int64_t capacity, int64_t L, const std::vector<KvView>& layers) {
  auto host = sp.HostKv(id);
  ASSERT_TRUE(host.ok()) << host.status();
  Fill(*host, c, capacity, L, layers);
  const absl::Status st = sp.ActivateSequence(id, L);
  ASSERT_TRUE(st.ok()) << st;
}

void CheckLoaded(const std::string& shape, int n_layers) {
  SparseModel m;
  MakeSparseModel(shape, n_layers, 21, 256, 4, &m);
  if (::testing::Test::HasFatalFailure()) return;
  const ModelConfig& c = m.config;
  CudaModel& gpu = *m.gpu;
  retrieval::cuda::SparseDecodeAttention& sp = *m.sp;
  const int vocab = c.vocab;
  constexpr int64_t kCapacity = 256, kPrompt = 150;

  SparseDecodeOptions so;
  so.method = SparseMethod::kQuest;
  so.slots = 2;
  so.max_capacity = kCapacity;
  so.budget = 256;  // covers every candidate
  so.n_sink = 4;
  so.local_window = 16;  // the ring wraps during the prompt and the steps
  so.hot_cache_rows = 64;
  ASSERT_TRUE(sp.Configure(so).ok());

  // Dense prefill with the KV export; the views stay valid until EndKvExport.
  constexpr SequenceId kDense = 1, kSparse = 2;
  ASSERT_TRUE(gpu.AddSequence(kDense, kCapacity).ok());
  std::vector<KvView> layers(c.n_layers);
  KvExportOptions eo;
  eo.length = kPrompt;
  eo.max_queries = 0;
  eo.on_layer = [&layers](const KvExportLayer& x) { layers[x.layer] = x.kv; };
  ASSERT_TRUE(gpu.BeginKvExport(kDense, eo).ok());
  const std::vector<int32_t> prompt = Tokens(kPrompt, vocab, 7);
  std::vector<float> logits(vocab);
  const CudaSequence p{kDense, prompt};
  ASSERT_TRUE(gpu.Forward(std::span(&p, 1), LogitsMode::kLast, logits).ok());

  // Misuse first.
  // The model's dense sequence is none of the sparse decode's.
  EXPECT_EQ(sp.HostKv(kDense).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(sp.ActivateSequence(99, 1).code(), absl::StatusCode::kNotFound);
  // The host KV acquired and filled on another thread (as the decode node's Prepare does while
  // its loop runs other sequences), then adopted by the sparse sequence.
  EXPECT_EQ(sp.AcquireHostKv(0).status().code(), absl::StatusCode::kInvalidArgument);
  std::shared_ptr<SparseHostKvBuffer> acquired;
  std::thread filler([&] {
    auto a = sp.AcquireHostKv(kCapacity);
    ASSERT_TRUE(a.ok()) << a.status();
    acquired = *a;
    ASSERT_EQ((*a)->capacity(), kCapacity);
    Fill(acquired->rows(), c, kCapacity, kPrompt, layers);
  });
  filler.join();
  ASSERT_NE(acquired, nullptr);
  SparseSequenceOptions adopt;
  adopt.host_kv = acquired;
  EXPECT_EQ(sp.AddSequence(kSparse, kCapacity - 1, adopt).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(sp.AddSequence(kSparse, kCapacity, adopt).ok());
  EXPECT_EQ(sp.AddSequence(3, kCapacity, adopt).code(), absl::StatusCode::kFailedPrecondition)
      << "a host KV in use by another sequence";
  EXPECT_EQ(sp.ActivateSequence(kSparse, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(sp.ActivateSequence(kSparse, kCapacity + 1).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(sp.ActivateSequence(kSparse, kPrompt).ok());
  acquired.reset();
  EXPECT_EQ(sp.ActivateSequence(kSparse, kPrompt).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(*sp.SequenceLength(kSparse), kPrompt);
  ASSERT_TRUE(gpu.EndKvExport(kDense).ok());

  // 32 steps on both, fed the dense greedy tokens.
  int32_t next = ArgMax(logits);
  double worst_cos = 1, worst_ratio = 0;
  int mismatches = 0;
  for (int step = 0; step < 32; ++step) {
    std::vector<float> want(vocab, NAN), got(vocab, NAN);
    const CudaSequence d{kDense, std::span(&next, 1)}, s{kSparse, std::span(&next, 1)};
    ASSERT_TRUE(gpu.Forward(std::span(&d, 1), LogitsMode::kLast, want).ok());
    const absl::Status st = sp.Forward(std::span(&s, 1), LogitsMode::kLast, got);
    ASSERT_TRUE(st.ok()) << st;
    const RowError e = Compare(got, want);
    ASSERT_TRUE(std::isfinite(e.max_err)) << "step " << step;
    worst_cos = std::min(worst_cos, e.cosine);
    worst_ratio = std::max(worst_ratio, e.max_err / std::max(e.rms, 1e-6));
    EXPECT_GE(e.cosine, kMinCosine) << shape << " step " << step;
    EXPECT_LE(e.max_err, kMaxErrOverRms * e.rms) << shape << " step " << step;
    // Greedy tokens: the same, or a near tie of the dense logits (within twice the logits'
    // error; which way such a tie goes depends on the GEMM algorithms the GPU picks).
    const int32_t g = ArgMax(got), w = ArgMax(want);
    if (g != w) ++mismatches;
    EXPECT_TRUE(g == w || want[w] - want[g] <= 2 * e.max_err)
        << shape << " step " << step << ": sparse greedy " << g << " vs dense " << w
        << " (dense gap " << want[w] - want[g] << ", logits max |err| " << e.max_err << ")";
    next = w;
  }
  EXPECT_LE(mismatches, 2) << shape << ": near ties stay rare";
  EXPECT_EQ(*sp.SequenceLength(kSparse), kPrompt + 32);
  std::printf(
      "[ load   ] %-14s prompt %lld, 32 steps: min cosine %.6f  max |err|/rms %.4f  "
      "greedy mismatches %d\n",
      shape.c_str(), static_cast<long long>(kPrompt), worst_cos, worst_ratio, mismatches);

  // The same rows at a small budget in the other slot (the host KV of kSparse is reused after
  // its release): runs and stays finite.
  ASSERT_TRUE(sp.ReleaseSequence(kSparse).ok());
  ASSERT_TRUE(gpu.ReleaseSequence(kDense).ok());
  ASSERT_TRUE(sp.Configure({}).ok());
  so.budget = 32;
  ASSERT_TRUE(sp.Configure(so).ok());
  ASSERT_TRUE(gpu.AddSequence(kDense, kCapacity).ok());
  layers.assign(c.n_layers, KvView{});
  ASSERT_TRUE(gpu.BeginKvExport(kDense, eo).ok());
  ASSERT_TRUE(gpu.Forward(std::span(&p, 1), LogitsMode::kLast, logits).ok());
  ASSERT_TRUE(sp.AddSequence(kSparse, kCapacity, {}).ok());
  Load(sp, kSparse, c, kCapacity, kPrompt, layers);
  ASSERT_TRUE(gpu.ReleaseSequence(kDense).ok());
  next = ArgMax(logits);
  for (int step = 0; step < 32; ++step) {
    std::vector<int32_t> out(1, -1);
    const CudaSequence s{kSparse, std::span(&next, 1)};
    const absl::Status st = sp.ForwardGreedy(std::span(&s, 1), out);
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_TRUE(out[0] >= 0 && out[0] < vocab);
    next = out[0];
  }
  EXPECT_EQ(*sp.SequenceLength(kSparse), kPrompt + 32);
  ASSERT_TRUE(sp.ReleaseSequence(kSparse).ok());
}

TEST(CudaSparseLoadTest, Llama3LoadedQuestEqualsDense) {
  SKIP_WITHOUT_GPU();
  CheckLoaded("llama3-8b", 2);
}

TEST(CudaSparseLoadTest, Smollm2LoadedQuestEqualsDense) {
  SKIP_WITHOUT_GPU();
  CheckLoaded("smollm2-135m", 4);
}

// ActivateSequenceWithClusters given the clustering ActivateSequence builds itself
// (contiguous runs of clusterkv_tokens_per_cluster candidates, centroid = mean bf16 key, summed
// in float in token order as FillClusterKernel does), plus ids it must drop (sinks, window) and
// a cluster that is empty once they are dropped: the two slots must then decode bit-equal
// logits at a budget that makes the selection matter. Misuse leaves the sequence unactivated.
TEST(CudaSparseLoadTest, GivenClustersEqualTheBuiltOnes) {
  SKIP_WITHOUT_GPU();
  SparseModel m;
  MakeSparseModel("smollm2-135m", 2, 23, 64, 2, &m);
  if (HasFatalFailure()) return;
  const ModelConfig& c = m.config;
  retrieval::cuda::SparseDecodeAttention& sp = *m.sp;
  constexpr int64_t kCapacity = 256, kPrompt = 150;
  SparseDecodeOptions so;
  so.method = SparseMethod::kClusterKv;
  so.slots = 2;
  so.max_capacity = kCapacity;
  so.budget = 24;  // a few of the ~16 clusters of 8: the centroids decide what is attended
  so.n_sink = 4;
  so.local_window = 16;
  so.hot_cache_rows = 64;
  so.clusterkv_tokens_per_cluster = 8;
  ASSERT_TRUE(sp.Configure(so).ok());

  // The same random rows (bf16: the top half of a float) in both host KVs.
  const int kv = c.n_kv_heads, d = c.head_dim;
  constexpr SequenceId kBuilt = 1, kGiven = 2;
  std::vector<uint16_t> rows;
  for (SequenceId id : {kBuilt, kGiven}) {
    ASSERT_TRUE(sp.AddSequence(id, kCapacity, SparseSequenceOptions{}).ok());
    auto host = sp.HostKv(id);
    ASSERT_TRUE(host.ok()) << host.status();
    if (rows.empty()) {
      rows.resize(host->size());
      uint64_t x = 99;
      for (uint16_t& r : rows) {
        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
        const float f = static_cast<float>(static_cast<int64_t>(x >> 40) - (1 << 23)) / (1 << 23);
        uint32_t u;
        std::memcpy(&u, &f, sizeof(u));
        r = static_cast<uint16_t>(u >> 16);
      }
    }
    ASSERT_EQ(host->size(), rows.size());
    std::copy(rows.begin(), rows.end(), host->begin());
  }
  auto key = [&](int l, int h, int64_t t, int i) {
    const uint32_t u = uint32_t{rows[((int64_t{l} * kv + h) * kCapacity + t) * 2 * d + i]} << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  };

  // Per (layer, head): a cluster of the sinks and the first window token (dropped whole), then
  // the built clusters, the first one with sink 0 added (dropped from it).
  const int64_t lo = so.n_sink, hi = kPrompt - so.local_window;
  const int64_t tpc = so.clusterkv_tokens_per_cluster;
  std::vector<std::vector<float>> cent(c.n_layers * kv);
  std::vector<std::vector<int32_t>> off(c.n_layers * kv), ids(c.n_layers * kv);
  std::vector<SparseClusterHead> heads(c.n_layers * kv);
  for (int l = 0; l < c.n_layers; ++l) {
    for (int h = 0; h < kv; ++h) {
      const int j = l * kv + h;
      off[j] = {0};
      for (int64_t t = 0; t < lo; ++t) ids[j].push_back(static_cast<int32_t>(t));
      ids[j].push_back(static_cast<int32_t>(hi));
      off[j].push_back(static_cast<int32_t>(ids[j].size()));
      cent[j].assign(d, 1.f);
      for (int64_t t0 = lo; t0 < hi; t0 += tpc) {
        const int64_t t1 = std::min(hi, t0 + tpc);
        if (t0 == lo) ids[j].push_back(0);
        for (int64_t t = t0; t < t1; ++t) ids[j].push_back(static_cast<int32_t>(t));
        off[j].push_back(static_cast<int32_t>(ids[j].size()));
        for (int i = 0; i < d; ++i) {
          float sum = 0.f;
          for (int64_t t = t0; t < t1; ++t) sum += key(l, h, t, i);
          cent[j].push_back(sum / static_cast<float>(t1 - t0));
        }
      }
      heads[j] = {cent[j], off[j], ids[j]};
    }
  }

  // Misuse: nothing activated, then the real call works.
  EXPECT_EQ(sp.ActivateSequenceWithClusters(99, kPrompt, heads).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(sp.ActivateSequenceWithClusters(kGiven, kPrompt, std::span(heads).first(1)).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<SparseClusterHead> bad = heads;
  bad.back().offsets = bad.back().offsets.first(bad.back().offsets.size() - 1);
  EXPECT_EQ(sp.ActivateSequenceWithClusters(kGiven, kPrompt, bad).code(),
            absl::StatusCode::kInvalidArgument)
      << "offsets that do not end at the ids' count";
  EXPECT_EQ(*sp.SequenceLength(kGiven), 0) << "a failed activation activates nothing";
  ASSERT_TRUE(sp.ActivateSequence(kBuilt, kPrompt).ok());
  const absl::Status st = sp.ActivateSequenceWithClusters(kGiven, kPrompt, heads);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(*sp.SequenceLength(kGiven), kPrompt);
  EXPECT_EQ(sp.ActivateSequenceWithClusters(kGiven, kPrompt, heads).code(),
            absl::StatusCode::kFailedPrecondition);

  // 24 steps, both fed the built sequence's greedy tokens (the window's tokens leave it and
  // join as singletons in both).
  int32_t next = 1;
  for (int step = 0; step < 24; ++step) {
    std::vector<float> want(c.vocab, NAN), got(c.vocab, NAN);
    const CudaSequence b{kBuilt, std::span(&next, 1)}, g{kGiven, std::span(&next, 1)};
    ASSERT_TRUE(sp.Forward(std::span(&b, 1), LogitsMode::kLast, want).ok());
    ASSERT_TRUE(sp.Forward(std::span(&g, 1), LogitsMode::kLast, got).ok());
    ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0)
        << "step " << step << ": given clusters decode other logits than the built ones (cosine "
        << Compare(got, want).cosine << ")";
    next = ArgMax(want);
  }
}

// A paged row source (SparseRowSource) over host memory this test owns, in the store's layout:
// page p of (layer l, head h) is page (l * kv + h) * pages_per_head + (pages_per_head - 1 - p)
// (reversed, so the page table matters), each of kPageRows rows of `row_bytes`.
struct PagedRows {
  static constexpr int32_t kPageRows = 128;
  void* host = nullptr;
  size_t bytes = 0;
  size_t row_bytes = 0;
  SparseRowSource source;

  PagedRows(const ModelConfig& c, int64_t capacity, size_t row) : row_bytes(row) {
    source.page_rows = kPageRows;
    source.pages_per_head = static_cast<int32_t>((capacity + kPageRows - 1) / kPageRows);
    source.page_bytes = int64_t{kPageRows} * static_cast<int64_t>(row);
    const int64_t heads = int64_t{c.n_layers} * c.n_kv_heads;
    for (int64_t j = 0; j < heads; ++j) {
      for (int32_t p = 0; p < source.pages_per_head; ++p) {
        source.pages.push_back(
            static_cast<int32_t>(j * source.pages_per_head + (source.pages_per_head - 1 - p)));
      }
    }
    bytes = static_cast<size_t>(heads * source.pages_per_head * source.page_bytes);
    bytes = (bytes + 4095) / 4096 * 4096;
    host = std::aligned_alloc(4096, bytes);
    std::memset(host, 0, bytes);
  }
  ~PagedRows() { std::free(host); }
  PagedRows(const PagedRows&) = delete;
  PagedRows& operator=(const PagedRows&) = delete;

  uint8_t* Row(int layer, int h, int n_kv, int64_t t) {
    const int32_t page =
        source.pages[(int64_t{layer} * n_kv + h) * source.pages_per_head + t / kPageRows];
    return static_cast<uint8_t*>(host) + page * source.page_bytes + (t % kPageRows) * row_bytes;
  }
};

// fp8 row sources (SparseDecodeOptions::row_format) against bf16 row sources of the values the
// fp8 rows decode to. Every K and V vector's largest magnitude is 448 * 2^k, so its fp8 scale is
// exactly 2^k and every decoded value (a 4-bit significand times 2^k) is a bf16: the two sources
// then hold the same numbers, and the ring, the summaries (quest bounds, clusterkv centroids),
// the selections and the gathered rows must be the same, so the logits must be bit-equal, at
// budgets where the selection matters, over steps that hit the hot cache.
TEST(CudaSparseLoadTest, Fp8RowSourceDecodesAsItsBf16Values) {
  SKIP_WITHOUT_GPU();
  SparseModel m;
  MakeSparseModel("smollm2-135m", 2, 29, 64, 2, &m);
  if (HasFatalFailure()) return;
  const ModelConfig& c = m.config;
  retrieval::cuda::SparseDecodeAttention& sp = *m.sp;
  const int kv = c.n_kv_heads, d = c.head_dim;
  constexpr int64_t kCapacity = 256, kPrompt = 200;
  constexpr SequenceId kSeq = 1;
  const Fp8RowLayout layout{2, d};

  PagedRows fp8(c, kCapacity, layout.RowBytes()), bf16(c, kCapacity, 4 * size_t(d));
  uint64_t x = 1234;
  auto uniform = [&x] {  // in [-1, 1)
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<float>(static_cast<int64_t>(x >> 40) - (1 << 23)) / (1 << 23);
  };
  std::vector<float> row(2 * d), decoded(2 * d);
  for (int l = 0; l < c.n_layers; ++l) {
    for (int h = 0; h < kv; ++h) {
      for (int64_t t = 0; t < kCapacity; ++t) {
        for (int half = 0; half < 2; ++half) {
          const float top = 448.f * std::ldexp(1.f, -static_cast<int>((t + half) % 7) - 5);
          for (int i = 0; i < d; ++i) row[half * d + i] = top * uniform();
          row[half * d + static_cast<int>(t % d)] = (t % 2 == 0 ? top : -top);
        }
        uint8_t* f = fp8.Row(l, h, kv, t);
        EncodeFp8Row(layout, row.data(), f);
        DecodeFp8Row(layout, f, decoded.data());
        uint16_t* b = reinterpret_cast<uint16_t*>(bf16.Row(l, h, kv, t));
        for (int i = 0; i < 2 * d; ++i) {
          b[i] = FloatToBf16(decoded[i]);
          ASSERT_EQ(Bf16ToFloat(b[i]), decoded[i]) << "the decoded fp8 value is a bf16";
        }
      }
    }
  }
  for (PagedRows* p : {&fp8, &bf16}) {
    auto device = sp.RegisterHostRegion(p->host, p->bytes, /*read_only=*/true);
    ASSERT_TRUE(device.ok()) << device.status();
    p->source.base = *device;
  }

  for (SparseMethod method : {SparseMethod::kQuest, SparseMethod::kClusterKv}) {
    const char* name = method == SparseMethod::kQuest ? "quest" : "clusterkv";
    SparseDecodeOptions so;
    so.method = method;
    so.slots = 2;
    so.max_capacity = kCapacity;
    so.budget = 32;  // of ~180 candidates: the selection decides what is attended
    so.n_sink = 4;
    so.local_window = 16;
    so.hot_cache_rows = 64;
    so.clusterkv_tokens_per_cluster = 8;
    so.min_page_rows = PagedRows::kPageRows;
    std::vector<std::vector<float>> want;  // per step: the bf16 source's logits
    int32_t tokens[24];
    for (SparseRowFormat format : {SparseRowFormat::kBf16, SparseRowFormat::kFp8E4m3}) {
      const bool is_fp8 = format == SparseRowFormat::kFp8E4m3;
      so.row_format = format;
      ASSERT_TRUE(sp.Configure({}).ok());
      if (is_fp8) {
        SparseDecodeOptions no_cache = so;
        no_cache.hot_cache_rows = 0;
        EXPECT_EQ(sp.Configure(no_cache).code(), absl::StatusCode::kInvalidArgument)
            << "fp8 rows without a hot cache";
      }
      ASSERT_TRUE(sp.Configure(so).ok());
      if (is_fp8) {
        EXPECT_EQ(sp.AddSequence(kSeq, kCapacity, SparseSequenceOptions{}).code(),
                  absl::StatusCode::kInvalidArgument)
            << "an fp8 configuration takes row sources only";
        EXPECT_EQ(sp.stats().row_bytes, static_cast<int64_t>(layout.RowBytes()));
      }
      SparseSequenceOptions opts;
      opts.rows = is_fp8 ? fp8.source : bf16.source;
      ASSERT_TRUE(sp.AddSequence(kSeq, kCapacity, opts).ok());
      const absl::Status st = sp.ActivateSequence(kSeq, kPrompt);
      ASSERT_TRUE(st.ok()) << name << ": " << st;
      int32_t next = 1;
      for (int step = 0; step < 24; ++step) {
        std::vector<float> logits(c.vocab, NAN);
        if (is_fp8) next = tokens[step];
        const CudaSequence s{kSeq, std::span(&next, 1)};
        const absl::Status fs = sp.Forward(std::span(&s, 1), LogitsMode::kLast, logits);
        ASSERT_TRUE(fs.ok()) << name << " step " << step << ": " << fs;
        if (!is_fp8) {
          tokens[step] = next;
          want.push_back(logits);
          next = ArgMax(logits);
          continue;
        }
        ASSERT_EQ(std::memcmp(logits.data(), want[step].data(), logits.size() * sizeof(float)), 0)
            << name << " step " << step << ": fp8 rows decode other logits than their bf16 "
            << "values (cosine " << Compare(logits, want[step]).cosine << ")";
      }
      const auto counters = sp.Counters(kSeq);
      ASSERT_TRUE(counters.ok()) << counters.status();
      EXPECT_GT(counters->hot_cache_hits, 0) << name << ": steps after the first hit the cache";
      ASSERT_TRUE(sp.ReleaseSequence(kSeq).ok());
    }
  }
  ASSERT_TRUE(sp.Configure({}).ok());
  for (PagedRows* p : {&fp8, &bf16}) ASSERT_TRUE(sp.UnregisterHostRegion(p->host).ok());
}

}  // namespace
}  // namespace kvr::model
