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
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "attention.cuh"
#include "kvr/common/cuda/cuda_util.h"
#include "kvr/common/status.h"
#include "kvr/model/cuda_model.h"
#include "kvr/retrieval/cuda/build.cuh"
#include "kvr/retrieval/cuda/decode_attention.cuh"
#include "kvr/retrieval/cuda/gather.cuh"
#include "kvr/retrieval/cuda/hot_cache.cuh"
#include "kvr/retrieval/cuda/selection.cuh"
#include "ops.cuh"
#include "sparse.cuh"

namespace kvr::model {
namespace {

using cuda::bf16;
using cuda::SeqKv;
using kvr::cuda::CudaEvent;
using kvr::cuda::CudaStream;
using kvr::cuda::DeviceBuffer;
using kvr::cuda::PinnedBuffer;
namespace rc = kvr::retrieval::cuda;

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

template <typename T>
[[nodiscard]] absl::Status Alloc(DeviceBuffer<T>& b, int64_t n) {
  absl::StatusOr<DeviceBuffer<T>> created = DeviceBuffer<T>::Create(static_cast<size_t>(n));
  if (!created.ok()) {
    // A failed cudaMalloc is also the runtime's "last error": clear it, or the next kernel
    // launch check (cudaGetLastError) would report this allocation's failure as its own.
    cudaGetLastError();
    return created.status();
  }
  b = *std::move(created);
  return absl::OkStatus();
}
template <typename T>
[[nodiscard]] absl::Status AllocPinned(PinnedBuffer<T>& b, int64_t n) {
  KVR_ASSIGN_OR_RETURN(b, PinnedBuffer<T>::Create(static_cast<size_t>(n)));
  return absl::OkStatus();
}

class CudaModelImpl final : public CudaModel {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<CudaModelImpl>> Make(
      const ModelConfig& config, const CudaModelOptions& options);

  [[nodiscard]] absl::Status UploadWeights(const ModelWeights& w);
  [[nodiscard]] absl::Status RandomizeWeights(uint64_t seed);

  const ModelConfig& config() const override { return config_; }
  int64_t weight_bytes() const override { return weight_bytes_; }
  absl::Status AddSequence(SequenceId id, int64_t capacity) override;
  absl::Status ReleaseSequence(SequenceId id) override;
  absl::StatusOr<int64_t> SequenceLength(SequenceId id) const override;
  absl::Status FillSequenceForBenchmark(SequenceId id, int64_t n_tokens, uint64_t seed) override;
  absl::StatusOr<std::span<uint16_t>> SparseHostKv(SequenceId id) override;
  absl::StatusOr<std::shared_ptr<SparseHostKvBuffer>> AcquireSparseHostKv(
      int64_t capacity) override;
  absl::Status ActivateSparseSequence(SequenceId id, int64_t n_tokens) override;
  absl::Status ActivateSparseSequenceWithClusters(
      SequenceId id, int64_t n_tokens, std::span<const SparseClusterHead> heads) override;
  absl::Status Forward(std::span<const CudaSequence> batch, LogitsMode mode,
                       std::span<float> logits) override {
    return Run(batch, mode, logits, {});
  }
  absl::Status ForwardGreedy(std::span<const CudaSequence> batch,
                             std::span<int32_t> next_tokens) override {
    if (next_tokens.size() != batch.size()) {
      return absl::InvalidArgumentError(absl::StrCat("ForwardGreedy: next_tokens has ",
                                                     next_tokens.size(), " entries, expected ",
                                                     batch.size()));
    }
    return Run(batch, LogitsMode::kLast, {}, next_tokens);
  }
  absl::Status ConfigureSparse(const SparseAttentionOptions& options) override;
  absl::Status AddSparseSequence(SequenceId id, int64_t capacity,
                                 const SparseSequenceOptions& options) override;
  absl::StatusOr<int64_t> SequenceDeviceBytes(SequenceId id) const override;
  SparseStats sparse_stats() const override;
  int64_t sparse_slot_device_bytes() const override {
    return sparse_ == nullptr ? 0 : sparse_->bytes / sparse_->opt.slots;
  }
  absl::StatusOr<SparseSequenceCounters> SparseCounters(SequenceId id) const override;
  void SnapshotSparseLayerForTesting(int layer) override { snapshot_layer_ = layer; }
  const SparseLayerSnapshot& sparse_snapshot() const override { return snapshot_; }
  absl::StatusOr<std::span<const uint16_t>> SparseHostKvForTesting(SequenceId id) const override {
    auto it = sequences_.find(id);
    if (it == sequences_.end() || it->second.slot < 0) {
      return absl::NotFoundError(absl::StrCat("CudaModel: no sparse sequence ", id));
    }
    if (it->second.host == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "CudaModel: sparse sequence ", id, " reads its past from a row source (no host KV)"));
    }
    const cuda::HostKvBuffer<bf16>& b = it->second.host->buf;
    return std::span<const uint16_t>(reinterpret_cast<const uint16_t*>(b.data()), b.size());
  }
  absl::StatusOr<std::span<const uint16_t>> SparseNewRows(SequenceId id) const override;
  absl::StatusOr<const void*> RegisterHostRegion(const void* host, size_t bytes,
                                                 bool read_only) override;
  absl::Status UnregisterHostRegion(const void* host) override;
  absl::Status SetPrefillSummaries(const PrefillSummaryOptions& options) override;
  double last_summary_build_ms() const override { return summary_build_ms_; }
  double last_summary_plan_ms() const override { return summary_plan_ms_; }
  absl::StatusOr<PrefillSummaryData> PrefillSummariesForTesting(SequenceId id) const override;
  absl::Status RebuildPrefillSummariesForTesting(SequenceId id) override;
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
  // A sparse sequence's full KV in mapped pinned host memory, [n_layers, n_kv_heads, capacity,
  // 2, head_dim] bf16. Kept (host_kvs_) for reuse by later sequences of the same capacity.
  struct HostKv final : SparseHostKvBuffer {
    cuda::HostKvBuffer<bf16> buf;  // on SparseSequenceOptions::host_numa_node (-1: cudaHostAlloc)
    bf16* device = nullptr;        // the device-side address of buf
    int64_t capacity_tokens = 0;
    uint64_t filled_seed = 0;  // FillSequenceForBenchmark's seed + 1; 0: not filled
    std::span<uint16_t> rows() override {
      return {reinterpret_cast<uint16_t*>(buf.data()), buf.size()};
    }
    int64_t capacity() const override { return capacity_tokens; }
  };
  // A free pooled host KV (use_count 1: only the pool holds it) or a new one; errors start with
  // `what` (the caller). Under host_kv_mu_.
  absl::StatusOr<std::shared_ptr<HostKv>> PooledHostKv(int64_t capacity, int numa_node,
                                                       bool huge_pages, const char* what);
  // A dense sequence's prefill summaries (PrefillSummaryOptions), all layers.
  struct Summaries {
    PrefillSummaryOptions opt;             // as set when the sequence was added
    int max_clusters = 1, max_points = 1;  // clusterkv: the plan's at the capacity
    int64_t pages = 0;                     // quest: pages at the capacity
    int64_t layer_f32 = 0, layer_i32 = 0;  // per-layer sizes of f32 / i32
    DeviceBuffer<float> f32;
    DeviceBuffer<int32_t> i32;
    // Build metadata: [0] the length built over; clusterkv: then per layer, plan_stride ints:
    // first_token [1], n_points [n_kv], n_init [n_kv], init_points [n_kv, max_clusters].
    int64_t plan_stride = 0;
    PinnedBuffer<int32_t> h_meta;
    DeviceBuffer<int32_t> meta;
    int64_t built_length = 0;
  };
  // A dense sequence's KV export (BeginKvExport). `host` holds, per layer, K [L, kv_dim], V
  // [L, kv_dim], the queries [nq, q_dim] (float32) and the layer's summary; `notes` point into it.
  struct KvExport;
  struct ExportNote {  // the user data of one layer's cudaLaunchHostFunc
    const KvExport* exp = nullptr;
    KvExportLayer view;
  };
  struct KvExport {
    KvExportOptions opt;
    int64_t nq = 0;  // min(max_queries, L)
    PinnedBuffer<float> host;
    std::vector<ExportNote> notes;  // [n_layers]; stable addresses for the host callbacks
  };
  struct Sequence {
    DeviceBuffer<bf16> kv;                 // [n_layers, 2, capacity, n_kv_heads, head_dim]
    std::unique_ptr<KvExport> exporting;   // between BeginKvExport and EndKvExport
    std::unique_ptr<Summaries> summaries;  // dense sequences added with a summary method
    int64_t capacity = 0;
    int64_t length = 0;
    // Sparse sequences: slot in sparse_ and host KV (null: the past comes from a row source,
    // SparseSequenceOptions::rows, whose page tables are the slot's).
    int slot = -1;
    std::shared_ptr<HostKv> host;
    bool new_rows_ready = false;  // row source: SparseNewRows holds the last Forward's rows
    uint64_t source_key = 0;      // row source: a hash of where its rows are (0: own host KV)
    int64_t sparse_steps = 0;     // sparse Forwards taken part in
    uint64_t filled_seed = 0;     // as HostKv, for this slot's ring and summaries
  };
  // The GPU state shared by the sparse sequences (ConfigureSparse); layouts in sparse.cuh.
  struct SparseState {
    SparseAttentionOptions opt;
    int rcap = 0;
    int64_t pages = 0;
    int64_t bytes = 0;  // device bytes of everything below
    DeviceBuffer<bf16> resident;
    DeviceBuffer<float> bounds;
    DeviceBuffer<float> centroids;
    DeviceBuffer<int32_t> n_clusters, offsets, members;
    std::vector<rc::HotCache> hot;  // per layer
    DeviceBuffer<float> q_f32;      // [slots, q_dim]
    DeviceBuffer<int32_t> ids;      // [slots, n_kv, budget]
    DeviceBuffer<int32_t> counts;   // [slots, n_kv]
    DeviceBuffer<bf16> gathered;    // [slots, n_kv, budget, 2 d]
    DeviceBuffer<uint8_t> select_ws, attend_ws;
    size_t select_ws_bytes = 0, attend_ws_bytes = 0;
    DeviceBuffer<int32_t> meta;  // [3, slots]: cand begin, cand end, resident count
    PinnedBuffer<int32_t> h_meta;
    DeviceBuffer<cuda::SparseRow> rows;  // [slots]
    PinnedBuffer<cuda::SparseRow> h_rows;
    // Where each slot's rows are (kv_pool.h): slots [slots], pages [n_layers, slots, n_kv,
    // max_pages]; written per slot when a sequence takes it (h_slot_pages stages one slot).
    int max_pages = 0;
    DeviceBuffer<rc::KvPoolSlot> pool_slots;
    PinnedBuffer<rc::KvPoolSlot> h_pool_slots;
    DeviceBuffer<int32_t> pool_pages;
    PinnedBuffer<int32_t> h_slot_pages;  // [n_layers, n_kv, max_pages]
    // The step's new K/V rows, [slots, n_layers, 2, n_kv, head_dim], and their host copy (row
    // sources only: the caller appends them to the store).
    DeviceBuffer<bf16> new_rows;
    PinnedBuffer<bf16> h_new_rows;
    rc::KvPoolView PoolView(int layer) const {
      return {pool_slots.data(), pool_pages.data() + int64_t{layer} * opt.slots * n_kv * max_pages,
              max_pages, n_kv};
    }
    DeviceBuffer<unsigned long long> selected;  // [1]
    // Per slot since it was taken: rows selected [0, slots) and hot-cache hits [slots, 2 slots),
    // all layers; copied back at the end of every sparse Forward (h_slot_counters).
    DeviceBuffer<unsigned long long> slot_counters;
    PinnedBuffer<unsigned long long> h_slot_counters;
    int64_t steps = 0;
    std::vector<std::optional<SequenceId>> owner;  // per slot
    cuda::SparseSummaryView View() {
      cuda::SparseSummaryView v;
      v.method = opt.method == SparseMethod::kQuest ? 0 : 1;
      v.slots = opt.slots;
      v.bounds = bounds.data();
      v.bounds_slot_stride = pages * bounds_row();
      v.bounds_layer_stride = opt.slots * v.bounds_slot_stride;
      v.page_size = opt.quest_page_size;
      v.centroids = centroids.data();
      v.n_clusters = n_clusters.data();
      v.offsets = offsets.data();
      v.members = members.data();
      v.max_clusters = max_clusters;
      v.max_members = static_cast<int>(opt.max_capacity);
      return v;
    }
    int64_t bounds_row() const { return int64_t{n_kv} * 2 * head_dim; }
    int n_kv = 0, head_dim = 0, max_clusters = 0;
  };
  enum class Kind { kGemm, kAttention, kOther, kSelect, kGather };

