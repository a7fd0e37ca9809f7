#include "kvr/retrieval/codebook.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "kvr/common/mapped_file.h"
#include "kvr/common/status.h"
#include "kvr/common/thread_pool.h"
#include "kvr/retrieval/rope.h"
#include "kvr/retrieval/serialization.h"
#include "method_util.h"
#include "srht.h"

// LAPACK's Cholesky from the OpenBLAS library we already link (Debian's libopenblas exports the
// LAPACK symbols, but the openblas-pthread include dir ships no lapack.h). Fortran ABI: all
// arguments by pointer, plus the hidden length of the character argument that gfortran appends.
extern "C" void dpotrf_(const char* uplo, const int* n, double* a, const int* lda, int* info,
                        size_t uplo_len);

namespace kvr::retrieval {
namespace {

constexpr char kMagic[8] = {'K', 'V', 'R', 'C', 'B', 'O', 'O', 'K'};
constexpr int kMaxLayers = 4096;
constexpr int kMaxHeads = 1024;
constexpr int kMaxHeadDim = 1024;
constexpr int kMaxCodebookSize = 65536;  // ids are u16
constexpr int64_t kAssignChunk = 1024;   // keys per GEMM block in Assign / Lloyd

uint64_t Fnv1a64(std::span<const uint8_t> bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (uint8_t b : bytes) {
    h ^= b;
    h *= 0x100000001b3ull;
  }
  return h;
}

double Uniform01(uint64_t& state) {
  return static_cast<double>(internal::SplitMix64Next(state) >> 11) * 0x1.0p-53;
}

std::string RopeStyleName(RopeStyle s) {
  switch (s) {
    case RopeStyle::kNone:
      return "none";
    case RopeStyle::kAdjacentPairs:
      return "adjacent-pairs";
    case RopeStyle::kHalfSplit:
      return "half-split";
  }
  return absl::StrCat("unknown(", static_cast<int>(s), ")");
}

// Lloyd's k-means with k-means++ seeding over points [n, d] (Euclidean). Returns centres
// [k, d]. Distances go through GEMM: |z - c|^2 = |z|^2 - 2 z.c + |c|^2.
std::vector<float> KMeansPlusPlusLloyd(const std::vector<float>& points, int64_t n, int d, int k,
                                       int max_iterations, uint64_t seed) {
  std::vector<float> centres(static_cast<size_t>(k) * d);
  uint64_t rng = seed;
  // k-means++ (Arthur & Vassilvitskii 2007): each next centre drawn with probability
  // proportional to the squared distance to the nearest centre chosen so far.
  std::vector<double> min_dist(n, std::numeric_limits<double>::infinity());
  int64_t pick = static_cast<int64_t>(Uniform01(rng) * n) % n;
  for (int c = 0; c < k; ++c) {
    std::copy_n(points.data() + pick * d, d, centres.data() + static_cast<size_t>(c) * d);
    const float* cc = centres.data() + static_cast<size_t>(c) * d;
    double total = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float* p = points.data() + i * d;
      double dist = 0;
      for (int j = 0; j < d; ++j) {
        const double diff = static_cast<double>(p[j]) - cc[j];
        dist += diff * diff;
      }
      min_dist[i] = std::min(min_dist[i], dist);
      total += min_dist[i];
    }
    if (c + 1 == k) break;
    if (total <= 0) {  // fewer distinct points than centres: duplicates are harmless
      pick = static_cast<int64_t>(Uniform01(rng) * n) % n;
      continue;
    }
    double target = Uniform01(rng) * total;
    pick = n - 1;
    for (int64_t i = 0; i < n; ++i) {
      target -= min_dist[i];
      if (target < 0) {
        pick = i;
        break;
      }
    }
  }

