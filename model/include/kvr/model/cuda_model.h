#pragma once
// The CUDA backend of the model runtime: the same Llama-family forward pass as the CPU `Model`
// (model.h), on one GPU, with bf16 weights and a bf16 device KV cache.
//
// - Weights are uploaded once, as bf16 (matrices and the embedding; norms and the QKV bias stay
//   float32). Every projection is one cuBLAS GEMM (bf16 in, float32 accumulate and output); the
//   residual adds are folded into the o_proj and down_proj GEMMs (beta = 1 onto the float32
//   residual stream).
// - Attention is dense and runs on the GPU (a causal flash-style kernel for prefill chunks, a
//   split-KV kernel with a log-sum-exp merge for decode steps): this backend does not go through
//   the `Attention` seam of attention.h, whose KvView is float32 host memory.
// - Each sequence owns a device KV cache [n_layers, 2 (K, V), capacity, n_kv_heads, head_dim]
//   bf16, keys with RoPE applied, reserved by AddSequence.
//
// This header has no CUDA types: the factories answer Unimplemented in a build without nvcc
// (CONVENTIONS.md 7), so callers link `kvr::model_cuda` unconditionally.
//
// Per-layer attention hook (CudaAttention, below): the device twin of the CPU `Attention` seam.
// A Forward over a hook's sequences (ForwardWithAttention) runs the model's layers (norms,
// GEMMs, FFN) over the rows the hook lays out and calls the hook once per layer between the QKV
// GEMM and the O GEMM; the hook owns those sequences' KV and their attention (the sparse decode
// of retrieval/cuda/decode is one). The model knows nothing of retrieval there.
//
// Thread safety: none; one thread drives a CudaModel (it owns one CUDA stream and one cuBLAS
// handle). Forward is synchronous: it returns once the logits are back in host memory.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvr/model/attention.h"
#include "kvr/model/config.h"
#include "kvr/model/model.h"
#include "kvr/model/weights.h"