  CudaModelImpl(ModelConfig config, CudaModelOptions options)
      : config_(std::move(config)), options_(options) {}

 public:
  ~CudaModelImpl() override {
    for (const auto& [host, region] : regions_) cudaHostUnregister(const_cast<void*>(host));
  }

 private:
  [[nodiscard]] absl::Status AllocateWeights();
  // Copies `from`'s ring rows and summaries (HBM to HBM) into `to`'s slot and clears `to`'s hot
  // cache: a slot over the same rows as one already prepared. Synchronous.
  [[nodiscard]] absl::Status CopySlot(const Sequence& from, Sequence& to);
  // A sparse sequence's slot prepared from its host KV's rows [0, n_tokens): ring rows and,
  // with `summaries`, the summaries (LaunchSparseFill), then its hot cache cleared; synchronous.
  [[nodiscard]] absl::Status FillSlotFromHostKv(Sequence& s, int64_t n_tokens, bool summaries);
  // Looks up a sparse sequence whose host KV no other sequence shares (`what` names the caller).
  [[nodiscard]] absl::StatusOr<Sequence*> OwnSparseSequence(SequenceId id, const char* what);
  // OwnSparseSequence, still empty, and n_tokens in [1, capacity]: one that Activate* may fill.
  [[nodiscard]] absl::StatusOr<Sequence*> ActivatableSequence(SequenceId id, int64_t n_tokens,
                                                              const char* what);
  // The sparse part of a layer: RoPE + KV append, select, gather, attend.
  [[nodiscard]] absl::Status SparseLayer(int layer, const Layer& w, int64_t max_candidates);
  // Uploads slot `s.slot`'s page tables: its row source's pages, or its own host KV as pages of
  // min_page_rows rows. Synchronous.
  [[nodiscard]] absl::Status WriteSlotTables(const Sequence& s,
                                             const std::optional<SparseRowSource>& source);
  [[nodiscard]] absl::Status Run(std::span<const CudaSequence> batch, LogitsMode mode,
                                 std::span<float> logits, std::span<int32_t> next_tokens);
  // C[m, n] (+)= A[m, k] W[n, k]^T; beta 1 adds onto C (the residual stream).
  [[nodiscard]] absl::Status Gemm(const bf16* a, int64_t m, int64_t k, const bf16* w, int64_t n,
                                  float* c, float beta);
  // Profiling: the GPU time from this mark to the next counts as `kind`.
  [[nodiscard]] absl::Status Mark(Kind kind);
  [[nodiscard]] absl::Status FinishProfile();

  cudaStream_t stream() const { return stream_.get(); }

  // Prefill summaries: fills the sequence's build metadata for `len` tokens (host plans) and
  // queues its upload on the main stream; queues layer `layer`'s build on `st`.
  [[nodiscard]] absl::Status PrepareSummaryBuild(Sequence& s, int64_t len);
  [[nodiscard]] absl::Status QueueSummaryBuild(Sequence& s, int layer, int64_t len,
                                               cudaStream_t st);
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
  std::map<std::pair<int, int>,
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
  std::unique_ptr<SparseState> sparse_;
  std::mutex host_kv_mu_;  // host_kvs_: AcquireSparseHostKv runs on other threads
  std::vector<std::shared_ptr<HostKv>> host_kvs_;
  // RegisterHostRegion: host address -> (bytes, device address).
  std::mutex regions_mu_;
  std::map<const void*, std::pair<size_t, const void*>> regions_;
  int snapshot_layer_ = -1;
  SparseLayerSnapshot snapshot_;
  std::vector<uint16_t> snapshot_attn_bits_;

  std::vector<CudaEvent> events_;
  std::vector<Kind> event_kinds_;
  CudaForwardProfile profile_;

  // Prefill summaries (SetPrefillSummaries).
  PrefillSummaryOptions summary_opt_;
  CudaStream side_stream_;                          // created by SetPrefillSummaries
  std::vector<CudaEvent> layer_ready_;              // [n_layers] K of the layer appended (main)
  std::vector<CudaEvent> build_begin_, build_end_;  // [n_layers] on the build stream
  CudaEvent builds_done_;
  DeviceBuffer<uint8_t> summary_ws_;  // shared by the builds (one stream at a time)
  double summary_build_ms_ = 0;
  double summary_plan_ms_ = 0;

  // KV export (BeginKvExport), created by the first export.
  CudaStream copy_stream_;
  std::vector<CudaEvent> export_ready_;  // [n_layers] K/V (and staged Q) of the layer ready
  DeviceBuffer<float> export_scratch_;   // [2 (K, V), T, kv_dim] a chunk's rows in float32
  DeviceBuffer<float> q_stage_;          // [n_layers, q_stage_rows_, q_dim]
  int64_t q_stage_rows_ = 0;
  std::vector<PinnedBuffer<float>> export_pool_;  // free host buffers, reused by later exports
  int64_t export_pinned_bytes_ = 0;
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

absl::Status CudaModelImpl::AddSequence(SequenceId id, int64_t capacity) {
  if (sequences_.contains(id)) {
    return absl::AlreadyExistsError(absl::StrCat("CudaModel: sequence ", id, " already exists"));
  }
  if (capacity < 1 || capacity > config_.context_length) {
    return absl::InvalidArgumentError(absl::StrCat("CudaModel: capacity ", capacity,
                                                   " tokens outside [1, context length ",
                                                   config_.context_length, "]"));
  }
  Sequence s;
  s.capacity = capacity;
  KVR_RETURN_IF_ERROR(Alloc(s.kv, int64_t{config_.n_layers} * 2 * capacity * config_.kv_dim()));
  if (summary_opt_.method != PrefillSummaryMethod::kNone) {
    const ModelConfig& c = config_;
    const PrefillSummaryOptions& o = summary_opt_;
    auto sm = std::make_unique<Summaries>();
    sm->opt = o;
    const int64_t nkv = c.n_kv_heads, d = c.head_dim, L = c.n_layers;
    size_t ws = 0;
    switch (o.method) {
      case PrefillSummaryMethod::kQuest:
        sm->pages = (capacity + o.quest_page_size - 1) / o.quest_page_size;
        sm->layer_f32 = sm->pages * nkv * 2 * d;
        break;
      case PrefillSummaryMethod::kKeyDiff: {
        sm->layer_f32 = nkv * capacity;
        rc::KeyDiffBuildParams p;
        p.batch = 1;
        p.n_kv_heads = c.n_kv_heads;
        p.head_dim = c.head_dim;
        p.max_tokens = static_cast<int>(capacity);
        p.score_stride = capacity;
        ws = rc::KeyDiffBuildWorkspaceBytes(p);
        break;
      }
      case PrefillSummaryMethod::kClusterKv: {
        retrieval::IndexShape shape;
        shape.n_heads = c.n_heads;
        shape.n_kv_heads = c.n_kv_heads;
        shape.head_dim = c.head_dim;
        shape.n_layers = c.n_layers;
        retrieval::IndexParams params;
        params.n_sink = o.n_sink;
        params.budget = o.budget;
        params.seed = o.seed;
        params.clusterkv.n_clusters = o.clusterkv_n_clusters;
        params.clusterkv.max_iterations = o.clusterkv_max_iterations;
        const int64_t cap = capacity;
        KVR_ASSIGN_OR_RETURN(const rc::ClusterKvBuildPlan plan,
                             rc::MakeClusterKvBuildPlan(shape, params, std::span(&cap, 1)));
        sm->max_clusters = plan.max_clusters;
        sm->max_points = plan.max_points;
        sm->layer_f32 = nkv * sm->max_clusters * d;
        sm->layer_i32 = nkv + nkv * (sm->max_clusters + 1) + nkv * sm->max_points;
        sm->plan_stride = 1 + 2 * nkv + nkv * sm->max_clusters;
        rc::ClusterKvBuildParams p;
        p.batch = 1;
        p.n_kv_heads = c.n_kv_heads;
        p.head_dim = c.head_dim;
        p.max_points = sm->max_points;
        p.max_clusters = sm->max_clusters;
        p.max_iterations = o.clusterkv_max_iterations;
        ws = rc::ClusterKvBuildWorkspaceBytes(p);
        break;
      }
      case PrefillSummaryMethod::kNone:
        break;
    }
    KVR_RETURN_IF_ERROR(Alloc(sm->f32, std::max<int64_t>(1, L * sm->layer_f32)));
    KVR_RETURN_IF_ERROR(Alloc(sm->i32, std::max<int64_t>(1, L * sm->layer_i32)));
    KVR_RETURN_IF_ERROR(Alloc(sm->meta, 1 + L * sm->plan_stride));
    KVR_RETURN_IF_ERROR(AllocPinned(sm->h_meta, 1 + L * sm->plan_stride));
    // Poisoned (NaN floats, -1 ints) until a build writes them.
    KVR_CUDA_RETURN_IF_ERROR(cudaMemset(sm->f32.data(), 0xFF, sm->f32.bytes()));
    KVR_CUDA_RETURN_IF_ERROR(cudaMemset(sm->i32.data(), 0xFF, sm->i32.bytes()));
    if (ws > summary_ws_.bytes()) {
      summary_ws_ = DeviceBuffer<uint8_t>();
      KVR_RETURN_IF_ERROR(Alloc(summary_ws_, static_cast<int64_t>(ws)));
    }
    s.summaries = std::move(sm);
  }
  sequences_.emplace(id, std::move(s));
  return absl::OkStatus();
}

absl::Status CudaModelImpl::SetPrefillSummaries(const PrefillSummaryOptions& o) {
  if (o.n_sink < 0 || o.budget < 1 || o.quest_page_size < 1 || o.clusterkv_n_clusters < 0 ||
      o.clusterkv_max_iterations < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("SetPrefillSummaries: n_sink ", o.n_sink, ", budget ", o.budget,
                     ", quest_page_size ", o.quest_page_size, ", clusterkv n_clusters ",
                     o.clusterkv_n_clusters, " / max_iterations ", o.clusterkv_max_iterations));
  }
  if (side_stream_.get() == nullptr) {
    KVR_ASSIGN_OR_RETURN(side_stream_, CudaStream::Create());
    KVR_ASSIGN_OR_RETURN(builds_done_, CudaEvent::Create(cudaEventDisableTiming));
    for (int l = 0; l < config_.n_layers; ++l) {
      KVR_ASSIGN_OR_RETURN(CudaEvent ready, CudaEvent::Create(cudaEventDisableTiming));
      KVR_ASSIGN_OR_RETURN(CudaEvent begin, CudaEvent::Create());
      KVR_ASSIGN_OR_RETURN(CudaEvent end, CudaEvent::Create());
      layer_ready_.push_back(std::move(ready));
      build_begin_.push_back(std::move(begin));
      build_end_.push_back(std::move(end));
    }
  }
  summary_opt_ = o;
  return absl::OkStatus();
}