  std::vector<int32_t> assignment(n, -1);
  std::vector<float> scores(static_cast<size_t>(kAssignChunk) * k);  // [chunk, k]
  std::vector<float> half_norm(k);
  std::vector<float> best_dist(n);
  std::vector<double> sums(static_cast<size_t>(k) * d);
  std::vector<int64_t> counts(k);
  for (int iter = 0; iter < max_iterations; ++iter) {
    for (int c = 0; c < k; ++c) {
      const float* cc = centres.data() + static_cast<size_t>(c) * d;
      half_norm[c] = 0.5f * std::inner_product(cc, cc + d, cc, 0.f);
    }
    int64_t changed = 0;
    for (int64_t begin = 0; begin < n; begin += kAssignChunk) {
      const int64_t rows = std::min(kAssignChunk, n - begin);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows), k, d, 1.f,
                  points.data() + begin * d, d, centres.data(), d, 0.f, scores.data(), k);
      for (int64_t r = 0; r < rows; ++r) {
        const float* s = scores.data() + r * k;
        int best = 0;
        float best_score = s[0] - half_norm[0];
        for (int c = 1; c < k; ++c) {
          const float v = s[c] - half_norm[c];
          if (v > best_score) {
            best_score = v;
            best = c;
          }
        }
        const int64_t i = begin + r;
        if (assignment[i] != best) ++changed;
        assignment[i] = best;
        const float* p = points.data() + i * d;
        // |z - c|^2 = |z|^2 - 2 (z.c - |c|^2 / 2)
        best_dist[i] = std::inner_product(p, p + d, p, 0.f) - 2.f * best_score;
      }
    }
    if (changed == 0) break;
    std::fill(sums.begin(), sums.end(), 0.0);
    std::fill(counts.begin(), counts.end(), 0);
    for (int64_t i = 0; i < n; ++i) {
      const float* p = points.data() + i * d;
      double* sum = sums.data() + static_cast<size_t>(assignment[i]) * d;
      for (int j = 0; j < d; ++j) sum[j] += p[j];
      ++counts[assignment[i]];
    }
    for (int c = 0; c < k; ++c) {
      float* cc = centres.data() + static_cast<size_t>(c) * d;
      if (counts[c] > 0) {
        for (int j = 0; j < d; ++j)
          cc[j] = static_cast<float>(sums[static_cast<size_t>(c) * d + j] / counts[c]);
      } else {
        // Empty cluster: re-seed at the point currently worst served, and stop it from being
        // picked twice.
        const int64_t far =
            std::max_element(best_dist.begin(), best_dist.end()) - best_dist.begin();
        std::copy_n(points.data() + far * d, d, cc);
        best_dist[far] = 0;
      }
    }
  }
  return centres;
}

}  // namespace

// ---- fingerprint and params ----

absl::Status ModelFingerprint::Validate() const {
  if (n_layers < 1 || n_layers > kMaxLayers || n_heads < 1 || n_heads > kMaxHeads ||
      n_kv_heads < 1 || n_kv_heads > kMaxHeads || head_dim < 1 || head_dim > kMaxHeadDim) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "model fingerprint: n_layers %d, n_heads %d, n_kv_heads %d, head_dim %d out of range",
        n_layers, n_heads, n_kv_heads, head_dim));
  }
  if (n_heads % n_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "model fingerprint: n_heads %d is not a multiple of n_kv_heads %d", n_heads, n_kv_heads));
  }
  if (rope.rotary_dim < 0 || rope.rotary_dim > head_dim || rope.rotary_dim % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("model fingerprint: rope rotary_dim %d invalid", rope.rotary_dim));
  }
  return absl::OkStatus();
}

absl::Status CheckFingerprint(const ModelFingerprint& file, const ModelFingerprint& model) {
  std::vector<std::string> diffs;
  if (!model.model_name.empty() && file.model_name != model.model_name) {
    diffs.push_back(absl::StrCat("model name '", file.model_name, "' vs '", model.model_name, "'"));
  }
  if (model.model_hash != 0 && file.model_hash != model.model_hash) {
    diffs.push_back(
        absl::StrFormat("model hash %016x vs %016x", file.model_hash, model.model_hash));
  }
  auto check_int = [&](const char* name, int a, int b) {
    if (a != b) diffs.push_back(absl::StrFormat("%s %d vs %d", name, a, b));
  };
  check_int("n_layers", file.n_layers, model.n_layers);
  check_int("n_heads", file.n_heads, model.n_heads);
  check_int("n_kv_heads", file.n_kv_heads, model.n_kv_heads);
  check_int("head_dim", file.head_dim, model.head_dim);
  if (file.rope.style != model.rope.style) {
    diffs.push_back(absl::StrCat("rope style ", RopeStyleName(file.rope.style), " vs ",
                                 RopeStyleName(model.rope.style)));
  }
  if (file.rope.style != RopeStyle::kNone && file.rope.theta != model.rope.theta) {
    diffs.push_back(absl::StrFormat("rope theta %g vs %g", file.rope.theta, model.rope.theta));
  }
  const int file_rot = file.rope.rotary_dim > 0 ? file.rope.rotary_dim : file.head_dim;
  const int model_rot = model.rope.rotary_dim > 0 ? model.rope.rotary_dim : model.head_dim;
  check_int("rope rotary_dim", file_rot, model_rot);
  if (diffs.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "a2ats codebook file is for another model (file vs this model): ", absl::StrJoin(diffs, ", "),
      "; run `kvr calibrate` for this model"));
}

