// The CUDA forward pass (cuda_model.h). Per layer, for a batch of T new tokens:
//   normed = RmsNorm(x)                          [T, hidden] bf16
//   qkv    = normed Wqkv^T                       [T, q_dim + 2 kv_dim] f32   (cuBLAS)
//   q, K/V = bias + RoPE; K/V into the caches    [T, n_heads, head_dim] bf16
//   attn   = attention(q, caches)                [T, n_heads, head_dim] bf16
//   x     += attn Wo^T                           [T, hidden] f32             (cuBLAS, beta 1)
//   normed = RmsNorm(x)
//   gu     = normed Wgu^T                        [T, 2 ffn] f32              (cuBLAS)
//   act    = silu(gate) * up                     [T, ffn] bf16
//   x     += act Wdown^T                                                     (cuBLAS, beta 1)
// then the final norm of the rows whose logits are wanted and the output projection.

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention.cuh"
#include "kvr/common/cuda/cuda_util.h"
#include "kvr/common/status.h"
#include "kvr/model/cuda_model.h"
#include "ops.cuh"

namespace kvr::model {
namespace {

using cuda::bf16;
using cuda::SeqKv;
using kvr::cuda::CudaEvent;
using kvr::cuda::CudaStream;
using kvr::cuda::DeviceBuffer;
using kvr::cuda::PinnedBuffer;

[[nodiscard]] absl::Status CublasStatus(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, ": ", cublasGetStatusName(s), " (", cublasGetStatusString(s), ")"));
}

#define KVR_CUBLAS_RETURN_IF_ERROR(expr) KVR_RETURN_IF_ERROR(CublasStatus((expr), #expr))

struct CublasDeleter {
  void operator()(cublasContext* h) const { cublasDestroy(h); }
};
using CublasHandle = std::unique_ptr<cublasContext, CublasDeleter>;

using kvr::cuda::Alloc;
using kvr::cuda::AllocPinned;

class CudaModelImpl final : public CudaModel {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<CudaModelImpl>> Make(
      const ModelConfig& config, const CudaModelOptions& options);

  [[nodiscard]] absl::Status UploadWeights(const ModelWeights& w);
  [[nodiscard]] absl::Status RandomizeWeights(uint64_t seed);

  const ModelConfig& config() const override { return config_; }
  int64_t weight_bytes() const override { return weight_bytes_; }
  absl::Status AddSequence(SequenceId id, int64_t capacity,
                           std::unique_ptr<CudaLayerBuilder> builder) override;
  absl::Status ReleaseSequence(SequenceId id) override;
  absl::StatusOr<int64_t> SequenceLength(SequenceId id) const override;
  absl::Status FillSequenceForBenchmark(SequenceId id, int64_t n_tokens, uint64_t seed) override;
  absl::Status AppendRows(SequenceId id, int64_t n_rows,
                          const std::function<absl::Status(int, std::span<uint16_t>,
                                                           std::span<uint16_t>)>& fill) override;
  absl::Status Forward(std::span<const CudaSequence> batch, LogitsMode mode,
                       std::span<float> logits) override {
    return Run(batch, mode, logits, {}, nullptr);
  }
  absl::Status ForwardGreedy(std::span<const CudaSequence> batch,
                             std::span<int32_t> next_tokens) override {
    if (next_tokens.size() != batch.size()) {
      return absl::InvalidArgumentError(absl::StrCat("ForwardGreedy: next_tokens has ",
                                                     next_tokens.size(), " entries, expected ",
                                                     batch.size()));
    }
    return Run(batch, LogitsMode::kLast, {}, next_tokens, nullptr);
  }
  absl::Status ForwardWithAttention(CudaAttention& attention, std::span<const CudaSequence> batch,
                                    LogitsMode mode, std::span<float> logits) override {
    return Run(batch, mode, logits, {}, &attention);
  }
  absl::Status ForwardGreedyWithAttention(CudaAttention& attention,
                                          std::span<const CudaSequence> batch,
                                          std::span<int32_t> next_tokens) override {
    if (next_tokens.size() != batch.size()) {
      return absl::InvalidArgumentError(absl::StrCat("ForwardGreedy: next_tokens has ",
                                                     next_tokens.size(), " entries, expected ",
                                                     batch.size()));
    }
    return Run(batch, LogitsMode::kLast, {}, next_tokens, &attention);
  }
  const CudaModelOptions& options() const override { return options_; }
  void* cuda_stream() const override { return stream(); }
  absl::Status FillRandomBf16(void* device, int64_t n, uint64_t seed) override {
    return cuda::LaunchRandomBf16(static_cast<bf16*>(device), n, seed, 1.f, stream());
  }
  absl::StatusOr<int64_t> SequenceDeviceBytes(SequenceId id) const override;
  absl::StatusOr<int64_t> FreeDeviceBytes() const override {
    KVR_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
    size_t free = 0, total = 0;
    KVR_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free, &total));
    return static_cast<int64_t>(free);
  }
  double last_build_ms() const override { return build_ms_; }
  double last_build_plan_ms() const override { return build_plan_ms_; }
  absl::Status RebuildForTesting(SequenceId id) override;
  CudaForwardProfile last_profile() const override { return profile_; }
  void set_profile(bool on) override { options_.profile = on; }
  CudaGraphStats graph_stats() const override { return graph_stats_; }
  void set_cuda_graphs(bool on) override { options_.cuda_graphs = on; }
  absl::Status BeginKvExport(SequenceId id, const KvExportOptions& options) override;
  absl::Status EndKvExport(SequenceId id) override;
  int64_t export_pinned_bytes() const override { return export_pinned_bytes_; }

 private:
  struct Layer {
    DeviceBuffer<float> attn_norm;  // [hidden]
    DeviceBuffer<bf16> wqkv;        // [q_dim + 2 kv_dim, hidden]
    DeviceBuffer<float> bqkv;       // [q_dim + 2 kv_dim] or empty
    DeviceBuffer<bf16> wo;          // [hidden, q_dim]
    DeviceBuffer<float> ffn_norm;   // [hidden]
    DeviceBuffer<bf16> w_gate_up;   // [2 ffn, hidden]
    DeviceBuffer<bf16> w_down;      // [hidden, ffn]
  };
  // A dense sequence's KV export (BeginKvExport). `host` holds, per layer, K [L, kv_dim], V
  // [L, kv_dim], the queries [nq, q_dim] (float32) and the layer's build; `notes` point into it.
  struct KvExport;
  struct ExportNote {  // the user data of one layer's cudaLaunchHostFunc
    const KvExport* exp = nullptr;
    KvExportLayer view;
  };
  struct KvExport {
    KvExportOptions opt;
    int64_t nq = 0;  // min(max_queries, L)
    // The builder wants_queries(): the window's queries of every layer on the device
    // [n_layers, nq, q_dim] fp32 (rows from position L - nq), written as chunks compute them;
    // q_first: the first position written (L until one is).
    DeviceBuffer<float> build_q;
    int64_t q_first = 0;
    PinnedBuffer<float> host;
    std::vector<ExportNote> notes;  // [n_layers]; stable addresses for the host callbacks
  };
  struct Sequence {
    DeviceBuffer<bf16> kv;                 // [n_layers, 2, capacity, n_kv_heads, head_dim]
    std::unique_ptr<KvExport> exporting;   // between BeginKvExport and EndKvExport
    std::unique_ptr<CudaLayerBuilder> builder;  // AddSequence's, or null
    int64_t built_length = 0;                   // tokens the last build covered
    int64_t capacity = 0;
    int64_t length = 0;
  };
  enum class Kind { kGemm, kAttention, kOther, kSelect, kGather };

  CudaModelImpl(ModelConfig config, CudaModelOptions options)
      : config_(std::move(config)), options_(options) {}

 public:
  ~CudaModelImpl() override = default;

 private:
  [[nodiscard]] absl::Status AllocateWeights();
  // One Forward; `hook` (may be null: dense sequences) attends the batch's sequences per layer.
  [[nodiscard]] absl::Status Run(std::span<const CudaSequence> batch, LogitsMode mode,
                                 std::span<float> logits, std::span<int32_t> next_tokens,
                                 CudaAttention* hook);
  // C[m, n] (+)= A[m, k] W[n, k]^T; beta 1 adds onto C (the residual stream).
  [[nodiscard]] absl::Status Gemm(const bf16* a, int64_t m, int64_t k, const bf16* w, int64_t n,
                                  float* c, float beta);
  // Profiling: the GPU time from this mark to the next counts as `kind`.
  [[nodiscard]] absl::Status Mark(Kind kind);
  [[nodiscard]] absl::Status FinishProfile();

  cudaStream_t stream() const { return stream_.get(); }

  // Queues layer `layer`'s build of `s` over its first `len` tokens on `st`.
  [[nodiscard]] absl::Status QueueBuild(Sequence& s, int layer, int64_t len, cudaStream_t st);
  // The build stream and the per-layer events, created for the first sequence with a builder.
  [[nodiscard]] absl::Status EnsureBuildStream();
  // KV export: returns the export's buffer to the pool.
  void RecycleExport(std::unique_ptr<KvExport> e);

  ModelConfig config_;
  CudaModelOptions options_;
  int n_sms_ = 132;
  CudaStream stream_;
  CublasHandle cublas_;
  int64_t weight_bytes_ = 0;

  // Weights.
  DeviceBuffer<bf16> token_embd_;    // [vocab, hidden]
  DeviceBuffer<bf16> output_;        // [vocab, hidden]; empty when tied
  DeviceBuffer<float> output_norm_;  // [hidden]
  DeviceBuffer<float> inv_freq_;     // [head_dim / 2]
  std::vector<Layer> layers_;

  // Activations, sized for options_ (T = max_batch_tokens, R = max_logits_rows).
  DeviceBuffer<float> x_;           // [T, hidden]
  DeviceBuffer<bf16> normed_;       // [max(T, R), hidden]
  DeviceBuffer<float> qkv_;         // [T, q_dim + 2 kv_dim]
  DeviceBuffer<bf16> q_;            // [T, n_heads, head_dim]
  DeviceBuffer<bf16> attn_;         // [T, n_heads, head_dim]
  DeviceBuffer<float> gate_up_;     // [T, 2 ffn]
  DeviceBuffer<bf16> act_;          // [T, ffn]
  DeviceBuffer<float> logits_;      // [R, vocab]
  DeviceBuffer<float> partial_o_;   // [max_sequences, n_heads, kMaxSplits, head_dim]
  DeviceBuffer<float> partial_ml_;  // [max_sequences, n_heads, kMaxSplits, 2]
  static constexpr int kMaxSplits = 32;
  // CudaModelOptions::cuda_graphs: instantiated dense greedy decode steps by (batch size,
  // attention splits); they reference only buffers allocated in Make, which never move.
  struct GraphExecDeleter {
    void operator()(cudaGraphExec_t g) const { cudaGraphExecDestroy(g); }
  };
  // Key: dense sequences, their attention splits, the hook's rows (-1: no hook), output rows,
  // the hook's graph key.
  std::map<std::array<int64_t, 5>,
           std::unique_ptr<std::remove_pointer_t<cudaGraphExec_t>, GraphExecDeleter>>
      graphs_;
  CudaGraphStats graph_stats_;
  DeviceBuffer<uint8_t> cublas_ws_;  // cuBLAS's workspace (no allocation inside a capture)

  // Per-Forward metadata: filled in pinned memory, copied to the device.
  PinnedBuffer<int32_t> h_tokens_, h_token_seq_, h_out_rows_, h_argmax_;
  PinnedBuffer<SeqKv> h_seqs_;
  DeviceBuffer<int32_t> d_tokens_;     // [T]
  DeviceBuffer<int32_t> d_token_seq_;  // [T]
  DeviceBuffer<int32_t> d_out_rows_;   // [max(T, max_sequences)]
  DeviceBuffer<int32_t> d_argmax_;     // [max_sequences]
  DeviceBuffer<SeqKv> d_seqs_;         // [max_sequences]

  std::unordered_map<SequenceId, Sequence> sequences_;

  std::vector<CudaEvent> events_;
  std::vector<Kind> event_kinds_;
  CudaForwardProfile profile_;

  // Per-layer builds (CudaLayerBuilder).
  CudaStream side_stream_;                          // created by EnsureBuildStream
  std::vector<CudaEvent> layer_ready_;              // [n_layers] K of the layer appended (main)
  std::vector<CudaEvent> build_begin_, build_end_;  // [n_layers] on the build stream
  CudaEvent builds_done_;
  double build_ms_ = 0;
  double build_plan_ms_ = 0;

  // KV export (BeginKvExport), created by the first export.
  CudaStream copy_stream_;
  std::vector<CudaEvent> export_ready_;  // [n_layers] K/V (and staged Q) of the layer ready
  DeviceBuffer<float> export_scratch_;   // [2 (K, V), T, kv_dim] a chunk's rows in float32
  DeviceBuffer<float> q_stage_;          // [n_layers, q_stage_rows_, q_dim]
  int64_t q_stage_rows_ = 0;
  std::vector<PinnedBuffer<float>> export_pool_;  // free host buffers, reused by later exports
  int64_t export_pinned_bytes_ = 0;

  // AppendRows of a sequence without a bf16 export: one layer's K and V rows, bf16, kept for
  // later calls (grows to the longest).
  PinnedBuffer<uint16_t> append_staging_;
};