absl::Status CudaModelImpl::PrepareSummaryBuild(Sequence& s, int64_t len) {
  Summaries& sm = *s.summaries;
  const ModelConfig& c = config_;
  int32_t* h = sm.h_meta.data();
  h[0] = static_cast<int32_t>(len);
  if (sm.opt.method == PrefillSummaryMethod::kClusterKv) {
    const int nkv = c.n_kv_heads, K = sm.max_clusters;
    retrieval::IndexShape shape;
    shape.n_heads = c.n_heads;
    shape.n_kv_heads = c.n_kv_heads;
    shape.head_dim = c.head_dim;
    shape.n_layers = c.n_layers;
    retrieval::IndexParams params;
    params.n_sink = sm.opt.n_sink;
    params.budget = sm.opt.budget;
    params.seed = sm.opt.seed;
    params.clusterkv.n_clusters = sm.opt.clusterkv_n_clusters;
    params.clusterkv.max_iterations = sm.opt.clusterkv_max_iterations;
    for (int l = 0; l < c.n_layers; ++l) {
      shape.layer = l;
      KVR_ASSIGN_OR_RETURN(const rc::ClusterKvBuildPlan plan,
                           rc::MakeClusterKvBuildPlan(shape, params, std::span(&len, 1)));
      if (plan.max_clusters > K || plan.max_points > sm.max_points) {
        return absl::InternalError("PrepareSummaryBuild: plan larger than at the capacity");
      }
      int32_t* m = h + 1 + l * sm.plan_stride;
      m[0] = plan.first_token[0];
      std::copy(plan.n_points.begin(), plan.n_points.end(), m + 1);
      std::copy(plan.n_init.begin(), plan.n_init.end(), m + 1 + nkv);
      int32_t* init = m + 1 + 2 * nkv;
      std::fill(init, init + int64_t{nkv} * K, -1);
      for (int r = 0; r < nkv; ++r) {
        std::copy_n(plan.init_points.begin() + int64_t{r} * plan.max_clusters, plan.max_clusters,
                    init + int64_t{r} * K);
      }
    }
  }
  KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(sm.meta.data(), h,
                                           (1 + c.n_layers * sm.plan_stride) * sizeof(int32_t),
                                           cudaMemcpyHostToDevice, stream()));
  return absl::OkStatus();
}

absl::Status CudaModelImpl::QueueSummaryBuild(Sequence& s, int layer, int64_t len,
                                              cudaStream_t st) {
  Summaries& sm = *s.summaries;
  const ModelConfig& c = config_;
  const int64_t kv_dim = c.kv_dim();
  rc::KeyView keys;
  keys.data = s.kv.data() + int64_t{layer} * 2 * s.capacity * kv_dim;
  keys.dtype = rc::KeyDType::kBf16;
  keys.token_stride = kv_dim;
  keys.head_stride = c.head_dim;
  keys.batch_stride = 0;
  float* f32 = sm.f32.data() + layer * sm.layer_f32;
  switch (sm.opt.method) {
    case PrefillSummaryMethod::kQuest: {
      rc::QuestBoundsParams p;
      p.batch = 1;
      p.n_kv_heads = c.n_kv_heads;
      p.head_dim = c.head_dim;
      p.page_size = sm.opt.quest_page_size;
      p.keys = keys;
      p.seq_len = sm.meta.data();
      p.max_tokens = static_cast<int>(len);
      p.bounds = f32;
      p.bounds_batch_stride = sm.layer_f32;
      return rc::QuestPageBounds(p, st);
    }
    case PrefillSummaryMethod::kKeyDiff: {
      rc::KeyDiffBuildParams p;
      p.batch = 1;
      p.n_kv_heads = c.n_kv_heads;
      p.head_dim = c.head_dim;
      p.keys = keys;
      p.seq_len = sm.meta.data();
      p.max_tokens = static_cast<int>(len);
      p.scores = f32;
      p.score_stride = s.capacity;
      p.workspace = summary_ws_.data();
      p.workspace_bytes = summary_ws_.bytes();
      return rc::KeyDiffBuild(p, st);
    }
    case PrefillSummaryMethod::kClusterKv: {
      const int nkv = c.n_kv_heads, K = sm.max_clusters;
      const int32_t* m = sm.meta.data() + 1 + layer * sm.plan_stride;
      int32_t* i32 = sm.i32.data() + layer * sm.layer_i32;
      rc::ClusterKvBuildParams p;
      p.batch = 1;
      p.n_kv_heads = nkv;
      p.head_dim = c.head_dim;
      p.keys = keys;
      p.max_points = sm.max_points;
      p.max_clusters = K;
      p.max_iterations = sm.opt.clusterkv_max_iterations;
      p.first_token = m;
      p.n_points = m + 1;
      p.n_init = m + 1 + nkv;
      p.init_points = m + 1 + 2 * nkv;
      p.centroids = f32;
      p.n_clusters = i32;
      p.offsets = i32 + nkv;
      p.members = i32 + nkv + int64_t{nkv} * (K + 1);
      p.workspace = summary_ws_.data();
      p.workspace_bytes = summary_ws_.bytes();
      return rc::ClusterKvBuild(p, st);
    }
    case PrefillSummaryMethod::kNone:
      break;
  }
  return absl::OkStatus();
}

absl::StatusOr<PrefillSummaryData> CudaModelImpl::PrefillSummariesForTesting(SequenceId id) const {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("CudaModel: no sequence ", id));
  }
  const Summaries* sm = it->second.summaries.get();
  if (sm == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("CudaModel: sequence ", id, " has no prefill summaries"));
  }
  PrefillSummaryData d;
  d.method = sm->opt.method;
  d.length = sm->built_length;
  d.f32.resize(sm->f32.size());
  d.i32.resize(sm->i32.size());
  KVR_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(d.f32.data(), sm->f32.data(), sm->f32.bytes(), cudaMemcpyDeviceToHost));
  KVR_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(d.i32.data(), sm->i32.data(), sm->i32.bytes(), cudaMemcpyDeviceToHost));
  return d;
}

absl::Status CudaModelImpl::RebuildPrefillSummariesForTesting(SequenceId id) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("CudaModel: no sequence ", id));
  }
  Sequence& s = it->second;
  if (s.summaries == nullptr || s.length < 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("CudaModel: sequence ", id, " has no prefill summaries or no tokens"));
  }
  KVR_RETURN_IF_ERROR(PrepareSummaryBuild(s, s.length));
  for (int l = 0; l < config_.n_layers; ++l) {
    KVR_RETURN_IF_ERROR(QueueSummaryBuild(s, l, s.length, stream()));
  }
  KVR_RETURN_IF_ERROR(stream_.Synchronize());
  s.summaries->built_length = s.length;
  return absl::OkStatus();
}

