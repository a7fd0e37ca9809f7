// SparseAttention through the model's attention seam: prefill stays dense, decode attends over
// sink + local + selected, budget >= context reproduces dense attention.

#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvr/common/fp8.h"
#include "kvr/common/half.h"
#include "kvr/retrieval/registry.h"
#include "kvr/retrieval/sparse_attention.h"
#include "test_util.h"

namespace kvr::retrieval {
namespace {

using kvr::model::AttentionRequest;
using kvr::model::AttentionShape;
using testing::CoreRegistry;
using ::testing::HasSubstr;
using testing::RandomTensor;

constexpr int kLayers = 2;

AttentionShape Shape() { return {4, 2, 16, 0.25f}; }

// Drives a fake "model": prefill of n tokens, then `steps` decode steps, over both layers, with
// random q/k/v. Returns the decode outputs [steps, layers, n_heads, head_dim].
struct DriveResult {
  std::vector<float> outputs;
  absl::Status status;
};

DriveResult Drive(kvr::model::Attention& attention, int64_t n, int64_t steps) {
  const AttentionShape s = Shape();
  const int64_t total = n + steps;
  const int64_t kv_row = s.n_kv_heads * s.head_dim, q_row = s.n_heads * s.head_dim;
  std::vector<float> k = RandomTensor(total, s.n_kv_heads, s.head_dim, 1);
  std::vector<float> v = RandomTensor(total, s.n_kv_heads, s.head_dim, 2);
  std::vector<float> q = RandomTensor(total, s.n_heads, s.head_dim, 3);
  DriveResult run;
  std::vector<float> out(total * q_row);
  // Prefill in chunks of 50 tokens, as the runtime does (Model::Prefill), layer by layer.
  for (int64_t begin = 0; begin < n; begin += 50) {
    const int64_t count = std::min<int64_t>(50, n - begin);
    for (int layer = 0; layer < kLayers; ++layer) {
      AttentionRequest r;
      r.sequence = 7;
      r.layer = layer;
      r.first_position = begin;
      r.n_queries = count;
      r.q = q.data() + begin * q_row;
      r.kv = {k.data(), v.data(), begin + count, kv_row, {}, begin + count};
      r.out = out.data() + begin * q_row;
      run.status = attention.Attend(s, {&r, 1});
      if (!run.status.ok()) return run;
    }
  }
  for (int64_t t = n; t < total; ++t) {
    for (int layer = 0; layer < kLayers; ++layer) {
      AttentionRequest r;
      r.sequence = 7;
      r.layer = layer;
      r.first_position = t;
      r.n_queries = 1;
      r.q = q.data() + t * q_row;
      r.kv = {k.data(), v.data(), t + 1, kv_row, {}, t + 1};
      std::vector<float> o(q_row);
      r.out = o.data();
      run.status = attention.Attend(s, {&r, 1});
      if (!run.status.ok()) return run;
      run.outputs.insert(run.outputs.end(), o.begin(), o.end());
    }
  }
  return run;
}

class DenseReference final : public kvr::model::Attention {
 public:
  absl::Status Attend(const AttentionShape& shape,
                      std::span<const AttentionRequest> batch) override {
    for (const auto& r : batch) {
      absl::Status s = DenseAttention(shape, r);
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }
};

class SparseEqualsDense : public ::testing::TestWithParam<std::string> {};

TEST_P(SparseEqualsDense, BudgetAtLeastContextGivesDenseOutput) {
  MethodRegistry registry = CoreRegistry();
  SparseAttentionOptions opt;
  opt.method = GetParam();
  opt.n_layers = kLayers;
  opt.params.budget = 1000;
  opt.params.n_sink = 4;
  opt.params.local_window = 16;
  opt.params.clusterkv.append_every = 8;
  auto sparse = SparseAttention::Create(&registry, opt);
  ASSERT_TRUE(sparse.ok()) << sparse.status();
  DenseReference dense;
  DriveResult a = Drive(**sparse, 120, 24);
  DriveResult b = Drive(dense, 120, 24);
  ASSERT_TRUE(a.status.ok()) << a.status;
  ASSERT_TRUE(b.status.ok()) << b.status;
  ASSERT_EQ(a.outputs.size(), b.outputs.size());
  for (size_t i = 0; i < a.outputs.size(); ++i) {
    ASSERT_NEAR(a.outputs[i], b.outputs[i], 2e-5f) << GetParam() << " element " << i;
  }
  EXPECT_EQ((*sparse)->stats().decode_calls, 24 * kLayers);
  ASSERT_NE((*sparse)->FindIndex(7, 1), nullptr);
  EXPECT_EQ((*sparse)->FindIndex(7, 1)->size(), 120 + 23);
  (*sparse)->Release(7);
  EXPECT_EQ((*sparse)->FindIndex(7, 1), nullptr);
}

INSTANTIATE_TEST_SUITE_P(Methods, SparseEqualsDense,
                         ::testing::Values("full", "exact", "quest", "clusterkv", "ctkvr",
                                           "keydiff"));

// With a small budget the output is no longer dense, but the oracle's selection brings it closer
// to dense than sink + local alone (streaming) does.
TEST(SparseAttentionTest, SmallBudgetExactBeatsStreaming) {
  MethodRegistry registry = CoreRegistry();
  DenseReference dense;
  DriveResult reference = Drive(dense, 200, 4);
  ASSERT_TRUE(reference.status.ok());
  auto error_of = [&](const std::string& method, int64_t* selected) {
    SparseAttentionOptions opt;
    opt.method = method;
    opt.n_layers = kLayers;
    opt.params.budget = 8;
    opt.params.n_sink = 4;
    opt.params.local_window = 8;
    auto sparse = SparseAttention::Create(&registry, opt);
    EXPECT_TRUE(sparse.ok());
    DriveResult a = Drive(**sparse, 200, 4);
    EXPECT_TRUE(a.status.ok()) << a.status;
    double diff = 0;
    for (size_t i = 0; i < a.outputs.size(); ++i) {
      diff += (a.outputs[i] - reference.outputs[i]) * (a.outputs[i] - reference.outputs[i]);
    }
    *selected = (*sparse)->stats().selected_rows;
    return diff;
  };
  int64_t selected_exact = 0, selected_streaming = 0;
  const double err_exact = error_of("exact", &selected_exact);
  const double err_streaming = error_of("streaming", &selected_streaming);
  EXPECT_GT(err_exact, 0.0);  // it really is sparse
  EXPECT_LT(err_exact, err_streaming);
  EXPECT_EQ(selected_exact, 4 * kLayers * 2 * 8);  // steps x layers x kv heads x budget
  EXPECT_EQ(selected_streaming, 0);
}

// Dense attention whose decode steps see the rows between the sinks and the local window as a
// reader of `format` rows would: what SparseAttention with `fetched_rows` = format and a budget
// covering every candidate must compute.
class ConvertedMiddleReference final : public kvr::model::Attention {
 public:
  ConvertedMiddleReference(FetchedRowFormat format, int64_t n_sink, int64_t local_window)
      : format_(format), n_sink_(n_sink), local_window_(local_window) {}
  absl::Status Attend(const AttentionShape& shape,
                      std::span<const AttentionRequest> batch) override {
    for (AttentionRequest r : batch) {
      if (r.n_queries == 1) {
        const int64_t p = r.first_position;
        const int64_t n_sink = std::min(n_sink_, p + 1);
        const int64_t local_begin = std::max(n_sink, p + 1 - local_window_);
        k_.assign(r.kv.k, r.kv.k + r.kv.n_rows * r.kv.row_stride);
        v_.assign(r.kv.v, r.kv.v + r.kv.n_rows * r.kv.row_stride);
        for (int64_t t = n_sink; t < local_begin; ++t) {
          for (int h = 0; h < shape.n_kv_heads; ++h) {
            for (std::vector<float>* kv : {&k_, &v_}) {
              float* x = kv->data() + t * r.kv.row_stride + h * shape.head_dim;
              if (format_ == FetchedRowFormat::kFp8E4m3) {
                RoundTripFp8(x, shape.head_dim);
              } else {
                for (int d = 0; d < shape.head_dim; ++d) x[d] = Bf16ToFloat(FloatToBf16(x[d]));
              }
            }
          }
        }
        r.kv.k = k_.data();
        r.kv.v = v_.data();
      }
      absl::Status s = DenseAttention(shape, r);
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }

 private:
  FetchedRowFormat format_;
  int64_t n_sink_, local_window_;
  std::vector<float> k_, v_;
};

// Fetched rows in fp8 or bf16: only the selected rows change (sinks and the local window stay as
// cached), each (row, KV head)'s K and V with their own scale; fp8 costs more than bf16.
TEST(SparseAttentionTest, FetchedRowFormatsConvertOnlyTheSelectedRows) {
  MethodRegistry registry = CoreRegistry();
  DenseReference dense;
  DriveResult reference = Drive(dense, 120, 6);
  ASSERT_TRUE(reference.status.ok());
  std::map<FetchedRowFormat, double> error;
  for (FetchedRowFormat format : {FetchedRowFormat::kBf16, FetchedRowFormat::kFp8E4m3}) {
    SparseAttentionOptions opt;
    opt.method = "full";
    opt.n_layers = kLayers;
    opt.params.budget = 1000;
    opt.params.n_sink = 4;
    opt.params.local_window = 16;
    opt.fetched_rows = format;
    auto sparse = SparseAttention::Create(&registry, opt);
    ASSERT_TRUE(sparse.ok()) << sparse.status();
    ConvertedMiddleReference converted(format, 4, 16);
    DriveResult a = Drive(**sparse, 120, 6);
    DriveResult b = Drive(converted, 120, 6);
    ASSERT_TRUE(a.status.ok()) << a.status;
    ASSERT_TRUE(b.status.ok()) << b.status;
    ASSERT_EQ(a.outputs.size(), reference.outputs.size());
    double diff = 0, norm = 0;
    for (size_t i = 0; i < a.outputs.size(); ++i) {
      ASSERT_NEAR(a.outputs[i], b.outputs[i], 2e-5f)
          << FetchedRowFormatName(format) << " element " << i;
      const double d = a.outputs[i] - reference.outputs[i];
      diff += d * d;
      norm += reference.outputs[i] * reference.outputs[i];
    }
    error[format] = std::sqrt(diff / norm);
  }
  // Relative output error: bf16 keeps 8 significant bits, e4m3 4.
  EXPECT_GT(error[FetchedRowFormat::kBf16], 1e-5);
  EXPECT_GT(error[FetchedRowFormat::kFp8E4m3], 4 * error[FetchedRowFormat::kBf16]);
  EXPECT_LT(error[FetchedRowFormat::kFp8E4m3], 0.05);
}

TEST(SparseAttentionTest, FetchedRowFormatNamesParse) {
  for (FetchedRowFormat f :
       {FetchedRowFormat::kAsCached, FetchedRowFormat::kBf16, FetchedRowFormat::kFp8E4m3}) {
    auto parsed = ParseFetchedRowFormat(FetchedRowFormatName(f));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, f);
  }
  auto bad = ParseFetchedRowFormat("int4");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("expected cache, bf16 or fp8"));
  EXPECT_EQ(FetchedRowBytes(FetchedRowFormat::kFp8E4m3, 64), 136);
  EXPECT_EQ(FetchedRowBytes(FetchedRowFormat::kBf16, 64), 256);
}

TEST(SparseAttentionTest, BadOptionsAreClearErrors) {
  MethodRegistry registry = CoreRegistry();
  SparseAttentionOptions opt;
  opt.method = "nope";
  auto a = SparseAttention::Create(&registry, opt);
  ASSERT_FALSE(a.ok());
  EXPECT_THAT(std::string(a.status().message()), HasSubstr("valid methods: clusterkv"));
  opt.method = "exact";
  opt.params.budget = 0;
  auto b = SparseAttention::Create(&registry, opt);
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("budget must be > 0"));
}

TEST(SparseAttentionTest, CtkvrWithoutPrefillQueriesExplainsItself) {
  MethodRegistry registry = CoreRegistry();
  SparseAttentionOptions opt;
  opt.method = "ctkvr";
  opt.n_layers = kLayers;
  opt.keep_prefill_queries = false;
  auto sparse = SparseAttention::Create(&registry, opt);
  ASSERT_TRUE(sparse.ok());
  DriveResult a = Drive(**sparse, 64, 2);
  EXPECT_FALSE(a.status.ok());
  EXPECT_THAT(std::string(a.status.message()), HasSubstr("prefill queries"));
}

}  // namespace
}  // namespace kvr::retrieval
