// A2ATS calibration on a real model (kvr::retrieval_calibrate): record the queries and keys
// that the runtime's forward pass computes, through the attention seam, so that the runtime
// needs no changes to expose them.

#include <cstring>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kvr/common/status.h"
#include "kvr/model/dense_attention.h"
#include "kvr/model/model.h"
#include "kvr/retrieval/codebook.h"
#include "kvr/retrieval/model_shape.h"

namespace kvr::retrieval {
namespace {

// Dense attention that also hands each request's queries and new keys to a CalibrationSamples.
// The output is the dense one, so the forward pass (and hence every later layer's Q/K) is
// exactly the model's.
class RecordingAttention final : public model::Attention {
 public:
  RecordingAttention(ThreadPool* pool, CalibrationSamples* samples)
      : dense_(pool), samples_(samples) {}

  absl::Status Attend(const model::AttentionShape& shape,
                      std::span<const model::AttentionRequest> batch) override {
    KVR_RETURN_IF_ERROR(dense_.Attend(shape, batch));
    const int d = shape.head_dim;
    for (const model::AttentionRequest& r : batch) {
      if (!r.kv.positions.empty()) {
        return absl::UnimplementedError(
            "a2ats calibration records dense caches only (KvView rows = positions)");
      }
      const int64_t n = r.n_queries;
      KVR_RETURN_IF_ERROR(samples_->AddQueries(
          r.layer, TokenTensor{r.q, n, static_cast<int64_t>(shape.n_heads) * d}, r.first_position));
      // The new tokens' keys are rows [first_position, first_position + n) of the cache.
      KVR_RETURN_IF_ERROR(samples_->AddKeys(
          r.layer, TokenTensor{r.kv.k + r.first_position * r.kv.row_stride, n, r.kv.row_stride},
          r.first_position));
    }
    return absl::OkStatus();
  }

 private:
  model::DenseAttention dense_;
  CalibrationSamples* samples_;  // not owned
};

class Fnv1a {
 public:
  void Add(const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    for (size_t i = 0; i < n; ++i) {
      hash_ ^= p[i];
      hash_ *= 0x100000001b3ull;
    }
  }
  template <typename T>
  void AddValue(T v) {
    Add(&v, sizeof(v));
  }
  // The size and kSamples evenly strided values of a tensor.
  void AddTensor(const std::vector<float>& t) {
    AddValue<uint64_t>(t.size());
    const size_t stride = std::max<size_t>(1, t.size() / kSamples);
    for (size_t i = 0; i < t.size(); i += stride) AddValue(t[i]);
  }
  // A weight matrix as AddTensor sees its float32 form, whichever storage holds it: a packed
  // matrix is dequantised row by row (the values the float32 load makes), so a model hashes
  // the same packed or not.
  void AddMatrix(const std::vector<float>& dense, const model::PackedMatrix& packed) {
    if (packed.empty()) return AddTensor(dense);
    const size_t cols = static_cast<size_t>(packed.cols);
    const size_t size = static_cast<size_t>(packed.rows) * cols;
    AddValue<uint64_t>(size);
    const size_t stride = std::max<size_t>(1, size / kSamples);
    std::vector<float> row(cols);
    size_t loaded = size;  // no row yet
    for (size_t i = 0; i < size; i += stride) {
      if (i / cols != loaded) {
        loaded = i / cols;
        packed.DequantizeRowInto(static_cast<int64_t>(loaded), row.data());
      }
      AddValue(row[i % cols]);
    }
  }
  uint64_t value() const { return hash_; }