absl::Status CudaModelImpl::ReleaseSequence(SequenceId id) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("CudaModel: no sequence ", id));
  }
  if (it->second.slot >= 0 && sparse_ != nullptr) {
    sparse_->owner[it->second.slot].reset();
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
  if (s.slot >= 0 || s.exporting != nullptr || s.length != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "BeginKvExport: sequence ", id,
        s.slot >= 0 ? " is sparse" : (s.exporting != nullptr ? " already exports" : ""),
        s.length != 0 ? absl::StrCat(" holds ", s.length, " tokens (export from the first)") : ""));
  }
  if (o.length < 1 || o.length > s.capacity || o.max_queries < 0) {
    return absl::InvalidArgumentError(absl::StrCat("BeginKvExport: length ", o.length,
                                                   " outside [1, capacity ", s.capacity,
                                                   "] or max_queries ", o.max_queries, " < 0"));
  }
  if (o.summaries && s.summaries == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "BeginKvExport: summaries asked for sequence ", id,
        ", which was added without a prefill summary method (SetPrefillSummaries first)"));
  }
  // The summary part of each layer's export (floats, then the int32s in the same buffer).
  int64_t sum_f32 = 0, sum_i32 = 0;
  if (o.summaries) {
    const Summaries& sm = *s.summaries;
    sum_f32 = sm.opt.method == PrefillSummaryMethod::kQuest
                  ? (o.length + sm.opt.quest_page_size - 1) / sm.opt.quest_page_size *
                        int64_t{config_.n_kv_heads} * 2 * config_.head_dim
                  : sm.layer_f32;
    sum_i32 = sm.layer_i32;
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
  const int64_t layer_stride = 2 * o.length * kv + e->nq * qd + sum_f32 + sum_i32;
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
    n.view.kv.k = base;
    n.view.kv.v = base + o.length * kv;
    n.view.kv.n_rows = o.length;
    n.view.kv.row_stride = kv;
    n.view.kv.total_tokens = o.length;
    n.view.queries = base + 2 * o.length * kv;
    n.view.n_queries = e->nq;
    n.view.queries_first_position = o.length - e->nq;
    if (o.summaries) {
      const Summaries& sm = *s.summaries;
      PrefillSummaryLayer& v = n.view.summary;
      v.method = sm.opt.method;
      v.length = o.length;
      v.f32 = base + 2 * o.length * kv + e->nq * qd;
      v.n_f32 = sum_f32;
      v.i32 = reinterpret_cast<const int32_t*>(v.f32 + sum_f32);
      v.n_i32 = sum_i32;
      v.max_clusters = sm.max_clusters;
      v.max_points = sm.max_points;
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

absl::Status CudaModelImpl::ConfigureSparse(const SparseAttentionOptions& o) {
  for (const auto& [id, seq] : sequences_) {
    if (seq.slot >= 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("ConfigureSparse: sparse sequence ", id, " still exists"));
    }
  }
  if (o.slots == 0) {  // frees the sparse state
    sparse_.reset();
    return absl::OkStatus();
  }
  const ModelConfig& c = config_;
  const bool quest = o.method == SparseMethod::kQuest;
  auto bad = [](auto... what) { return absl::InvalidArgumentError(absl::StrCat(what...)); };
  if (o.slots < 1 || o.slots > options_.max_sequences || o.slots > options_.max_batch_tokens) {
    return bad("ConfigureSparse: slots ", o.slots, " outside [1, min(max_sequences ",
               options_.max_sequences, ", max_batch_tokens ", options_.max_batch_tokens, ")]");
  }
  if (o.max_capacity < 1 || o.max_capacity > c.context_length) {
    return bad("ConfigureSparse: max_capacity ", o.max_capacity, " outside [1, context length ",
               c.context_length, "]");
  }
  if (o.budget < 1 || o.budget > (quest ? rc::kMaxBudget : 2048) ||
      (quest && (o.quest_page_size < 1 ||
                 (o.budget + o.quest_page_size - 1) / o.quest_page_size + 2 > 1024))) {
    return bad("ConfigureSparse: budget ", o.budget, " (page size ", o.quest_page_size,
               ") outside the selector's limits (quest <= 4096 and budget/page + 2 <= 1024, "
               "clusterkv <= 2048)");
  }
  if (o.n_sink < 0 || o.local_window < 1 || o.hot_cache_rows < 0 ||
      o.clusterkv_tokens_per_cluster < 1 || o.clusterkv_max_pending < 0) {
    return bad(
        "ConfigureSparse: n_sink >= 0, local_window >= 1, hot_cache_rows >= 0, "
        "clusterkv_tokens_per_cluster >= 1 and clusterkv_max_pending >= 0 needed");
  }
  if (c.n_heads / c.n_kv_heads > 8) {
    return absl::UnimplementedError(
        "ConfigureSparse: sparse decode attention takes GQA groups <= 8");
  }
  const int ways = std::min(8, std::max(1, o.hot_cache_rows));
  if (o.hot_cache_rows > 0 && o.hot_cache_rows % ways != 0) {
    return bad("ConfigureSparse: hot_cache_rows ", o.hot_cache_rows, " not a multiple of 8");
  }
  if (o.min_page_rows < 1) return bad("ConfigureSparse: min_page_rows ", o.min_page_rows, " < 1");
  sparse_.reset();
  auto st = std::make_unique<SparseState>();
  st->opt = o;
  st->n_kv = c.n_kv_heads;
  st->head_dim = c.head_dim;
  st->rcap = o.n_sink + o.local_window;
  const int64_t L = c.n_layers, S = o.slots, kv = c.n_kv_heads, d = c.head_dim;
  KVR_RETURN_IF_ERROR(Alloc(st->resident, L * S * kv * st->rcap * 2 * d));
  if (quest) {
    st->pages = (o.max_capacity + o.quest_page_size - 1) / o.quest_page_size;
    KVR_RETURN_IF_ERROR(Alloc(st->bounds, L * S * st->pages * st->bounds_row()));
  } else {
    st->max_clusters = static_cast<int>(std::min<int64_t>(
        o.max_capacity,
        (o.max_capacity + o.clusterkv_tokens_per_cluster - 1) / o.clusterkv_tokens_per_cluster +
            o.clusterkv_max_pending));
    KVR_RETURN_IF_ERROR(Alloc(st->centroids, L * S * kv * st->max_clusters * d));
    KVR_RETURN_IF_ERROR(Alloc(st->n_clusters, L * S * kv));
    KVR_RETURN_IF_ERROR(Alloc(st->offsets, L * S * kv * (st->max_clusters + 1)));
    KVR_RETURN_IF_ERROR(Alloc(st->members, L * S * kv * o.max_capacity));
  }
  int64_t hot_bytes = 0;
  if (o.hot_cache_rows > 0) {
    rc::HotCacheShape hs;
    hs.batch = o.slots;
    hs.n_kv_heads = c.n_kv_heads;
    hs.head_dim = c.head_dim;
    hs.dtype = rc::RowDType::kBf16;
    hs.n_sets = o.hot_cache_rows / ways;
    hs.ways = ways;
    hs.budget = o.budget;
    for (int l = 0; l < c.n_layers; ++l) {
      absl::StatusOr<rc::HotCache> created = rc::HotCache::Create(hs, stream());
      if (!created.ok()) {
        cudaGetLastError();  // as in Alloc
        return created.status();
      }
      rc::HotCache h = *std::move(created);
      // Data plus tags, stamps, claims (4 + 4 + 8 bytes a slot) and slot_of.
      hot_bytes += static_cast<int64_t>(h.data_bytes()) + S * kv * o.hot_cache_rows * 16 +
                   S * kv * o.budget * 4;
      st->hot.push_back(std::move(h));
    }
  }
  KVR_RETURN_IF_ERROR(Alloc(st->q_f32, S * c.q_dim()));
  KVR_RETURN_IF_ERROR(Alloc(st->ids, S * kv * o.budget));
  KVR_RETURN_IF_ERROR(Alloc(st->counts, S * kv));
  KVR_RETURN_IF_ERROR(Alloc(st->gathered, S * kv * o.budget * 2 * d));
  KVR_RETURN_IF_ERROR(Alloc(st->meta, 3 * S));
  KVR_RETURN_IF_ERROR(AllocPinned(st->h_meta, 3 * S));
  KVR_RETURN_IF_ERROR(Alloc(st->rows, S));
  KVR_RETURN_IF_ERROR(AllocPinned(st->h_rows, S));
  st->max_pages = static_cast<int>((o.max_capacity + o.min_page_rows - 1) / o.min_page_rows);
  KVR_RETURN_IF_ERROR(Alloc(st->pool_slots, S));
  KVR_RETURN_IF_ERROR(AllocPinned(st->h_pool_slots, S));
  KVR_RETURN_IF_ERROR(Alloc(st->pool_pages, L * S * kv * st->max_pages));
  KVR_RETURN_IF_ERROR(AllocPinned(st->h_slot_pages, L * kv * st->max_pages));
  KVR_RETURN_IF_ERROR(Alloc(st->new_rows, S * L * 2 * kv * d));
  KVR_RETURN_IF_ERROR(AllocPinned(st->h_new_rows, S * L * 2 * kv * d));
  KVR_RETURN_IF_ERROR(Alloc(st->selected, 1));
  KVR_RETURN_IF_ERROR(Alloc(st->slot_counters, 2 * S));
  KVR_RETURN_IF_ERROR(AllocPinned(st->h_slot_counters, 2 * S));
  KVR_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(st->slot_counters.data(), 0, st->slot_counters.bytes(), stream()));
  std::fill(st->h_slot_counters.data(), st->h_slot_counters.data() + 2 * S, 0ull);
  KVR_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(st->selected.data(), 0, sizeof(unsigned long long), stream()));
  const rc::SelectionOutput out{o.budget, st->ids.data(), st->counts.data()};
  const float scale = 1.f / std::sqrt(static_cast<float>(c.head_dim));
  if (quest) {
    rc::QuestSelectParams qp;
    qp.batch = o.slots;
    qp.n_heads = c.n_heads;
    qp.n_kv_heads = c.n_kv_heads;
    qp.head_dim = c.head_dim;
    qp.page_size = o.quest_page_size;
    qp.scale = scale;
    qp.max_candidates = static_cast<int>(o.max_capacity);
    qp.out = out;
    st->select_ws_bytes = rc::QuestSelectWorkspaceBytes(qp);
  } else {
    rc::ClusterKvSelectParams cp;
    cp.batch = o.slots;
    cp.n_heads = c.n_heads;
    cp.n_kv_heads = c.n_kv_heads;
    cp.head_dim = c.head_dim;
    cp.scale = scale;
    cp.max_clusters = st->max_clusters;
    cp.max_members = static_cast<int>(o.max_capacity);
    cp.out = out;
    st->select_ws_bytes = rc::ClusterKvSelectWorkspaceBytes(cp);
  }
  rc::DecodeAttentionParams ap;
  ap.batch = o.slots;
  ap.n_heads = c.n_heads;
  ap.n_kv_heads = c.n_kv_heads;
  ap.head_dim = c.head_dim;
  ap.budget = o.budget;
  ap.resident_capacity = st->rcap;
  ap.max_rows = st->rcap + o.budget;
  st->attend_ws_bytes = rc::DecodeAttentionWorkspaceBytes(ap);
  KVR_RETURN_IF_ERROR(Alloc(st->select_ws, static_cast<int64_t>(st->select_ws_bytes) + 256));
  KVR_RETURN_IF_ERROR(Alloc(st->attend_ws, static_cast<int64_t>(st->attend_ws_bytes) + 256));
  st->owner.resize(o.slots);
  st->bytes =
      static_cast<int64_t>(st->resident.bytes() + st->bounds.bytes() + st->centroids.bytes() +
                           st->n_clusters.bytes() + st->offsets.bytes() + st->members.bytes() +
                           st->q_f32.bytes() + st->ids.bytes() + st->counts.bytes() +
                           st->gathered.bytes() + st->select_ws.bytes() + st->attend_ws.bytes() +
                           st->meta.bytes() + st->rows.bytes() + st->pool_slots.bytes() +
                           st->pool_pages.bytes() + st->new_rows.bytes()) +
      hot_bytes;
  KVR_RETURN_IF_ERROR(stream_.Synchronize());
  sparse_ = std::move(st);
  return absl::OkStatus();
}