absl::Status CodebookParams::Validate() const {
  if (codebook_size < 1 || codebook_size > kMaxCodebookSize) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "a2ats codebook_size must be in [1, %d], got %d", kMaxCodebookSize, codebook_size));
  }
  if (max_iterations < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("a2ats max_iterations must be >= 0, got ", max_iterations));
  }
  if (wrope_offset < 0 || wrope_window < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("a2ats WRoPE offset b and window w must be >= 0, got b = %d, w = %d",
                        wrope_offset, wrope_window));
  }
  if (!(ridge >= 0 && ridge < 1)) {
    return absl::InvalidArgumentError(absl::StrCat("a2ats ridge must be in [0, 1), got ", ridge));
  }
  if (max_keys_per_head < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("a2ats max_keys_per_head must be >= 1, got ", max_keys_per_head));
  }
  return absl::OkStatus();
}

// ---- HeadCodebook ----

void HeadCodebook::Finalize() {
  half_norms.resize(size);
  for (int c = 0; c < size; ++c) {
    const float* cc = codewords.data() + static_cast<size_t>(c) * head_dim;
    half_norms[c] = 0.5f * std::inner_product(cc, cc + head_dim, cc, 0.f);
  }
}

void HeadCodebook::Assign(const float* keys, int64_t n, int64_t stride, uint16_t* ids,
                          std::vector<float>& scratch) const {
  const int d = head_dim;
  scratch.resize(static_cast<size_t>(kAssignChunk) * (d + size));
  float* z = scratch.data();                                               // [chunk, d]
  float* scores = scratch.data() + static_cast<size_t>(kAssignChunk) * d;  // [chunk, size]
  for (int64_t begin = 0; begin < n; begin += kAssignChunk) {
    const int rows = static_cast<int>(std::min(kAssignChunk, n - begin));
    // z = k L (row vectors), then z . c^z for every codeword.
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, d, d, 1.f, keys + begin * stride,
                static_cast<int>(stride), chol.data(), d, 0.f, z, d);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, size, d, 1.f, z, d, codewords.data(),
                d, 0.f, scores, size);
    for (int r = 0; r < rows; ++r) {
      const float* s = scores + static_cast<size_t>(r) * size;
      int best = 0;
      float best_score = s[0] - half_norms[0];
      for (int c = 1; c < size; ++c) {
        const float v = s[c] - half_norms[c];
        if (v > best_score) {
          best_score = v;
          best = c;
        }
      }
      ids[begin + r] = static_cast<uint16_t>(best);
    }
  }
}

void HeadCodebook::Scores(const float* q, float* scores, std::vector<float>& scratch) const {
  // q . c with c = c^z L^-1 equals (q L^-T) . c^z; x = q L^-T solves L x = q (x, q as columns).
  scratch.assign(q, q + head_dim);
  cblas_strsv(CblasRowMajor, CblasLower, CblasNoTrans, CblasNonUnit, head_dim, chol.data(),
              head_dim, scratch.data(), 1);
  cblas_sgemv(CblasRowMajor, CblasNoTrans, size, head_dim, 1.f, codewords.data(), head_dim,
              scratch.data(), 1, 0.f, scores, 1);
}

// ---- building ----