absl::StatusOr<std::unique_ptr<CudaModelImpl>> CudaModelImpl::Make(
    const ModelConfig& config, const CudaModelOptions& options) {
  KVR_RETURN_IF_ERROR(config.Validate());
  if (!kvr::cuda::HaveCudaDevice()) {
    return absl::FailedPreconditionError("CudaModel: no usable CUDA device");
  }
  if (options.max_batch_tokens < 1 || options.max_sequences < 1 || options.max_logits_rows < 1) {
    return absl::InvalidArgumentError(absl::StrCat("CudaModel: max_batch_tokens (",
                                                   options.max_batch_tokens, "), max_sequences (",
                                                   options.max_sequences, ") and max_logits_rows (",
                                                   options.max_logits_rows, ") must be positive"));
  }
  if (config.n_heads / config.n_kv_heads > cuda::kMaxDecodeGroup ||
      (config.head_dim != 64 && config.head_dim != 128)) {
    return absl::UnimplementedError(absl::StrCat(
        "CudaModel: head_dim ", config.head_dim, " with ", config.n_heads / config.n_kv_heads,
        " query heads per KV head (compiled: head_dim 64 or 128, at most ", cuda::kMaxDecodeGroup,
        " per group)"));
  }
  KVR_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device));
  auto m = std::unique_ptr<CudaModelImpl>(new CudaModelImpl(config, options));
  KVR_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&m->n_sms_, cudaDevAttrMultiProcessorCount, options.device));
  KVR_ASSIGN_OR_RETURN(m->stream_, CudaStream::Create());
  cublasHandle_t handle = nullptr;
  KVR_CUBLAS_RETURN_IF_ERROR(cublasCreate(&handle));
  m->cublas_.reset(handle);
  KVR_CUBLAS_RETURN_IF_ERROR(cublasSetStream(handle, m->stream()));
  // A workspace of our own: cuBLAS then allocates nothing while a decode step is captured.
  KVR_RETURN_IF_ERROR(Alloc(m->cublas_ws_, int64_t{32} << 20));
  KVR_CUBLAS_RETURN_IF_ERROR(
      cublasSetWorkspace(handle, m->cublas_ws_.data(), m->cublas_ws_.bytes()));

  const ModelConfig& c = m->config_;
  const int64_t t = options.max_batch_tokens, b = options.max_sequences;
  const int64_t r = options.max_logits_rows, h = c.hidden;
  const int64_t qkv_dim = c.q_dim() + 2 * c.kv_dim();
  KVR_RETURN_IF_ERROR(Alloc(m->x_, t * h));
  KVR_RETURN_IF_ERROR(Alloc(m->normed_, std::max(t, r) * h));
  KVR_RETURN_IF_ERROR(Alloc(m->qkv_, t * qkv_dim));
  KVR_RETURN_IF_ERROR(Alloc(m->q_, t * c.q_dim()));
  KVR_RETURN_IF_ERROR(Alloc(m->attn_, t * c.q_dim()));
  KVR_RETURN_IF_ERROR(Alloc(m->gate_up_, t * 2 * c.ffn));
  KVR_RETURN_IF_ERROR(Alloc(m->act_, t * c.ffn));
  KVR_RETURN_IF_ERROR(Alloc(m->logits_, r * c.vocab));
  KVR_RETURN_IF_ERROR(Alloc(m->partial_o_, b * c.n_heads * kMaxSplits * c.head_dim));
  KVR_RETURN_IF_ERROR(Alloc(m->partial_ml_, b * c.n_heads * kMaxSplits * 2));
  KVR_RETURN_IF_ERROR(AllocPinned(m->h_tokens_, t));
  KVR_RETURN_IF_ERROR(AllocPinned(m->h_token_seq_, t));
  KVR_RETURN_IF_ERROR(AllocPinned(m->h_out_rows_, std::max(t, b)));
  KVR_RETURN_IF_ERROR(AllocPinned(m->h_argmax_, b));
  KVR_RETURN_IF_ERROR(AllocPinned(m->h_seqs_, b));
  KVR_RETURN_IF_ERROR(Alloc(m->d_tokens_, t));
  KVR_RETURN_IF_ERROR(Alloc(m->d_token_seq_, t));
  KVR_RETURN_IF_ERROR(Alloc(m->d_out_rows_, std::max(t, b)));
  KVR_RETURN_IF_ERROR(Alloc(m->d_argmax_, b));
  KVR_RETURN_IF_ERROR(Alloc(m->d_seqs_, b));

  const std::vector<float> inv_freq = RopeInverseFrequencies(c);
  KVR_RETURN_IF_ERROR(Alloc(m->inv_freq_, static_cast<int64_t>(inv_freq.size())));
  KVR_CUDA_RETURN_IF_ERROR(cudaMemcpy(m->inv_freq_.data(), inv_freq.data(),
                                      inv_freq.size() * sizeof(float), cudaMemcpyHostToDevice));
  KVR_RETURN_IF_ERROR(m->AllocateWeights());
  return m;
}

