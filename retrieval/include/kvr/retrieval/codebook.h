#pragma once
// A2ATS query-aware codebooks (He et al., "A2ATS: Retrieval-Based KV Cache Reduction via Windowed
// Rotary Position Embedding and Query-Aware Vector Quantization", section 4.2): built OFFLINE from
// sample (query, key) pairs, shared by every sequence, one per (layer, KV head), stored in the
// file format of docs/codebook-format.md.
//
// Windowed RoPE (section 4.1): for tokens farther than w from the query the relative rotation
// R_(i-j) is replaced by a fixed R_b, so scores become (q_i R_b) . k_j with k_j the PRE-RoPE key:
// keys lose their position dependence and one shared codebook can quantise them. The runtime
// hands us post-RoPE vectors, so keys are un-rotated by their position and queries re-rotated
// from their position to b (kvr/retrieval/rope.h).
//
// Query-aware VQ: the score error of quantising k to c is E_q[(q.(k - c))^2] = (k - c) H (k - c)^T
// with H = E[q^T q] the second moment of the (WRoPE) queries. With H = L L^T (Cholesky),
// z = k L turns that into a plain squared distance |z - c^z|^2, so codebooks are k-means++ /
// Lloyd in the whitened z space; a codebook is stored as (L, C^z). Scores need no C = C^z L^-1:
// q . c = (q L^-T) . c^z, one triangular solve per query. In GQA every query head of a group
// feeds the group's H, so the codebook minimises the score error of the whole group.

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvr/retrieval/index.h"

namespace kvr {
class ThreadPool;
}  // namespace kvr

namespace kvr::model {
class Model;
struct ModelConfig;
}  // namespace kvr::model

namespace kvr::retrieval {

inline constexpr std::string_view kA2atsCodebooksKind = "a2ats-codebooks";
inline constexpr uint32_t kCodebookFormatVersion = 1;

// Identifies the model a codebook file was calibrated on. A file for another model is refused.
struct ModelFingerprint {
  std::string model_name;   // e.g. "SmolLM2-135M-Instruct"
  uint64_t model_hash = 0;  // content hash chosen by the producer (kvr calibrate: see there)
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  RopeParams rope;

  [[nodiscard]] absl::Status Validate() const;
};

// OK when `model` may use codebooks calibrated for `file`; otherwise InvalidArgument listing
// every field that differs ("codebook file is for another model: n_layers 24 vs 30, ...").
// An empty model_name / zero model_hash on `model` skips that field (shape-only check).
[[nodiscard]] absl::Status CheckFingerprint(const ModelFingerprint& file,
                                            const ModelFingerprint& model);

// Builder knobs. Paper defaults are for 16K-96K contexts of an 8B model; ours are scaled to the
// 4K-8K contexts that SmolLM2 runs at (each choice explained).
struct CodebookParams {
  // L codewords per (layer, KV head). Paper: 4096 for 16K-96K contexts (>= 4 tokens per
  // codeword). At 4-8K tokens 1024 keeps ~4-8 tokens per codeword, so a budget of 64-512 is
  // made of whole codewords at a useful resolution; must be <= 65536 (ids are u16).
  int codebook_size = 1024;
  int max_iterations = 25;  // Lloyd iterations after k-means++ (stops early when settled)
  // WRoPE offset b. Paper: b = 2048 for 16K-96K contexts, i.e. a typical distance of a
  // non-local token at the short end. At 4-8K tokens the typical distance of a retrieved
  // (non-local) token is ~1-4K; b = 1024 sits there.
  int64_t wrope_offset = 1024;
  // WRoPE window w. Paper: 64. Tokens inside the window get exact RoPE; in kvr they are the local
  // window (>= 256 tokens), attended exactly anyway, so w is recorded for reference only.
  int wrope_window = 64;
  // Ridge added to H (times trace(H) / d) before Cholesky, so that a direction queries never
  // take (H singular) still has a finite whitening. Small enough not to change the objective.
  double ridge = 1e-4;
  // Keys kept per (layer, KV head) for k-means (reservoir sample beyond this). Queries need no
  // cap: only their second moment is kept.
  int64_t max_keys_per_head = 16384;
  uint64_t seed = 0x6132617473ull;  // "a2ats"