absl::StatusOr<HeadCodebook> BuildHeadCodebook(std::span<const double> second_moment,
                                               int64_t n_queries, std::span<const float> keys,
                                               int d, const CodebookParams& params, uint64_t seed) {
  KVR_RETURN_IF_ERROR(params.Validate());
  if (d < 1 || second_moment.size() != static_cast<size_t>(d) * d) {
    return absl::InvalidArgumentError(
        absl::StrFormat("a2ats codebook: second moment has %d entries, head_dim %d needs %d",
                        second_moment.size(), d, static_cast<int64_t>(d) * d));
  }
  const int64_t n_keys = static_cast<int64_t>(keys.size()) / d;
  if (n_queries < 1 || n_keys < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("a2ats codebook: need sample queries and keys, got %d queries and %d keys",
                        n_queries, n_keys));
  }
  // H = E[q^T q] + ridge * trace(H) / d * I, then H = L L^T.
  std::vector<double> h(second_moment.begin(), second_moment.end());
  double trace = 0;
  for (int i = 0; i < d; ++i) trace += h[static_cast<size_t>(i) * d + i];
  for (double& v : h) v /= static_cast<double>(n_queries);
  trace /= static_cast<double>(n_queries);
  const double ridge = trace > 0 ? params.ridge * trace / d : 1.0;  // all-zero queries: identity
  for (int i = 0; i < d; ++i) h[static_cast<size_t>(i) * d + i] += ridge;
  // Row-major symmetric H is its own transpose, so Fortran's 'U' factor (H = U^T U, column-major)
  // read back row-major is the lower-triangular L with H = L L^T.
  int info = 0;
  const char uplo = 'U';
  dpotrf_(&uplo, &d, h.data(), &d, &info, 1);
  if (info != 0) {
    return absl::InternalError(absl::StrFormat(
        "a2ats codebook: Cholesky of the query second moment failed (LAPACK info %d); the "
        "ridge %g did not make it positive definite",
        info, params.ridge));
  }
  HeadCodebook book;
  book.head_dim = d;
  book.chol.assign(static_cast<size_t>(d) * d, 0.f);
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j <= i; ++j) {
      book.chol[static_cast<size_t>(i) * d + j] =
          static_cast<float>(h[static_cast<size_t>(i) * d + j]);
    }
  }
  // Whitened keys z = k L.
  std::vector<float> z(static_cast<size_t>(n_keys) * d);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(n_keys), d, d, 1.f,
              keys.data(), d, book.chol.data(), d, 0.f, z.data(), d);
  book.size = static_cast<int>(std::min<int64_t>(params.codebook_size, n_keys));
  book.codewords = KMeansPlusPlusLloyd(z, n_keys, d, book.size, params.max_iterations, seed);
  book.Finalize();
  return book;
}

absl::StatusOr<std::shared_ptr<const A2atsCodebooks>> BuildCodebooks(
    const CalibrationSamples& samples, ThreadPool* pool) {
  const ModelFingerprint& model = samples.model();
  const int n_heads_total = model.n_layers * model.n_kv_heads;
  std::vector<HeadCodebook> books(n_heads_total);
  std::vector<absl::Status> status(n_heads_total);
  int64_t n_query_samples = 0, n_key_samples = 0;
  for (int i = 0; i < n_heads_total; ++i) {
    const auto& head = samples.head(i / model.n_kv_heads, i % model.n_kv_heads);
    if (head.n_queries == 0 || head.keys.empty()) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "a2ats calibration: layer %d KV head %d got %d queries and %d keys; every layer "
          "needs samples (was the calibration text run through the whole model?)",
          i / model.n_kv_heads, i % model.n_kv_heads, head.n_queries,
          head.keys.size() / model.head_dim));
    }
    n_query_samples += head.n_queries;
    n_key_samples += head.n_keys_seen;
  }
  auto build = [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      const auto& head = samples.head(static_cast<int>(i) / model.n_kv_heads,
                                      static_cast<int>(i) % model.n_kv_heads);
      uint64_t seed = samples.params().seed + 0x9E3779B97F4A7C15ull * (i + 1);
      auto book = BuildHeadCodebook(head.second_moment, head.n_queries, head.keys, model.head_dim,
                                    samples.params(), internal::SplitMix64Next(seed));
      if (book.ok()) {
        books[i] = *std::move(book);
      } else {
        status[i] = book.status();
      }
    }
  };
  if (pool != nullptr) {
    pool->ParallelFor(n_heads_total, build, 1);
  } else {
    build(0, n_heads_total);
  }
  for (int i = 0; i < n_heads_total; ++i) {
    if (!status[i].ok()) {
      return absl::Status(status[i].code(),
                          absl::StrFormat("layer %d KV head %d: %s", i / model.n_kv_heads,
                                          i % model.n_kv_heads, status[i].message()));
    }
  }
  return std::make_shared<const A2atsCodebooks>(model, samples.params(), std::move(books),
                                                n_query_samples, n_key_samples);
}

// ---- samples ----