absl::Status CudaModelImpl::AddSparseSequence(SequenceId id, int64_t capacity,
                                              const SparseSequenceOptions& options) {
  if (sparse_ == nullptr) {
    return absl::FailedPreconditionError("AddSparseSequence: ConfigureSparse first");
  }
  if (sequences_.contains(id)) {
    return absl::AlreadyExistsError(absl::StrCat("CudaModel: sequence ", id, " already exists"));
  }
  if (capacity < 1 || capacity > sparse_->opt.max_capacity) {
    return absl::InvalidArgumentError(absl::StrCat("AddSparseSequence: capacity ", capacity,
                                                   " outside [1, max_capacity ",
                                                   sparse_->opt.max_capacity, "]"));
  }
  int slot = -1;
  for (int i = 0; i < sparse_->opt.slots && slot < 0; ++i) {
    if (!sparse_->owner[i].has_value()) slot = i;
  }
  if (slot < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("AddSparseSequence: all ", sparse_->opt.slots, " sparse slots are taken"));
  }
  const ModelConfig& c = config_;
  std::shared_ptr<HostKv> host;
  if (options.rows.has_value()) {
    const SparseRowSource& r = *options.rows;
    const int64_t row_bytes = 4 * int64_t{c.head_dim};
    auto bad = [&](auto&&... parts) {
      return absl::InvalidArgumentError(absl::StrCat("AddSparseSequence: row source: ", parts...));
    };
    if (r.base == nullptr) return bad("no base address");
    if (r.page_rows < sparse_->opt.min_page_rows) {
      return bad("pages of ", r.page_rows, " rows, fewer than min_page_rows ",
                 sparse_->opt.min_page_rows);
    }
    if (r.page_bytes < int64_t{r.page_rows} * row_bytes || r.page_bytes % 16 != 0) {
      return bad("page_bytes ", r.page_bytes, " hold no ", r.page_rows, " rows of ", row_bytes,
                 " bytes at 16-byte alignment");
    }
    if (int64_t{r.pages_per_head} * r.page_rows < capacity ||
        r.pages_per_head > sparse_->max_pages) {
      return bad(r.pages_per_head, " pages of ", r.page_rows, " rows per head for capacity ",
                 capacity, " (at most ", sparse_->max_pages, " pages)");
    }
    if (static_cast<int64_t>(r.pages.size()) !=
        int64_t{c.n_layers} * c.n_kv_heads * r.pages_per_head) {
      return bad(r.pages.size(), " page ids, expected ", c.n_layers, " layers x ", c.n_kv_heads,
                 " heads x ", r.pages_per_head);
    }
    for (int32_t page : r.pages) {
      if (page < 0) return bad("negative page id ", page);
    }
  } else if (options.share_host_kv_with.has_value()) {
    auto it = sequences_.find(*options.share_host_kv_with);
    if (it == sequences_.end() || it->second.slot < 0 || it->second.capacity != capacity) {
      return absl::InvalidArgumentError(
          absl::StrCat("AddSparseSequence: share_host_kv_with ", *options.share_host_kv_with,
                       " is no sparse sequence of capacity ", capacity));
    }
    host = it->second.host;
  } else if (options.host_kv != nullptr) {
    host = std::dynamic_pointer_cast<HostKv>(options.host_kv);
    if (host == nullptr || host->capacity_tokens != capacity) {
      return absl::InvalidArgumentError(
          absl::StrCat("AddSparseSequence: host_kv is not this model's (AcquireSparseHostKv) or "
                       "not of capacity ",
                       capacity));
    }
    for (const auto& [other_id, other] : sequences_) {
      if (other.host == host) {
        return absl::FailedPreconditionError(
            absl::StrCat("AddSparseSequence: host_kv is in use by sequence ", other_id));
      }
    }
  } else {
    std::lock_guard<std::mutex> lock(host_kv_mu_);
    KVR_ASSIGN_OR_RETURN(host, PooledHostKv(capacity, options.host_numa_node,
                                            options.host_huge_pages, "AddSparseSequence"));
  }
  for (rc::HotCache& h : sparse_->hot) KVR_RETURN_IF_ERROR(h.ResetSlot(slot, stream()));
  for (int64_t i : {int64_t{slot}, int64_t{sparse_->opt.slots} + slot}) {
    KVR_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(sparse_->slot_counters.data() + i, 0,
                                             sizeof(unsigned long long), stream()));
    sparse_->h_slot_counters.data()[i] = 0;
  }
  KVR_RETURN_IF_ERROR(
      cuda::LaunchSparseClearSlot(sparse_->View(), slot, c.n_layers, c.n_kv_heads, stream()));
  KVR_RETURN_IF_ERROR(stream_.Synchronize());
  Sequence s;
  s.capacity = capacity;
  s.slot = slot;
  s.host = std::move(host);
  if (options.rows.has_value()) {
    const SparseRowSource& r = *options.rows;
    s.source_key = absl::HashOf(reinterpret_cast<uintptr_t>(r.base), r.page_bytes, r.page_rows,
                                r.pages_per_head, r.pages) |
                   1;
  }
  KVR_RETURN_IF_ERROR(WriteSlotTables(s, options.rows));
  sequences_.emplace(id, std::move(s));
  sparse_->owner[slot] = id;
  return absl::OkStatus();
}

absl::StatusOr<SparseSequenceCounters> CudaModelImpl::SparseCounters(SequenceId id) const {
  auto it = sequences_.find(id);
  if (it == sequences_.end() || it->second.slot < 0) {
    return absl::NotFoundError(absl::StrCat("SparseCounters: no sparse sequence ", id));
  }
  const int slot = it->second.slot;
  const unsigned long long* h = sparse_->h_slot_counters.data();
  SparseSequenceCounters out;
  out.steps = it->second.sparse_steps;
  out.selected_rows = static_cast<int64_t>(h[slot]);
  out.hot_cache_hits = static_cast<int64_t>(h[sparse_->opt.slots + slot]);
  return out;
}

absl::Status CudaModelImpl::WriteSlotTables(const Sequence& s,
                                            const std::optional<SparseRowSource>& source) {
  SparseState& sp = *sparse_;
  const ModelConfig& c = config_;
  const int64_t L = c.n_layers, S = sp.opt.slots, kv = c.n_kv_heads, P = sp.max_pages;
  int32_t* pages = sp.h_slot_pages.data();
  std::fill(pages, pages + L * kv * P, 0);
  rc::KvPoolSlot& slot = sp.h_pool_slots.data()[s.slot];
  if (source.has_value()) {
    slot = {source->base, source->page_bytes, source->page_rows, 0};
    for (int64_t lh = 0; lh < L * kv; ++lh) {
      std::copy_n(source->pages.data() + lh * source->pages_per_head, source->pages_per_head,
                  pages + lh * P);
    }
  } else {
    // The own host KV [n_layers, n_kv, capacity, row]: page_bytes = one row, so a page index is
    // the row index of the page's first row.
    const int32_t pr = sp.opt.min_page_rows;
    slot = {s.host->device, 4 * int64_t{c.head_dim}, pr, 0};
    for (int64_t lh = 0; lh < L * kv; ++lh) {
      for (int64_t p = 0; p * pr < s.capacity; ++p) {
        pages[lh * P + p] = static_cast<int32_t>(lh * s.capacity + p * pr);
      }
    }
  }
  KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(sp.pool_slots.data() + s.slot, &slot, sizeof(slot),
                                           cudaMemcpyHostToDevice, stream()));
  for (int64_t l = 0; l < L; ++l) {
    KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(sp.pool_pages.data() + (l * S + s.slot) * kv * P,
                                             pages + l * kv * P, kv * P * sizeof(int32_t),
                                             cudaMemcpyHostToDevice, stream()));
  }
  return stream_.Synchronize();
}

absl::StatusOr<std::span<const uint16_t>> CudaModelImpl::SparseNewRows(SequenceId id) const {
  auto it = sequences_.find(id);
  if (it == sequences_.end() || it->second.slot < 0) {
    return absl::NotFoundError(absl::StrCat("SparseNewRows: no sparse sequence ", id));
  }
  const Sequence& s = it->second;
  if (s.host != nullptr || !s.new_rows_ready) {
    return absl::FailedPreconditionError(absl::StrCat(
        "SparseNewRows: sequence ", id,
        s.host != nullptr ? " has its own host KV (no row source)" : " has run no Forward"));
  }
  const ModelConfig& c = config_;
  const int64_t n = int64_t{c.n_layers} * 2 * c.n_kv_heads * c.head_dim;
  return std::span<const uint16_t>(
      reinterpret_cast<const uint16_t*>(sparse_->h_new_rows.data()) + s.slot * n, n);
}

absl::StatusOr<const void*> CudaModelImpl::RegisterHostRegion(const void* host, size_t bytes,
                                                              bool read_only) {
  if (host == nullptr || bytes == 0) {
    return absl::InvalidArgumentError("RegisterHostRegion: empty region");
  }
  std::lock_guard<std::mutex> lock(regions_mu_);
  if (auto it = regions_.find(host); it != regions_.end()) {
    if (it->second.first < bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("RegisterHostRegion: the region is registered "
                       "with ",
                       it->second.first, " bytes, not ", bytes));
    }
    return it->second.second;
  }
  // This thread may never have used the device.
  KVR_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  unsigned flags = cudaHostRegisterMapped | cudaHostRegisterPortable;
  if (read_only) {
    int ro = 0;
    if (cudaDeviceGetAttribute(&ro, cudaDevAttrHostRegisterReadOnlySupported, options_.device) ==
            cudaSuccess &&
        ro != 0) {
      flags |= cudaHostRegisterReadOnly;
    }
  }
  if (const cudaError_t e = cudaHostRegister(const_cast<void*>(host), bytes, flags);
      e != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat("RegisterHostRegion: cudaHostRegister of ",
                                                      bytes, " bytes: ", cudaGetErrorString(e)));
  }
  void* device = nullptr;
  if (const cudaError_t e = cudaHostGetDevicePointer(&device, const_cast<void*>(host), 0);
      e != cudaSuccess) {
    cudaHostUnregister(const_cast<void*>(host));
    return absl::InternalError(
        absl::StrCat("RegisterHostRegion: cudaHostGetDevicePointer: ", cudaGetErrorString(e)));
  }
  regions_.emplace(host, std::make_pair(bytes, static_cast<const void*>(device)));
  return static_cast<const void*>(device);
}