  [[nodiscard]] absl::Status Validate() const;
};

// One (layer, KV head) codebook.
struct HeadCodebook {
  int head_dim = 0;
  int size = 0;                   // L
  std::vector<float> chol;        // [head_dim, head_dim] row-major lower-triangular, H = L L^T
  std::vector<float> codewords;   // [size, head_dim] C^z, whitened space
  std::vector<float> half_norms;  // [size] 0.5 |c^z|^2 (derived, not stored in files)

  // Codeword id of a pre-RoPE key: argmin_c |k L - c^z|^2. Batched: keys [n, head_dim]
  // (row stride `stride`), ids [n]. Uses BLAS; `scratch` is resized as needed.
  void Assign(const float* keys, int64_t n, int64_t stride, uint16_t* ids,
              std::vector<float>& scratch) const;
  // scores[c] = q . c for a WRoPE query q ([head_dim]); scores: [size].
  void Scores(const float* q, float* scores, std::vector<float>& scratch) const;
  // Recomputes half_norms from codewords.
  void Finalize();
};

// Sample collector for BuildCodebooks: queries and keys as the runtime produces them
// (post-RoPE, with positions). Not thread-safe.
class CalibrationSamples {
 public:
  // Validates both; InvalidArgument on a bad fingerprint or params.
  [[nodiscard]] static absl::StatusOr<CalibrationSamples> Create(const ModelFingerprint& model,
                                                                 const CodebookParams& params);

  // queries: [n, n_heads, head_dim] of positions first_position.., post-RoPE. Re-rotated to the
  // WRoPE offset b and accumulated into the second moment of their KV head's group.
  [[nodiscard]] absl::Status AddQueries(int layer, const TokenTensor& queries,
                                        int64_t first_position);
  // keys: [n, n_kv_heads, head_dim] of positions first_position.., post-RoPE. Un-rotated to
  // pre-RoPE and kept (a uniform reservoir sample of at most max_keys_per_head per head).
  [[nodiscard]] absl::Status AddKeys(int layer, const TokenTensor& keys, int64_t first_position);

  // What was collected for one (layer, KV head).
  struct HeadSamples {
    std::vector<double> second_moment;  // [head_dim, head_dim] sum of q^T q (WRoPE queries)
    int64_t n_queries = 0;              // query vectors summed (tokens x group heads)
    std::vector<float> keys;            // [<= max_keys_per_head, head_dim] pre-RoPE
    int64_t n_keys_seen = 0;            // keys offered (before reservoir sampling)
    uint64_t rng = 0;                   // reservoir sampler state
  };

  const ModelFingerprint& model() const { return model_; }
  const CodebookParams& params() const { return params_; }
  const HeadSamples& head(int layer, int kv_head) const {
    return heads_[static_cast<size_t>(layer) * model_.n_kv_heads + kv_head];
  }

 private:
  CalibrationSamples(const ModelFingerprint& model, const CodebookParams& params);

  ModelFingerprint model_;
  CodebookParams params_;
  std::vector<HeadSamples> heads_;  // [n_layers * n_kv_heads]
};

// All codebooks of one model: what `kvr calibrate` writes and the a2ats method reads (passed to
// indexes as IndexParams::assets). Immutable once built; share through shared_ptr.
class A2atsCodebooks final : public MethodAssets {
 public:
  std::string_view kind() const override { return kA2atsCodebooksKind; }

  const ModelFingerprint& model() const { return model_; }
  const CodebookParams& params() const { return params_; }
  const HeadCodebook& head(int layer, int kv_head) const {
    return heads_[static_cast<size_t>(layer) * model_.n_kv_heads + kv_head];
  }
  int64_t n_query_samples() const { return n_query_samples_; }
  int64_t n_key_samples() const { return n_key_samples_; }
  // FNV-1a 64 of the serialised file: written into every a2ats index so that a decode node with
  // different codebooks refuses the codeword ids instead of misreading them.
  uint64_t content_hash() const { return content_hash_; }