CalibrationSamples::CalibrationSamples(const ModelFingerprint& model, const CodebookParams& params)
    : model_(model),
      params_(params),
      heads_(static_cast<size_t>(model.n_layers) * model.n_kv_heads) {
  uint64_t state = params.seed;
  for (HeadSamples& h : heads_) {
    h.second_moment.assign(static_cast<size_t>(model.head_dim) * model.head_dim, 0.0);
    h.rng = internal::SplitMix64Next(state);
  }
}

absl::StatusOr<CalibrationSamples> CalibrationSamples::Create(const ModelFingerprint& model,
                                                              const CodebookParams& params) {
  KVR_RETURN_IF_ERROR(model.Validate());
  KVR_RETURN_IF_ERROR(params.Validate());
  return CalibrationSamples(model, params);
}

namespace {
absl::Status CheckSampleTensor(const TokenTensor& t, int layer, int n_layers, int n_heads,
                               int head_dim, const char* what) {
  if (layer < 0 || layer >= n_layers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("a2ats calibration %s: layer %d outside [0, %d)", what, layer, n_layers));
  }
  if (t.n_tokens < 0 || (t.n_tokens > 0 && t.data == nullptr) ||
      (t.n_tokens > 0 && t.row_stride < static_cast<int64_t>(n_heads) * head_dim)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("a2ats calibration %s: bad tensor (n_tokens %d, row_stride %d, need >= %d)",
                        what, t.n_tokens, t.row_stride, static_cast<int64_t>(n_heads) * head_dim));
  }
  return absl::OkStatus();
}
}  // namespace

absl::Status CalibrationSamples::AddQueries(int layer, const TokenTensor& queries,
                                            int64_t first_position) {
  const int d = model_.head_dim;
  KVR_RETURN_IF_ERROR(
      CheckSampleTensor(queries, layer, model_.n_layers, model_.n_heads, d, "queries"));
  const int group = model_.n_heads / model_.n_kv_heads;
  const int64_t n = queries.n_tokens;
  if (n == 0) return absl::OkStatus();
  std::vector<float> rows(static_cast<size_t>(n) * group * d);  // [n * group, d]
  std::vector<float> gram(static_cast<size_t>(d) * d);
  for (int kv = 0; kv < model_.n_kv_heads; ++kv) {
    for (int64_t t = 0; t < n; ++t) {
      for (int g = 0; g < group; ++g) {
        float* row = rows.data() + (static_cast<size_t>(t) * group + g) * d;
        std::copy_n(queries.At(t, kv * group + g, d), d, row);
        // WRoPE: the query at position p was rotated by p; re-rotate it to the offset b.
        ApplyRope(
            std::span<float>(row, d),
            static_cast<double>(params_.wrope_offset) - static_cast<double>(first_position + t),
            model_.rope);
      }
    }
    // Gram of this batch in float (a few thousand rows), accumulated in double across batches.
    cblas_ssyrk(CblasRowMajor, CblasLower, CblasTrans, d, static_cast<int>(n * group), 1.f,
                rows.data(), d, 0.f, gram.data(), d);
    HeadSamples& head = heads_[static_cast<size_t>(layer) * model_.n_kv_heads + kv];
    for (int i = 0; i < d; ++i) {
      for (int j = 0; j <= i; ++j) {
        const double v = gram[static_cast<size_t>(i) * d + j];
        head.second_moment[static_cast<size_t>(i) * d + j] += v;
        if (i != j) head.second_moment[static_cast<size_t>(j) * d + i] += v;
      }
    }
    head.n_queries += n * group;
  }
  return absl::OkStatus();
}

