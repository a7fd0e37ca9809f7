#include "kvr/retrieval/codebook.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>
#include <vector>

#include <unistd.h>

#include "gtest/gtest.h"
#include "kvr/retrieval/rope.h"

namespace kvr::retrieval {
namespace {

// Anisotropic queries (a few dominant directions, like real query heads) and clustered keys.
struct Samples {
  std::vector<double> second_moment;  // [d, d] sum of q^T q
  int64_t n_queries = 0;
  std::vector<float> queries;  // [n_queries, d]
  std::vector<float> keys;     // [n_keys, d]
};

Samples MakeSamples(int d, int n_queries, int n_keys, int n_clusters, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  Samples s;
  s.n_queries = n_queries;
  // Query channel scales fall off geometrically: H is far from a multiple of the identity.
  std::vector<float> channel_scale(d);
  for (int i = 0; i < d; ++i) channel_scale[i] = 3.f * std::pow(0.85f, static_cast<float>(i));
  s.queries.resize(static_cast<size_t>(n_queries) * d);
  s.second_moment.assign(static_cast<size_t>(d) * d, 0.0);
  for (int q = 0; q < n_queries; ++q) {
    float* row = s.queries.data() + static_cast<size_t>(q) * d;
    for (int i = 0; i < d; ++i) row[i] = channel_scale[i] * normal(rng);
    for (int i = 0; i < d; ++i) {
      for (int j = 0; j < d; ++j)
        s.second_moment[static_cast<size_t>(i) * d + j] += double(row[i]) * row[j];
    }
  }
  std::vector<float> centres(static_cast<size_t>(n_clusters) * d);
  for (float& c : centres) c = normal(rng);
  std::uniform_int_distribution<int> pick(0, n_clusters - 1);
  s.keys.resize(static_cast<size_t>(n_keys) * d);
  for (int k = 0; k < n_keys; ++k) {
    const float* c = centres.data() + static_cast<size_t>(pick(rng)) * d;
    for (int i = 0; i < d; ++i) s.keys[static_cast<size_t>(k) * d + i] = c[i] + 0.5f * normal(rng);
  }
  return s;
}

// c = c^z L^-1 for one codeword, by forward substitution on x L = c^z (x row vector).
std::vector<double> Codeword(const HeadCodebook& b, int c) {
  const int d = b.head_dim;
  std::vector<double> x(d);
  // x L = z  <=>  sum_i x_i L[i][j] = z_j; L lower => solve from j = d-1 down.
  for (int j = d - 1; j >= 0; --j) {
    double acc = b.codewords[static_cast<size_t>(c) * d + j];
    for (int i = j + 1; i < d; ++i) acc -= x[i] * b.chol[static_cast<size_t>(i) * d + j];
    x[j] = acc / b.chol[static_cast<size_t>(j) * d + j];
  }
  return x;
}

TEST(CodebookTest, CholeskyFactorsTheQuerySecondMoment) {
  constexpr int kD = 16;
  Samples s = MakeSamples(kD, 2000, 500, 8, 1);
  CodebookParams params;
  params.codebook_size = 8;
  auto book = BuildHeadCodebook(s.second_moment, s.n_queries, s.keys, kD, params, 1);
  ASSERT_TRUE(book.ok()) << book.status();
  double trace = 0;
  for (int i = 0; i < kD; ++i) trace += s.second_moment[i * kD + i] / s.n_queries;
  for (int i = 0; i < kD; ++i) {
    for (int j = 0; j < kD; ++j) {
      if (j > i) {
        EXPECT_EQ(book->chol[i * kD + j], 0.f) << "L must be lower-triangular";
      }
      double llt = 0;
      for (int k = 0; k < kD; ++k) llt += double(book->chol[i * kD + k]) * book->chol[j * kD + k];
      const double h =
          s.second_moment[i * kD + j] / s.n_queries + (i == j ? params.ridge * trace / kD : 0.0);
      EXPECT_NEAR(llt, h, 1e-4 * trace) << i << "," << j;
    }
  }
}

// Scores() equals q . c with c = c^z L^-1, and Assign() is the brute-force argmin of the
// query-aware distance (k - c) H (k - c)^T.
TEST(CodebookTest, ScoresAndAssignMatchBruteForce) {
  constexpr int kD = 16;
  Samples s = MakeSamples(kD, 2000, 600, 12, 2);
  CodebookParams params;
  params.codebook_size = 12;
  params.ridge = 0;  // brute force below uses the plain H
  auto book = BuildHeadCodebook(s.second_moment, s.n_queries, s.keys, kD, params, 2);
  ASSERT_TRUE(book.ok()) << book.status();
  std::vector<std::vector<double>> cw;
  for (int c = 0; c < book->size; ++c) cw.push_back(Codeword(*book, c));
  std::vector<float> scores(book->size), scratch;
  for (int q = 0; q < 20; ++q) {
    const float* qv = s.queries.data() + q * kD;
    book->Scores(qv, scores.data(), scratch);
    for (int c = 0; c < book->size; ++c) {
      double expected = 0;
      for (int i = 0; i < kD; ++i) expected += qv[i] * cw[c][i];
      EXPECT_NEAR(scores[c], expected, 1e-3 * (1 + std::fabs(expected)));
    }
  }
  std::vector<uint16_t> ids(100);
  book->Assign(s.keys.data(), 100, kD, ids.data(), scratch);
  for (int k = 0; k < 100; ++k) {
    const float* kv = s.keys.data() + k * kD;
    int best = 0;
    double best_d = INFINITY;
    for (int c = 0; c < book->size; ++c) {
      double dist = 0;
      for (int i = 0; i < kD; ++i) {
        for (int j = 0; j < kD; ++j) {
          dist +=
              (kv[i] - cw[c][i]) * s.second_moment[i * kD + j] / s.n_queries * (kv[j] - cw[c][j]);
        }
      }
      if (dist < best_d) {
        best_d = dist;
        best = c;
      }
    }
    EXPECT_EQ(ids[k], best) << "key " << k;
  }
}

// Well-separated clusters are recovered exactly by k-means++ + Lloyd.
TEST(CodebookTest, RecoversSeparatedClusters) {
  constexpr int kD = 8, kClusters = 6, kPer = 50;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  std::vector<float> keys;
  for (int c = 0; c < kClusters; ++c) {
    std::vector<float> centre(kD);
    for (float& x : centre) x = 20.f * normal(rng);
    for (int k = 0; k < kPer; ++k) {
      for (int i = 0; i < kD; ++i) keys.push_back(centre[i] + 0.1f * normal(rng));
    }
  }
  std::vector<double> identity(kD * kD, 0.0);
  for (int i = 0; i < kD; ++i) identity[i * kD + i] = 1.0;
  CodebookParams params;
  params.codebook_size = kClusters;
  auto book = BuildHeadCodebook(identity, 1, keys, kD, params, 3);
  ASSERT_TRUE(book.ok()) << book.status();
  std::vector<uint16_t> ids(kClusters * kPer);
  std::vector<float> scratch;
  book->Assign(keys.data(), ids.size(), kD, ids.data(), scratch);
  std::vector<int> seen;
  for (int c = 0; c < kClusters; ++c) {
    for (int k = 1; k < kPer; ++k) EXPECT_EQ(ids[c * kPer + k], ids[c * kPer]);
    seen.push_back(ids[c * kPer]);
  }
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(std::unique(seen.begin(), seen.end()), seen.end()) << "one codeword per cluster";
}

// Observation 3 of the paper: with anisotropic queries, the query-aware codebook approximates
// attention scores better (lower E[(q.k - q.c(k))^2]) than a plain k-means codebook of equal
// size, measured on held-out queries.
TEST(CodebookTest, QueryAwareBeatsPlainVqOnScoreError) {
  constexpr int kD = 32;
  Samples s = MakeSamples(kD, 4000, 4000, 200, 4);
  Samples held_out = MakeSamples(kD, 500, 10, 2, 5);
  CodebookParams params;
  params.codebook_size = 64;
  std::vector<double> identity(kD * kD, 0.0);
  for (int i = 0; i < kD; ++i) identity[i * kD + i] = 1.0;
  auto aware = BuildHeadCodebook(s.second_moment, s.n_queries, s.keys, kD, params, 6);
  auto plain = BuildHeadCodebook(identity, 1, s.keys, kD, params, 6);
  ASSERT_TRUE(aware.ok() && plain.ok());
  auto score_mse = [&](const HeadCodebook& b) {
    std::vector<uint16_t> ids(s.keys.size() / kD);
    std::vector<float> scratch, scores(b.size);
    b.Assign(s.keys.data(), ids.size(), kD, ids.data(), scratch);
    double err = 0;
    int64_t n = 0;
    for (int q = 0; q < 200; ++q) {
      const float* qv = held_out.queries.data() + q * kD;
      b.Scores(qv, scores.data(), scratch);
      for (size_t k = 0; k < ids.size(); k += 7) {
        double exact = 0;
        for (int i = 0; i < kD; ++i) exact += qv[i] * s.keys[k * kD + i];
        err += (exact - scores[ids[k]]) * (exact - scores[ids[k]]);
        ++n;
      }
    }
    return err / n;
  };
  const double mse_aware = score_mse(*aware), mse_plain = score_mse(*plain);
  std::printf("score MSE: query-aware %.4f, plain VQ %.4f\n", mse_aware, mse_plain);
  EXPECT_LT(mse_aware, 0.9 * mse_plain);
}

TEST(CodebookTest, BadInputs) {
  std::vector<double> h(16, 0.0);
  std::vector<float> keys(16, 1.f);
  EXPECT_FALSE(BuildHeadCodebook(h, 0, keys, 4, CodebookParams{}, 1).ok());  // no queries
  EXPECT_FALSE(BuildHeadCodebook(h, 1, {}, 4, CodebookParams{}, 1).ok());    // no keys
  EXPECT_FALSE(BuildHeadCodebook(h, 1, keys, 5, CodebookParams{}, 1).ok());  // wrong H size
  CodebookParams bad;
  bad.codebook_size = 70000;
  EXPECT_EQ(bad.Validate().code(), absl::StatusCode::kInvalidArgument);
}

ModelFingerprint TinyModel() {
  ModelFingerprint m;
  m.model_name = "tiny-test-model";
  m.model_hash = 0x1234abcd;
  m.n_layers = 2;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.head_dim = 16;
  m.rope.style = RopeStyle::kHalfSplit;
  m.rope.theta = 10000.f;
  return m;
}

// Collects post-RoPE samples for TinyModel and builds its codebooks.
std::shared_ptr<const A2atsCodebooks> BuildTiny(int codebook_size) {
  ModelFingerprint m = TinyModel();
  CodebookParams params;
  params.codebook_size = codebook_size;
  auto samples = CalibrationSamples::Create(m, params);
  EXPECT_TRUE(samples.ok()) << samples.status();
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  constexpr int kN = 300;
  std::vector<float> q(kN * m.n_heads * m.head_dim), k(kN * m.n_kv_heads * m.head_dim);
  for (int layer = 0; layer < m.n_layers; ++layer) {
    for (float& x : q) x = normal(rng);
    for (float& x : k) x = normal(rng);
    EXPECT_TRUE(
        samples->AddQueries(layer, TokenTensor{q.data(), kN, m.n_heads * m.head_dim}, 0).ok());
    EXPECT_TRUE(
        samples->AddKeys(layer, TokenTensor{k.data(), kN, m.n_kv_heads * m.head_dim}, 0).ok());
  }
  auto books = BuildCodebooks(*samples, nullptr);
  EXPECT_TRUE(books.ok()) << books.status();
  return books.ok() ? *books : nullptr;
}

TEST(CalibrationSamplesTest, KeysAreStoredPreRopeAndReservoirSampled) {
  ModelFingerprint m = TinyModel();
  CodebookParams params;
  params.max_keys_per_head = 10;
  auto samples = CalibrationSamples::Create(m, params);
  ASSERT_TRUE(samples.ok());
  // One pre-RoPE key, rotated to position 500 as the runtime would store it.
  std::vector<float> pre(m.n_kv_heads * m.head_dim);
  for (size_t i = 0; i < pre.size(); ++i) pre[i] = 0.1f * static_cast<float>(i) - 0.7f;
  std::vector<float> post = pre;
  for (int h = 0; h < m.n_kv_heads; ++h) {
    ApplyRope(std::span<float>(post.data() + h * m.head_dim, m.head_dim), 500, m.rope);
  }
  ASSERT_TRUE(
      samples->AddKeys(0, TokenTensor{post.data(), 1, m.n_kv_heads * m.head_dim}, 500).ok());
  const auto& head1 = samples->head(0, 1);
  ASSERT_EQ(head1.keys.size(), static_cast<size_t>(m.head_dim));
  for (int i = 0; i < m.head_dim; ++i) EXPECT_NEAR(head1.keys[i], pre[m.head_dim + i], 1e-4);
  std::vector<float> many(100 * m.n_kv_heads * m.head_dim, 1.f);
  ASSERT_TRUE(
      samples->AddKeys(0, TokenTensor{many.data(), 100, m.n_kv_heads * m.head_dim}, 1).ok());
  EXPECT_EQ(samples->head(0, 0).keys.size(), static_cast<size_t>(10 * m.head_dim));
  EXPECT_EQ(samples->head(0, 0).n_keys_seen, 101);
  EXPECT_FALSE(samples->AddKeys(2, TokenTensor{many.data(), 1, m.n_kv_heads * m.head_dim}, 0).ok());
}

TEST(CalibrationSamplesTest, MissingLayerIsAClearError) {
  auto samples = CalibrationSamples::Create(TinyModel(), CodebookParams{});
  ASSERT_TRUE(samples.ok());
  auto books = BuildCodebooks(*samples, nullptr);
  ASSERT_FALSE(books.ok());
  EXPECT_EQ(books.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(books.status().message().find("layer 0"), std::string::npos) << books.status();
}

TEST(CodebookFileTest, RoundTripSaveLoad) {
  auto books = BuildTiny(16);
  ASSERT_NE(books, nullptr);
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("kvr_codebook_test_" + std::to_string(::getpid()) + ".kvrcb"))
                               .string();
  ASSERT_TRUE(books->Save(path).ok());
  ModelFingerprint expected = TinyModel();
  auto loaded = A2atsCodebooks::Load(path, &expected);
  std::filesystem::remove(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ((*loaded)->content_hash(), books->content_hash());
  EXPECT_EQ((*loaded)->model().model_name, "tiny-test-model");
  EXPECT_EQ((*loaded)->params().wrope_offset, books->params().wrope_offset);
  for (int layer = 0; layer < 2; ++layer) {
    for (int h = 0; h < 2; ++h) {
      EXPECT_EQ((*loaded)->head(layer, h).chol, books->head(layer, h).chol);
      EXPECT_EQ((*loaded)->head(layer, h).codewords, books->head(layer, h).codewords);
      EXPECT_EQ((*loaded)->head(layer, h).half_norms, books->head(layer, h).half_norms);
    }
  }
  EXPECT_EQ((*loaded)->Serialize(), books->Serialize());
}

TEST(CodebookFileTest, AnotherModelIsRefusedWithTheDifference) {
  auto books = BuildTiny(8);
  ASSERT_NE(books, nullptr);
  const std::vector<uint8_t> bytes = books->Serialize();
  ModelFingerprint other = TinyModel();
  other.n_layers = 30;
  other.model_name = "SmolLM2-135M-Instruct";
  auto r = A2atsCodebooks::Parse(bytes, &other);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("another model"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("n_layers 2 vs 30"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("SmolLM2"), std::string::npos) << r.status();
  other = TinyModel();
  other.rope.theta = 100000.f;
  r = A2atsCodebooks::Parse(bytes, &other);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("rope theta"), std::string::npos) << r.status();
  other = TinyModel();
  other.model_hash = 99;
  EXPECT_FALSE(A2atsCodebooks::Parse(bytes, &other).ok());
}

TEST(CodebookFileTest, CorruptBytesAreRefused) {
  auto books = BuildTiny(8);
  ASSERT_NE(books, nullptr);
  const std::vector<uint8_t> bytes = books->Serialize();
  // Not a codebook at all.
  std::vector<uint8_t> junk(100, 'x');
  auto r = A2atsCodebooks::Parse(junk);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("not an a2ats codebook"), std::string::npos);
  // Every truncation and every single flipped byte is caught (magic, version or checksum).
  for (size_t cut = 0; cut < bytes.size(); cut += 97) {
    EXPECT_FALSE(A2atsCodebooks::Parse(std::span<const uint8_t>(bytes.data(), cut)).ok()) << cut;
  }
  std::mt19937 rng(9);
  for (int trial = 0; trial < 100; ++trial) {
    std::vector<uint8_t> corrupt = bytes;
    corrupt[rng() % corrupt.size()] ^= static_cast<uint8_t>(1 + rng() % 255);
    EXPECT_FALSE(A2atsCodebooks::Parse(corrupt).ok());
  }
  EXPECT_FALSE(A2atsCodebooks::Load("/nonexistent/dir/codebook.kvrcb").ok());
}

}  // namespace
}  // namespace kvr::retrieval