  // The file bytes (docs/codebook-format.md).
  std::vector<uint8_t> Serialize() const;
  // Parses and checks magic, version, checksum and sizes; when `expected` is given, also that the
  // file is for that model (CheckFingerprint).
  [[nodiscard]] static absl::StatusOr<std::shared_ptr<const A2atsCodebooks>> Parse(
      std::span<const uint8_t> bytes, const ModelFingerprint* expected = nullptr);
  [[nodiscard]] static absl::StatusOr<std::shared_ptr<const A2atsCodebooks>> Load(
      const std::string& path, const ModelFingerprint* expected = nullptr);
  [[nodiscard]] absl::Status Save(const std::string& path) const;

  // For BuildCodebooks and Parse.
  A2atsCodebooks(ModelFingerprint model, CodebookParams params, std::vector<HeadCodebook> heads,
                 int64_t n_query_samples, int64_t n_key_samples);

 private:
  ModelFingerprint model_;
  CodebookParams params_;
  std::vector<HeadCodebook> heads_;  // [n_layers * n_kv_heads]
  int64_t n_query_samples_ = 0;
  int64_t n_key_samples_ = 0;
  uint64_t content_hash_ = 0;
};

// Builds one codebook from a query second moment (sum of q^T q over `n_queries` WRoPE queries,
// [d, d]) and pre-RoPE keys ([n_keys, d]): Cholesky of H (+ ridge), whitening, k-means++ and
// Lloyd. codebook_size is clipped to n_keys. InvalidArgument without queries or keys.
[[nodiscard]] absl::StatusOr<HeadCodebook> BuildHeadCodebook(std::span<const double> second_moment,
                                                             int64_t n_queries,
                                                             std::span<const float> keys, int d,
                                                             const CodebookParams& params,
                                                             uint64_t seed);

// Builds every (layer, KV head) codebook; heads run in parallel on `pool` (may be null).
// FailedPrecondition when a layer got no samples.
[[nodiscard]] absl::StatusOr<std::shared_ptr<const A2atsCodebooks>> BuildCodebooks(
    const CalibrationSamples& samples, ThreadPool* pool);

// ---- Calibration on a real model -------------------------------------------------------------
// Declared here with the rest of the codebook API, DEFINED by kvr::retrieval_calibrate
// (retrieval/quant.cmake), which links the model runtime; link that target to use them.

// The runtime's RoPE as RopeParams: Hugging Face rotate-half pairs (weights.h), config theta.
// Unimplemented for frequency-scaled RoPE (llama3 scaling, rope_freqs): WRoPE would need the
// scaled frequencies, which RopeParams cannot express yet.
[[nodiscard]] absl::StatusOr<RopeParams> RopeParamsOf(const model::ModelConfig& config);

// The fingerprint of a loaded model: shape and RoPE from its config; model_name = config name;
// model_hash = FNV-1a 64 over the hyper-parameters and a strided sample (4096 values) of every
// weight tensor, so that another fine-tune of the same architecture is told apart without
// hashing all weights, and the same weights loaded from GGUF or safetensors agree.
[[nodiscard]] absl::StatusOr<ModelFingerprint> FingerprintOf(const model::Model& model);

// Loads the `kvr calibrate` file at `path` for `model` (checked against FingerprintOf(model));
// errors name the path. What prefill and decode nodes offer method `a2ats` with.
[[nodiscard]] absl::StatusOr<std::shared_ptr<const A2atsCodebooks>> LoadCodebooksFor(
    const model::Model& model, const std::string& path);

// Runs each token sequence through `model` (dense attention, chunked prefill of
// `prefill_chunk` tokens) and records every layer's post-RoPE queries and keys into `samples`
// (created for FingerprintOf(model)). Positions restart at 0 for each sequence.
[[nodiscard]] absl::Status CollectCalibrationSamples(
    const model::Model& model, std::span<const std::vector<int32_t>> sequences,
    CalibrationSamples& samples, int64_t prefill_chunk = 512);

}  // namespace kvr::retrieval