absl::Status CalibrationSamples::AddKeys(int layer, const TokenTensor& keys,
                                         int64_t first_position) {
  const int d = model_.head_dim;
  KVR_RETURN_IF_ERROR(
      CheckSampleTensor(keys, layer, model_.n_layers, model_.n_kv_heads, d, "keys"));
  std::vector<float> key(d);
  for (int kv = 0; kv < model_.n_kv_heads; ++kv) {
    HeadSamples& head = heads_[static_cast<size_t>(layer) * model_.n_kv_heads + kv];
    for (int64_t t = 0; t < keys.n_tokens; ++t) {
      // Reservoir sampling (Vitter's algorithm R): every key seen so far is kept with equal
      // probability, so long calibration texts are sampled evenly, not truncated.
      const int64_t stored = static_cast<int64_t>(head.keys.size()) / d;
      int64_t slot = stored;
      if (stored >= params_.max_keys_per_head) {
        slot = static_cast<int64_t>(internal::SplitMix64Next(head.rng) %
                                    static_cast<uint64_t>(head.n_keys_seen + 1));
      }
      ++head.n_keys_seen;
      if (slot >= params_.max_keys_per_head) continue;
      std::copy_n(keys.At(t, kv, d), d, key.data());
      ApplyRope(key, -static_cast<double>(first_position + t), model_.rope);  // to pre-RoPE
      if (slot == stored) {
        head.keys.insert(head.keys.end(), key.begin(), key.end());
      } else {
        std::copy(key.begin(), key.end(), head.keys.begin() + slot * d);
      }
    }
  }
  return absl::OkStatus();
}

// ---- file format ----

A2atsCodebooks::A2atsCodebooks(ModelFingerprint model, CodebookParams params,
                               std::vector<HeadCodebook> heads, int64_t n_query_samples,
                               int64_t n_key_samples)
    : model_(std::move(model)),
      params_(params),
      heads_(std::move(heads)),
      n_query_samples_(n_query_samples),
      n_key_samples_(n_key_samples) {
  // Every holder of codebooks may read half_norms (derived, not stored in files).
  for (HeadCodebook& h : heads_) {
    if (h.half_norms.size() != static_cast<size_t>(h.size)) h.Finalize();
  }
  content_hash_ = Fnv1a64(Serialize());
}

std::vector<uint8_t> A2atsCodebooks::Serialize() const {
  ByteWriter w;
  w.PutBytes(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(kMagic), sizeof(kMagic)));
  w.Put<uint32_t>(kCodebookFormatVersion);
  w.Put<uint32_t>(0);  // flags
  w.PutString(model_.model_name);
  w.Put<uint64_t>(model_.model_hash);
  w.Put<int32_t>(model_.n_layers);
  w.Put<int32_t>(model_.n_heads);
  w.Put<int32_t>(model_.n_kv_heads);
  w.Put<int32_t>(model_.head_dim);
  internal::PutRope(w, model_.rope);
  const int size = heads_.empty() ? 0 : heads_.front().size;
  w.Put<int32_t>(size);
  w.Put<int64_t>(params_.wrope_offset);
  w.Put<int32_t>(params_.wrope_window);
  w.Put<double>(params_.ridge);
  w.Put<int64_t>(n_query_samples_);
  w.Put<int64_t>(n_key_samples_);
  for (const HeadCodebook& h : heads_) {
    w.PutBytes(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(h.chol.data()),
                                        h.chol.size() * sizeof(float)));
    w.PutBytes(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(h.codewords.data()),
                                        h.codewords.size() * sizeof(float)));
  }
  const uint64_t checksum = Fnv1a64(w.bytes());
  w.Put<uint64_t>(checksum);
  return w.Take();
}