namespace kvr::model {

struct CudaModelOptions {
  int device = 0;                   // CUDA device ordinal
  int64_t max_batch_tokens = 2048;  // new tokens per Forward (sizes the activation buffers)
  int max_sequences = 64;           // sequences per Forward
  int64_t max_logits_rows = 64;     // rows of the output projection per GEMM (kAll is chunked)
  // Times GEMMs, attention and the other kernels of each Forward with CUDA events
  // (last_profile()); costs a little host time per kernel, so off by default.
  bool profile = false;
  // Dense decode steps of ForwardGreedy (every sequence one token, no export or summary build,
  // profiling off) run as a CUDA graph: captured once per (batch size, attention split count)
  // and replayed, so the ~10 launches per layer cost one graph launch. A step with an attention
  // hook does too when the hook's plan has a graph_key (CudaAttentionPlan), captured per key. Every
  // per-step value (tokens, positions, cache pointers, lengths) is read from device metadata that
  // the graph's first nodes copy from pinned host memory, so a replay serves any sequences of that
  // size.
  bool cuda_graphs = true;
};

// One sequence's part of a CudaModel::Forward call: the tokens that follow what its device KV
// cache already holds (a prefill chunk, or one token of a decode step).
struct CudaSequence {
  SequenceId id = 0;
  std::span<const int32_t> tokens;
  // This chunk completes the prompt: after each layer's K rows of the chunk are appended, the
  // sequence's CudaLayerBuilder (AddSequence) builds that layer over ALL the sequence's tokens
  // so far (a later build of the same sequence overwrites it). Ignored for a sequence added
  // without a builder, and in a ForwardWithAttention.
  bool build = false;
};

// Per-layer builds over a dense sequence's keys on the GPU during prefill, supplied with
// AddSequence: what is built (a prefill node's retrieval summaries, for one) is the builder's
// business; the model only schedules it.
// - A Forward chunk with CudaSequence::build: before the layers, Prepare(length) on the thread
//   that drives the model (host plans; it may queue uploads on the model's stream, `stream`);
//   then per layer, once that layer's K rows of the chunk are in the cache (a CUDA event on the
//   main stream), Build on a SECOND stream when any builder of the Forward asks for it
//   (side_stream(): the next layers' compute goes on, layer-pipelined), else on the main stream.
//   Forward waits for the builds before it returns.
// - The builds of one Forward run one after another on one stream, sequence by sequence, so
//   builders of one model may share device scratch.
// - Output(layer, length): the device arrays a KV export (KvExportOptions::built) copies to the
//   host once the layer's build is done, in layer order with the rows.
struct CudaLayerKeys {
  int layer = 0;
  const void* keys = nullptr;  // the layer's K cache: bf16 [capacity, n_kv_heads, head_dim]
  int64_t token_stride = 0;    // elements from one token's keys to the next (kv_dim)
  int64_t length = 0;          // tokens to build over
  // For a builder that wants_queries() and a sequence exporting (BeginKvExport): the layer's
  // queries of positions [length - n_queries, length), fp32 [n_queries, n_heads, head_dim]
  // (RoPE applied, the bf16 values widened: the export's queries), device memory of the model.
  // They are those of the export's window (max_queries) that this sequence computed (rows
  // appended by AppendRows bring none). Null / 0 otherwise.
  const float* queries = nullptr;
  int64_t n_queries = 0;
};
struct CudaLayerOutput {  // device arrays (either may be empty)
  const float* f32 = nullptr;
  int64_t n_f32 = 0;
  const int32_t* i32 = nullptr;
  int64_t n_i32 = 0;
};
class CudaLayerBuilder {
 public:
  virtual ~CudaLayerBuilder() = default;
  // Whether builds should leave the main stream (a build of milliseconds per layer: yes; one of
  // microseconds is done sooner on the main stream than waiting for SMs on a side stream).
  virtual bool side_stream() const = 0;
  // Whether the builds read the layer's last queries (CudaLayerKeys::queries): the model then
  // keeps the export window's queries of every layer on the device until the build.
  virtual bool wants_queries() const { return false; }
  [[nodiscard]] virtual absl::Status Prepare(int64_t length, void* stream) = 0;
  [[nodiscard]] virtual absl::Status Build(const CudaLayerKeys& keys, void* stream) = 0;
  virtual CudaLayerOutput Output(int layer, int64_t length) const = 0;
};

// A layer's build as a KV export hands it out, in pinned host memory (Output's arrays).
struct CudaBuiltLayer {
  int64_t length = 0;  // tokens it covers (L); 0: nothing was built
  const float* f32 = nullptr;
  int64_t n_f32 = 0;
  const int32_t* i32 = nullptr;
  int64_t n_i32 = 0;
};

// Per-layer export of a dense sequence's K/V rows to host memory (for the prefill
// node ships every row to the KV store while the next layers compute).
//
// BeginKvExport(id, {length = L, ...}) on an empty dense sequence; then every Forward chunk of
// that sequence, layer by layer, once the layer's K/V rows of the chunk are in the device cache
// (a CUDA event on the main stream), converts them bf16 -> float32 on a COPY stream (a small
// kernel into a device scratch) and copies them device-to-host into pinned host buffers owned by
// the model, at their rows; likewise the chunk's queries that fall in the last max_queries
// positions of [0, L). The chunk that ends at L calls `on_layer` once per layer, in layer order,
// as soon as that layer's copies are done, while later layers still compute.
// - Why convert on the GPU: the kernel costs ~GPU-bandwidth time (microseconds per layer) and
//   doubles the PCIe bytes (float32), but leaves the host's cores to the retrieval index builds,
//   which are the prefill node's CPU bottleneck; converting on the host would cost a pass over
//   every row there.
// - Layouts (the KvView that LayerWorker's store put takes without packing): k and v each
//   [L, n_kv_heads * head_dim] float32 (row_stride = n_kv_heads * head_dim), keys with RoPE;
//   queries [n, n_heads, head_dim] float32, RoPE applied, unscaled (as the CPU Model passes
//   AttentionRequest.q), positions [L - n, L), n = min(max_queries, L). Values are the GPU's
//   bf16 values widened exactly.
// - Ownership: the buffers belong to the model; the views handed to `on_layer` stay valid until
//   EndKvExport(id) or ReleaseSequence(id), after which the buffers go back to a pool of pinned
//   buffers that later exports reuse (pinning GiBs costs seconds; the pool keeps that off the
//   request path after the first export of a given size).
// - `on_layer` runs on a CUDA runtime thread (cudaLaunchHostFunc, stream-ordered after the
//   layer's copies): it must not call CUDA and must not block (push to a queue and return);
//   every call has returned before the Forward that made it returns.
// - Forward refuses a chunk that would take an exporting sequence past L.
struct KvExportLayer {
  SequenceId sequence = 0;
  int layer = 0;
  KvView kv;                       // rows [0, L), float32, pinned host memory
  // KvExportOptions::bf16_rows: the rows as the cache holds them instead, bf16 bits, K and V
  // each [L, n_kv_heads * head_dim]; kv.k and kv.v are then null (its n_rows, row_stride and
  // total_tokens still set).
  const uint16_t* k_bf16 = nullptr;
  const uint16_t* v_bf16 = nullptr;
  const float* queries = nullptr;  // [n_queries, n_heads, head_dim]
  int64_t n_queries = 0;
  int64_t queries_first_position = 0;  // L - n_queries
  CudaBuiltLayer built;                // KvExportOptions::built only
};

struct KvExportOptions {
  int64_t length = 0;         // L: the prompt's tokens (the sequence's length when complete)
  int64_t max_queries = 512;  // last prefill queries per layer to export (0: none)
  // Also export each layer's build (CudaLayerBuilder::Output): the sequence must have been added
  // with a builder and the chunk that completes L must set CudaSequence::build. The layer's copy
  // then waits for its build (on the build stream) as well, so on_layer sees rows and build
  // together; the builds still overlap the later layers' compute.
  bool built = false;
  // Export the K/V rows as the cache's bf16 (KvExportLayer::k_bf16 / v_bf16), copied device to
  // host as they lie: half the PCIe bytes and no conversion, for a consumer that stores bf16
  // rows (a prefill node with store_dtype bf16). Queries stay float32.
  bool bf16_rows = false;
  std::function<void(const KvExportLayer&)> on_layer;  // see above; may be empty
};

struct CudaGraphStats {
  int64_t captures = 0;  // decode steps captured and instantiated (one per batch size / splits
                         // / hook key)
  int64_t replays = 0;   // decode steps run as a graph launch (captures included)
};

// Where the GPU time of the last Forward went (profile = true), in milliseconds.
struct CudaForwardProfile {
  double total_ms = 0;      // first kernel to last, on the GPU
  double gemm_ms = 0;       // cuBLAS projections (QKV, O, gate/up, down, output)
  double attention_ms = 0;  // attention kernels (incl. the decode merge)
  double other_ms = 0;      // norms, RoPE (+ a hook's KV append), SwiGLU, embedding, argmax
  double select_ms = 0;     // attention hooks (CudaStage::kSelect): e.g. sparse selection
  double gather_ms = 0;     // attention hooks (CudaStage::kGather): e.g. hot cache + gather
  // Host wall time of the last Forward, filled whether profiling or not: from the call to the
  // first queued work (checks, plans, metadata), queueing (launches, or one graph launch),
  // waiting for the stream, and from the stream's end to the return.
  double host_before_ms = 0, host_queue_ms = 0, host_wait_ms = 0, host_after_ms = 0;
};

// Where the GPU time of a hooked layer goes (CudaForwardProfile's buckets).
enum class CudaStage { kOther, kAttention, kSelect, kGather };

// One layer of a Forward over a hook's sequences, between the model's QKV GEMM and its O GEMM.
// Device pointers (no CUDA types in this header); row r of each tensor is row r of the rows the
// hook's Plan laid out.
struct CudaAttentionRequest {
  int layer = 0;
  int64_t n_rows = 0;
  // [n_rows, q_dim + 2 kv_dim] float32: the QKV GEMM's output, no bias, no RoPE. The hook
  // applies the bias and RoPE itself (fused with its KV append: one launch, as the dense path's
  // LaunchQkvRope), with these:
  const float* qkv = nullptr;
  const float* qkv_bias = nullptr;  // [q_dim + 2 kv_dim] float32, or null (no bias)
  const float* inv_freq = nullptr;  // [head_dim / 2] float32, RopeInverseFrequencies
  void* q = nullptr;                // [n_rows, n_heads, head_dim] bf16 scratch for the queries
  void* out = nullptr;   // [n_rows, n_heads, head_dim] bf16: the attention output (O GEMM's input)
  bool profile = false;  // CudaModelOptions::profile (the hook may count extra work then)
  // Profiling: the GPU time from this point of the stream to the next mark counts as `stage`
  // (a no-op while profiling is off). Valid during the Attend call only.
  std::function<absl::Status(CudaStage)> mark;
};

// Where a Forward's tokens go among the rows the model runs (CudaAttention::Plan).
struct CudaAttentionPlan {
  int64_t n_rows = 0;         // rows of every layer's tensors (at least the batch's tokens)
  std::vector<int32_t> rows;  // [batch]: the row of each sequence's token
  // Set when everything the hook queues for this plan (Begin, every Attend, End) is the same
  // launches with the same arguments as for any other plan with the same key: every per-step
  // value is read from device memory or copied from pinned host memory at run time. A greedy
  // decode step may then run as a CUDA graph captured once per key (CudaModelOptions::
  // cuda_graphs). Unset: the step is queued launch by launch.
  std::optional<uint64_t> graph_key;
};

// The per-layer device attention hook. One Forward calls, on the thread that drives the model:
// Plan (host, before anything is queued), Begin (after the model's own metadata uploads),
// Attend once per layer, End (after the output projection), then Finish once the stream is done
// (or drained after an error). `stream` is the model's cudaStream_t.
class CudaAttention {
 public:
  virtual ~CudaAttention() = default;
  // Checks the batch against the hook's sequences (the model has checked the token ids, the
  // batch size and max_batch_tokens) and lays out the rows; nothing is queued yet. An error
  // leaves everything as it was.
  [[nodiscard]] virtual absl::StatusOr<CudaAttentionPlan> Plan(
      std::span<const CudaSequence> batch) = 0;
  // Queues the plan's per-Forward uploads.
  [[nodiscard]] virtual absl::Status Begin(void* stream) = 0;
  [[nodiscard]] virtual absl::Status Attend(const CudaAttentionRequest& request, void* stream) = 0;
  // Queues what goes back to the host after the layers (counters, new rows).
  [[nodiscard]] virtual absl::Status End(void* stream) = 0;
  // The Forward's stream work completed (ok: the sequences advance by their token) or failed
  // (the stream was drained; nothing advances).
  virtual void Finish(bool ok) = 0;
};

class CudaModel {
 public:
  virtual ~CudaModel() = default;