absl::Status CudaModelImpl::UnregisterHostRegion(const void* host) {
  std::lock_guard<std::mutex> lock(regions_mu_);
  auto it = regions_.find(host);
  if (it == regions_.end()) {
    return absl::NotFoundError("UnregisterHostRegion: the region is not registered");
  }
  regions_.erase(it);
  KVR_CUDA_RETURN_IF_ERROR(cudaHostUnregister(const_cast<void*>(host)));
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<CudaModelImpl::HostKv>> CudaModelImpl::PooledHostKv(
    int64_t capacity, int numa_node, bool huge_pages, const char* what) {
  for (const auto& h : host_kvs_) {
    if (h.use_count() == 1 && h->capacity_tokens == capacity && h->buf.numa_node() == numa_node &&
        h->buf.huge_pages() == huge_pages) {
      return h;
    }
  }
  const ModelConfig& c = config_;
  auto host = std::make_shared<HostKv>();
  host->capacity_tokens = capacity;
  const int64_t n = int64_t{c.n_layers} * c.kv_dim() * 2 * capacity;
  absl::StatusOr<cuda::HostKvBuffer<bf16>> buf =
      cuda::HostKvBuffer<bf16>::Create(static_cast<size_t>(n), numa_node, huge_pages);
  if (!buf.ok()) {
    cudaGetLastError();  // as in Alloc
    return absl::ResourceExhaustedError(
        absl::StrCat(what, ": pinning ", n * 2, " bytes of host KV: ", buf.status().message()));
  }
  host->buf = *std::move(buf);
  KVR_ASSIGN_OR_RETURN(host->device, host->buf.device_pointer());
  host_kvs_.push_back(host);
  return host;
}

absl::StatusOr<std::shared_ptr<SparseHostKvBuffer>> CudaModelImpl::AcquireSparseHostKv(
    int64_t capacity) {
  if (capacity < 1 || capacity > config_.context_length) {
    return absl::InvalidArgumentError(absl::StrCat("AcquireSparseHostKv: capacity ", capacity,
                                                   " outside [1, ", config_.context_length, "]"));
  }
  // This thread may never have used the device: the mapped pointer needs it current.
  KVR_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  std::lock_guard<std::mutex> lock(host_kv_mu_);
  KVR_ASSIGN_OR_RETURN(std::shared_ptr<HostKv> host,
                       PooledHostKv(capacity, -1, false, "AcquireSparseHostKv"));
  host->filled_seed = 0;  // the caller writes it
  return std::shared_ptr<SparseHostKvBuffer>(std::move(host));
}

absl::StatusOr<int64_t> CudaModelImpl::SequenceDeviceBytes(SequenceId id) const {
  auto it = sequences_.find(id);
  if (it == sequences_.end())
    return absl::NotFoundError(absl::StrCat("CudaModel: no sequence ", id));
  if (it->second.slot < 0) return static_cast<int64_t>(it->second.kv.bytes());
  return sparse_->bytes / sparse_->opt.slots;
}

SparseStats CudaModelImpl::sparse_stats() const {
  SparseStats st;
  if (sparse_ == nullptr) return st;
  st.steps = sparse_->steps;
  st.row_bytes = 2 * int64_t{config_.head_dim} * 2;
  unsigned long long v = 0;
  if (cudaMemcpy(&v, sparse_->selected.data(), sizeof(v), cudaMemcpyDeviceToHost) == cudaSuccess) {
    st.selected_rows = static_cast<int64_t>(v);
  }
  for (const rc::HotCache& h : sparse_->hot) {
    if (cudaMemcpy(&v, h.hits(), sizeof(v), cudaMemcpyDeviceToHost) == cudaSuccess) {
      st.hot_cache_hits += static_cast<int64_t>(v);
    }
  }
  return st;
}

absl::Status CudaModelImpl::SparseLayer(int layer, const Layer& w, int64_t max_candidates) {
  SparseState& sp = *sparse_;
  const ModelConfig& c = config_;
  const SparseAttentionOptions& o = sp.opt;
  const int S = o.slots;
  const int64_t kv = c.n_kv_heads, d = c.head_dim;
  const int64_t resident_layer = int64_t{S} * kv * sp.rcap * 2 * d;
  KVR_RETURN_IF_ERROR(Mark(Kind::kOther));
  cuda::SparseRopeParams rp;
  rp.qkv = qkv_.data();
  rp.bias = w.bqkv.size() > 0 ? w.bqkv.data() : nullptr;
  rp.inv_freq = inv_freq_.data();
  rp.rows = sp.rows.data();
  rp.q = q_.data();
  rp.q_f32 = sp.q_f32.data();
  rp.resident = sp.resident.data();
  rp.resident_layer_stride = resident_layer;
  rp.rcap = sp.rcap;
  rp.n_sink = o.n_sink;
  rp.window = o.local_window;
  rp.sum = sp.View();
  rp.new_rows = sp.new_rows.data();
  rp.n_layers = c.n_layers;
  rp.slots = S;
  rp.n_heads = c.n_heads;
  rp.n_kv_heads = c.n_kv_heads;
  rp.head_dim = c.head_dim;
  rp.layer = layer;
  KVR_RETURN_IF_ERROR(cuda::LaunchSparseRope(rp, stream()));

  KVR_RETURN_IF_ERROR(Mark(Kind::kSelect));
  const rc::SelectionOutput out{o.budget, sp.ids.data(), sp.counts.data()};
  const rc::CandidateRanges cand{sp.meta.data(), sp.meta.data() + S};
  const float scale = 1.f / std::sqrt(static_cast<float>(c.head_dim));
  if (o.method == SparseMethod::kQuest) {
    const cuda::SparseSummaryView v = sp.View();
    rc::QuestSelectParams qp;
    qp.batch = S;
    qp.n_heads = c.n_heads;
    qp.n_kv_heads = c.n_kv_heads;
    qp.head_dim = c.head_dim;
    qp.page_size = o.quest_page_size;
    qp.scale = scale;
    qp.query = sp.q_f32.data();
    qp.bounds = v.bounds + layer * v.bounds_layer_stride;
    qp.bounds_batch_stride = v.bounds_slot_stride;
    qp.cand = cand;
    qp.max_candidates = static_cast<int>(std::max<int64_t>(1, max_candidates));
    qp.out = out;
    qp.workspace = sp.select_ws.data();
    qp.workspace_bytes = sp.select_ws_bytes;
    KVR_RETURN_IF_ERROR(rc::QuestSelect(qp, stream()));
  } else {
    const int64_t heads_before = int64_t{layer} * S * kv;
    rc::ClusterKvSelectParams cp;
    cp.batch = S;
    cp.n_heads = c.n_heads;
    cp.n_kv_heads = c.n_kv_heads;
    cp.head_dim = c.head_dim;
    cp.scale = scale;
    cp.query = sp.q_f32.data();
    cp.centroids = sp.centroids.data() + heads_before * sp.max_clusters * d;
    cp.n_clusters = sp.n_clusters.data() + heads_before;
    cp.offsets = sp.offsets.data() + heads_before * (sp.max_clusters + 1);
    cp.members = sp.members.data() + heads_before * o.max_capacity;
    cp.max_clusters = sp.max_clusters;
    cp.max_members = static_cast<int>(o.max_capacity);
    cp.cand = cand;
    cp.out = out;
    cp.workspace = sp.select_ws.data();
    cp.workspace_bytes = sp.select_ws_bytes;
    KVR_RETURN_IF_ERROR(rc::ClusterKvSelect(cp, stream()));
  }
  if (options_.profile) {
    KVR_RETURN_IF_ERROR(cuda::LaunchSumCounts(sp.counts.data(), static_cast<int>(S * kv),
                                              sp.selected.data(), stream()));
  }
  KVR_RETURN_IF_ERROR(cuda::LaunchSumCountsPerSlot(sp.counts.data(), S, static_cast<int>(kv),
                                                   sp.slot_counters.data(), stream()));

  KVR_RETURN_IF_ERROR(Mark(Kind::kGather));
  const rc::KvPoolView pool = sp.PoolView(layer);
  if (!sp.hot.empty()) {
    KVR_RETURN_IF_ERROR(sp.hot[layer].Gather(pool, sp.ids.data(), sp.counts.data(),
                                             sp.gathered.data(), stream(),
                                             sp.slot_counters.data() + S));
  } else {
    rc::GatherParams gp;
    gp.batch = S;
    gp.n_kv_heads = c.n_kv_heads;
    gp.budget = o.budget;
    gp.head_dim = c.head_dim;
    gp.dtype = rc::RowDType::kBf16;
    gp.pool = pool;
    gp.ids = sp.ids.data();
    gp.counts = sp.counts.data();
    gp.out = sp.gathered.data();
    KVR_RETURN_IF_ERROR(rc::GatherRows(gp, stream()));
  }

  KVR_RETURN_IF_ERROR(Mark(Kind::kAttention));
  rc::DecodeAttentionParams ap;
  ap.batch = S;
  ap.n_heads = c.n_heads;
  ap.n_kv_heads = c.n_kv_heads;
  ap.head_dim = c.head_dim;
  ap.dtype = rc::RowDType::kBf16;
  ap.scale = scale;
  ap.q = q_.data();
  ap.resident = sp.resident.data() + layer * resident_layer;
  ap.resident_capacity = sp.rcap;
  ap.resident_counts = sp.meta.data() + 2 * S;
  ap.budget = o.budget;
  ap.counts = sp.counts.data();
  ap.gathered = sp.gathered.data();
  ap.max_rows = sp.rcap + o.budget;
  ap.out = attn_.data();
  ap.workspace = sp.attend_ws.data();
  ap.workspace_bytes = sp.attend_ws_bytes;
  KVR_RETURN_IF_ERROR(rc::DecodeAttention(ap, stream()));
  if (layer == snapshot_layer_) {  // tests: copied back to pageable memory (synchronous)
    SparseLayerSnapshot& s = snapshot_;
    s.layer = layer;
    s.q.resize(sp.q_f32.size());
    s.ids.resize(sp.ids.size());
    s.counts.resize(sp.counts.size());
    snapshot_attn_bits_.resize(static_cast<size_t>(S) * c.q_dim());
    KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.q.data(), sp.q_f32.data(), sp.q_f32.bytes(),
                                             cudaMemcpyDeviceToHost, stream()));
    KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.ids.data(), sp.ids.data(), sp.ids.bytes(),
                                             cudaMemcpyDeviceToHost, stream()));
    KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.counts.data(), sp.counts.data(), sp.counts.bytes(),
                                             cudaMemcpyDeviceToHost, stream()));
    KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(snapshot_attn_bits_.data(), attn_.data(),
                                             snapshot_attn_bits_.size() * sizeof(uint16_t),
                                             cudaMemcpyDeviceToHost, stream()));
    KVR_RETURN_IF_ERROR(stream_.Synchronize());
    s.attn.resize(snapshot_attn_bits_.size());
    for (size_t i = 0; i < s.attn.size(); ++i) {
      const uint32_t u = uint32_t{snapshot_attn_bits_[i]} << 16;
      std::memcpy(&s.attn[i], &u, sizeof(float));
    }
  }
  return absl::OkStatus();
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
  if (s.slot >= 0) {
    if (s.host == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat("FillSequenceForBenchmark: sequence ", id,
                                                        " reads its past from a row source"));
    }
    HostKv& host = *s.host;
    if (host.filled_seed != seed + 1) {
      KVR_RETURN_IF_ERROR(cuda::LaunchRandomBf16(host.device, static_cast<int64_t>(host.buf.size()),
                                                 seed, 1.f, stream()));
      host.filled_seed = seed + 1;
    }
    // Another slot on the same host KV filled alike: copy its ring and summaries (HBM to HBM)
    // instead of reading the host KV again.
    const Sequence* twin = nullptr;
    for (const auto& [oid, o] : sequences_) {
      if (oid != id && o.slot >= 0 && o.host == s.host && o.filled_seed == seed + 1 &&
          o.length == n_tokens) {
        twin = &o;
        break;
      }
    }
    if (twin != nullptr) {
      KVR_RETURN_IF_ERROR(CopySlot(*twin, s));
    } else {
      KVR_RETURN_IF_ERROR(FillSlotFromHostKv(s, n_tokens, /*summaries=*/true));
    }
    s.filled_seed = seed + 1;
    s.length = n_tokens;
    return absl::OkStatus();
  }
  KVR_RETURN_IF_ERROR(
      cuda::LaunchRandomBf16(s.kv.data(), static_cast<int64_t>(s.kv.size()), seed, 1.f, stream()));
  KVR_RETURN_IF_ERROR(stream_.Synchronize());
  s.length = n_tokens;
  return absl::OkStatus();
}

absl::Status CudaModelImpl::CopySlot(const Sequence& from, Sequence& to) {
  SparseState& sp = *sparse_;
  const ModelConfig& c = config_;
  const int64_t kv = c.n_kv_heads, d = c.head_dim, S = sp.opt.slots;
  auto copy = [&](auto* base, int64_t per_slot) -> absl::Status {
    for (int64_t l = 0; l < c.n_layers; ++l) {
      auto* layer = base + l * S * per_slot;
      KVR_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(layer + to.slot * per_slot, layer + from.slot * per_slot,
                          per_slot * sizeof(*base), cudaMemcpyDeviceToDevice, stream()));
    }
    return absl::OkStatus();
  };
  KVR_RETURN_IF_ERROR(copy(sp.resident.data(), kv * sp.rcap * 2 * d));
  if (sp.opt.method == SparseMethod::kQuest) {
    KVR_RETURN_IF_ERROR(copy(sp.bounds.data(), sp.pages * sp.bounds_row()));
  } else {
    KVR_RETURN_IF_ERROR(copy(sp.centroids.data(), kv * sp.max_clusters * d));
    KVR_RETURN_IF_ERROR(copy(sp.n_clusters.data(), kv));
    KVR_RETURN_IF_ERROR(copy(sp.offsets.data(), kv * (sp.max_clusters + 1)));
    KVR_RETURN_IF_ERROR(copy(sp.members.data(), kv * sp.opt.max_capacity));
  }
  for (rc::HotCache& h : sp.hot) KVR_RETURN_IF_ERROR(h.ResetSlot(to.slot, stream()));
  return stream_.Synchronize();
}

