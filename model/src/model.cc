#include "kvr/model/model.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvr/common/half.h"
#include "kvr/common/status.h"
#include "kvr/common/thread_pool.h"

namespace kvr::model {

void RmsNorm(const float* x, const float* weight, int64_t n_rows, int dim, float eps, float* y) {
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    // Accumulate in double: the mean of squares over thousands of elements is where float
    // rounding would show first.
    double sum = 0.0;
    for (int i = 0; i < dim; ++i) sum += static_cast<double>(xr[i]) * xr[i];
    const float inv = 1.f / std::sqrt(static_cast<float>(sum / dim) + eps);
    for (int i = 0; i < dim; ++i) yr[i] = weight[i] * (xr[i] * inv);
  }
}

namespace {

// cos/sin of position * inv_freq: [n_tokens, half] each.
void RopeTables(std::span<const int64_t> positions, std::span<const float> inv_freq,
                std::vector<float>& cos_table, std::vector<float>& sin_table) {
  const size_t half = inv_freq.size();
  cos_table.resize(positions.size() * half);
  sin_table.resize(positions.size() * half);
  for (size_t t = 0; t < positions.size(); ++t) {
    for (size_t i = 0; i < half; ++i) {
      // The angle is rounded to float as transformers does (position * inv_freq in float32);
      // cos/sin of it are then taken accurately.
      const float angle = static_cast<float>(positions[t]) * inv_freq[i];
      cos_table[t * half + i] = static_cast<float>(std::cos(static_cast<double>(angle)));
      sin_table[t * half + i] = static_cast<float>(std::sin(static_cast<double>(angle)));
    }
  }
}

void RotateRows(float* x, int64_t n_tokens, int n_heads, int head_dim, int64_t row_stride,
                const float* cos_table, const float* sin_table) {
  const int half = head_dim / 2;
  for (int64_t t = 0; t < n_tokens; ++t) {
    const float* c = cos_table + t * half;
    const float* s = sin_table + t * half;
    for (int h = 0; h < n_heads; ++h) {
      float* v = x + t * row_stride + int64_t{h} * head_dim;
      for (int i = 0; i < half; ++i) {
        const float x0 = v[i], x1 = v[i + half];
        v[i] = x0 * c[i] - x1 * s[i];
        v[i + half] = x1 * c[i] + x0 * s[i];
      }
    }
  }
}

// Calls fn(begin, end) over [0, n) on the pool, in one piece when n is small.
void ParallelRows(ThreadPool* pool, int64_t n, int64_t min_chunk,
                  const std::function<void(size_t, size_t)>& fn) {
  if (pool == nullptr || n <= min_chunk) {
    fn(0, static_cast<size_t>(n));
  } else {
    pool->ParallelFor(static_cast<size_t>(n), fn, static_cast<size_t>(min_chunk));
  }
}

}  // namespace

void ApplyRope(float* x, int64_t n_tokens, int n_heads, int head_dim, int64_t row_stride,
               std::span<const int64_t> positions, std::span<const float> inv_freq) {
  std::vector<float> cos_table, sin_table;
  RopeTables(positions.first(static_cast<size_t>(n_tokens)), inv_freq, cos_table, sin_table);
  RotateRows(x, n_tokens, n_heads, head_dim, row_stride, cos_table.data(), sin_table.data());
}

void MatMulTransposed(ThreadPool* pool, const float* a, int64_t m, int64_t k, const float* w,
                      int64_t n, float* c, bool allow_gemv) {
  // Split the output columns (= weight rows) so each thread streams its own slice of W: for
  // decode (small m) the GEMM is bound by reading W, and this divides that traffic evenly.
  // Slices of whole 64-column SGEMM calls when rows must not depend on m (see PackedMatMul).
  const int64_t align = allow_gemv ? 16 : 64;
  const int64_t threads = pool == nullptr ? 1 : static_cast<int64_t>(pool->size());
  const int64_t parts = std::max<int64_t>(1, std::min(threads, n / align));
  const int64_t per_part = ((n + parts - 1) / parts + align - 1) / align * align;
  auto run = [&](size_t begin, size_t end) {
    for (size_t p = begin; p < end; ++p) {
      const int64_t n0 = static_cast<int64_t>(p) * per_part;
      const int64_t n1 = std::min(n, n0 + per_part);
      if (n1 <= n0) continue;
      if (m == 1 && allow_gemv) {
        // OpenBLAS 0.3.21's sgemm packs all of W even for one row; sgemv streams it once.
        cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<int>(n1 - n0), static_cast<int>(k),
                    1.f, w + n0 * k, static_cast<int>(k), a, 1, 0.f, c + n0, 1);
        continue;
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m),
                  static_cast<int>(n1 - n0), static_cast<int>(k), 1.f, a, static_cast<int>(k),
                  w + n0 * k, static_cast<int>(k), 0.f, c + n0, static_cast<int>(n));
    }
  };
  if (parts == 1) {
    run(0, 1);
  } else {
    pool->ParallelFor(static_cast<size_t>(parts), run, 1);
  }
}