  virtual const ModelConfig& config() const = 0;
  // Bytes of device memory held by the weights.
  virtual int64_t weight_bytes() const = 0;

  // Reserves the device KV cache of a new sequence for `capacity` tokens (at most the model's
  // context length), with an optional per-layer builder (CudaLayerBuilder) that the model owns
  // from here. AlreadyExists for a known id, ResourceExhausted when the GPU is full.
  [[nodiscard]] virtual absl::Status AddSequence(
      SequenceId id, int64_t capacity, std::unique_ptr<CudaLayerBuilder> builder = nullptr) = 0;
  // Frees the sequence's KV cache. NotFound for an unknown id.
  [[nodiscard]] virtual absl::Status ReleaseSequence(SequenceId id) = 0;
  // Tokens held in the sequence's cache.
  [[nodiscard]] virtual absl::StatusOr<int64_t> SequenceLength(SequenceId id) const = 0;
  // For benchmarks: sets the sequence's length to `n_tokens`, filling its cache with
  // deterministic random K/V rows (no forward pass), so that decode can be timed at a long
  // context without a prefill.
  [[nodiscard]] virtual absl::Status FillSequenceForBenchmark(SequenceId id, int64_t n_tokens,
                                                              uint64_t seed) = 0;
  // Appends `n_rows` K/V rows computed elsewhere (a cached prompt prefix read back from
  // somewhere) to a dense sequence's cache without running the model, so that the next Forward
  // continues at their end as if it had computed them. Layer by layer, `fill(layer, k, v)`
  // writes that layer's rows as bf16 bits, K and V each [n_rows, n_kv_heads * head_dim], keys
  // with RoPE applied at their positions (as the cache holds them), into pinned host memory;
  // the upload of a layer runs on the model's stream while the next layer is filled. Rows that
  // the cache would hold bit for bit make the following chunks compute what they compute after
  // a Forward of the same tokens, when the chunks have the same boundaries.
  // A sequence that exports (BeginKvExport) exports the appended rows too: they are filled
  // straight into the export's buffer (bf16_rows) or widened into it (float32), and the layer
  // views still cover [0, L); the exported queries are those of the tokens computed afterwards
  // only (queries_first_position >= the appended rows' end). The export must be left at least
  // one token to compute (its layers are handed out by the Forward that completes it).
  // Errors: NotFound; InvalidArgument for n_rows < 1 or a length past the capacity, the
  // context length or (exporting) L - 1; fill's first error. On error the length is unchanged.
  [[nodiscard]] virtual absl::Status AppendRows(
      SequenceId id, int64_t n_rows,
      const std::function<absl::Status(int layer, std::span<uint16_t> k, std::span<uint16_t> v)>&
          fill) = 0;
  // Runs the new tokens of every sequence, appends their K/V to the sequences' caches and writes
  // the logits into `logits` (kLast: [batch, vocab]; kAll: [total new tokens, vocab]).
  // Errors: empty batch or sequence, unknown or repeated sequence, more tokens or sequences than
  // the options allow, a sequence past its capacity or the context length, token ids outside
  // the vocabulary, logits of the wrong size. On error no cache changes length.
  [[nodiscard]] virtual absl::Status Forward(std::span<const CudaSequence> batch, LogitsMode mode,
                                             std::span<float> logits) = 0;
  // As Forward with kLast, but takes the argmax of each sequence's logits on the GPU (ties go
  // to the lowest id, as ArgMax in sampler.h) and copies back only the tokens: [batch].
  [[nodiscard]] virtual absl::Status ForwardGreedy(std::span<const CudaSequence> batch,
                                                   std::span<int32_t> next_tokens) = 0;