 private:
  static constexpr size_t kSamples = 4096;
  uint64_t hash_ = 0xcbf29ce484222325ull;
};

}  // namespace

absl::StatusOr<RopeParams> RopeParamsOf(const model::ModelConfig& config) {
  if (config.has_llama3_scaling || !config.rope_freq_factors.empty()) {
    return absl::UnimplementedError(absl::StrCat(
        "a2ats: model '", config.name,
        "' uses frequency-scaled RoPE (llama3 scaling); WRoPE supports plain RoPE only"));
  }
  return RuntimeRope(config);
}

absl::StatusOr<ModelFingerprint> FingerprintOf(const model::Model& model) {
  const model::ModelConfig& c = model.config();
  ModelFingerprint f;
  f.model_name = c.name;
  f.n_layers = c.n_layers;
  f.n_heads = c.n_heads;
  f.n_kv_heads = c.n_kv_heads;
  f.head_dim = c.head_dim;
  KVR_ASSIGN_OR_RETURN(f.rope, RopeParamsOf(c));
  Fnv1a h;
  h.AddValue(static_cast<int32_t>(c.arch));
  for (int v : {c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn, c.vocab}) {
    h.AddValue<int32_t>(v);
  }
  h.AddValue(c.rms_eps);
  h.AddValue(c.rope_theta);
  h.AddValue<int64_t>(c.context_length);
  h.AddValue<uint8_t>(c.tied_embeddings);
  h.AddValue<uint8_t>(c.qkv_bias);
  const model::ModelWeights& w = model.weights();
  h.AddMatrix(w.token_embd, w.packed_token_embd);
  h.AddTensor(w.output_norm);
  h.AddMatrix(w.output, w.packed_output);
  for (const model::LayerWeights& l : w.layers) {
    h.AddTensor(l.attn_norm);
    h.AddMatrix(l.wqkv, l.packed_wqkv);
    h.AddTensor(l.bqkv);
    h.AddMatrix(l.wo, l.packed_wo);
    h.AddTensor(l.ffn_norm);
    h.AddMatrix(l.w_gate_up, l.packed_w_gate_up);
    h.AddMatrix(l.w_down, l.packed_w_down);
  }
  f.model_hash = h.value();
  KVR_RETURN_IF_ERROR(f.Validate());
  return f;
}

absl::StatusOr<std::shared_ptr<const A2atsCodebooks>> LoadCodebooksFor(
    const model::Model& model, const std::string& path) {
  absl::StatusOr<ModelFingerprint> fp = FingerprintOf(model);
  if (!fp.ok()) {
    return absl::Status(fp.status().code(), absl::StrCat("a2ats codebooks ", path,
                                                         ": the model: ", fp.status().message()));
  }
  absl::StatusOr<std::shared_ptr<const A2atsCodebooks>> books = A2atsCodebooks::Load(path, &*fp);
  if (!books.ok()) {
    return absl::Status(books.status().code(),
                        absl::StrCat("a2ats codebooks ", path, ": ", books.status().message()));
  }
  return books;
}

absl::Status CollectCalibrationSamples(const model::Model& model,
                                       std::span<const std::vector<int32_t>> sequences,
                                       CalibrationSamples& samples, int64_t prefill_chunk) {
  const model::ModelConfig& c = model.config();
  const ModelFingerprint& f = samples.model();
  if (f.n_layers != c.n_layers || f.n_heads != c.n_heads || f.n_kv_heads != c.n_kv_heads ||
      f.head_dim != c.head_dim) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "a2ats calibration: samples are shaped for %d layers, %d/%d heads, head_dim %d; the "
        "model has %d, %d/%d, %d",
        f.n_layers, f.n_heads, f.n_kv_heads, f.head_dim, c.n_layers, c.n_heads, c.n_kv_heads,
        c.head_dim));
  }
  RecordingAttention attention(model.pool(), &samples);
  model::SequenceId id = 1;
  for (const std::vector<int32_t>& tokens : sequences) {
    if (tokens.empty()) continue;
    model::KvCache cache = model.NewCache(model::KvDType::kF32);
    KVR_RETURN_IF_ERROR(model.Prefill(id, cache, tokens, attention, prefill_chunk).status());
    attention.Release(id);
    ++id;
  }
  return absl::OkStatus();
}

}  // namespace kvr::retrieval