absl::Status CudaModelImpl::AllocateWeights() {
  const ModelConfig& c = config_;
  const int64_t h = c.hidden, q = c.q_dim(), kv = c.kv_dim(), f = c.ffn;
  KVR_RETURN_IF_ERROR(Alloc(token_embd_, int64_t{c.vocab} * h));
  if (!c.tied_embeddings) KVR_RETURN_IF_ERROR(Alloc(output_, int64_t{c.vocab} * h));
  KVR_RETURN_IF_ERROR(Alloc(output_norm_, h));
  layers_.resize(c.n_layers);
  for (Layer& l : layers_) {
    KVR_RETURN_IF_ERROR(Alloc(l.attn_norm, h));
    KVR_RETURN_IF_ERROR(Alloc(l.wqkv, (q + 2 * kv) * h));
    if (c.qkv_bias) KVR_RETURN_IF_ERROR(Alloc(l.bqkv, q + 2 * kv));
    KVR_RETURN_IF_ERROR(Alloc(l.wo, h * q));
    KVR_RETURN_IF_ERROR(Alloc(l.ffn_norm, h));
    KVR_RETURN_IF_ERROR(Alloc(l.w_gate_up, 2 * f * h));
    KVR_RETURN_IF_ERROR(Alloc(l.w_down, h * f));
  }
  weight_bytes_ =
      static_cast<int64_t>(token_embd_.bytes() + output_.bytes() + output_norm_.bytes());
  for (const Layer& l : layers_) {
    weight_bytes_ +=
        static_cast<int64_t>(l.attn_norm.bytes() + l.wqkv.bytes() + l.bqkv.bytes() + l.wo.bytes() +
                             l.ffn_norm.bytes() + l.w_gate_up.bytes() + l.w_down.bytes());
  }
  return absl::OkStatus();
}

absl::Status CudaModelImpl::UploadWeights(const ModelWeights& w) {
  KVR_RETURN_IF_ERROR(w.CheckShapes(config_));
  if (config_.tied_embeddings != w.output.empty()) {
    return absl::InvalidArgumentError(
        "CudaModel: the weights' output projection disagrees with config.tied_embeddings");
  }
  // float32 host tensors go through a float32 device staging buffer and are rounded to bf16
  // there, in chunks, so the staging stays small.
  constexpr int64_t kChunk = int64_t{1} << 24;
  DeviceBuffer<float> staging;
  KVR_RETURN_IF_ERROR(Alloc(staging, kChunk));
  auto to_bf16 = [&](const std::vector<float>& src, DeviceBuffer<bf16>& dst) -> absl::Status {
    for (int64_t i = 0; i < static_cast<int64_t>(src.size()); i += kChunk) {
      const int64_t n = std::min<int64_t>(kChunk, static_cast<int64_t>(src.size()) - i);
      KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(staging.data(), src.data() + i, n * sizeof(float),
                                               cudaMemcpyHostToDevice, stream()));
      KVR_RETURN_IF_ERROR(cuda::LaunchToBf16(staging.data(), dst.data() + i, n, stream()));
    }
    return absl::OkStatus();
  };
  auto copy = [&](const std::vector<float>& src, DeviceBuffer<float>& dst) -> absl::Status {
    KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst.data(), src.data(), src.size() * sizeof(float),
                                             cudaMemcpyHostToDevice, stream()));
    return absl::OkStatus();
  };
  KVR_RETURN_IF_ERROR(to_bf16(w.token_embd, token_embd_));
  if (!w.output.empty()) KVR_RETURN_IF_ERROR(to_bf16(w.output, output_));
  KVR_RETURN_IF_ERROR(copy(w.output_norm, output_norm_));
  for (int i = 0; i < config_.n_layers; ++i) {
    const LayerWeights& src = w.layers[i];
    Layer& dst = layers_[i];
    KVR_RETURN_IF_ERROR(copy(src.attn_norm, dst.attn_norm));
    KVR_RETURN_IF_ERROR(to_bf16(src.wqkv, dst.wqkv));
    if (!src.bqkv.empty()) KVR_RETURN_IF_ERROR(copy(src.bqkv, dst.bqkv));
    KVR_RETURN_IF_ERROR(to_bf16(src.wo, dst.wo));
    KVR_RETURN_IF_ERROR(copy(src.ffn_norm, dst.ffn_norm));
    KVR_RETURN_IF_ERROR(to_bf16(src.w_gate_up, dst.w_gate_up));
    KVR_RETURN_IF_ERROR(to_bf16(src.w_down, dst.w_down));
  }
  return stream_.Synchronize();
}

absl::Status CudaModelImpl::RandomizeWeights(uint64_t seed) {
  const ModelConfig& c = config_;
  uint64_t tensor = seed * 1000003ULL;
  auto random = [&](DeviceBuffer<bf16>& b, float stddev) {
    return cuda::LaunchRandomBf16(b.data(), static_cast<int64_t>(b.size()), ++tensor, stddev,
                                  stream());
  };
  auto ones = [&](DeviceBuffer<float>& b) {
    return cuda::LaunchFillF32(b.data(), static_cast<int64_t>(b.size()), 1.f, stream());
  };
  const float in_h = 1.f / std::sqrt(static_cast<float>(c.hidden));
  KVR_RETURN_IF_ERROR(random(token_embd_, 1.f));
  if (output_.size() > 0) KVR_RETURN_IF_ERROR(random(output_, in_h));
  KVR_RETURN_IF_ERROR(ones(output_norm_));
  for (Layer& l : layers_) {
    KVR_RETURN_IF_ERROR(ones(l.attn_norm));
    KVR_RETURN_IF_ERROR(random(l.wqkv, in_h));
    if (l.bqkv.size() > 0) {
      KVR_RETURN_IF_ERROR(
          cuda::LaunchFillF32(l.bqkv.data(), static_cast<int64_t>(l.bqkv.size()), 0.f, stream()));
    }
    KVR_RETURN_IF_ERROR(random(l.wo, 1.f / std::sqrt(static_cast<float>(c.q_dim()))));
    KVR_RETURN_IF_ERROR(ones(l.ffn_norm));
    KVR_RETURN_IF_ERROR(random(l.w_gate_up, in_h));
    KVR_RETURN_IF_ERROR(random(l.w_down, 1.f / std::sqrt(static_cast<float>(c.ffn))));
  }
  return stream_.Synchronize();
}

absl::Status CudaModelImpl::AddSequence(SequenceId id, int64_t capacity,
                                        std::unique_ptr<CudaLayerBuilder> builder) {
  if (sequences_.contains(id)) {
    return absl::AlreadyExistsError(absl::StrCat("CudaModel: sequence ", id, " already exists"));
  }
  if (capacity < 1 || capacity > config_.context_length) {
    return absl::InvalidArgumentError(absl::StrCat("CudaModel: capacity ", capacity,
                                                   " tokens outside [1, context length ",
                                                   config_.context_length, "]"));
  }
  if (builder != nullptr) KVR_RETURN_IF_ERROR(EnsureBuildStream());
  Sequence s;
  s.capacity = capacity;
  KVR_RETURN_IF_ERROR(Alloc(s.kv, int64_t{config_.n_layers} * 2 * capacity * config_.kv_dim()));
  s.builder = std::move(builder);
  sequences_.emplace(id, std::move(s));
  return absl::OkStatus();
}

absl::Status CudaModelImpl::EnsureBuildStream() {
  if (side_stream_.get() != nullptr) return absl::OkStatus();
  KVR_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  KVR_ASSIGN_OR_RETURN(CudaStream side, CudaStream::Create());
  KVR_ASSIGN_OR_RETURN(CudaEvent done, CudaEvent::Create(cudaEventDisableTiming));
  std::vector<CudaEvent> ready, begin, end;
  for (int l = 0; l < config_.n_layers; ++l) {
    KVR_ASSIGN_OR_RETURN(CudaEvent r, CudaEvent::Create(cudaEventDisableTiming));
    KVR_ASSIGN_OR_RETURN(CudaEvent b, CudaEvent::Create());
    KVR_ASSIGN_OR_RETURN(CudaEvent e, CudaEvent::Create());
    ready.push_back(std::move(r));
    begin.push_back(std::move(b));
    end.push_back(std::move(e));
  }
  side_stream_ = std::move(side);
  builds_done_ = std::move(done);
  layer_ready_ = std::move(ready);
  build_begin_ = std::move(begin);
  build_end_ = std::move(end);
  return absl::OkStatus();
}

absl::Status CudaModelImpl::QueueBuild(Sequence& s, int layer, int64_t len, cudaStream_t st) {
  CudaLayerKeys keys;
  keys.layer = layer;
  keys.keys = s.kv.data() + int64_t{layer} * 2 * s.capacity * config_.kv_dim();
  keys.token_stride = config_.kv_dim();
  keys.length = len;
  const KvExport* e = s.exporting.get();
  if (e != nullptr && e->build_q.size() > 0 && len == e->opt.length && e->q_first < len) {
    const int64_t qd = config_.q_dim();
    keys.queries = e->build_q.data() + (int64_t{layer} * e->nq + e->q_first - (len - e->nq)) * qd;
    keys.n_queries = len - e->q_first;
  }
  return s.builder->Build(keys, st);
}