  // A Forward over sequences of `attention`, each calling the hook per layer (see
  // CudaAttention): the hook's Plan says which rows its sequences run over. The batch may also
  // name the model's own dense sequences (a mixed batch: a sequence run densely beside sparse
  // ones): they run the dense path on rows before the hook's, every GEMM once over both, with
  // last-token logits only (kAll, a KV export or a build for a dense sequence of a hooked
  // Forward is InvalidArgument, even when the batch names none of the hook's); a batch of dense
  // sequences alone then runs as a plain Forward. Logits and tokens come back in batch order. A
  // greedy step runs as a CUDA graph only when the hook's plan has a graph_key. Errors as
  // Forward's, plus the hook's.
  [[nodiscard]] virtual absl::Status ForwardWithAttention(CudaAttention& attention,
                                                          std::span<const CudaSequence> batch,
                                                          LogitsMode mode,
                                                          std::span<float> logits) = 0;
  [[nodiscard]] virtual absl::Status ForwardGreedyWithAttention(CudaAttention& attention,
                                                                std::span<const CudaSequence> batch,
                                                                std::span<int32_t> next_tokens) = 0;
  // Device bytes of a dense sequence's KV cache.
  [[nodiscard]] virtual absl::StatusOr<int64_t> SequenceDeviceBytes(SequenceId id) const = 0;
  // Device memory free now on the model's GPU (cudaMemGetInfo: every process's allocations
  // counted), for sizing caches by what is left.
  [[nodiscard]] virtual absl::StatusOr<int64_t> FreeDeviceBytes() const = 0;

