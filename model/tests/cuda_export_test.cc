// CudaModel's per-layer KV export (BeginKvExport) and its bf16 -> float32 kernel.
//
// - Bf16ToF32 against its plain reference (Bf16BitsToFloat): bit-exact, both kernel paths
//   (paired and unaligned), odd sizes, poisoned outputs.
// - The export of a chunked prefill against the CPU Model on dummy shapes: every exported K, V
//   and query row within the tolerance of model_cuda_model_test (cosine >= 0.999 and max |err|
//   <= 0.1 x the CPU row's RMS: the GPU runs bf16 weights and GEMM inputs, the CPU float32, so
//   the rows differ by bf16 rounding carried through the layers; measured values are printed);
//   the exported values are bf16 values exactly widened (low 16 bits zero); on_layer once per
//   layer, in order, on another thread, in the last chunk only, all before Forward returns;
//   logits bitwise equal with and without the export (it must not change the compute).
// - Per-layer builds (CudaLayerBuilder) exported with the rows, after the layer's keys.
// - Misuse errors and the reuse of pooled pinned buffers.
// CTest label `gpu`.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "cuda_test_util.h"
#include "gtest/gtest.h"
#include "kvr/common/cuda/cuda_util.h"
#include "kvr/common/status.h"
#include "kvr/common/thread_pool.h"
#include "kvr/model/cuda_model.h"
#include "kvr/model/dense_attention.h"
#include "kvr/model/dummy.h"
#include "kvr/model/model.h"
#include "ops.cuh"

namespace kvr::model {
namespace {

using namespace cuda_test;

TEST(CudaExportTest, Bf16ToF32IsExactWidening) {
  SKIP_WITHOUT_GPU();
  for (int64_t n :
       {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{3}, int64_t{1001}, int64_t{(1 << 20) + 1}}) {
    for (int offset : {0, 1}) {  // offset 1: src not 4-byte aligned (the scalar path)
      std::vector<uint16_t> bits(n + offset);
      uint64_t x = 12345 + n;
      for (uint16_t& b : bits) {
        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
        b = static_cast<uint16_t>(x >> 48);
      }
      auto src = kvr::cuda::DeviceBuffer<uint16_t>::Create(bits.size() + 1);
      auto dst = kvr::cuda::DeviceBuffer<float>::Create(n + 2);
      ASSERT_TRUE(src.ok() && dst.ok());
      ASSERT_EQ(cudaMemcpy(src->data(), bits.data(), bits.size() * 2, cudaMemcpyHostToDevice),
                cudaSuccess);
      ASSERT_EQ(cudaMemset(dst->data(), 0xFF, (n + 2) * 4), cudaSuccess);  // NaN poison
      ASSERT_TRUE(cuda::LaunchBf16ToF32(reinterpret_cast<const cuda::bf16*>(src->data()) + offset,
                                        dst->data(), n, nullptr)
                      .ok());
      std::vector<uint32_t> got(n + 2);
      ASSERT_EQ(cudaMemcpy(got.data(), dst->data(), (n + 2) * 4, cudaMemcpyDeviceToHost),
                cudaSuccess);
      int64_t bad = 0;
      for (int64_t i = 0; i < n; ++i) {
        const float want = cuda::Bf16BitsToFloat(bits[i + offset]);
        uint32_t want_bits;
        std::memcpy(&want_bits, &want, 4);
        bad += got[i] != want_bits;
      }
      EXPECT_EQ(bad, 0) << "n " << n << " offset " << offset;
      EXPECT_EQ(got[n], 0xFFFFFFFFu) << "wrote past n " << n;  // untouched poison
    }
  }
}

// Dense attention that keeps each layer's queries at positions [first, L).
class RecordingAttention final : public Attention {
 public:
  RecordingAttention(ThreadPool* pool, int n_layers, int64_t first, int64_t length, int q_row)
      : dense_(pool), first_(first), q_row_(q_row), q_(n_layers) {
    for (auto& q : q_) q.assign((length - first) * q_row, NAN);
  }
  absl::Status Attend(const AttentionShape& shape,
                      std::span<const AttentionRequest> batch) override {
    for (const AttentionRequest& r : batch) {
      for (int64_t i = 0; i < r.n_queries; ++i) {
        const int64_t p = r.first_position + i;
        if (p < first_) continue;
        std::memcpy(&q_[r.layer][(p - first_) * q_row_], r.q + i * q_row_, q_row_ * 4);
      }
    }
    return dense_.Attend(shape, batch);
  }
  const std::vector<float>& queries(int layer) const { return q_[layer]; }