absl::Status CudaModelImpl::RebuildForTesting(SequenceId id) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("CudaModel: no sequence ", id));
  }
  Sequence& s = it->second;
  if (s.builder == nullptr || s.length < 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("CudaModel: sequence ", id, " has no builder or no tokens"));
  }
  KVR_RETURN_IF_ERROR(s.builder->Prepare(s.length, stream()));
  for (int l = 0; l < config_.n_layers; ++l) {
    KVR_RETURN_IF_ERROR(QueueBuild(s, l, s.length, stream()));
  }
  KVR_RETURN_IF_ERROR(stream_.Synchronize());
  s.built_length = s.length;
  return absl::OkStatus();
}

absl::Status CudaModelImpl::ReleaseSequence(SequenceId id) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("CudaModel: no sequence ", id));
  }
  if (it->second.exporting != nullptr) RecycleExport(std::move(it->second.exporting));
  sequences_.erase(it);
  return absl::OkStatus();
}

absl::Status CudaModelImpl::BeginKvExport(SequenceId id, const KvExportOptions& o) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("BeginKvExport: no sequence ", id));
  }
  Sequence& s = it->second;
  if (s.exporting != nullptr || s.length != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "BeginKvExport: sequence ", id, s.exporting != nullptr ? " already exports" : "",
        s.length != 0 ? absl::StrCat(" holds ", s.length, " tokens (export from the first)") : ""));
  }
  if (o.length < 1 || o.length > s.capacity || o.max_queries < 0) {
    return absl::InvalidArgumentError(absl::StrCat("BeginKvExport: length ", o.length,
                                                   " outside [1, capacity ", s.capacity,
                                                   "] or max_queries ", o.max_queries, " < 0"));
  }
  if (o.built && s.builder == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "BeginKvExport: builds asked for sequence ", id, ", which was added without a builder"));
  }
  // The build part of each layer's export (floats, then the int32s in the same buffer), sized
  // for the largest layer.
  int64_t sum_f32 = 0, sum_i32 = 0;
  if (o.built) {
    for (int l = 0; l < config_.n_layers; ++l) {
      const CudaLayerOutput out = s.builder->Output(l, o.length);
      if (out.n_f32 < 0 || out.n_i32 < 0) {
        return absl::InternalError(absl::StrCat("BeginKvExport: layer ", l, "'s build has ",
                                                out.n_f32, " floats and ", out.n_i32, " ints"));
      }
      sum_f32 = std::max(sum_f32, out.n_f32);
      sum_i32 = std::max(sum_i32, out.n_i32);
    }
  }
  const ModelConfig& c = config_;
  const int64_t kv = c.kv_dim(), qd = c.q_dim(), T = options_.max_batch_tokens;
  KVR_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  if (copy_stream_.get() == nullptr) {
    KVR_ASSIGN_OR_RETURN(CudaStream st, CudaStream::Create());
    std::vector<CudaEvent> events;
    for (int l = 0; l < c.n_layers; ++l) {
      KVR_ASSIGN_OR_RETURN(CudaEvent e, CudaEvent::Create(cudaEventDisableTiming));
      events.push_back(std::move(e));
    }
    KVR_RETURN_IF_ERROR(Alloc(export_scratch_, 2 * T * kv));
    copy_stream_ = std::move(st);
    export_ready_ = std::move(events);
  }
  auto e = std::make_unique<KvExport>();
  e->opt = o;
  e->nq = std::min(o.max_queries, o.length);
  e->q_first = o.length;
  if (o.built && s.builder->wants_queries() && e->nq > 0) {
    KVR_RETURN_IF_ERROR(Alloc(e->build_q, int64_t{c.n_layers} * e->nq * qd));
  }
  // Queries of one chunk that can fall in the windows of all exporting sequences at once.
  int64_t stage_rows = e->nq;
  for (const auto& [other_id, other] : sequences_) {
    if (other.exporting != nullptr) stage_rows += other.exporting->nq;
  }
  stage_rows = std::min(stage_rows, T);
  if (stage_rows > q_stage_rows_) {
    q_stage_ = DeviceBuffer<float>();
    KVR_RETURN_IF_ERROR(Alloc(q_stage_, int64_t{c.n_layers} * stage_rows * qd));
    q_stage_rows_ = stage_rows;
  }
  // K and V rows: float32, or bf16 (two per float of the buffer; kv_dim is even).
  const int64_t row_floats = o.bf16_rows ? o.length * kv : 2 * o.length * kv;
  const int64_t layer_stride = row_floats + e->nq * qd + sum_f32 + sum_i32;
  const int64_t need = int64_t{c.n_layers} * layer_stride;
  // The smallest pooled buffer that fits; when none does, the pool is freed first (one request
  // at a time is the prefill node's case: its buffer grows to the longest prompt).
  auto best = export_pool_.end();
  for (auto p = export_pool_.begin(); p != export_pool_.end(); ++p) {
    if (static_cast<int64_t>(p->size()) >= need &&
        (best == export_pool_.end() || p->size() < best->size())) {
      best = p;
    }
  }
  if (best != export_pool_.end()) {
    e->host = std::move(*best);
    export_pool_.erase(best);
  } else {
    for (const PinnedBuffer<float>& p : export_pool_) {
      export_pinned_bytes_ -= static_cast<int64_t>(p.bytes());
    }
    export_pool_.clear();
    absl::StatusOr<PinnedBuffer<float>> host = PinnedBuffer<float>::Create(need);
    if (!host.ok()) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(
          absl::StrCat("BeginKvExport: ", need * 4, " bytes of pinned host memory for ", o.length,
                       " tokens: ", host.status().message()));
    }
    e->host = *std::move(host);
    export_pinned_bytes_ += static_cast<int64_t>(e->host.bytes());
  }
  e->notes.resize(c.n_layers);
  for (int l = 0; l < c.n_layers; ++l) {
    float* base = e->host.data() + l * layer_stride;
    ExportNote& n = e->notes[l];
    n.exp = e.get();
    n.view.sequence = id;
    n.view.layer = l;
    if (o.bf16_rows) {
      n.view.k_bf16 = reinterpret_cast<const uint16_t*>(base);
      n.view.v_bf16 = n.view.k_bf16 + o.length * kv;
    } else {
      n.view.kv.k = base;
      n.view.kv.v = base + o.length * kv;
    }
    n.view.kv.n_rows = o.length;
    n.view.kv.row_stride = kv;
    n.view.kv.total_tokens = o.length;
    n.view.queries = base + row_floats;
    n.view.n_queries = e->nq;
    n.view.queries_first_position = o.length - e->nq;
    if (o.built) {
      const CudaLayerOutput out = s.builder->Output(l, o.length);
      CudaBuiltLayer& v = n.view.built;
      v.length = o.length;
      v.f32 = base + row_floats + e->nq * qd;
      v.n_f32 = out.n_f32;
      v.i32 = reinterpret_cast<const int32_t*>(v.f32 + sum_f32);
      v.n_i32 = out.n_i32;
    }
  }
  s.exporting = std::move(e);
  return absl::OkStatus();
}

absl::Status CudaModelImpl::EndKvExport(SequenceId id) {
  auto it = sequences_.find(id);
  if (it == sequences_.end() || it->second.exporting == nullptr) {
    return absl::NotFoundError(absl::StrCat("EndKvExport: sequence ", id, " does not export"));
  }
  RecycleExport(std::move(it->second.exporting));
  return absl::OkStatus();
}

void CudaModelImpl::RecycleExport(std::unique_ptr<KvExport> e) {
  // Forward synchronizes the copy stream before it returns: no copy or callback still uses it.
  export_pool_.push_back(std::move(e->host));
}

absl::StatusOr<int64_t> CudaModelImpl::SequenceDeviceBytes(SequenceId id) const {
  auto it = sequences_.find(id);
  if (it == sequences_.end())
    return absl::NotFoundError(absl::StrCat("CudaModel: no sequence ", id));
  return static_cast<int64_t>(it->second.kv.bytes());
}

absl::StatusOr<int64_t> CudaModelImpl::SequenceLength(SequenceId id) const {
  auto it = sequences_.find(id);
  if (it == sequences_.end())
    return absl::NotFoundError(absl::StrCat("CudaModel: no sequence ", id));
  return it->second.length;
}

absl::Status CudaModelImpl::FillSequenceForBenchmark(SequenceId id, int64_t n_tokens,
                                                     uint64_t seed) {
  auto it = sequences_.find(id);
  if (it == sequences_.end())
    return absl::NotFoundError(absl::StrCat("CudaModel: no sequence ", id));
  Sequence& s = it->second;
  if (n_tokens < 0 || n_tokens > s.capacity) {
    return absl::InvalidArgumentError(
        absl::StrCat("FillSequenceForBenchmark: ", n_tokens, " tokens, capacity ", s.capacity));
  }
  KVR_RETURN_IF_ERROR(
      cuda::LaunchRandomBf16(s.kv.data(), static_cast<int64_t>(s.kv.size()), seed, 1.f, stream()));
  KVR_RETURN_IF_ERROR(stream_.Synchronize());
  s.length = n_tokens;
  return absl::OkStatus();
}