absl::StatusOr<std::shared_ptr<const A2atsCodebooks>> A2atsCodebooks::Parse(
    std::span<const uint8_t> bytes, const ModelFingerprint* expected) {
  if (bytes.size() < sizeof(kMagic) + 16 ||
      !std::equal(kMagic, kMagic + sizeof(kMagic), reinterpret_cast<const char*>(bytes.data()))) {
    return absl::InvalidArgumentError(
        "not an a2ats codebook file (missing 'KVRCBOOK' magic); make one with `kvr calibrate`");
  }
  ByteReader r(bytes.subspan(sizeof(kMagic), bytes.size() - sizeof(kMagic) - sizeof(uint64_t)));
  uint32_t version = 0, flags = 0;
  KVR_RETURN_IF_ERROR(r.Get("codebook version", &version));
  if (version != kCodebookFormatVersion) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "a2ats codebook file version %d is not supported (this build reads version %d)", version,
        kCodebookFormatVersion));
  }
  uint64_t stored_checksum = 0;
  std::memcpy(&stored_checksum, bytes.data() + bytes.size() - sizeof(uint64_t), sizeof(uint64_t));
  if (Fnv1a64(bytes.first(bytes.size() - sizeof(uint64_t))) != stored_checksum) {
    return absl::DataLossError(
        "a2ats codebook file is corrupt: checksum mismatch (truncated or modified bytes)");
  }
  KVR_RETURN_IF_ERROR(r.Get("codebook flags", &flags));
  ModelFingerprint model;
  KVR_RETURN_IF_ERROR(r.GetString("model name", &model.model_name, 4096));
  KVR_RETURN_IF_ERROR(r.Get("model hash", &model.model_hash));
  KVR_RETURN_IF_ERROR(r.Get("n_layers", &model.n_layers));
  KVR_RETURN_IF_ERROR(r.Get("n_heads", &model.n_heads));
  KVR_RETURN_IF_ERROR(r.Get("n_kv_heads", &model.n_kv_heads));
  KVR_RETURN_IF_ERROR(r.Get("head_dim", &model.head_dim));
  KVR_RETURN_IF_ERROR(internal::GetRope(r, "a2ats codebook file", &model.rope));
  if (absl::Status s = model.Validate(); !s.ok()) {
    return absl::DataLossError(absl::StrCat("a2ats codebook file: ", s.message()));
  }
  if (expected != nullptr) KVR_RETURN_IF_ERROR(CheckFingerprint(model, *expected));
  CodebookParams params;
  int32_t size = 0;
  int64_t n_query_samples = 0, n_key_samples = 0;
  KVR_RETURN_IF_ERROR(r.Get("codebook size", &size));
  KVR_RETURN_IF_ERROR(r.Get("wrope offset", &params.wrope_offset));
  KVR_RETURN_IF_ERROR(r.Get("wrope window", &params.wrope_window));
  KVR_RETURN_IF_ERROR(r.Get("ridge", &params.ridge));
  KVR_RETURN_IF_ERROR(r.Get("query samples", &n_query_samples));
  KVR_RETURN_IF_ERROR(r.Get("key samples", &n_key_samples));
  params.codebook_size = size;
  if (absl::Status s = params.Validate(); !s.ok()) {
    return absl::DataLossError(absl::StrCat("a2ats codebook file: ", s.message()));
  }
  const int d = model.head_dim;
  const uint64_t per_head = (static_cast<uint64_t>(d) * d + static_cast<uint64_t>(size) * d) * 4;
  const uint64_t n_heads = static_cast<uint64_t>(model.n_layers) * model.n_kv_heads;
  if (r.remaining() != per_head * n_heads) {
    return absl::DataLossError(absl::StrFormat(
        "a2ats codebook file: %d bytes of codebook data, the header (%d layers x %d KV heads, "
        "%d codewords of dim %d) needs %d",
        r.remaining(), model.n_layers, model.n_kv_heads, size, d, per_head * n_heads));
  }
  std::vector<HeadCodebook> heads(n_heads);
  for (HeadCodebook& h : heads) {
    h.head_dim = d;
    h.size = size;
    h.chol.resize(static_cast<size_t>(d) * d);
    h.codewords.resize(static_cast<size_t>(size) * d);
    for (float& v : h.chol) KVR_RETURN_IF_ERROR(r.Get("cholesky factor", &v));
    for (float& v : h.codewords) KVR_RETURN_IF_ERROR(r.Get("codewords", &v));
    for (int i = 0; i < d; ++i) {
      if (!(h.chol[static_cast<size_t>(i) * d + i] > 0.f)) {
        return absl::DataLossError(
            "a2ats codebook file: a Cholesky factor has a non-positive diagonal");
      }
    }
  }
  return std::make_shared<const A2atsCodebooks>(std::move(model), params, std::move(heads),
                                                n_query_samples, n_key_samples);
}

absl::StatusOr<std::shared_ptr<const A2atsCodebooks>> A2atsCodebooks::Load(
    const std::string& path, const ModelFingerprint* expected) {
  KVR_ASSIGN_OR_RETURN(MappedFile file, MappedFile::Open(path));
  auto parsed = Parse(file.bytes(), expected);
  if (!parsed.ok()) {
    return absl::Status(parsed.status().code(),
                        absl::StrCat(path, ": ", parsed.status().message()));
  }
  return parsed;
}

absl::Status A2atsCodebooks::Save(const std::string& path) const {
  const std::vector<uint8_t> bytes = Serialize();
  // Write a sibling temp file and rename, so that readers never see a half-written codebook.
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return absl::UnavailableError(absl::StrCat("cannot open ", tmp, " for writing"));
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
    if (!out) return absl::DataLossError(absl::StrCat("short write to ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return absl::UnavailableError(absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

}  // namespace kvr::retrieval