 private:
  DenseAttention dense_;
  int64_t first_;
  int q_row_;
  std::vector<std::vector<float>> q_;  // [n_layers][L - first, q_row]
};

// Compares `n_rows` rows of `width` floats; returns the worst (1 - cosine, max_err / rms).
std::pair<double, double> ExpectRowsClose(const float* got, const float* want, int64_t n_rows,
                                          int64_t width, const std::string& what) {
  double worst_cos = 1, worst_ratio = 0;
  int64_t failed = 0, not_bf16 = 0;
  for (int64_t r = 0; r < n_rows; ++r) {
    const RowError e =
        Compare(std::span(got + r * width, width), std::span(want + r * width, width));
    for (int64_t i = 0; i < width; ++i) {
      uint32_t bits;
      std::memcpy(&bits, &got[r * width + i], 4);
      not_bf16 += (bits & 0xFFFF) != 0;
    }
    const double ratio = e.max_err / std::max(e.rms, 1e-12);  // infinite for a non-finite row
    worst_cos = std::min(worst_cos, e.cosine);
    worst_ratio = std::max(worst_ratio, ratio);
    failed += e.cosine < kMinCosine || ratio > kMaxErrOverRms;
  }
  EXPECT_EQ(failed, 0) << what << ": rows outside the tolerance, worst cosine " << worst_cos
                       << " max|err|/rms " << worst_ratio;
  EXPECT_EQ(not_bf16, 0) << what << ": exported values that are not widened bf16";
  return {worst_cos, worst_ratio};
}

struct Seen {
  std::mutex mu;
  std::vector<int> layers;
  std::vector<KvExportLayer> views;
  bool other_thread = true;
};

void CheckExport(const std::string& shape, int n_layers, int64_t L, int64_t chunk,
                 int64_t max_queries) {
  ThreadPool pool;
  auto config = DummyConfig(shape, n_layers);
  ASSERT_TRUE(config.ok()) << config.status();
  const ModelConfig& c = *config;
  auto weights = RandomWeights(c, 11, &pool);
  ASSERT_TRUE(weights.ok()) << weights.status();
  CudaModelOptions opt;
  opt.max_batch_tokens = chunk;
  opt.max_sequences = 4;
  auto gpu = CreateCudaModel(c, *weights, opt);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  auto cpu = Model::Create(c, std::move(*weights), &pool);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  const std::vector<int32_t> prompt = Tokens(static_cast<int>(L), c.vocab, 3);
  const int64_t nq = std::min(max_queries, L);

  // CPU reference.
  KvCache cache = (*cpu)->NewCache();
  RecordingAttention rec(&pool, c.n_layers, L - nq, L, c.q_dim());
  auto want_logits = (*cpu)->Prefill(1, cache, prompt, rec, chunk);
  ASSERT_TRUE(want_logits.ok()) << want_logits.status();

  // GPU: sequence 1 exports, sequence 2 runs the same chunks without.
  Seen seen;
  const std::thread::id caller = std::this_thread::get_id();
  ASSERT_TRUE((*gpu)->AddSequence(1, L + 8).ok());
  ASSERT_TRUE((*gpu)->AddSequence(2, L + 8).ok());
  KvExportOptions eo;
  eo.length = L;
  eo.max_queries = max_queries;
  eo.on_layer = [&](const KvExportLayer& layer) {
    std::lock_guard<std::mutex> lock(seen.mu);
    seen.layers.push_back(layer.layer);
    seen.views.push_back(layer);
    seen.other_thread = seen.other_thread && std::this_thread::get_id() != caller;
  };
  ASSERT_TRUE((*gpu)->BeginKvExport(1, eo).ok());
  const int64_t pinned = (*gpu)->export_pinned_bytes();
  EXPECT_GE(pinned, int64_t{c.n_layers} * (2 * L * c.kv_dim() + nq * c.q_dim()) * 4);
  std::vector<float> got(c.vocab), plain(c.vocab);
  for (int64_t begin = 0; begin < L; begin += chunk) {
    const auto tokens = std::span(prompt).subspan(begin, std::min(chunk, L - begin));
    const CudaSequence a{1, tokens}, b{2, tokens};
    ASSERT_TRUE((*gpu)->Forward(std::span(&a, 1), LogitsMode::kLast, got).ok());
    ASSERT_TRUE((*gpu)->Forward(std::span(&b, 1), LogitsMode::kLast, plain).ok());
    std::lock_guard<std::mutex> lock(seen.mu);
    if (begin + chunk < L) {
      EXPECT_TRUE(seen.layers.empty()) << "on_layer before the last chunk (at " << begin << ")";
    } else {
      ASSERT_EQ(seen.layers.size(), static_cast<size_t>(c.n_layers)) << "before Forward returned";
    }
  }
  EXPECT_EQ(std::memcmp(got.data(), plain.data(), got.size() * 4), 0)
      << "the export changed the logits";
  for (int l = 0; l < c.n_layers; ++l) EXPECT_EQ(seen.layers[l], l);
  EXPECT_TRUE(seen.other_thread);

  double worst_cos = 1, worst_ratio = 0;
  for (int l = 0; l < c.n_layers; ++l) {
    const KvExportLayer& v = seen.views[l];
    EXPECT_EQ(v.sequence, 1u);
    ASSERT_EQ(v.kv.n_rows, L);
    ASSERT_EQ(v.kv.row_stride, c.kv_dim());
    ASSERT_EQ(v.n_queries, nq);
    ASSERT_EQ(v.queries_first_position, L - nq);
    const KvView want = cache.View(l);
    ASSERT_EQ(want.row_stride, c.kv_dim());  // KvCache rows are dense
    const std::string at = shape + " layer " + std::to_string(l);
    for (auto [g, w, n, width, what] :
         {std::tuple{v.kv.k, want.k, L, int64_t{c.kv_dim()}, "K"},
          std::tuple{v.kv.v, want.v, L, int64_t{c.kv_dim()}, "V"},
          std::tuple{v.queries, rec.queries(l).data(), nq, int64_t{c.q_dim()}, "Q"}}) {
      // Per KV head (K, V) or per query head (Q): a head's row is what attention uses.
      const int64_t head = c.head_dim;
      std::vector<float> gh, wh;
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t h = 0; h < width / head; ++h) {
          gh.insert(gh.end(), g + r * width + h * head, g + r * width + (h + 1) * head);
          wh.insert(wh.end(), w + r * width + h * head, w + r * width + (h + 1) * head);
        }
      }
      auto [cs, ratio] =
          ExpectRowsClose(gh.data(), wh.data(), n * (width / head), head, at + " " + what);
      worst_cos = std::min(worst_cos, cs);
      worst_ratio = std::max(worst_ratio, ratio);
    }
  }
  std::printf(
      "[ parity ] %-14s L %4lld chunk %3lld nq %3lld: K/V/Q head rows min cosine %.6f"
      "  max |err|/rms %.4f\n",
      shape.c_str(), static_cast<long long>(L), static_cast<long long>(chunk),
      static_cast<long long>(nq), worst_cos, worst_ratio);