absl::Status CudaModelImpl::AppendRows(
    SequenceId id, int64_t n_rows,
    const std::function<absl::Status(int, std::span<uint16_t>, std::span<uint16_t>)>& fill) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("AppendRows: no sequence ", id));
  }
  Sequence& s = it->second;
  const ModelConfig& c = config_;
  const int64_t first = s.length, end = s.length + n_rows;
  KvExport* e = s.exporting.get();
  // An exporting sequence keeps at least one token to compute: the Forward that completes the
  // export hands its layers out.
  const int64_t limit = std::min(
      {s.capacity, int64_t{c.context_length}, e != nullptr ? e->opt.length - 1 : s.capacity});
  if (n_rows < 1 || end > limit) {
    return absl::InvalidArgumentError(absl::StrCat(
        "AppendRows: ", n_rows, " rows after ", first, " in sequence ", id, " (at most ", limit,
        " rows: capacity ", s.capacity, ", context length ", c.context_length,
        e != nullptr ? absl::StrCat(", export length ", e->opt.length, " less one") : "", ")"));
  }
  KVR_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  const int64_t kv = c.kv_dim();
  const int64_t n = n_rows * kv;  // values of K (and of V) per layer
  // With a bf16 export the rows are filled into the export's pinned buffer at their rows and
  // uploaded from there: no staging, and the uploads need not be waited for before the next
  // layer's fill. Otherwise one layer is staged at a time (and widened into a float32 export).
  const bool direct = e != nullptr && e->opt.bf16_rows;
  if (!direct && append_staging_.size() < static_cast<size_t>(2 * n)) {
    append_staging_ = PinnedBuffer<uint16_t>();
    KVR_ASSIGN_OR_RETURN(append_staging_, PinnedBuffer<uint16_t>::Create(2 * n));
  }
  SeqKv sk;
  sk.base = s.kv.data();
  sk.capacity = s.capacity;
  const auto upload = [&]() -> absl::Status {
    for (int layer = 0; layer < c.n_layers; ++layer) {
      uint16_t *k = nullptr, *v = nullptr;
      if (direct) {
        const KvExportLayer& view = e->notes[layer].view;
        k = const_cast<uint16_t*>(view.k_bf16) + first * kv;
        v = const_cast<uint16_t*>(view.v_bf16) + first * kv;
      } else {
        // The previous layer's upload reads the staging buffer.
        KVR_RETURN_IF_ERROR(stream_.Synchronize());
        k = append_staging_.data();
        v = k + n;
      }
      KVR_RETURN_IF_ERROR(
          fill(layer, std::span(k, static_cast<size_t>(n)), std::span(v, static_cast<size_t>(n))));
      KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(cuda::KRow(sk, layer, first, static_cast<int>(kv)),
                                               k, n * sizeof(uint16_t), cudaMemcpyHostToDevice,
                                               stream()));
      KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(cuda::VRow(sk, layer, first, static_cast<int>(kv)),
                                               v, n * sizeof(uint16_t), cudaMemcpyHostToDevice,
                                               stream()));
      if (e != nullptr && !direct) {
        // A float32 export: the same values widened (exact), as the export of a chunk.
        const KvExportLayer& view = e->notes[layer].view;
        float* kd = const_cast<float*>(view.kv.k) + first * kv;
        float* vd = const_cast<float*>(view.kv.v) + first * kv;
        for (int64_t i = 0; i < n; ++i) {
          const uint32_t kb = uint32_t{k[i]} << 16, vb = uint32_t{v[i]} << 16;
          std::memcpy(kd + i, &kb, sizeof(float));
          std::memcpy(vd + i, &vb, sizeof(float));
        }
      }
    }
    return absl::OkStatus();
  };
  absl::Status status = upload();
  // Every upload is done (or drained after an error) before the host memory can be reused.
  const absl::Status synced = stream_.Synchronize();
  if (status.ok()) status = synced;
  if (!status.ok()) return status;
  s.length = end;
  if (e != nullptr) {
    // Appended rows bring no queries: the window starts at the first computed token at the
    // earliest (the chunks' staging writes each query at its position in the window).
    const int64_t qd = c.q_dim();
    for (ExportNote& note : e->notes) {
      KvExportLayer& view = note.view;
      const int64_t skip = std::max<int64_t>(0, end - view.queries_first_position);
      view.queries += skip * qd;
      view.n_queries -= skip;
      view.queries_first_position += skip;
    }
  }
  return absl::OkStatus();
}

absl::Status CudaModelImpl::Gemm(const bf16* a, int64_t m, int64_t k, const bf16* w, int64_t n,
                                 float* c, float beta) {
  // cuBLAS is column-major: row-major C[m, n] is its C'[n, m] = W'^T[n, k] A'[k, m], where
  // W' (= row-major W[n, k]) is [k, n] with leading dimension k and A' is [k, m].
  const float alpha = 1.f;
  KVR_CUBLAS_RETURN_IF_ERROR(
      cublasGemmEx(cublas_.get(), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n),
                   static_cast<int>(m), static_cast<int>(k), &alpha, w, CUDA_R_16BF,
                   static_cast<int>(k), a, CUDA_R_16BF, static_cast<int>(k), &beta, c, CUDA_R_32F,
                   static_cast<int>(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

absl::Status CudaModelImpl::Mark(Kind kind) {
  if (!options_.profile) return absl::OkStatus();
  const size_t i = event_kinds_.size();
  if (i == events_.size()) {
    KVR_ASSIGN_OR_RETURN(CudaEvent e, CudaEvent::Create());
    events_.push_back(std::move(e));
  }
  KVR_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[i].get(), stream()));
  event_kinds_.push_back(kind);
  return absl::OkStatus();
}

absl::Status CudaModelImpl::FinishProfile() {
  profile_ = CudaForwardProfile{};
  if (!options_.profile || event_kinds_.empty()) return absl::OkStatus();
  // The last mark closes the last interval; its kind is not used.
  for (size_t i = 0; i + 1 < event_kinds_.size(); ++i) {
    float ms = 0.f;
    KVR_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, events_[i].get(), events_[i + 1].get()));
    profile_.total_ms += ms;
    switch (event_kinds_[i]) {
      case Kind::kGemm:
        profile_.gemm_ms += ms;
        break;
      case Kind::kAttention:
        profile_.attention_ms += ms;
        break;
      case Kind::kOther:
        profile_.other_ms += ms;
        break;
      case Kind::kSelect:
        profile_.select_ms += ms;
        break;
      case Kind::kGather:
        profile_.gather_ms += ms;
        break;
    }
  }
  event_kinds_.clear();
  return absl::OkStatus();
}