Model::Model(ModelConfig config, ModelWeights weights, ThreadPool* pool, KvDType kv_dtype)
    : config_(std::move(config)),
      weights_(std::move(weights)),
      pool_(pool),
      kv_dtype_(kv_dtype),
      kernels_(&BestCpuKernels()),
      rope_inv_freq_(RopeInverseFrequencies(config_)) {}

absl::StatusOr<std::unique_ptr<Model>> Model::Create(ModelConfig config, ModelWeights weights,
                                                     ThreadPool* pool, KvDType kv_dtype) {
  KVR_RETURN_IF_ERROR(config.Validate());
  KVR_RETURN_IF_ERROR(weights.CheckShapes(config));
  // Every GEMM is issued from the pool's threads, one slice each; OpenBLAS's own threads would
  // only compete with them (2 cores here). This is process-wide OpenBLAS state, set the same
  // way by every Model.
  openblas_set_num_threads(1);
  return std::unique_ptr<Model>(new Model(std::move(config), std::move(weights), pool, kv_dtype));
}

KvCache Model::NewCache(KvDType storage) const {
  return KvCache(config_.n_layers, config_.n_kv_heads, config_.head_dim, storage);
}

absl::Status Model::Forward(std::span<const ForwardSequence> batch, Attention& attention,
                            LogitsMode mode, std::span<float> logits) const {
  const ModelConfig& c = config_;
  if (batch.empty()) return absl::InvalidArgumentError("Forward: empty batch");
  int64_t total = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (batch[i].cache == batch[j].cache) {
        return absl::InvalidArgumentError(absl::StrCat("Forward: sequences ", batch[j].id, " and ",
                                                       batch[i].id, " share one KvCache"));
      }
    }
  }
  for (const ForwardSequence& s : batch) {
    if (s.cache == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("Forward: sequence ", s.id, " has no cache"));
    }
    if (s.tokens.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("Forward: sequence ", s.id, " has no tokens"));
    }
    const KvCache& cache = *s.cache;
    if (cache.n_layers() != c.n_layers || cache.n_kv_heads() != c.n_kv_heads ||
        cache.head_dim() != c.head_dim) {
      return absl::InvalidArgumentError(
          absl::StrCat("Forward: sequence ", s.id, "'s KvCache is shaped for another model"));
    }
    if (cache.windowed() && s.tokens.size() > 1) {
      // The window would slide while the chunk's earlier queries still need the rows.
      return absl::InvalidArgumentError(absl::StrCat(
          "Forward: sequence ", s.id, " has a windowed KvCache, which takes one token per step (",
          s.tokens.size(), " given)"));
    }
    if (cache.n_tokens(0) != cache.n_tokens()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "Forward: sequence ", s.id, "'s KvCache is inconsistent (a failed forward pass?)"));
    }
    const int64_t length = cache.n_tokens() + static_cast<int64_t>(s.tokens.size());
    if (length > c.context_length) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sequence ", s.id, " would be ", length, " tokens (", cache.n_tokens(), " cached + ",
          s.tokens.size(), " new), longer than the model's context length of ", c.context_length,
          " tokens"));
    }
    for (int32_t token : s.tokens) {
      if (token < 0 || token >= c.vocab) {
        return absl::InvalidArgumentError(absl::StrCat(
            "Forward: token id ", token, " outside the vocabulary [0, ", c.vocab, ")"));
      }
    }
    total += static_cast<int64_t>(s.tokens.size());
  }
  const int64_t n_out = mode == LogitsMode::kLast ? static_cast<int64_t>(batch.size()) : total;
  if (static_cast<int64_t>(logits.size()) != n_out * c.vocab) {
    return absl::InvalidArgumentError(absl::StrCat("Forward: logits has ", logits.size(),
                                                   " floats, expected ", n_out, " x ", c.vocab));
  }

  const int64_t h = c.hidden, q_dim = c.q_dim(), kv_dim = c.kv_dim();
  const int64_t qkv_dim = q_dim + 2 * kv_dim, f = c.ffn;
  std::vector<int64_t> positions(total);  // [total]
  std::vector<int64_t> first_row(batch.size());
  {
    int64_t row = 0;
    for (size_t b = 0; b < batch.size(); ++b) {
      first_row[b] = row;
      const int64_t start = batch[b].cache->n_tokens();
      for (size_t i = 0; i < batch[b].tokens.size(); ++i) positions[row++] = start + i;
    }
  }
  std::vector<float> cos_table, sin_table;  // [total, head_dim / 2]
  RopeTables(positions, rope_inv_freq_, cos_table, sin_table);

  std::vector<float> x(total * h);            // [total, hidden] residual stream
  std::vector<float> normed(total * h);       // [total, hidden]
  std::vector<float> qkv(total * qkv_dim);    // [total, q_dim + 2 kv_dim]
  std::vector<float> q(total * q_dim);        // [total, n_heads, head_dim]
  std::vector<float> attn(total * q_dim);     // [total, n_heads, head_dim]
  std::vector<float> gate_up(total * 2 * f);  // [total, 2 ffn]
  std::vector<float> act(total * f);          // [total, ffn]
  std::vector<float> proj(total * h);         // [total, hidden]
  {
    int64_t row = 0;
    for (const ForwardSequence& s : batch) {
      for (int32_t token : s.tokens) {
        if (weights_.packed()) {
          weights_.packed_token_embd.DequantizeRowInto(token, x.data() + row++ * h);
        } else {
          std::memcpy(x.data() + row++ * h, weights_.token_embd.data() + int64_t{token} * h,
                      h * sizeof(float));
        }
      }
    }
  }
  constexpr int64_t kMinRows = 8;  // below this, handing rows to other threads costs more
  const AttentionShape shape{c.n_heads, c.n_kv_heads, c.head_dim,
                             1.f / std::sqrt(static_cast<float>(c.head_dim))};
  std::vector<AttentionRequest> requests(batch.size());
  // A decode step (one token per sequence) takes the gemv kernels for its few rows. A prompt
  // chunk never does, and its GEMMs are cut so that a row's result does not depend on how many
  // rows the chunk has: a prefill that starts from a cached prefix then computes the bits a
  // cold prefill does (with DenseAttention's query blocks, see kDefaultQueryBlock).
  const bool decode_step = std::all_of(batch.begin(), batch.end(),
                                       [](const ForwardSequence& s) { return s.tokens.size() == 1; });
  // out[m, n] = a[m, k] W^T in whichever storage the weights use.
  auto project = [&](const float* a, int64_t m, int64_t k, const std::vector<float>& dense,
                     const PackedMatrix& packed, int64_t n, float* out) {
    if (packed.empty()) {
      MatMulTransposed(pool_, a, m, k, dense.data(), n, out, decode_step);
    } else {
      PackedMatMul(pool_, *kernels_, a, m, k, packed, out, ActivationPrecision::kInt8,
                   decode_step ? kMaxGemvRows : 0);
    }
  };

  for (int layer = 0; layer < c.n_layers; ++layer) {
    const LayerWeights& w = weights_.layers[layer];
    ParallelRows(pool_, total, kMinRows, [&](size_t b, size_t e) {
      RmsNorm(x.data() + b * h, w.attn_norm.data(), e - b, h, c.rms_eps, normed.data() + b * h);
    });
    project(normed.data(), total, h, w.wqkv, w.packed_wqkv, qkv_dim, qkv.data());
    ParallelRows(pool_, total, kMinRows, [&](size_t b, size_t e) {
      const int64_t half = c.head_dim / 2;
      for (size_t t = b; t < e; ++t) {
        float* row = qkv.data() + t * qkv_dim;
        if (!w.bqkv.empty()) {
          for (int64_t i = 0; i < qkv_dim; ++i) row[i] += w.bqkv[i];
        }
        std::memcpy(q.data() + t * q_dim, row, q_dim * sizeof(float));
      }
      RotateRows(q.data() + b * q_dim, e - b, c.n_heads, c.head_dim, q_dim,
                 cos_table.data() + b * half, sin_table.data() + b * half);
      RotateRows(qkv.data() + b * qkv_dim + q_dim, e - b, c.n_kv_heads, c.head_dim, qkv_dim,
                 cos_table.data() + b * half, sin_table.data() + b * half);
      if (kv_dtype_ == KvDType::kF16) {
        // Every cache gets the half values, whatever it stores (see Create).
        for (size_t t = b; t < e; ++t) {
          float* kv_row = qkv.data() + t * qkv_dim + q_dim;
          for (int64_t i = 0; i < 2 * kv_dim; ++i) kv_row[i] = Fp16ToFloat(FloatToFp16(kv_row[i]));
        }
      }
    });
    for (size_t b = 0; b < batch.size(); ++b) {
      const ForwardSequence& s = batch[b];
      const int64_t n = static_cast<int64_t>(s.tokens.size());
      const float* k_rows = qkv.data() + first_row[b] * qkv_dim + q_dim;
      KVR_RETURN_IF_ERROR(s.cache->Append(layer, n, k_rows, k_rows + kv_dim, qkv_dim));
    }
    for (size_t b = 0; b < batch.size(); ++b) {
      const ForwardSequence& s = batch[b];
      AttentionRequest& r = requests[b];
      r.sequence = s.id;
      r.layer = layer;
      r.n_queries = static_cast<int64_t>(s.tokens.size());
      r.first_position = s.cache->n_tokens(layer) - r.n_queries;
      r.q = q.data() + first_row[b] * q_dim;
      r.kv = s.cache->View(layer);
      r.out = attn.data() + first_row[b] * q_dim;
    }
    KVR_RETURN_IF_ERROR(attention.Attend(shape, requests));
    project(attn.data(), total, q_dim, w.wo, w.packed_wo, h, proj.data());
    ParallelRows(pool_, total, kMinRows, [&](size_t b, size_t e) {
      for (size_t i = b * h; i < e * h; ++i) x[i] += proj[i];
      RmsNorm(x.data() + b * h, w.ffn_norm.data(), e - b, h, c.rms_eps, normed.data() + b * h);
    });
    project(normed.data(), total, h, w.w_gate_up, w.packed_w_gate_up, 2 * f, gate_up.data());
    ParallelRows(pool_, total, kMinRows, [&](size_t b, size_t e) {
      for (size_t t = b; t < e; ++t) {
        const float* g = gate_up.data() + t * 2 * f;
        const float* u = g + f;
        float* a = act.data() + t * f;
        for (int64_t i = 0; i < f; ++i) a[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
      }
    });
    project(act.data(), total, f, w.w_down, w.packed_w_down, h, proj.data());
    ParallelRows(pool_, total, kMinRows, [&](size_t b, size_t e) {
      for (size_t i = b * h; i < e * h; ++i) x[i] += proj[i];
    });
  }

  // Final norm of the rows whose logits are wanted, then the output projection.
  std::vector<float> out_rows(n_out * h);  // [n_out, hidden]
  if (mode == LogitsMode::kLast) {
    for (size_t b = 0; b < batch.size(); ++b) {
      const int64_t last = first_row[b] + static_cast<int64_t>(batch[b].tokens.size()) - 1;
      RmsNorm(x.data() + last * h, weights_.output_norm.data(), 1, h, c.rms_eps,
              out_rows.data() + b * h);
    }
  } else {
    ParallelRows(pool_, total, kMinRows, [&](size_t b, size_t e) {
      RmsNorm(x.data() + b * h, weights_.output_norm.data(), e - b, h, c.rms_eps,
              out_rows.data() + b * h);
    });
  }
  if (weights_.packed()) {
    // Float activations here: an 8-bit rounding of the final hidden state would move logits by
    // ~0.1 and flip near-tied greedy choices; this product is ~1/4 of a step's weight bytes.
    PackedMatMul(pool_, *kernels_, out_rows.data(), n_out, h, weights_.packed_output_matrix(),
                 logits.data(), ActivationPrecision::kFloat32);
  } else {
    MatMulTransposed(pool_, out_rows.data(), n_out, h, weights_.output_matrix(), c.vocab,
                     logits.data());
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> Model::Prefill(SequenceId id, KvCache& cache,
                                                  std::span<const int32_t> tokens,
                                                  Attention& attention,
                                                  int64_t chunk_tokens) const {
  if (tokens.empty()) return absl::InvalidArgumentError("Prefill: no tokens");
  if (chunk_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Prefill: chunk_tokens must be positive, got ", chunk_tokens));
  }
  // Check the whole prompt against the context before doing any work.
  const int64_t length = cache.n_tokens() + static_cast<int64_t>(tokens.size());
  if (length > config_.context_length) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt of ", tokens.size(), " tokens (", length, " with the ", cache.n_tokens(),
        " already cached) is longer than the model's context length of ", config_.context_length,
        " tokens"));
  }
  cache.Reserve(length);
  std::vector<float> logits(config_.vocab);
  for (size_t begin = 0; begin < tokens.size(); begin += static_cast<size_t>(chunk_tokens)) {
    const size_t n = std::min(tokens.size() - begin, static_cast<size_t>(chunk_tokens));
    const ForwardSequence sequence{id, &cache, tokens.subspan(begin, n)};
    KVR_RETURN_IF_ERROR(Forward(std::span(&sequence, 1), attention, LogitsMode::kLast, logits));
  }
  return logits;
}

}  // namespace kvr::model