  // For hooks: the CUDA device ordinal, the model's options, its stream (a cudaStream_t; a
  // hook's setup work between Forwards goes there, so that it is ordered with the model's), and
  // FillSequenceForBenchmark's deterministic random bf16 fill (standard deviation 1) of `n`
  // values at a device-accessible address, queued on that stream.
  virtual const CudaModelOptions& options() const = 0;
  virtual void* cuda_stream() const = 0;
  [[nodiscard]] virtual absl::Status FillRandomBf16(void* device, int64_t n, uint64_t seed) = 0;

  // GPU time of the last Forward's builds (CudaLayerBuilder): the sum over layers of each
  // layer's builds' span on their stream (CUDA events after the wait on the layer's K append),
  // ms; 0 when none. Overlapped with the main stream, that is the builds' time while sharing
  // the GPU.
  virtual double last_build_ms() const = 0;
  // Host time of the last Forward in the builders' Prepare, ms.
  virtual double last_build_plan_ms() const = 0;
  // For tests: runs the sequence's builder again over its current cache (Prepare, every layer's
  // Build, on the main stream, synchronously). NotFound; FailedPrecondition without a builder
  // or tokens.
  [[nodiscard]] virtual absl::Status RebuildForTesting(SequenceId id) = 0;

  // KV export (see KvExportOptions). BeginKvExport: NotFound for an unknown id;
  // FailedPrecondition for a sequence already exporting or one that holds tokens;
  // InvalidArgument for a length outside [1, capacity] or max_queries < 0; ResourceExhausted
  // when the pinned host memory cannot be had. EndKvExport: NotFound when the sequence does not
  // export. ReleaseSequence ends a sequence's export too.
  [[nodiscard]] virtual absl::Status BeginKvExport(SequenceId id,
                                                   const KvExportOptions& options) = 0;
  [[nodiscard]] virtual absl::Status EndKvExport(SequenceId id) = 0;
  // Bytes of pinned host memory held for exports (in use and pooled).
  virtual int64_t export_pinned_bytes() const = 0;