  // Past the length: refused, nothing appended.
  const int32_t one = 1;
  const CudaSequence past{1, std::span(&one, 1)};
  EXPECT_EQ((*gpu)->Forward(std::span(&past, 1), LogitsMode::kLast, got).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*(*gpu)->SequenceLength(1), L);
  // End, then a second export of the same size reuses the pooled buffer.
  ASSERT_TRUE((*gpu)->EndKvExport(1).ok());
  EXPECT_EQ((*gpu)->EndKvExport(1).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE((*gpu)->AddSequence(3, L).ok());
  ASSERT_TRUE((*gpu)->BeginKvExport(3, eo).ok());
  EXPECT_EQ((*gpu)->export_pinned_bytes(), pinned);
  ASSERT_TRUE((*gpu)->ReleaseSequence(3).ok());  // ends the export too
  EXPECT_EQ((*gpu)->export_pinned_bytes(), pinned);
}

// Queries window [L - nq, L) spans the last two chunks (300 - 100 = 200 in chunk [192, 256)).
TEST(CudaExportTest, Smollm2ShapeMatchesCpu) {
  SKIP_WITHOUT_GPU();
  CheckExport("smollm2-135m", 4, 300, 64, 100);
}

// head_dim 128, GQA 4, llama3 RoPE scaling; a window longer than the prompt (nq = L).
TEST(CudaExportTest, Llama3ShapeMatchesCpu) {
  SKIP_WITHOUT_GPU();
  CheckExport("llama3-8b", 2, 200, 128, 512);
}

TEST(CudaExportTest, RejectsMisuse) {
  SKIP_WITHOUT_GPU();
  auto config = DummyConfig("smollm2-135m", 1);
  ASSERT_TRUE(config.ok());
  CudaModelOptions opt;
  opt.max_batch_tokens = 64;
  auto gpu = CreateCudaModelWithRandomWeights(*config, 1, opt);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  KvExportOptions eo;
  eo.length = 16;
  EXPECT_EQ((*gpu)->BeginKvExport(7, eo).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ((*gpu)->EndKvExport(7).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE((*gpu)->AddSequence(7, 16).ok());
  eo.length = 17;  // past the capacity
  EXPECT_EQ((*gpu)->BeginKvExport(7, eo).code(), absl::StatusCode::kInvalidArgument);
  eo.length = 0;
  EXPECT_EQ((*gpu)->BeginKvExport(7, eo).code(), absl::StatusCode::kInvalidArgument);
  eo.length = 16;
  eo.max_queries = -1;
  EXPECT_EQ((*gpu)->BeginKvExport(7, eo).code(), absl::StatusCode::kInvalidArgument);
  eo.max_queries = 4;
  ASSERT_TRUE((*gpu)->BeginKvExport(7, eo).ok());
  EXPECT_EQ((*gpu)->BeginKvExport(7, eo).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE((*gpu)->EndKvExport(7).ok());
  const std::vector<int32_t> tokens = {1, 2, 3};
  std::vector<float> logits(config->vocab);
  const CudaSequence s{7, tokens};
  ASSERT_TRUE((*gpu)->Forward(std::span(&s, 1), LogitsMode::kLast, logits).ok());
  EXPECT_EQ((*gpu)->BeginKvExport(7, eo).code(), absl::StatusCode::kFailedPrecondition)
      << "a sequence that holds tokens";
}

// A CudaLayerBuilder for the tests: its "build" of a layer copies the bf16 bits of the first
// two tokens' keys into its int32 output and fills `length` floats with the layer's number, so
// that the export can be checked against the rows it hands out with them.
class KeyCopyBuilder final : public CudaLayerBuilder {
 public:
  KeyCopyBuilder(const ModelConfig& c, int64_t capacity, bool side)
      : c_(c), capacity_(capacity), side_(side) {}
  absl::Status Init() {
    KVR_RETURN_IF_ERROR(kvr::cuda::Alloc(i32_, int64_t{c_.n_layers} * c_.kv_dim()));
    return kvr::cuda::Alloc(f32_, int64_t{c_.n_layers} * capacity_);
  }
  bool side_stream() const override { return side_; }
  absl::Status Prepare(int64_t length, void*) override {
    prepared.push_back(length);
    return absl::OkStatus();
  }
  absl::Status Build(const CudaLayerKeys& k, void* stream) override {
    built.push_back({k.layer, k.length});
    const auto st = static_cast<cudaStream_t>(stream);
    KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(i32_.data() + k.layer * c_.kv_dim(), k.keys,
                                             2 * k.token_stride * sizeof(uint16_t),
                                             cudaMemcpyDeviceToDevice, st));
    // Bytes 0x40: every float is 3.0039 (0x40404040), whichever the layer.
    KVR_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(f32_.data() + k.layer * capacity_, 0x40, k.length * sizeof(float), st));
    return absl::OkStatus();
  }
  CudaLayerOutput Output(int layer, int64_t length) const override {
    return {f32_.data() + layer * capacity_, length, i32_.data() + layer * c_.kv_dim(),
            c_.kv_dim()};
  }
  std::vector<int64_t> prepared;
  std::vector<std::pair<int, int64_t>> built;

 private:
  ModelConfig c_;
  int64_t capacity_;
  bool side_;
  kvr::cuda::DeviceBuffer<int32_t> i32_;
  kvr::cuda::DeviceBuffer<float> f32_;
};

// KvExportOptions::built: the sequence needs a builder, and the chunk that completes the export
// must build; then each layer's view carries its build, made after the layer's K rows were in
// the cache (the copied keys equal the exported rows), on the side stream and on the main one.
TEST(CudaExportTest, ExportsBuildsWithTheRows) {
  SKIP_WITHOUT_GPU();
  auto config = DummyConfig("smollm2-135m", 2);
  ASSERT_TRUE(config.ok());
  const ModelConfig& c = *config;
  CudaModelOptions opt;
  opt.max_batch_tokens = 64;
  auto gpu = CreateCudaModelWithRandomWeights(c, 1, opt);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  KvExportOptions eo;
  eo.length = 40;
  eo.built = true;
  eo.bf16_rows = true;
  ASSERT_TRUE((*gpu)->AddSequence(1, 40).ok());
  EXPECT_EQ((*gpu)->BeginKvExport(1, eo).code(), absl::StatusCode::kFailedPrecondition)
      << "no builder";
  std::vector<int32_t> tokens(40);
  for (int i = 0; i < 40; ++i) tokens[i] = 3 * i + 1;
  SequenceId id = 2;
  for (bool side : {true, false}) {
    auto owned = std::make_unique<KeyCopyBuilder>(c, 48, side);
    ASSERT_TRUE(owned->Init().ok());
    KeyCopyBuilder* builder = owned.get();
    ASSERT_TRUE((*gpu)->AddSequence(id, 48, std::move(owned)).ok());
    std::vector<int> layers;
    std::vector<std::vector<uint16_t>> rows;  // the first two tokens' keys, as exported
    std::vector<std::vector<int32_t>> copied;
    std::vector<std::vector<float>> filled;
    std::vector<int64_t> lengths;
    eo.on_layer = [&](const KvExportLayer& x) {
      layers.push_back(x.layer);
      rows.emplace_back(x.k_bf16, x.k_bf16 + 2 * c.kv_dim());
      copied.emplace_back(x.built.i32, x.built.i32 + x.built.n_i32);
      filled.emplace_back(x.built.f32, x.built.f32 + x.built.n_f32);
      lengths.push_back(x.built.length);
    };
    ASSERT_TRUE((*gpu)->BeginKvExport(id, eo).ok());
    std::vector<float> logits(c.vocab);
    const CudaSequence first{id, std::span(tokens).first(24)};
    ASSERT_TRUE((*gpu)->Forward(std::span(&first, 1), LogitsMode::kLast, logits).ok());
    EXPECT_TRUE(builder->prepared.empty()) << "a chunk without build";
    const CudaSequence no_build{id, std::span(tokens).subspan(24)};
    EXPECT_EQ((*gpu)->Forward(std::span(&no_build, 1), LogitsMode::kLast, logits).code(),
              absl::StatusCode::kInvalidArgument)
        << "the completing chunk must build";
    const CudaSequence last{id, std::span(tokens).subspan(24), /*build=*/true};
    ASSERT_TRUE((*gpu)->Forward(std::span(&last, 1), LogitsMode::kLast, logits).ok());
    EXPECT_EQ(builder->prepared, std::vector<int64_t>{40});
    ASSERT_EQ(builder->built.size(), 2u);
    ASSERT_EQ(layers, (std::vector<int>{0, 1}));
    for (int l = 0; l < 2; ++l) {
      EXPECT_EQ(builder->built[l], std::make_pair(l, int64_t{40}));
      EXPECT_EQ(lengths[l], 40);
      ASSERT_EQ(copied[l].size(), static_cast<size_t>(c.kv_dim()));
      EXPECT_EQ(0, std::memcmp(copied[l].data(), rows[l].data(), rows[l].size() * 2))
          << "layer " << l << (side ? " side" : " main")
          << ": the build did not see the layer's keys, or the export did not wait for it";
      ASSERT_EQ(filled[l].size(), 40u);
      EXPECT_TRUE(std::all_of(filled[l].begin(), filled[l].end(),
                              [](float v) { return v > 3.003f && v < 3.005f; }));
    }
    EXPECT_GT((*gpu)->last_build_ms(), 0.0);
    ASSERT_TRUE((*gpu)->RebuildForTesting(id).ok());
    EXPECT_EQ(builder->prepared, (std::vector<int64_t>{40, 40}));
    ASSERT_TRUE((*gpu)->EndKvExport(id).ok());
    ++id;
  }
}

}  // namespace
}  // namespace kvr::model