absl::Status CudaModelImpl::FillSlotFromHostKv(Sequence& s, int64_t n_tokens, bool summaries) {
  SparseState& sp = *sparse_;
  const ModelConfig& c = config_;
  cuda::SparseFillParams fp;
  fp.pool = sp.PoolView(0);
  fp.pages_layer_stride = int64_t{sp.opt.slots} * c.n_kv_heads * sp.max_pages;
  fp.length = n_tokens;
  fp.slot = s.slot;
  fp.resident = sp.resident.data();
  fp.resident_layer_stride = int64_t{sp.opt.slots} * c.n_kv_heads * sp.rcap * 2 * c.head_dim;
  fp.rcap = sp.rcap;
  fp.n_sink = sp.opt.n_sink;
  fp.window = sp.opt.local_window;
  fp.sum = sp.View();
  fp.tokens_per_cluster = sp.opt.clusterkv_tokens_per_cluster;
  fp.n_layers = c.n_layers;
  fp.n_kv_heads = c.n_kv_heads;
  fp.head_dim = c.head_dim;
  fp.summaries = summaries;
  KVR_RETURN_IF_ERROR(cuda::LaunchSparseFill(fp, stream()));
  for (rc::HotCache& h : sp.hot) KVR_RETURN_IF_ERROR(h.ResetSlot(s.slot, stream()));
  return stream_.Synchronize();
}

absl::StatusOr<CudaModelImpl::Sequence*> CudaModelImpl::OwnSparseSequence(SequenceId id,
                                                                          const char* what) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat(what, ": no sequence ", id));
  }
  Sequence& s = it->second;
  if (s.slot < 0) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": sequence ", id, " is dense"));
  }
  for (const auto& [oid, o] : sequences_) {
    if (oid != id && s.host != nullptr && o.host == s.host) {
      return absl::FailedPreconditionError(absl::StrCat(what, ": sequence ", id,
                                                        " shares its host KV with sequence ", oid,
                                                        " (benchmarks only)"));
    }
  }
  return &s;
}

absl::StatusOr<std::span<uint16_t>> CudaModelImpl::SparseHostKv(SequenceId id) {
  KVR_ASSIGN_OR_RETURN(Sequence * s, OwnSparseSequence(id, "SparseHostKv"));
  if (s->host == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "SparseHostKv: sequence ", id, " reads its past from a row source (no host KV)"));
  }
  // The caller overwrites it: no longer FillSequenceForBenchmark's random rows.
  s->host->filled_seed = 0;
  s->filled_seed = 0;
  return s->host->rows();
}

absl::StatusOr<CudaModelImpl::Sequence*> CudaModelImpl::ActivatableSequence(SequenceId id,
                                                                            int64_t n_tokens,
                                                                            const char* what) {
  KVR_ASSIGN_OR_RETURN(Sequence * s, OwnSparseSequence(id, what));
  if (s->length != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": sequence ", id, " already holds ", s->length, " tokens"));
  }
  if (n_tokens < 1 || n_tokens > s->capacity) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": n_tokens ", n_tokens, " outside [1, capacity ", s->capacity, "]"));
  }
  if (s->host != nullptr) s->host->filled_seed = 0;
  s->filled_seed = 0;
  return s;
}

absl::Status CudaModelImpl::ActivateSparseSequence(SequenceId id, int64_t n_tokens) {
  KVR_ASSIGN_OR_RETURN(Sequence * s, ActivatableSequence(id, n_tokens, "ActivateSparseSequence"));
  // Another slot over the same row source, activated at the same length, holds the same ring
  // and summaries (benchmarks run many slots over one store sequence): copy them.
  const Sequence* twin = nullptr;
  for (const auto& [oid, o] : sequences_) {
    if (oid != id && o.slot >= 0 && s->source_key != 0 && o.source_key == s->source_key &&
        o.length == n_tokens && o.sparse_steps == 0) {
      twin = &o;
      break;
    }
  }
  if (twin != nullptr) {
    KVR_RETURN_IF_ERROR(CopySlot(*twin, *s));
    s->length = n_tokens;
    return absl::OkStatus();
  }
  KVR_RETURN_IF_ERROR(FillSlotFromHostKv(*s, n_tokens, /*summaries=*/true));
  s->length = n_tokens;
  return absl::OkStatus();
}