  // CUDA graphs of dense greedy decode steps (CudaModelOptions::cuda_graphs) so far.
  virtual CudaGraphStats graph_stats() const = 0;
  // Turns CudaModelOptions::cuda_graphs on or off (benchmarks compare both in one process).
  virtual void set_cuda_graphs(bool on) = 0;
  // GPU time split of the last Forward/ForwardGreedy (zeros unless profiling is on).
  virtual CudaForwardProfile last_profile() const = 0;
  // Turns the per-kernel event timing of CudaModelOptions::profile on or off.
  virtual void set_profile(bool on) = 0;
};

// Whether this build has the CUDA backend and a usable GPU.
bool CudaModelAvailable();

// Uploads `weights` (checked against `config`) to the GPU as bf16. Unimplemented in a build
// without CUDA; FailedPrecondition when no GPU is usable.
[[nodiscard]] absl::StatusOr<std::unique_ptr<CudaModel>> CreateCudaModel(
    const ModelConfig& config, const ModelWeights& weights, const CudaModelOptions& options);

// Random weights generated on the GPU (deterministic in `seed`; scaled as RandomWeights in
// weights.h: norms 1, matrices with standard deviation 1/sqrt(fan_in)), for benchmarks of
// shapes whose float32 host weights would not fit in host memory.
[[nodiscard]] absl::StatusOr<std::unique_ptr<CudaModel>> CreateCudaModelWithRandomWeights(
    const ModelConfig& config, uint64_t seed, const CudaModelOptions& options);

}  // namespace kvr::model