absl::Status CudaModelImpl::Run(std::span<const CudaSequence> batch, LogitsMode mode,
                                std::span<float> logits, std::span<int32_t> next_tokens,
                                CudaAttention* hook) {
  const ModelConfig& c = config_;
  using Clock = std::chrono::steady_clock;
  const Clock::time_point t_entry = Clock::now();
  Clock::time_point t_queue = t_entry, t_queued = t_entry, t_synced = t_entry;
  if (batch.empty()) return absl::InvalidArgumentError("CudaModel::Forward: empty batch");
  // The calling thread may not be the one that made the model (a server's request threads).
  KVR_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  if (static_cast<int64_t>(batch.size()) > options_.max_sequences) {
    return absl::InvalidArgumentError(absl::StrCat("CudaModel::Forward: ", batch.size(),
                                                   " sequences, more than max_sequences ",
                                                   options_.max_sequences));
  }
  // A hook's sequences are its own (not in sequences_) and take one token per Forward; the
  // rows they run over are the hook's (its Plan). A hooked Forward may carry the model's own
  // dense sequences too (a mixed batch: a decode node runs a sequence densely where that pays):
  // those run the dense path on rows [0, n_dense), the hook's on rows [n_dense, n_rows), and
  // every GEMM runs once over all of them.
  std::vector<Sequence*> seqs(batch.size(), nullptr);  // dense sequences; null: the hook's
  std::vector<CudaSequence> hook_batch;                // the hook's, in batch order
  std::vector<size_t> hook_of;                         // [hook_batch]: its place in batch
  int64_t total = 0;                                   // tokens of the dense sequences
  {
    std::unordered_set<SequenceId> seen;
    for (size_t b = 0; b < batch.size(); ++b) {
      const CudaSequence& in = batch[b];
      auto it = sequences_.find(in.id);
      if (hook == nullptr && it == sequences_.end()) {
        return absl::NotFoundError(absl::StrCat("CudaModel::Forward: no sequence ", in.id));
      }
      const bool dense = it != sequences_.end();
      if (!dense) {
        hook_batch.push_back(in);
        hook_of.push_back(b);
      }
      if (hook != nullptr && dense &&
          (mode != LogitsMode::kLast || it->second.exporting != nullptr || in.build)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "CudaModel::Forward: dense sequence ", in.id,
            " in a hooked Forward: only last-token logits, no KV export and no build there"));
      }
      if (!seen.insert(in.id).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("CudaModel::Forward: sequence ", in.id, " appears twice in the batch"));
      }
      if (in.tokens.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("CudaModel::Forward: sequence ", in.id, " has no tokens"));
      }
      if (!dense && in.tokens.size() != 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("CudaModel::Forward: sparse sequence ", in.id, " has ", in.tokens.size(),
                         " tokens; sparse sequences take one token per Forward"));
      }
      if (dense) {
        const Sequence& s = it->second;
        const int64_t length = s.length + static_cast<int64_t>(in.tokens.size());
        if (length > s.capacity || length > c.context_length) {
          return absl::InvalidArgumentError(
              absl::StrCat("sequence ", in.id, " would be ", length, " tokens (", s.length,
                           " cached + ", in.tokens.size(), " new), more than its capacity of ",
                           s.capacity, " or the context length of ", c.context_length));
        }
        if (s.exporting != nullptr && length > s.exporting->opt.length) {
          return absl::InvalidArgumentError(absl::StrCat(
              "sequence ", in.id, " would be ", length,
              " tokens, past the length of its KV export (", s.exporting->opt.length, ")"));
        }
        if (s.exporting != nullptr && s.exporting->opt.built &&
            length == s.exporting->opt.length && !in.build) {
          return absl::InvalidArgumentError(absl::StrCat(
              "sequence ", in.id, " exports its builds: the chunk that completes its ", length,
              " tokens must set build"));
        }
      }
      for (int32_t token : in.tokens) {
        if (token < 0 || token >= c.vocab) {
          return absl::InvalidArgumentError(absl::StrCat("CudaModel::Forward: token id ", token,
                                                         " outside the vocabulary [0, ", c.vocab,
                                                         ")"));
        }
      }
      if (dense) {
        seqs[b] = &it->second;
        total += static_cast<int64_t>(in.tokens.size());
      }
    }
  }
  // Only dense sequences: the dense Forward (the hook hears nothing).
  const bool hooked = !hook_batch.empty();
  if (!hooked) hook = nullptr;
  const int n_dense = static_cast<int>(batch.size() - hook_batch.size());
  if (total + static_cast<int64_t>(hook_batch.size()) > options_.max_batch_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("CudaModel::Forward: ", total,
                                                   " tokens, more than max_batch_tokens ",
                                                   options_.max_batch_tokens));
  }
  // From the hook's Plan on, the hook hears how the Forward ended (Finish) on every return.
  struct HookFinish {
    CudaAttention* hook = nullptr;
    bool ok = false;
    ~HookFinish() {
      if (hook != nullptr) hook->Finish(ok);
    }
  };
  CudaAttentionPlan plan;
  if (hooked) {
    KVR_ASSIGN_OR_RETURN(plan, hook->Plan(hook_batch));
  }
  HookFinish finish{hook};
  if (hooked &&
      (plan.n_rows < static_cast<int64_t>(hook_batch.size()) ||
       total + plan.n_rows > options_.max_batch_tokens || plan.rows.size() != hook_batch.size())) {
    return absl::InternalError(
        absl::StrCat("CudaModel::Forward: the attention hook laid out ", plan.n_rows, " rows for ",
                     hook_batch.size(), " sequences beside ", total,
                     " dense rows (max_batch_tokens ", options_.max_batch_tokens, ")"));
  }
  const int64_t n_rows = total + (hooked ? plan.n_rows : 0);
  if (hooked) {
    for (int64_t r = total; r < n_rows; ++r) h_tokens_.data()[r] = 0;
    for (size_t i = 0; i < hook_batch.size(); ++i) {
      h_tokens_.data()[total + plan.rows[i]] = hook_batch[i].tokens[0];
      h_out_rows_.data()[hook_of[i]] = static_cast<int32_t>(total + plan.rows[i]);
    }
  }
  const int64_t n_out = mode == LogitsMode::kLast ? static_cast<int64_t>(batch.size())
                                                  : total + static_cast<int64_t>(hook_batch.size());
  if (next_tokens.empty() && static_cast<int64_t>(logits.size()) != n_out * c.vocab) {
    return absl::InvalidArgumentError(absl::StrCat("CudaModel::Forward: logits has ", logits.size(),
                                                   " floats, expected ", n_out, " x ", c.vocab));
  }

  // Metadata of this batch, in pinned memory.
  bool all_decode = true;
  int max_q = 0;
  int64_t max_length = 0;
  {
    // The dense sequences' rows come first; h_seqs_ holds them in batch order (so a dense
    // Forward's exports index it by their batch place).
    int64_t row = 0;
    int i = 0;
    for (size_t b = 0; b < batch.size(); ++b) {
      if (seqs[b] == nullptr) continue;
      const int n = static_cast<int>(batch[b].tokens.size());
      SeqKv& k = h_seqs_.data()[i];
      k.base = seqs[b]->kv.data();
      k.capacity = seqs[b]->capacity;
      k.first_position = seqs[b]->length;
      k.length = seqs[b]->length + n;
      k.q_begin = static_cast<int32_t>(row);
      k.n_q = n;
      std::memcpy(h_tokens_.data() + row, batch[b].tokens.data(), n * sizeof(int32_t));
      for (int t = 0; t < n; ++t) h_token_seq_.data()[row + t] = i;
      if (mode == LogitsMode::kLast) h_out_rows_.data()[b] = static_cast<int32_t>(row + n - 1);
      row += n;
      ++i;
      all_decode = all_decode && n == 1;
      max_q = std::max(max_q, n);
      max_length = std::max(max_length, k.length);
    }
    if (mode == LogitsMode::kAll && !hooked) {
      for (int64_t r = 0; r < total; ++r) h_out_rows_.data()[r] = static_cast<int32_t>(r);
    }
  }
  // Per-layer builds of this Forward (dense sequences added with a builder).
  build_ms_ = build_plan_ms_ = 0;
  std::vector<std::pair<Sequence*, int64_t>> builds;  // sequence, its length after the chunk
  if (!hooked) {
    for (size_t b = 0; b < batch.size(); ++b) {
      if (batch[b].build && seqs[b]->builder != nullptr) {
        builds.emplace_back(seqs[b],
                            seqs[b]->length + static_cast<int64_t>(batch[b].tokens.size()));
      }
    }
  }
  const bool side = std::any_of(builds.begin(), builds.end(),
                                [](const auto& x) { return x.first->builder->side_stream(); });
  // KV exports of this chunk (BeginKvExport): per exporting sequence, its new rows and the
  // queries among them that fall in the export's window [L - nq, L).
  struct ChunkExport {
    int b = 0;
    KvExport* exp = nullptr;
    int64_t first = 0, n = 0;                     // new rows [first, first + n)
    int64_t scratch_row = 0;                      // row of export_scratch_'s K (and V) half
    int64_t q_first = 0, q_n = 0, stage_row = 0;  // window queries [q_first, q_first + q_n)
  };
  std::vector<ChunkExport> exports;
  if (!hooked) {
    int64_t scratch_row = 0, stage_row = 0;
    for (size_t b = 0; b < batch.size(); ++b) {
      KvExport* e = seqs[b]->exporting.get();
      if (e == nullptr) continue;
      ChunkExport x;
      x.b = static_cast<int>(b);
      x.exp = e;
      x.first = seqs[b]->length;
      x.n = static_cast<int64_t>(batch[b].tokens.size());
      x.scratch_row = scratch_row;
      scratch_row += x.n;
      x.q_first = std::max(x.first, e->opt.length - e->nq);
      x.q_n = std::max<int64_t>(0, x.first + x.n - x.q_first);
      x.stage_row = stage_row;
      stage_row += x.q_n;
      exports.push_back(x);
    }
    if (stage_row > q_stage_rows_) {
      return absl::InternalError(absl::StrCat(
          "CudaModel: ", stage_row, " export queries in one chunk, staged for ", q_stage_rows_));
    }
  }
  // Layer `layer`'s export, queued once its RoPE + KV append is on the main stream.
  auto queue_export = [&](int layer) -> absl::Status {
    const int64_t kv = c.kv_dim(), qd = c.q_dim(), T = options_.max_batch_tokens;
    // The window's queries to the stage, on the MAIN stream: the next layer's RoPE overwrites
    // q_. bf16 -> float32 here, so the copy stream only copies them.
    float* stage = q_stage_.data() + int64_t{layer} * q_stage_rows_ * qd;
    // A builder's sequence has them in build_q already (converted after this layer's RoPE): the
    // copy stream copies them from there.
    auto queries_of = [&](const ChunkExport& x) -> const float* {
      const KvExport* e = x.exp;
      return e->build_q.size() > 0
                 ? e->build_q.data() +
                       (int64_t{layer} * e->nq + x.q_first - (e->opt.length - e->nq)) * qd
                 : stage + x.stage_row * qd;
    };
    for (const ChunkExport& x : exports) {
      if (x.q_n == 0 || x.exp->build_q.size() > 0) continue;
      const int64_t row = h_seqs_.data()[x.b].q_begin + (x.q_first - x.first);
      KVR_RETURN_IF_ERROR(cuda::LaunchBf16ToF32(q_.data() + row * qd, stage + x.stage_row * qd,
                                                x.q_n * qd, stream()));
    }
    KVR_CUDA_RETURN_IF_ERROR(cudaEventRecord(export_ready_[layer].get(), stream()));
    cudaStream_t cs = copy_stream_.get();
    KVR_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(cs, export_ready_[layer].get(), 0));
    // One scratch for all layers: the copy stream converts layer l + 1 only after layer l's
    // copies out of it (stream order).
    for (const ChunkExport& x : exports) {
      const SeqKv& sk = h_seqs_.data()[x.b];
      const KvExportLayer& view = x.exp->notes[layer].view;
      auto d2h = [&](const float* dst, const float* src, int64_t n) {
        return cudaMemcpyAsync(const_cast<float*>(dst), src, n * sizeof(float),
                               cudaMemcpyDeviceToHost, cs);
      };
      // A layer's K rows [first, first + n) are contiguous in the cache, and so are its V rows.
      const bf16* k_rows = cuda::KRow(sk, layer, x.first, static_cast<int>(kv));
      const bf16* v_rows = cuda::VRow(sk, layer, x.first, static_cast<int>(kv));
      if (x.exp->opt.bf16_rows) {
        // As they lie: bf16 straight from the cache.
        const size_t bytes = static_cast<size_t>(x.n * kv) * sizeof(uint16_t);
        KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(const_cast<uint16_t*>(view.k_bf16) + x.first * kv,
                                                 k_rows, bytes, cudaMemcpyDeviceToHost, cs));
        KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(const_cast<uint16_t*>(view.v_bf16) + x.first * kv,
                                                 v_rows, bytes, cudaMemcpyDeviceToHost, cs));
      } else {
        float* k_scratch = export_scratch_.data() + x.scratch_row * kv;
        float* v_scratch = export_scratch_.data() + (T + x.scratch_row) * kv;
        KVR_RETURN_IF_ERROR(cuda::LaunchBf16ToF32(k_rows, k_scratch, x.n * kv, cs));
        KVR_RETURN_IF_ERROR(cuda::LaunchBf16ToF32(v_rows, v_scratch, x.n * kv, cs));
        KVR_CUDA_RETURN_IF_ERROR(d2h(view.kv.k + x.first * kv, k_scratch, x.n * kv));
        KVR_CUDA_RETURN_IF_ERROR(d2h(view.kv.v + x.first * kv, v_scratch, x.n * kv));
      }
      if (x.q_n > 0) {
        KVR_CUDA_RETURN_IF_ERROR(d2h(view.queries + (x.q_first - view.queries_first_position) * qd,
                                     queries_of(x), x.q_n * qd));
      }
      const CudaBuiltLayer& bv = view.built;
      if (x.first + x.n == x.exp->opt.length && bv.length > 0) {
        // The layer's build, once it is done (queued before this export).
        const CudaLayerOutput out = seqs[x.b]->builder->Output(layer, bv.length);
        KVR_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(cs, build_end_[layer].get(), 0));
        if (bv.n_f32 > 0) KVR_CUDA_RETURN_IF_ERROR(d2h(bv.f32, out.f32, bv.n_f32));
        if (bv.n_i32 > 0) {
          KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(const_cast<int32_t*>(bv.i32), out.i32,
                                                   bv.n_i32 * sizeof(int32_t),
                                                   cudaMemcpyDeviceToHost, cs));
        }
      }
      if (x.first + x.n == x.exp->opt.length && x.exp->opt.on_layer) {
        // The chunk that completes the export: the layer is whole once these copies are done.
        KVR_CUDA_RETURN_IF_ERROR(cudaLaunchHostFunc(
            cs,
            [](void* p) {
              const auto* note = static_cast<const ExportNote*>(p);
              note->exp->opt.on_layer(note->view);
            },
            &x.exp->notes[layer]));
      }
    }
    return absl::OkStatus();
  };
  // The hook's per-layer request (enqueue sets .layer and the layer's bias).
  // The hook's rows follow the dense rows.
  CudaAttentionRequest request;
  request.n_rows = n_rows - total;
  request.qkv = qkv_.data() + total * (c.q_dim() + 2 * c.kv_dim());
  request.inv_freq = inv_freq_.data();
  request.q = q_.data() + total * c.q_dim();
  request.out = attn_.data() + total * c.q_dim();
  request.profile = options_.profile;
  request.mark = [this](CudaStage stage) {
    switch (stage) {
      case CudaStage::kAttention:
        return Mark(Kind::kAttention);
      case CudaStage::kSelect:
        return Mark(Kind::kSelect);
      case CudaStage::kGather:
        return Mark(Kind::kGather);
      case CudaStage::kOther:
        break;
    }
    return Mark(Kind::kOther);
  };
  // The attention launches' parameters (enqueue sets .layer); the graph key uses the same.
  cuda::AttentionParams ap;
  ap.q = q_.data();
  ap.out = attn_.data();
  ap.seqs = d_seqs_.data();
  ap.n_seqs = n_dense;
  ap.max_q = max_q;
  ap.max_length = max_length;
  ap.n_heads = c.n_heads;
  ap.n_kv_heads = c.n_kv_heads;
  ap.head_dim = c.head_dim;
  ap.scale = 1.f / std::sqrt(static_cast<float>(c.head_dim));
  ap.partial_o = partial_o_.data();
  ap.partial_ml = partial_ml_.data();
  ap.max_splits = kMaxSplits;
  ap.n_sms = n_sms_;
  // Everything from here is queued on the stream; on an error part of it may already be
  // queued (reading the pinned metadata, writing cache rows past the sequences' lengths), so
  // the stream is drained before returning and the lengths are left as they were.
  const auto enqueue = [&]() -> absl::Status {
    auto h2d = [&](auto* dst, const auto* src, int64_t n) {
      return cudaMemcpyAsync(dst, src, n * sizeof(*src), cudaMemcpyHostToDevice, stream());
    };
    KVR_RETURN_IF_ERROR(Mark(Kind::kOther));
    KVR_CUDA_RETURN_IF_ERROR(h2d(d_tokens_.data(), h_tokens_.data(), n_rows));
    KVR_CUDA_RETURN_IF_ERROR(h2d(d_out_rows_.data(), h_out_rows_.data(), n_out));
    if (hooked) KVR_RETURN_IF_ERROR(hook->Begin(stream()));
    if (n_dense > 0) {
      KVR_CUDA_RETURN_IF_ERROR(h2d(d_token_seq_.data(), h_token_seq_.data(), total));
      KVR_CUDA_RETURN_IF_ERROR(h2d(d_seqs_.data(), h_seqs_.data(), int64_t{n_dense}));
    }

    if (!builds.empty()) {
      const auto t0 = std::chrono::steady_clock::now();
      for (auto& [seq, len] : builds) KVR_RETURN_IF_ERROR(seq->builder->Prepare(len, stream()));
      build_plan_ms_ =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    }
    const int64_t h = c.hidden, q_dim = c.q_dim(), kv_dim = c.kv_dim();
    const int64_t qkv_dim = q_dim + 2 * kv_dim, f = c.ffn;
    KVR_RETURN_IF_ERROR(cuda::LaunchEmbed(
        {d_tokens_.data(), token_embd_.data(), x_.data(), n_rows, c.hidden}, stream()));

    for (int layer = 0; layer < c.n_layers; ++layer) {
      const Layer& w = layers_[layer];
      KVR_RETURN_IF_ERROR(Mark(Kind::kOther));
      cuda::RmsNormParams norm;
      norm.x = x_.data();
      norm.weight = w.attn_norm.data();
      norm.y_bf16 = normed_.data();
      norm.n_rows = n_rows;
      norm.dim = c.hidden;
      norm.eps = c.rms_eps;
      KVR_RETURN_IF_ERROR(cuda::LaunchRmsNorm(norm, stream()));
      KVR_RETURN_IF_ERROR(Mark(Kind::kGemm));
      KVR_RETURN_IF_ERROR(
          Gemm(normed_.data(), n_rows, h, w.wqkv.data(), qkv_dim, qkv_.data(), 0.f));
      if (hooked) {
        request.layer = layer;
        request.qkv_bias = w.bqkv.size() > 0 ? w.bqkv.data() : nullptr;
        KVR_RETURN_IF_ERROR(hook->Attend(request, stream()));
      }
      if (n_dense > 0) {
        KVR_RETURN_IF_ERROR(Mark(Kind::kOther));
        cuda::QkvRopeParams rope;
        rope.qkv = qkv_.data();
        rope.bias = w.bqkv.size() > 0 ? w.bqkv.data() : nullptr;
        rope.inv_freq = inv_freq_.data();
        rope.token_seq = d_token_seq_.data();
        rope.seqs = d_seqs_.data();
        rope.q = q_.data();
        rope.n_tokens = total;
        rope.n_heads = c.n_heads;
        rope.n_kv_heads = c.n_kv_heads;
        rope.head_dim = c.head_dim;
        rope.layer = layer;
        KVR_RETURN_IF_ERROR(cuda::LaunchQkvRope(rope, stream()));
        // The window's queries a builder reads (before the next layer's RoPE overwrites q_,
        // and before this layer's build, which waits for the main stream).
        for (const ChunkExport& x : exports) {
          KvExport* e = x.exp;
          if (x.q_n == 0 || e->build_q.size() == 0) continue;
          const int64_t row = h_seqs_.data()[x.b].q_begin + (x.q_first - x.first);
          KVR_RETURN_IF_ERROR(cuda::LaunchBf16ToF32(
              q_.data() + row * q_dim,
              e->build_q.data() +
                  (int64_t{layer} * e->nq + x.q_first - (e->opt.length - e->nq)) * q_dim,
              x.q_n * q_dim, stream()));
          if (layer == 0) e->q_first = std::min(e->q_first, x.q_first);
        }
        if (!builds.empty()) {
          // This layer's K rows are in the caches: it can be built.
          cudaStream_t bs = stream();
          if (side) {
            bs = side_stream_.get();
            KVR_CUDA_RETURN_IF_ERROR(cudaEventRecord(layer_ready_[layer].get(), stream()));
            KVR_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(bs, layer_ready_[layer].get(), 0));
          }
          KVR_CUDA_RETURN_IF_ERROR(cudaEventRecord(build_begin_[layer].get(), bs));
          for (auto& [seq, len] : builds) {
            KVR_RETURN_IF_ERROR(QueueBuild(*seq, layer, len, bs));
          }
          KVR_CUDA_RETURN_IF_ERROR(cudaEventRecord(build_end_[layer].get(), bs));
        }
        // After the builds: an export of builds waits for build_end_[layer].
        if (!exports.empty()) KVR_RETURN_IF_ERROR(queue_export(layer));
        KVR_RETURN_IF_ERROR(Mark(Kind::kAttention));
        ap.layer = layer;
        KVR_RETURN_IF_ERROR(all_decode ? cuda::LaunchDecodeAttention(ap, stream())
                                       : cuda::LaunchPrefillAttention(ap, stream()));
      }
      KVR_RETURN_IF_ERROR(Mark(Kind::kGemm));
      KVR_RETURN_IF_ERROR(Gemm(attn_.data(), n_rows, q_dim, w.wo.data(), h, x_.data(), 1.f));
      KVR_RETURN_IF_ERROR(Mark(Kind::kOther));
      norm.weight = w.ffn_norm.data();
      KVR_RETURN_IF_ERROR(cuda::LaunchRmsNorm(norm, stream()));
      KVR_RETURN_IF_ERROR(Mark(Kind::kGemm));
      KVR_RETURN_IF_ERROR(
          Gemm(normed_.data(), n_rows, h, w.w_gate_up.data(), 2 * f, gate_up_.data(), 0.f));
      KVR_RETURN_IF_ERROR(Mark(Kind::kOther));
      KVR_RETURN_IF_ERROR(
          cuda::LaunchSwiGlu({gate_up_.data(), act_.data(), n_rows, c.ffn}, stream()));
      KVR_RETURN_IF_ERROR(Mark(Kind::kGemm));
      KVR_RETURN_IF_ERROR(Gemm(act_.data(), n_rows, f, w.w_down.data(), h, x_.data(), 1.f));
    }

    if (side) {
      KVR_CUDA_RETURN_IF_ERROR(cudaEventRecord(builds_done_.get(), side_stream_.get()));
      KVR_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream(), builds_done_.get(), 0));
    }
    // Output rows in chunks of max_logits_rows: final norm, projection, argmax or copy back.
    const bf16* out_w = output_.size() > 0 ? output_.data() : token_embd_.data();
    for (int64_t r0 = 0; r0 < n_out; r0 += options_.max_logits_rows) {
      const int64_t n = std::min(options_.max_logits_rows, n_out - r0);
      KVR_RETURN_IF_ERROR(Mark(Kind::kOther));
      cuda::RmsNormParams norm;
      norm.x = x_.data();
      norm.rows = d_out_rows_.data() + r0;
      norm.weight = output_norm_.data();
      norm.y_bf16 = normed_.data();
      norm.n_rows = n;
      norm.dim = c.hidden;
      norm.eps = c.rms_eps;
      KVR_RETURN_IF_ERROR(cuda::LaunchRmsNorm(norm, stream()));
      KVR_RETURN_IF_ERROR(Mark(Kind::kGemm));
      KVR_RETURN_IF_ERROR(Gemm(normed_.data(), n, h, out_w, c.vocab, logits_.data(), 0.f));
      KVR_RETURN_IF_ERROR(Mark(Kind::kOther));
      if (!next_tokens.empty()) {
        KVR_RETURN_IF_ERROR(
            cuda::LaunchArgMax({logits_.data(), d_argmax_.data() + r0, n, c.vocab}, stream()));
      } else {
        KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(logits.data() + r0 * c.vocab, logits_.data(),
                                                 n * c.vocab * sizeof(float),
                                                 cudaMemcpyDeviceToHost, stream()));
      }
    }
    if (!next_tokens.empty()) {
      KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(h_argmax_.data(), d_argmax_.data(),
                                               n_out * sizeof(int32_t), cudaMemcpyDeviceToHost,
                                               stream()));
    }
    if (hooked) KVR_RETURN_IF_ERROR(hook->End(stream()));
    KVR_RETURN_IF_ERROR(Mark(Kind::kOther));
    return absl::OkStatus();
  };
  const absl::Status queued = [&]() -> absl::Status {
    t_queue = Clock::now();
    const bool graph = options_.cuda_graphs && !options_.profile &&
                       (!hooked || plan.graph_key.has_value()) && all_decode &&
                       !next_tokens.empty() && exports.empty() && builds.empty();
    if (!graph) {
      KVR_RETURN_IF_ERROR(enqueue());
    } else {
      // The grid of the decode attention is the only launch shape of the model's own that
      // depends on the step; the hook's launches depend on its key alone.
      const std::array<int64_t, 5> key{ap.n_seqs, n_dense > 0 ? cuda::DecodeSplits(ap) : 0,
                                       hooked ? plan.n_rows : -1, n_out,
                                       static_cast<int64_t>(hooked ? *plan.graph_key : 0)};
      auto it = graphs_.find(key);
      if (it == graphs_.end()) {
        KVR_CUDA_RETURN_IF_ERROR(
            cudaStreamBeginCapture(stream(), cudaStreamCaptureModeThreadLocal));
        const absl::Status captured = enqueue();
        cudaGraph_t g = nullptr;
        const cudaError_t ended = cudaStreamEndCapture(stream(), &g);
        if (!captured.ok() || ended != cudaSuccess) {
          if (g != nullptr) cudaGraphDestroy(g);
          cudaGetLastError();
          if (!captured.ok()) return captured;
          KVR_CUDA_RETURN_IF_ERROR(ended);
        }
        cudaGraphExec_t exec = nullptr;
        const cudaError_t made = cudaGraphInstantiate(&exec, g, 0);
        cudaGraphDestroy(g);
        KVR_CUDA_RETURN_IF_ERROR(made);
        it = graphs_.emplace(key, decltype(graphs_)::mapped_type(exec)).first;
        ++graph_stats_.captures;
      }
      KVR_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(it->second.get(), stream()));
      ++graph_stats_.replays;
    }
    t_queued = Clock::now();
    KVR_RETURN_IF_ERROR(stream_.Synchronize());
    t_synced = Clock::now();
    // The exports' copies and host callbacks (all queued before the main stream's tail).
    if (!exports.empty()) KVR_RETURN_IF_ERROR(copy_stream_.Synchronize());
    return absl::OkStatus();
  }();
  if (!queued.ok()) {
    cudaStreamSynchronize(stream());  // best effort: the first error is the one reported
    if (side_stream_.get() != nullptr) cudaStreamSynchronize(side_stream_.get());
    if (copy_stream_.get() != nullptr) cudaStreamSynchronize(copy_stream_.get());
    event_kinds_.clear();
    return queued;
  }
  KVR_RETURN_IF_ERROR(FinishProfile());
  if (!builds.empty()) {
    for (int l = 0; l < c.n_layers; ++l) {
      float ms = 0.f;
      KVR_CUDA_RETURN_IF_ERROR(
          cudaEventElapsedTime(&ms, build_begin_[l].get(), build_end_[l].get()));
      build_ms_ += ms;
    }
    for (auto& [seq, len] : builds) seq->built_length = len;
  }
  if (!next_tokens.empty()) {
    std::memcpy(next_tokens.data(), h_argmax_.data(), n_out * sizeof(int32_t));
  }
  for (size_t b = 0; b < batch.size(); ++b) {
    if (seqs[b] != nullptr) seqs[b]->length += static_cast<int64_t>(batch[b].tokens.size());
  }
  finish.ok = true;
  const auto ms = [](Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double, std::milli>(b - a).count();
  };
  profile_.host_before_ms = ms(t_entry, t_queue);
  profile_.host_queue_ms = ms(t_queue, t_queued);
  profile_.host_wait_ms = ms(t_queued, t_synced);
  profile_.host_after_ms = ms(t_synced, Clock::now());
  return absl::OkStatus();
}

}  // namespace

bool CudaModelAvailable() { return kvr::cuda::HaveCudaDevice(); }

absl::StatusOr<std::unique_ptr<CudaModel>> CreateCudaModel(const ModelConfig& config,
                                                           const ModelWeights& weights,
                                                           const CudaModelOptions& options) {
  if (weights.packed()) {
    return absl::InvalidArgumentError(
        "CreateCudaModel: the weights are packed; load them with LoadOptions::weights = "
        "WeightStorage::kFloat32");
  }
  KVR_ASSIGN_OR_RETURN(auto model, CudaModelImpl::Make(config, options));
  KVR_RETURN_IF_ERROR(model->UploadWeights(weights));
  return std::unique_ptr<CudaModel>(std::move(model));
}

absl::StatusOr<std::unique_ptr<CudaModel>> CreateCudaModelWithRandomWeights(
    const ModelConfig& config, uint64_t seed, const CudaModelOptions& options) {
  KVR_ASSIGN_OR_RETURN(auto model, CudaModelImpl::Make(config, options));
  KVR_RETURN_IF_ERROR(model->RandomizeWeights(seed));
  return std::unique_ptr<CudaModel>(std::move(model));
}

}  // namespace kvr::model