absl::Status CudaModelImpl::ActivateSparseSequenceWithClusters(
    SequenceId id, int64_t n_tokens, std::span<const SparseClusterHead> heads) {
  const ModelConfig& c = config_;
  if (sparse_ == nullptr || sparse_->opt.method != SparseMethod::kClusterKv) {
    return absl::InvalidArgumentError(
        "ActivateSparseSequenceWithClusters: the sparse configuration is not clusterkv");
  }
  const int64_t kv = c.n_kv_heads, d = c.head_dim;
  if (static_cast<int64_t>(heads.size()) != int64_t{c.n_layers} * kv) {
    return absl::InvalidArgumentError(
        absl::StrCat("ActivateSparseSequenceWithClusters: ", heads.size(), " heads, expected ",
                     c.n_layers, " layers x ", kv));
  }
  KVR_ASSIGN_OR_RETURN(Sequence * sq,
                       ActivatableSequence(id, n_tokens, "ActivateSparseSequenceWithClusters"));
  Sequence& s = *sq;
  SparseState& sp = *sparse_;
  const int K = sp.max_clusters;
  const int64_t M = sp.opt.max_capacity;
  const int64_t lo = sp.opt.n_sink, hi = n_tokens - sp.opt.local_window;  // clustered: [lo, hi)
  std::vector<float> cent(static_cast<size_t>(kv * K * d));
  std::vector<int32_t> count(kv), off(static_cast<size_t>(kv * (K + 1))), mem(kv * M);
  const int64_t S = sp.opt.slots;
  auto fail = [&](auto&&... parts) {  // s.length stays 0: not activated
    return absl::InvalidArgumentError(
        absl::StrCat("ActivateSparseSequenceWithClusters: ", parts...));
  };
  for (int l = 0; l < c.n_layers; ++l) {
    std::fill(cent.begin(), cent.end(), 0.f);
    std::fill(mem.begin(), mem.end(), -1);
    for (int64_t h = 0; h < kv; ++h) {
      const SparseClusterHead& in = heads[l * kv + h];
      const int64_t nc_in = static_cast<int64_t>(in.offsets.size()) - 1;
      if (nc_in < 0 || static_cast<int64_t>(in.centroids.size()) != nc_in * d ||
          in.offsets.back() != static_cast<int32_t>(in.ids.size())) {
        return fail("layer ", l, " head ", h, ": inconsistent centroids / offsets / ids");
      }
      int32_t nc = 0, n = 0;
      int32_t* o = off.data() + h * (K + 1);
      o[0] = 0;
      for (int64_t cl = 0; cl < nc_in; ++cl) {
        const int32_t before = n;
        for (int32_t j = in.offsets[cl]; j < in.offsets[cl + 1]; ++j) {
          const int32_t t = in.ids[j];
          if (t < lo || t >= hi) continue;
          if (n >= M) return fail("layer ", l, " head ", h, ": more members than ", M);
          mem[h * M + n++] = t;
        }
        if (n == before) continue;  // empty after the window's tokens left it
        if (nc >= K) return fail("layer ", l, " head ", h, ": more than ", K, " clusters");
        std::copy_n(in.centroids.data() + cl * d, d, cent.data() + (h * K + nc) * d);
        o[++nc] = n;
      }
      for (int cl = nc + 1; cl <= K; ++cl) o[cl] = n;
      count[h] = nc;
    }
    const int64_t base = (int64_t{l} * S + s.slot) * kv;
    auto h2d = [&](auto* dst, const auto& src) {
      return cudaMemcpyAsync(dst, src.data(), src.size() * sizeof(src[0]), cudaMemcpyHostToDevice,
                             stream());
    };
    KVR_CUDA_RETURN_IF_ERROR(h2d(sp.centroids.data() + base * K * d, cent));
    KVR_CUDA_RETURN_IF_ERROR(h2d(sp.n_clusters.data() + base, count));
    KVR_CUDA_RETURN_IF_ERROR(h2d(sp.offsets.data() + base * (K + 1), off));
    // Pageable sources: each copy has staged them when it returns, so the next layer may reuse
    // the host arrays without a synchronize.
    KVR_CUDA_RETURN_IF_ERROR(h2d(sp.members.data() + base * M, mem));
  }
  // The ring rows only: the synthetic clustering LaunchSparseFill would build (reading every
  // key over PCIe) is what the real clusters above replace. Synchronous.
  KVR_RETURN_IF_ERROR(FillSlotFromHostKv(s, n_tokens, /*summaries=*/false));
  s.length = n_tokens;
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
                                std::span<float> logits, std::span<int32_t> next_tokens) {
  const ModelConfig& c = config_;
  if (batch.empty()) return absl::InvalidArgumentError("CudaModel::Forward: empty batch");
  // The calling thread may not be the one that made the model (a server's request threads).
  KVR_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  if (static_cast<int64_t>(batch.size()) > options_.max_sequences) {
    return absl::InvalidArgumentError(absl::StrCat("CudaModel::Forward: ", batch.size(),
                                                   " sequences, more than max_sequences ",
                                                   options_.max_sequences));
  }
  std::vector<Sequence*> seqs(batch.size());
  int64_t total = 0;
  {
    std::unordered_set<SequenceId> seen;
    for (size_t b = 0; b < batch.size(); ++b) {
      const CudaSequence& in = batch[b];
      auto it = sequences_.find(in.id);
      if (it == sequences_.end()) {
        return absl::NotFoundError(absl::StrCat("CudaModel::Forward: no sequence ", in.id));
      }
      if (!seen.insert(in.id).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("CudaModel::Forward: sequence ", in.id, " appears twice in the batch"));
      }
      if (in.tokens.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("CudaModel::Forward: sequence ", in.id, " has no tokens"));
      }
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
            "sequence ", in.id, " would be ", length, " tokens, past the length of its KV export (",
            s.exporting->opt.length, ")"));
      }
      if (s.exporting != nullptr && s.exporting->opt.summaries &&
          length == s.exporting->opt.length && !in.build_summaries) {
        return absl::InvalidArgumentError(absl::StrCat(
            "sequence ", in.id, " exports its summaries: the chunk that completes its ", length,
            " tokens must set build_summaries"));
      }
      for (int32_t token : in.tokens) {
        if (token < 0 || token >= c.vocab) {
          return absl::InvalidArgumentError(absl::StrCat("CudaModel::Forward: token id ", token,
                                                         " outside the vocabulary [0, ", c.vocab,
                                                         ")"));
        }
      }
      seqs[b] = &it->second;
      total += static_cast<int64_t>(in.tokens.size());
    }
  }
  if (total > options_.max_batch_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("CudaModel::Forward: ", total,
                                                   " tokens, more than max_batch_tokens ",
                                                   options_.max_batch_tokens));
  }
  // Sparse sequences: a batch of them only, one token each; the batch's rows are the slots.
  const bool sparse = seqs[0]->slot >= 0;
  for (size_t b = 0; b < batch.size(); ++b) {
    if ((seqs[b]->slot >= 0) != sparse) {
      return absl::InvalidArgumentError(
          "CudaModel::Forward: a batch mixes dense and sparse sequences (run them apart)");
    }
    if (sparse && batch[b].tokens.size() != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "CudaModel::Forward: sparse sequence ", batch[b].id, " has ", batch[b].tokens.size(),
          " tokens; sparse sequences take one token per Forward"));
    }
  }
  const int64_t n_rows = sparse ? sparse_->opt.slots : total;
  int64_t max_candidates = 0;
  // Sequences reading their past from a row source get the step's new rows back in host memory.
  bool copy_new_rows = false;
  for (size_t b = 0; sparse && b < batch.size(); ++b) copy_new_rows |= seqs[b]->host == nullptr;
  if (sparse) {
    SparseState& sp = *sparse_;
    const SparseAttentionOptions& o = sp.opt;
    const int S = o.slots;
    for (int r = 0; r < S; ++r) {
      h_tokens_.data()[r] = 0;
      sp.h_rows.data()[r] = cuda::SparseRow{};
      sp.h_meta.data()[r] = sp.h_meta.data()[S + r] = sp.h_meta.data()[2 * S + r] = 0;
    }
    for (size_t b = 0; b < batch.size(); ++b) {
      const Sequence& q = *seqs[b];
      const int r = q.slot;
      const int64_t len = q.length + 1;  // with the new token
      const int64_t local_begin = std::max<int64_t>(o.n_sink, len - o.local_window);
      h_tokens_.data()[r] = batch[b].tokens[0];
      h_out_rows_.data()[b] = r;
      sp.h_rows.data()[r] =
          cuda::SparseRow{q.host != nullptr ? q.host->device : nullptr, q.capacity, q.length, 1};
      sp.h_meta.data()[r] = o.n_sink;
      sp.h_meta.data()[S + r] = static_cast<int32_t>(local_begin);
      sp.h_meta.data()[2 * S + r] = static_cast<int32_t>(std::min<int64_t>(o.n_sink, len) +
                                                         std::max<int64_t>(0, len - local_begin));
      max_candidates = std::max(max_candidates, local_begin - o.n_sink);
    }
  }
  const int64_t n_out = mode == LogitsMode::kLast ? static_cast<int64_t>(batch.size()) : total;
  if (next_tokens.empty() && static_cast<int64_t>(logits.size()) != n_out * c.vocab) {
    return absl::InvalidArgumentError(absl::StrCat("CudaModel::Forward: logits has ", logits.size(),
                                                   " floats, expected ", n_out, " x ", c.vocab));
  }

  // Metadata of this batch, in pinned memory.
  bool all_decode = true;
  int max_q = 0;
  int64_t max_length = 0;
  if (!sparse) {
    int64_t row = 0;
    for (size_t b = 0; b < batch.size(); ++b) {
      const int n = static_cast<int>(batch[b].tokens.size());
      SeqKv& k = h_seqs_.data()[b];
      k.base = seqs[b]->kv.data();
      k.capacity = seqs[b]->capacity;
      k.first_position = seqs[b]->length;
      k.length = seqs[b]->length + n;
      k.q_begin = static_cast<int32_t>(row);
      k.n_q = n;
      std::memcpy(h_tokens_.data() + row, batch[b].tokens.data(), n * sizeof(int32_t));
      for (int i = 0; i < n; ++i) h_token_seq_.data()[row + i] = static_cast<int32_t>(b);
      if (mode == LogitsMode::kLast) h_out_rows_.data()[b] = static_cast<int32_t>(row + n - 1);
      row += n;
      all_decode = all_decode && n == 1;
      max_q = std::max(max_q, n);
      max_length = std::max(max_length, k.length);
    }
    if (mode == LogitsMode::kAll) {
      for (int64_t i = 0; i < total; ++i) h_out_rows_.data()[i] = static_cast<int32_t>(i);
    }
  }
  // Prefill summaries to build in this Forward (dense sequences added with a method).
  summary_build_ms_ = summary_plan_ms_ = 0;
  std::vector<std::pair<Sequence*, int64_t>> builds;  // sequence, its length after the chunk
  if (!sparse) {
    for (size_t b = 0; b < batch.size(); ++b) {
      if (batch[b].build_summaries && seqs[b]->summaries != nullptr) {
        builds.emplace_back(seqs[b],
                            seqs[b]->length + static_cast<int64_t>(batch[b].tokens.size()));
      }
    }
  }
  const bool side = !builds.empty() && summary_opt_.side_stream;
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
  if (!sparse) {
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
    for (const ChunkExport& x : exports) {
      if (x.q_n == 0) continue;
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
      float* k_scratch = export_scratch_.data() + x.scratch_row * kv;
      float* v_scratch = export_scratch_.data() + (T + x.scratch_row) * kv;
      // A layer's K rows [first, first + n) are contiguous in the cache, and so are its V rows.
      KVR_RETURN_IF_ERROR(cuda::LaunchBf16ToF32(
          cuda::KRow(sk, layer, x.first, static_cast<int>(kv)), k_scratch, x.n * kv, cs));
      KVR_RETURN_IF_ERROR(cuda::LaunchBf16ToF32(
          cuda::VRow(sk, layer, x.first, static_cast<int>(kv)), v_scratch, x.n * kv, cs));
      const KvExportLayer& view = x.exp->notes[layer].view;
      auto d2h = [&](const float* dst, const float* src, int64_t n) {
        return cudaMemcpyAsync(const_cast<float*>(dst), src, n * sizeof(float),
                               cudaMemcpyDeviceToHost, cs);
      };
      KVR_CUDA_RETURN_IF_ERROR(d2h(view.kv.k + x.first * kv, k_scratch, x.n * kv));
      KVR_CUDA_RETURN_IF_ERROR(d2h(view.kv.v + x.first * kv, v_scratch, x.n * kv));
      if (x.q_n > 0) {
        KVR_CUDA_RETURN_IF_ERROR(d2h(view.queries + (x.q_first - view.queries_first_position) * qd,
                                     stage + x.stage_row * qd, x.q_n * qd));
      }
      const PrefillSummaryLayer& sv = view.summary;
      if (x.first + x.n == x.exp->opt.length && sv.method != PrefillSummaryMethod::kNone) {
        // The layer's summary, once its build (queued before this export) is done.
        const Summaries& sm = *seqs[x.b]->summaries;
        KVR_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(cs, build_end_[layer].get(), 0));
        KVR_CUDA_RETURN_IF_ERROR(d2h(sv.f32, sm.f32.data() + layer * sm.layer_f32, sv.n_f32));
        if (sv.n_i32 > 0) {
          KVR_CUDA_RETURN_IF_ERROR(
              cudaMemcpyAsync(const_cast<int32_t*>(sv.i32), sm.i32.data() + layer * sm.layer_i32,
                              sv.n_i32 * sizeof(int32_t), cudaMemcpyDeviceToHost, cs));
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
  // The attention launches' parameters (enqueue sets .layer); the graph key uses the same.
  cuda::AttentionParams ap;
  ap.q = q_.data();
  ap.out = attn_.data();
  ap.seqs = d_seqs_.data();
  ap.n_seqs = static_cast<int>(batch.size());
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
    if (sparse) {
      SparseState& sp = *sparse_;
      KVR_CUDA_RETURN_IF_ERROR(h2d(sp.rows.data(), sp.h_rows.data(), n_rows));
      KVR_CUDA_RETURN_IF_ERROR(h2d(sp.meta.data(), sp.h_meta.data(), 3 * n_rows));
    } else {
      KVR_CUDA_RETURN_IF_ERROR(h2d(d_token_seq_.data(), h_token_seq_.data(), total));
      KVR_CUDA_RETURN_IF_ERROR(
          h2d(d_seqs_.data(), h_seqs_.data(), static_cast<int64_t>(batch.size())));
    }

    if (!builds.empty()) {
      const auto t0 = std::chrono::steady_clock::now();
      for (auto& [seq, len] : builds) KVR_RETURN_IF_ERROR(PrepareSummaryBuild(*seq, len));
      summary_plan_ms_ =
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
      if (sparse) {
        KVR_RETURN_IF_ERROR(SparseLayer(layer, w, max_candidates));
      } else {
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
        if (!builds.empty()) {
          // This layer's K rows are in the caches: its summaries can be built (issue 7).
          cudaStream_t bs = stream();
          if (side) {
            bs = side_stream_.get();
            KVR_CUDA_RETURN_IF_ERROR(cudaEventRecord(layer_ready_[layer].get(), stream()));
            KVR_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(bs, layer_ready_[layer].get(), 0));
          }
          KVR_CUDA_RETURN_IF_ERROR(cudaEventRecord(build_begin_[layer].get(), bs));
          for (auto& [seq, len] : builds) {
            KVR_RETURN_IF_ERROR(QueueSummaryBuild(*seq, layer, len, bs));
          }
          KVR_CUDA_RETURN_IF_ERROR(cudaEventRecord(build_end_[layer].get(), bs));
        }
        // After the builds: an export of summaries waits for build_end_[layer].
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
    if (sparse) {
      const SparseState& sp = *sparse_;
      KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(sp.h_slot_counters.data(), sp.slot_counters.data(),
                                               sp.slot_counters.bytes(), cudaMemcpyDeviceToHost,
                                               stream()));
    }
    if (copy_new_rows) {
      const SparseState& sp = *sparse_;
      KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(sp.h_new_rows.data(), sp.new_rows.data(),
                                               sp.new_rows.bytes(), cudaMemcpyDeviceToHost,
                                               stream()));
    }
    KVR_RETURN_IF_ERROR(Mark(Kind::kOther));
    return absl::OkStatus();
  };
  const absl::Status queued = [&]() -> absl::Status {
    const bool graph = options_.cuda_graphs && !options_.profile && !sparse && all_decode &&
                       !next_tokens.empty() && exports.empty() && builds.empty();
    if (!graph) {
      KVR_RETURN_IF_ERROR(enqueue());
    } else {
      // The grid of the decode attention is the only launch shape that depends on the step.
      const std::pair<int, int> key{ap.n_seqs, cuda::DecodeSplits(ap)};
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
    KVR_RETURN_IF_ERROR(stream_.Synchronize());
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
      summary_build_ms_ += ms;
    }
    for (auto& [seq, len] : builds) seq->summaries->built_length = len;
  }
  if (!next_tokens.empty()) {
    std::memcpy(next_tokens.data(), h_argmax_.data(), n_out * sizeof(int32_t));
  }
  for (size_t b = 0; b < batch.size(); ++b) {
    seqs[b]->length += static_cast<int64_t>(batch[b].tokens.size());
    if (sparse) {
      seqs[b]->new_rows_ready = seqs[b]->host == nullptr;
      ++seqs[b]->sparse_steps;
    }
  }
  if (sparse) ++sparse_->steps;
  return absl::OkStatus();
}

}  // namespace

bool CudaModelAvailable() { return kvr::cuda::HaveCudaDevice(); }

absl::StatusOr<std::unique_ptr<CudaModel>> CreateCudaModel(const ModelConfig& config,
                                                           const ModelWeights& weights,
                                                           const CudaModelOptions& options) {
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
