// Building blocks of the CPU runtime against naive references: RMSNorm, RoPE (+ llama3
// scaling), the split GEMM, the GGUF Q/K un-permutation, the KV cache, dense attention and the
// sampler.

#include <cmath>
#include <numbers>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvr/common/half.h"
#include "kvr/common/thread_pool.h"
#include "kvr/model/config.h"
#include "kvr/model/dense_attention.h"
#include "kvr/model/kv_cache.h"
#include "kvr/model/model.h"
#include "kvr/model/sampler.h"
#include "kvr/model/weights.h"

namespace kvr::model {
namespace {

std::vector<float> RandomVector(size_t n, uint32_t seed, float scale = 1.f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

TEST(RmsNormTest, MatchesNaive) {
  const int dim = 576, rows = 3;
  const auto x = RandomVector(rows * dim, 1, 3.f);
  const auto w = RandomVector(dim, 2);
  std::vector<float> y(rows * dim);
  RmsNorm(x.data(), w.data(), rows, dim, 1e-5f, y.data());
  for (int r = 0; r < rows; ++r) {
    double ss = 0;
    for (int i = 0; i < dim; ++i) ss += double{x[r * dim + i]} * x[r * dim + i];
    const double inv = 1.0 / std::sqrt(ss / dim + 1e-5);
    for (int i = 0; i < dim; ++i) {
      EXPECT_NEAR(y[r * dim + i], w[i] * x[r * dim + i] * inv, 1e-5) << r << "," << i;
    }
  }
}

TEST(RopeTest, RotatesHalvesByPositionTimesFrequency) {
  ModelConfig c;
  c.head_dim = 8;
  c.rope_theta = 10000.f;
  const auto inv = RopeInverseFrequencies(c);
  ASSERT_EQ(inv.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(inv[i], std::pow(10000.0, -2.0 * i / 8), 1e-7);

  const int n_heads = 2, n_tokens = 3;
  auto x = RandomVector(n_tokens * n_heads * 8, 3);
  const auto original = x;
  const std::vector<int64_t> positions = {0, 5, 1000};
  ApplyRope(x.data(), n_tokens, n_heads, 8, n_heads * 8, positions, inv);
  for (int t = 0; t < n_tokens; ++t) {
    for (int h = 0; h < n_heads; ++h) {
      const float* in = original.data() + (t * n_heads + h) * 8;
      const float* out = x.data() + (t * n_heads + h) * 8;
      for (int i = 0; i < 4; ++i) {
        const double angle = double(positions[t]) * inv[i];
        EXPECT_NEAR(out[i], in[i] * std::cos(angle) - in[i + 4] * std::sin(angle), 2e-4);
        EXPECT_NEAR(out[i + 4], in[i + 4] * std::cos(angle) + in[i] * std::sin(angle), 2e-4);
      }
    }
  }
  // Position 0 is the identity.
  for (int i = 0; i < n_heads * 8; ++i) EXPECT_FLOAT_EQ(x[i], original[i]);
}

TEST(RopeTest, Llama3ScalingMatchesTransformersFormula) {
  ModelConfig c;
  c.head_dim = 128;
  c.rope_theta = 500000.f;
  c.has_llama3_scaling = true;
  c.llama3_scaling = {8.f, 1.f, 4.f, 8192};
  const auto inv = RopeInverseFrequencies(c);
  int low = 0, medium = 0, high = 0;
  for (int i = 0; i < 64; ++i) {
    const double base = std::pow(500000.0, -2.0 * i / 128);
    const double wavelen = 2 * std::numbers::pi / base;
    double expected;
    if (wavelen < 8192.0 / 4) {
      expected = base, ++high;
    } else if (wavelen > 8192.0 / 1) {
      expected = base / 8, ++low;
    } else {
      const double smooth = (8192.0 / wavelen - 1) / (4 - 1);
      expected = (1 - smooth) * base / 8 + smooth * base, ++medium;
    }
    EXPECT_NEAR(inv[i], expected, 1e-5 * expected) << i;
  }
  // All three regimes are exercised.
  EXPECT_GT(low, 0);
  EXPECT_GT(medium, 0);
  EXPECT_GT(high, 0);
}

TEST(RopeTest, GgufFreqFactorsDivide) {
  ModelConfig c;
  c.head_dim = 4;
  c.rope_theta = 100.f;
  c.rope_freq_factors = {2.f, 4.f};
  const auto inv = RopeInverseFrequencies(c);
  EXPECT_NEAR(inv[0], 1.0 / 2, 1e-7);
  EXPECT_NEAR(inv[1], std::pow(100.0, -0.5) / 4, 1e-7);
}

TEST(MatMulTest, SplitGemmMatchesNaive) {
  ThreadPool pool(3);
  // n = 50 over 3 threads: the slices (rounded to 16 columns) must still cover every column.
  for (auto [m, n] : {std::pair<int64_t, int64_t>{1, 130}, {2, 130}, {7, 130}, {1, 50}, {3, 50}}) {
    const int64_t k = 33;
    const auto a = RandomVector(m * k, 4);
    const auto w = RandomVector(n * k, 5);
    std::vector<float> c(m * n, -1.f);
    MatMulTransposed(&pool, a.data(), m, k, w.data(), n, c.data());
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (int64_t p = 0; p < k; ++p) s += double{a[i * k + p]} * w[j * k + p];
        EXPECT_NEAR(c[i * n + j], s, 1e-4) << "m=" << m << " " << i << "," << j;
      }
    }
  }
}

TEST(WeightsTest, UnpermuteInvertsLlamaCppPermutation) {
  const int n_head = 2, d = 6, in = 3;
  // HF rows: value = row * 10 + column.
  std::vector<float> hf(n_head * d * in);
  for (int r = 0; r < n_head * d; ++r) {
    for (int c = 0; c < in; ++c) hf[r * in + c] = r * 10.f + c;
  }
  // llama.cpp: w.reshape(n_head, 2, d/2, in).swapaxes(1, 2).reshape(n_head*d, in)
  std::vector<float> gguf(hf.size());
  for (int h = 0; h < n_head; ++h) {
    for (int i = 0; i < d / 2; ++i) {
      for (int j = 0; j < 2; ++j) {
        for (int c = 0; c < in; ++c) {
          gguf[((h * d) + i * 2 + j) * in + c] = hf[((h * d) + j * (d / 2) + i) * in + c];
        }
      }
    }
  }
  ASSERT_NE(gguf, hf);
  UnpermuteRopeRows(gguf.data(), n_head, d, in);
  EXPECT_EQ(gguf, hf);
}

TEST(KvCacheTest, GrowsAndKeepsRows) {
  KvCache cache(2, 3, 4);
  const int64_t row = 12;
  std::vector<float> k(100 * 20), v(100 * 20);
  for (size_t i = 0; i < k.size(); ++i) k[i] = float(i), v[i] = -float(i);
  int64_t appended = 0;
  for (int64_t n : {1, 5, 30, 64}) {
    ASSERT_TRUE(cache.Append(0, n, k.data() + appended * 20, v.data() + appended * 20, 20).ok());
    appended += n;
    EXPECT_EQ(cache.n_tokens(0), appended);
    EXPECT_GE(cache.capacity(0), appended);
  }
  EXPECT_EQ(cache.n_tokens(1), 0);
  EXPECT_EQ(cache.n_tokens(), 0);  // last layer
  const KvView view = cache.View(0);
  ASSERT_EQ(view.n_rows, appended);
  EXPECT_EQ(view.row_stride, row);
  for (int64_t r = 0; r < appended; ++r) {
    for (int i = 0; i < row; ++i) {
      ASSERT_EQ(view.k[r * row + i], k[r * 20 + i]);
      ASSERT_EQ(view.v[r * row + i], v[r * 20 + i]);
    }
  }
  EXPECT_FALSE(cache.Append(2, 1, k.data(), v.data(), 20).ok());
  EXPECT_FALSE(cache.Append(0, 1, k.data(), v.data(), 11).ok());  // stride below a row
  cache.Clear();
  EXPECT_EQ(cache.n_tokens(0), 0);
}

// softmax(q k^T scale) v with a plain loop, double accumulation.
void NaiveAttention(const AttentionShape& s, const AttentionRequest& r, std::vector<float>& out) {
  const int group = s.n_heads / s.n_kv_heads;
  out.assign(r.n_queries * s.n_heads * s.head_dim, 0.f);
  for (int64_t i = 0; i < r.n_queries; ++i) {
    const int64_t pos = r.first_position + i;
    for (int h = 0; h < s.n_heads; ++h) {
      const int kvh = h / group;
      const float* q = r.q + (i * s.n_heads + h) * s.head_dim;
      std::vector<double> scores;
      std::vector<int64_t> rows;
      for (int64_t row = 0; row < r.kv.n_rows; ++row) {
        const int64_t row_pos = r.kv.positions.empty() ? row : r.kv.positions[row];
        if (row_pos > pos) continue;
        const float* k = r.kv.k + row * r.kv.row_stride + kvh * s.head_dim;
        double dot = 0;
        for (int d = 0; d < s.head_dim; ++d) dot += double{q[d]} * k[d];
        scores.push_back(dot * s.scale);
        rows.push_back(row);
      }
      if (rows.empty()) continue;
      double mx = scores[0];
      for (double x : scores) mx = std::max(mx, x);
      double sum = 0;
      for (double& x : scores) sum += (x = std::exp(x - mx));
      for (int d = 0; d < s.head_dim; ++d) {
        double acc = 0;
        for (size_t j = 0; j < rows.size(); ++j) {
          acc += scores[j] / sum * r.kv.v[rows[j] * r.kv.row_stride + kvh * s.head_dim + d];
        }
        out[(i * s.n_heads + h) * s.head_dim + d] = static_cast<float>(acc);
      }
    }
  }
}

TEST(DenseAttentionTest, MatchesNaiveGqaCausal) {
  ThreadPool pool(2);
  DenseAttention attention(&pool, /*query_block=*/4);
  const AttentionShape shape{6, 2, 8, 1.f / std::sqrt(8.f)};
  const int64_t stride = 2 * 8 + 3;  // padded rows
  // Sequence A: prefill of 10 queries over 10 rows. B: decode, 1 query over 7 rows.
  // C: 3 queries at positions 20.. over rows with explicit (sparse) positions.
  const auto ka = RandomVector(10 * stride, 10, 2.f), va = RandomVector(10 * stride, 11);
  const auto kb = RandomVector(7 * stride, 12, 2.f), vb = RandomVector(7 * stride, 13);
  const auto kc = RandomVector(5 * stride, 14, 2.f), vc = RandomVector(5 * stride, 15);
  const std::vector<int64_t> positions_c = {0, 3, 20, 21, 30};
  const auto qa = RandomVector(10 * 48, 16), qb = RandomVector(48, 17),
             qc = RandomVector(3 * 48, 18);
  std::vector<float> oa(10 * 48, NAN), ob(48, NAN), oc(3 * 48, NAN);
  std::vector<AttentionRequest> batch(3);
  batch[0] = {1, 0, 0, 10, qa.data(), {ka.data(), va.data(), 10, stride, {}, 10}, oa.data()};
  batch[1] = {2, 0, 6, 1, qb.data(), {kb.data(), vb.data(), 7, stride, {}, 7}, ob.data()};
  batch[2] = {3,        0, 20, 3, qc.data(), {kc.data(), vc.data(), 5, stride, positions_c, 31},
              oc.data()};
  ASSERT_TRUE(attention.Attend(shape, batch).ok());
  std::vector<float>* outs[] = {&oa, &ob, &oc};
  for (int b = 0; b < 3; ++b) {
    std::vector<float> expected;
    NaiveAttention(shape, batch[b], expected);
    ASSERT_EQ(expected.size(), outs[b]->size());
    for (size_t i = 0; i < expected.size(); ++i) {
      ASSERT_NEAR((*outs[b])[i], expected[i], 1e-5) << "sequence " << b << " element " << i;
    }
  }
}

// A half cache holds each row rounded to nearest even, in half the bytes; AsFloatView widens
// it back exactly.
TEST(KvCacheTest, HalfCacheHoldsRoundedRowsInHalfTheBytes) {
  KvCache half(1, 2, 8, KvDType::kF16), full(1, 2, 8, KvDType::kF32);
  const auto k = RandomVector(37 * 16, 40, 3.f), v = RandomVector(37 * 16, 41);
  ASSERT_TRUE(half.Append(0, 37, k.data(), v.data(), 16).ok());
  ASSERT_TRUE(full.Append(0, 37, k.data(), v.data(), 16).ok());
  EXPECT_EQ(half.dtype(), KvDType::kF16);
  EXPECT_EQ(2 * half.allocated_bytes(), full.allocated_bytes());
  const KvView view = half.View(0);
  EXPECT_EQ(view.k, nullptr);
  ASSERT_NE(view.k_f16, nullptr);
  std::vector<float> scratch;
  const KvView wide = AsFloatView(view, &scratch);
  ASSERT_EQ(wide.n_rows, 37);
  for (size_t i = 0; i < k.size(); ++i) {
    ASSERT_EQ(view.k_f16[i], FloatToFp16(k[i]));
    ASSERT_EQ(wide.k[i], Fp16ToFloat(FloatToFp16(k[i])));
    ASSERT_EQ(wide.v[i], Fp16ToFloat(FloatToFp16(v[i])));
  }
  EXPECT_EQ(ParseKvDType("f16").value(), KvDType::kF16);
  EXPECT_EQ(ParseKvDType("f32").value(), KvDType::kF32);
  EXPECT_FALSE(ParseKvDType("bf16").ok());
}

// Dense attention over a half cache equals dense attention over a float32 cache of the rounded
// values, bit for bit, for prefill (SGEMM on widened rows) and decode (attend_rows on half).
TEST(DenseAttentionTest, HalfRowsGiveTheBitsOfTheirFloatValues) {
  ThreadPool pool(2);
  DenseAttention attention(&pool, /*query_block=*/4);
  const AttentionShape shape{6, 2, 32, 1.f / std::sqrt(32.f)};
  KvCache half(1, 2, 32, KvDType::kF16), full(1, 2, 32, KvDType::kF32);
  const auto k = RandomVector(50 * 64, 42, 2.f), v = RandomVector(50 * 64, 43);
  std::vector<float> rk(k.size()), rv(v.size());
  for (size_t i = 0; i < k.size(); ++i) {
    rk[i] = Fp16ToFloat(FloatToFp16(k[i]));
    rv[i] = Fp16ToFloat(FloatToFp16(v[i]));
  }
  ASSERT_TRUE(half.Append(0, 50, k.data(), v.data(), 64).ok());
  ASSERT_TRUE(full.Append(0, 50, rk.data(), rv.data(), 64).ok());
  const auto q = RandomVector(9 * 192, 44);
  for (int64_t n_queries : {9, 1}) {
    SCOPED_TRACE(n_queries == 1 ? "decode" : "prefill");
    std::vector<float> out_half(n_queries * 192, NAN), out_full(n_queries * 192, NAN);
    AttentionRequest a{0, 0, 50 - n_queries, n_queries, q.data(), half.View(0), out_half.data()};
    AttentionRequest b{0, 0, 50 - n_queries, n_queries, q.data(), full.View(0), out_full.data()};
    ASSERT_TRUE(attention.Attend(shape, std::span(&a, 1)).ok());
    ASSERT_TRUE(attention.Attend(shape, std::span(&b, 1)).ok());
    for (size_t i = 0; i < out_half.size(); ++i) ASSERT_EQ(out_half[i], out_full[i]) << i;
    std::vector<float> expected;
    NaiveAttention(shape, b, expected);
    for (size_t i = 0; i < expected.size(); ++i) ASSERT_NEAR(out_half[i], expected[i], 1e-5) << i;
  }
}

TEST(DenseAttentionTest, StableWithLargeScores) {
  DenseAttention attention(nullptr);
  const AttentionShape shape{1, 1, 4, 1.f};
  // Scores around 1e4 would overflow exp() without the max subtraction.
  std::vector<float> k = {1000, 0, 0, 0, 1001, 0, 0, 0};
  std::vector<float> v = {1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<float> q = {10, 0, 0, 0}, out(4);
  AttentionRequest r{0, 0, 1, 1, q.data(), {k.data(), v.data(), 2, 4, {}, 2}, out.data()};
  ASSERT_TRUE(attention.Attend(shape, std::span(&r, 1)).ok());
  // weights: softmax([10000, 10010]) ~ [4.5e-5, 1]
  const double w0 = 1.0 / (1.0 + std::exp(10.0));
  for (int d = 0; d < 4; ++d) {
    EXPECT_TRUE(std::isfinite(out[d]));
    EXPECT_NEAR(out[d], w0 * v[d] + (1 - w0) * v[4 + d], 1e-4);
  }
}

TEST(DenseAttentionTest, RejectsBadRequests) {
  DenseAttention attention(nullptr);
  std::vector<float> q(4), out(4), k(4);
  AttentionRequest r{0, 0, 0, 1, q.data(), {k.data(), k.data(), 1, 2, {}, 1}, out.data()};
  const auto status = attention.Attend({1, 1, 4, 1.f}, std::span(&r, 1));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), testing::HasSubstr("row_stride"));
}

TEST(SamplerTest, GreedyPicksArgmaxLowestIdOnTies) {
  auto sampler = Sampler::Create({});
  ASSERT_TRUE(sampler.ok());
  const std::vector<float> logits = {0.f, 3.f, -1.f, 3.f, NAN};
  EXPECT_EQ(*sampler->Sample(logits), 1);
}

TEST(SamplerTest, GreedyPickIsWhatAGreedySampleReturns) {
  auto greedy = Sampler::Create({});
  auto hot = Sampler::Create({0.8f, 1.f, 1});
  ASSERT_TRUE(greedy.ok() && hot.ok());
  EXPECT_TRUE(greedy->greedy());
  EXPECT_FALSE(hot->greedy());
  const std::vector<float> logits = {0.5f, 3.f, -1.f, 3.f};
  auto sampled = greedy->Sample(logits);
  ASSERT_TRUE(sampled.ok());
  auto picked = Sampler::GreedyPick(ArgMax(logits));
  ASSERT_TRUE(picked.ok());
  EXPECT_EQ(*picked, *sampled);
  // No finite logit: the same error either way.
  const std::vector<float> nan(3, std::nanf(""));
  const absl::Status from_sample = greedy->Sample(nan).status();
  const absl::Status from_pick = Sampler::GreedyPick(ArgMax(nan)).status();
  EXPECT_EQ(from_sample.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(from_pick, from_sample);
}

TEST(SamplerTest, SameSeedSameTokensDifferentSeedDiffers) {
  const auto logits = RandomVector(1000, 20, 2.f);
  auto draw = [&](uint64_t seed) {
    auto sampler = Sampler::Create({1.0f, 0.95f, seed});
    EXPECT_TRUE(sampler.ok());
    std::vector<int32_t> tokens;
    for (int i = 0; i < 50; ++i) tokens.push_back(*sampler->Sample(logits));
    return tokens;
  };
  EXPECT_EQ(draw(7), draw(7));
  EXPECT_NE(draw(7), draw(8));
}

TEST(SamplerTest, TopPKeepsOnlyTheNucleus) {
  // Probabilities ~ [0.64, 0.24, 0.09, 0.03]: top_p 0.7 keeps ids 0 and 1 only.
  const std::vector<float> logits = {std::log(0.64f), std::log(0.24f), std::log(0.09f),
                                     std::log(0.03f)};
  auto sampler = Sampler::Create({1.f, 0.7f, 3});
  ASSERT_TRUE(sampler.ok());
  int counts[4] = {0, 0, 0, 0};
  for (int i = 0; i < 2000; ++i) ++counts[*sampler->Sample(logits)];
  EXPECT_EQ(counts[2] + counts[3], 0);
  EXPECT_GT(counts[0], counts[1]);
  EXPECT_GT(counts[1], 0);
}

TEST(SamplerTest, TopPNucleusLargerThanTheSortedPrefix) {
  // 1000 equal logits: the nucleus at 0.9 is the 900 lowest ids (ties break by id), more than
  // the prefix the sampler orders first.
  const std::vector<float> logits(1000, 0.5f);
  auto sampler = Sampler::Create({1.f, 0.9f, 11});
  ASSERT_TRUE(sampler.ok());
  int max_id = 0;
  for (int i = 0; i < 3000; ++i) max_id = std::max(max_id, *sampler->Sample(logits));
  EXPECT_LT(max_id, 900);
  EXPECT_GT(max_id, 800);  // and the nucleus is not cut short
}

TEST(SamplerTest, TopKKeepsOnlyTheKMostLikely) {
  // Probabilities ~ [0.09, 0.64, 0.03, 0.24]: top_k 2 keeps ids 1 and 3, in proportion.
  const std::vector<float> logits = {std::log(0.09f), std::log(0.64f), std::log(0.03f),
                                     std::log(0.24f)};
  SamplingOptions o{1.f, 1.f, 5};
  o.top_k = 2;
  auto sampler = Sampler::Create(o);
  ASSERT_TRUE(sampler.ok());
  int counts[4] = {0, 0, 0, 0};
  for (int i = 0; i < 4000; ++i) ++counts[*sampler->Sample(logits)];
  EXPECT_EQ(counts[0] + counts[2], 0);
  // 0.64 / 0.88 = 0.727 of the draws; 4000 draws: +-0.03 is > 4 standard deviations.
  EXPECT_NEAR(counts[1] / 4000.0, 0.64 / 0.88, 0.03);
  // top_k 1 is greedy whatever the temperature; top_k >= vocabulary changes nothing.
  o.top_k = 1;
  auto one = Sampler::Create(o);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(*one->Sample(logits), 1);
  o.top_k = 100;
  auto all = Sampler::Create(o);
  auto off = Sampler::Create({1.f, 1.f, 5});
  for (int i = 0; i < 200; ++i) EXPECT_EQ(*all->Sample(logits), *off->Sample(logits));
}

TEST(SamplerTest, TopPAppliesToTheTopKRenormalisedMass) {
  // top_k 3 keeps [0.64, 0.24, 0.09] (mass 0.97); top_p 0.9 of that is 0.873: ids 0 and 1
  // (0.88) reach it, id 2 is cut. Without top_k, top_p 0.9 would keep id 2 (0.88 < 0.9).
  const std::vector<float> logits = {std::log(0.64f), std::log(0.24f), std::log(0.09f),
                                     std::log(0.03f)};
  SamplingOptions o{1.f, 0.9f, 9};
  o.top_k = 3;
  auto sampler = Sampler::Create(o);
  int counts[4] = {0, 0, 0, 0};
  for (int i = 0; i < 3000; ++i) ++counts[*sampler->Sample(logits)];
  EXPECT_EQ(counts[2] + counts[3], 0);
  EXPECT_GT(counts[1], 0);
  auto no_k = Sampler::Create({1.f, 0.9f, 9});
  int third = 0;
  for (int i = 0; i < 3000; ++i) third += *no_k->Sample(logits) == 2;
  EXPECT_GT(third, 0);
}

TEST(SamplerTest, RejectsBadOptions) {
  EXPECT_FALSE(Sampler::Create({1.f, 0.f, 0}).ok());
  EXPECT_FALSE(Sampler::Create({1.f, 1.5f, 0}).ok());
  EXPECT_FALSE(Sampler::Create({INFINITY, 1.f, 0}).ok());
  auto sampler = Sampler::Create({});
  ASSERT_TRUE(sampler.ok());
  EXPECT_FALSE(sampler->Sample({}).ok());
}

}  // namespace
}  // namespace kvr::model
