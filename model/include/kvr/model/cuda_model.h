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
// Sparse sequences (AddSparseSequence; the decode node's data path on one GPU):
// - Such a sequence's FULL KV stays in host memory that the GPU reads zero-copy, through a page
//   table per slot (kvr/common/cuda/kv_pool.h): either the KV store's own pages (a
//   SparseRowSource: the store's pool mapped into this process and registered with CUDA,
//   RegisterHostRegion; the decode node's path, no copy of the past) or a pinned host KV of the
//   model's, [n_layers, n_kv_heads, capacity, 2 (K | V), head_dim] bf16 (benchmarks and tests,
//   and rows a caller writes itself: SparseHostKv).
// - On the GPU it keeps only: the sink rows and a ring of the local window (the "resident"
//   rows), the method's summaries (quest: fp32 per-page key min/max; clusterkv: fp32 centroids,
//   member lists) and a hot cache of recently fetched rows (retrieval/cuda/.../hot_cache.cuh).
// - Its decode step per layer: QKV GEMM; RoPE, the new K/V row written to the window ring, to the
//   own host KV if any, and to the step's new rows (SparseNewRows: a row source's caller appends
//   them to the store), summaries updated (quest: the page bounds of the new token; clusterkv: the
//   token leaving the window becomes a singleton cluster whose centroid is its key, as the CPU
//   index's pending tokens; no re-clustering on the GPU); ONE select launch for all sparse
//   sequences over the candidates [n_sink, len - local_window); one hot-cache gather (misses
//   read from the store's pages or the host KV); one sparse decode attention over sink + window + selected
//   rows (one softmax); O GEMM.
// - All sparse sequences of one CudaModel share the method and its parameters
//   (ConfigureSparse) and a fixed number of slots: a Forward over sparse sequences runs the
//   QKV/O/FFN GEMMs and the select/gather/attend launches over ALL slots (empty slots are
//   masked), so size `slots` to the batch that is run.
// - A Forward batch is either all dense or all sparse sequences, and a sparse sequence takes
//   exactly one token per Forward (decode): its past comes from a row source
//   (ActivateSparseSequence over the store's pages: the decode node), from
//   FillSequenceForBenchmark, from rows written into its host KV (SparseHostKv +
//   ActivateSparseSequence) or from token-by-token steps.
//
// Thread safety: none; one thread drives a CudaModel (it owns one CUDA stream and one cuBLAS
// handle), except AcquireSparseHostKv, which any thread may call. Forward is synchronous: it returns once the logits are back in host memory.

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
  // and replayed, so the ~10 launches per layer cost one graph launch. Every per-step value
  // (tokens, positions, cache pointers, lengths) is read from device metadata that the graph's
  // first nodes copy from pinned host memory, so a replay serves any sequences of that size.
  bool cuda_graphs = true;
};

// One sequence's part of a CudaModel::Forward call: the tokens that follow what its device KV
// cache already holds (a prefill chunk, or one token of a decode step).
struct CudaSequence {
  SequenceId id = 0;
  std::span<const int32_t> tokens;
  // Prefill summaries (SetPrefillSummaries): this chunk completes the prompt; after each layer's
  // K rows of the chunk are appended, that layer's summary is built over ALL the sequence's
  // tokens so far (a later build of the same sequence overwrites it). Ignored for a sequence
  // added while no method was set, and for sparse sequences.
  bool build_summaries = false;
};

// Summaries built on the GPU during prefill (issue 7 item 2), from the device KV cache in place,
// by the kernels of retrieval/cuda/include/kvr/retrieval/cuda/build.cuh.
// - Per layer, once that layer's K rows of a `build_summaries` chunk are in the cache (a CUDA
//   event on the main stream), the layer's build is launched on a SECOND stream, so that the
//   next layers' compute goes on (layer-pipelined); Forward waits for that stream before it
//   returns. side_stream = false runs the builds on the main stream instead (serial, to compare);
//   side_stream is read from the options current at the Forward.
// - Outputs go to per-sequence buffers reserved by AddSequence (sized for its capacity), layouts
//   as the build kernels write them, per layer:
//     quest      bounds [pages, n_kv_heads, 2, head_dim] fp32 (pages = ceil(len / page_size))
//     clusterkv  centroids [n_kv_heads, max_clusters, head_dim] fp32, n_clusters [n_kv_heads],
//                offsets [n_kv_heads, max_clusters + 1], members [n_kv_heads, max_points]
//                (max_clusters / max_points: the build plan's at the sequence's capacity)
//     keydiff    scores [n_kv_heads, capacity] fp32
// - clusterkv's host plan (C0, initial points: MakeClusterKvBuildPlan, the CPU index's) is made
//   in Forward for the sequence's length, one per layer (its seeds depend on the layer).
// CTKVR is not offered: its build needs the last C prefill queries of every layer (C up to 2048),
// which the runtime overwrites layer by layer (see model/cuda/README.md).
enum class PrefillSummaryMethod { kNone, kQuest, kClusterKv, kKeyDiff };

struct PrefillSummaryOptions {
  PrefillSummaryMethod method = PrefillSummaryMethod::kNone;
  bool side_stream = true;
  // As retrieval's IndexParams (index.h): n_sink (clusterkv does not cluster the sinks), budget
  // (clusterkv's default C0 = max(L / 80, 4 L / budget), at most L / 8), quest.page_size,
  // clusterkv.{n_clusters (0: default), max_iterations}, seed (k-means initial points).
  int64_t n_sink = 16;
  int64_t budget = 256;
  int quest_page_size = 16;
  int64_t clusterkv_n_clusters = 0;
  int clusterkv_max_iterations = 10;
  uint64_t seed = 0x6b7672;
};

// For tests: a sequence's prefill summaries copied back (all layers, the buffers whole).
struct PrefillSummaryData {
  PrefillSummaryMethod method = PrefillSummaryMethod::kNone;
  int64_t length = 0;  // tokens the last build covered (0: never built)
  std::vector<float> f32;    // quest bounds, clusterkv centroids, keydiff scores
  std::vector<int32_t> i32;  // clusterkv: n_clusters, offsets, members (concatenated)
};

// Per-layer export of a dense sequence's K/V rows to host memory (issue 7 item 2: the prefill
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
// One layer's prefill summary as built on the GPU (SetPrefillSummaries), in pinned host memory,
// layouts as PrefillSummaryOptions describes (quest: only the ceil(L / page_size) pages of L).
struct PrefillSummaryLayer {
  PrefillSummaryMethod method = PrefillSummaryMethod::kNone;  // kNone: not exported
  int64_t length = 0;                                          // tokens it covers (L)
  const float* f32 = nullptr;  // quest bounds, clusterkv centroids, keydiff scores
  int64_t n_f32 = 0;
  // clusterkv: n_clusters [n_kv_heads], offsets [n_kv_heads, max_clusters + 1], members
  // [n_kv_heads, max_points], concatenated.
  const int32_t* i32 = nullptr;
  int64_t n_i32 = 0;
  int max_clusters = 0, max_points = 0;
};

struct KvExportLayer {
  SequenceId sequence = 0;
  int layer = 0;
  KvView kv;                       // rows [0, L), float32, pinned host memory
  const float* queries = nullptr;  // [n_queries, n_heads, head_dim]
  int64_t n_queries = 0;
  int64_t queries_first_position = 0;  // L - n_queries
  PrefillSummaryLayer summary;         // KvExportOptions::summaries only
};

struct KvExportOptions {
  int64_t length = 0;         // L: the prompt's tokens (the sequence's length when complete)
  int64_t max_queries = 512;  // last prefill queries per layer to export (0: none)
  // Also export each layer's prefill summary: the sequence must have been added with a summary
  // method (SetPrefillSummaries) and the chunk that completes L must set build_summaries. The
  // layer's copy then waits for its build (on the build stream) as well, so on_layer sees rows
  // and summary together; the builds still overlap the later layers' compute.
  bool summaries = false;
  std::function<void(const KvExportLayer&)> on_layer;  // see above; may be empty
};

struct CudaGraphStats {
  int64_t captures = 0;  // decode steps captured and instantiated (one per batch size / splits)
  int64_t replays = 0;   // decode steps run as a graph launch (captures included)
};

// Where the GPU time of the last Forward went (profile = true), in milliseconds.
struct CudaForwardProfile {
  double total_ms = 0;      // first kernel to last, on the GPU
  double gemm_ms = 0;       // cuBLAS projections (QKV, O, gate/up, down, output)
  double attention_ms = 0;  // attention kernels (incl. the decode merge)
  double other_ms = 0;      // norms, RoPE (+ sparse KV append), SwiGLU, embedding, argmax
  double select_ms = 0;     // sparse sequences: quest / clusterkv selection
  double gather_ms = 0;     // sparse sequences: hot-cache lookup + gather of misses from host
};

enum class SparseMethod { kQuest, kClusterKv };

// The sparse attention of a CudaModel's sparse sequences (ConfigureSparse).
struct SparseAttentionOptions {
  SparseMethod method = SparseMethod::kQuest;
  int slots = 0;              // sparse sequences at once (sizes every per-sequence GPU buffer)
  int64_t max_capacity = 0;   // tokens per sparse sequence (sizes the summaries)
  int budget = 1024;          // selected tokens per KV head and step (quest <= 4096, ckv <= 2048)
  int n_sink = 16;            // always attended, kept on the GPU (decode-node defaults)
  int local_window = 256;     // most recent tokens (incl. the new one), kept on the GPU
  int hot_cache_rows = 1024;  // per (sequence, layer, KV head); 0: no hot cache
  int quest_page_size = 16;
  // clusterkv: tokens per cluster of FillSequenceForBenchmark's stand-in clustering, and the
  // singleton clusters room for tokens leaving the window afterwards (dropped past it).
  int clusterkv_tokens_per_cluster = 80;
  int clusterkv_max_pending = 4096;
  // Smallest page of rows a sequence's row source may have (SparseRowSource::page_rows; the
  // model's own host KVs use this size): sizes the page tables, [n_layers, slots, n_kv_heads,
  // ceil(max_capacity / min_page_rows)] int32. A 64 KiB store page of bf16 rows holds 128 rows at
  // head_dim 128 and 256 at 64.
  int min_page_rows = 128;
};

// For tests: what one layer of a sparse Forward computed, per slot (SnapshotSparseLayerForTesting).
struct SparseLayerSnapshot {
  int layer = -1;
  std::vector<float> q;         // [slots, n_heads, head_dim]: the (bf16-valued) query
  std::vector<int32_t> ids;     // [slots, n_kv_heads, budget]: the selection (contract of
  std::vector<int32_t> counts;  // [slots, n_kv_heads]         retrieval/cuda selection.cuh)
  std::vector<float> attn;      // [slots, n_heads, head_dim]: attention output (bf16 values)
};

// A sparse sequence's host KV acquired ahead of its slot (CudaModel::AcquireSparseHostKv): pinned,
// mapped host memory in SparseHostKv's layout, [n_layers, n_kv_heads, capacity, 2, head_dim]
// bf16, that the caller fills on its own thread while the model runs other sequences, then hands
// to AddSparseSequence (SparseSequenceOptions::host_kv). Buffers come from, and go back to, the
// model's pool of host KVs (pinning GiBs costs seconds, once).
class SparseHostKvBuffer {
 public:
  virtual ~SparseHostKvBuffer() = default;
  virtual std::span<uint16_t> rows() = 0;  // bf16 bits
  virtual int64_t capacity() const = 0;
};

// A sparse sequence's past read in place from paged host memory that the caller owns: the KV
// store's page pool, mapped into this process and registered with CUDA (RegisterHostRegion). The
// GPU reads the selected rows from those pages; the sequence holds no copy of its past. Layout as
// the store keeps it: page p of (layer l, kv head h) holds rows [p * page_rows, (p + 1) *
// page_rows) of bf16 [K | V] rows (keys with RoPE applied), at byte `base + pages[(l *
// n_kv_heads + h) * pages_per_head + p] * page_bytes`. The pages must cover every row the
// sequence will hold (its capacity); rows the model generates are NOT written there (the memory
// may be read-only): each Forward's new rows are handed back (SparseNewRows) for the caller to
// append to the store before they leave the local window.
struct SparseRowSource {
  const void* base = nullptr;  // device-accessible address of page index 0
  int64_t page_bytes = 0;
  int32_t page_rows = 0;  // at least SparseAttentionOptions::min_page_rows
  int32_t pages_per_head = 0;
  std::vector<int32_t> pages;  // [n_layers, n_kv_heads, pages_per_head]
};

struct SparseSequenceOptions {
  // Read the past from this paged source instead of a host KV of the model's (host_kv,
  // share_host_kv_with and the NUMA / huge page fields are then ignored).
  std::optional<SparseRowSource> rows;
  // The host KV to adopt, filled by the caller (AcquireSparseHostKv of this model, the same
  // capacity); ActivateSparseSequence then takes its rows. Excludes share_host_kv_with.
  std::shared_ptr<SparseHostKvBuffer> host_kv;
  // Benchmarks only: use the host KV of this (sparse) sequence instead of pinning a new one
  // (128 GiB of host memory holds ~7 Llama-3-8B sequences of 128K). The sequences then read the
  // same past rows and their new rows overwrite each other's: throughput only, never for output
  // that matters. The GPU-side state (ring, summaries, hot cache) stays per sequence.
  std::optional<SequenceId> share_host_kv_with;
  // Where the pinned host KV's pages go: -1, cudaHostAlloc (the kernel's default policy: pages
  // near the allocating thread's CPU at first touch); >= 0, that NUMA node (mbind, touched, then
  // cudaHostRegister; HostTopology says which node the GPU sits on). A host KV made earlier is
  // reused only at the same capacity and node; share_host_kv_with ignores this field.
  int host_numa_node = -1;
  // Back the host KV with transparent huge pages (mmap 2 MiB aligned + MADV_HUGEPAGE, also with
  // host_numa_node -1): fewer address translations for the GPU's scattered row reads.
  bool host_huge_pages = false;
};

// Counters of the sparse path since ConfigureSparse (device counters; profile on only).
struct SparseStats {
  int64_t steps = 0;           // sparse Forward calls
  int64_t selected_rows = 0;   // rows selected, summed over layers, sequences and KV heads
  int64_t hot_cache_hits = 0;  // of those, found in the hot cache (the rest crossed PCIe)
  int64_t row_bytes = 0;       // bytes of one [K | V] row of one KV head
};

// One sparse sequence's retrieval work since it was added (device counters, read on demand).
struct SparseSequenceCounters {
  int64_t steps = 0;           // Forward calls it took part in
  int64_t selected_rows = 0;   // rows selected, summed over layers and KV heads
  int64_t hot_cache_hits = 0;  // of those, served from the hot cache (the rest crossed the link)
};

class CudaModel {
 public:
  virtual ~CudaModel() = default;

  virtual const ModelConfig& config() const = 0;
  // Bytes of device memory held by the weights.
  virtual int64_t weight_bytes() const = 0;

  // Reserves the device KV cache of a new sequence for `capacity` tokens (at most the model's
  // context length). AlreadyExists for a known id, ResourceExhausted when the GPU is full.
  [[nodiscard]] virtual absl::Status AddSequence(SequenceId id, int64_t capacity) = 0;
  // Frees the sequence's KV cache. NotFound for an unknown id.
  [[nodiscard]] virtual absl::Status ReleaseSequence(SequenceId id) = 0;
  // Tokens held in the sequence's cache.
  [[nodiscard]] virtual absl::StatusOr<int64_t> SequenceLength(SequenceId id) const = 0;
  // For benchmarks: sets the sequence's length to `n_tokens`, filling its cache with
  // deterministic random K/V rows (no forward pass), so that decode can be timed at a long
  // context without a prefill. Sparse sequence: fills the host KV (skipped when a shared host KV
  // already holds this seed), copies the sink and window rows to the GPU ring and builds the
  // summaries on the GPU (quest: page min/max; clusterkv: a SYNTHETIC stand-in for k-means:
  // contiguous runs of clusterkv_tokens_per_cluster candidates, centroid = their mean key).
  [[nodiscard]] virtual absl::Status FillSequenceForBenchmark(SequenceId id, int64_t n_tokens,
                                                              uint64_t seed) = 0;
  // A real past for a sparse sequence. With a row source (the decode node: the KV store's
  // pages), ActivateSparseSequence(id, n_tokens) alone: rows [0, n_tokens) must be in the pages;
  // a slot over the same source already activated at the same length is copied instead (HBM to
  // HBM). With a host KV of the model's, in two steps: SparseHostKv hands out the sequence's host KV to write rows [0, n_tokens) of every
  // (layer, KV head) into: bf16 bits, [n_layers, n_kv_heads, capacity, 2 (K | V), head_dim],
  // keys with RoPE applied (as the model's own rows). ActivateSparseSequence(id, n_tokens) then
  // sets the length and prepares the GPU side as FillSequenceForBenchmark does, from those rows:
  // the sink and window rows copied to the ring, the summaries built on the GPU (quest: the page
  // min/max of the bf16 keys; clusterkv: the SYNTHETIC stand-in clustering, not k-means), the
  // slot's hot cache cleared. The view stays valid until the sequence is released; write it only
  // between Forward calls. Errors: NotFound (unknown id), FailedPrecondition (a dense sequence,
  // a host KV shared with another sequence, or Activate on a sequence that already holds
  // tokens), InvalidArgument (n_tokens outside [1, capacity]).
  [[nodiscard]] virtual absl::StatusOr<std::span<uint16_t>> SparseHostKv(SequenceId id) = 0;
  // A free host KV of `capacity` tokens from the pool (or a new one), for a sparse sequence to
  // come (SparseSequenceOptions::host_kv). THREAD-SAFE: the one method that may be called from
  // any thread while another drives the model (it touches only the pool, under a mutex, and
  // pins memory). InvalidArgument for a capacity outside [1, context length]; ResourceExhausted
  // when the memory cannot be pinned.
  [[nodiscard]] virtual absl::StatusOr<std::shared_ptr<SparseHostKvBuffer>> AcquireSparseHostKv(
      int64_t capacity) = 0;
  [[nodiscard]] virtual absl::Status ActivateSparseSequence(SequenceId id, int64_t n_tokens) = 0;
  // As ActivateSparseSequence, for clusterkv with REAL clusters (the prefill node's k-means, as
  // shipped): `heads` is [n_layers * n_kv_heads] (layer-major), each head's clusters over the
  // prompt. Members outside [n_sink, n_tokens - local_window) are dropped (sinks and the window
  // are resident; tokens leave the window as singleton clusters, as for any sparse sequence),
  // then empty clusters. InvalidArgument for a quest configuration, a wrong head count, or more
  // clusters / members than the slot holds.
  struct SparseClusterHead {
    std::span<const float> centroids;  // [n_clusters, head_dim]
    std::span<const int32_t> offsets;  // [n_clusters + 1]
    std::span<const int32_t> ids;      // token ids grouped by cluster
  };
  [[nodiscard]] virtual absl::Status ActivateSparseSequenceWithClusters(
      SequenceId id, int64_t n_tokens, std::span<const SparseClusterHead> heads) = 0;

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

  // Sets up the shared GPU state of sparse sequences (see the top of this file), replacing any
  // earlier one. FailedPrecondition while sparse sequences exist; ResourceExhausted when the GPU
  // is full; InvalidArgument for bad options (method limits, window/sink, slots > max_sequences).
  // slots = 0 frees the sparse state.
  [[nodiscard]] virtual absl::Status ConfigureSparse(const SparseAttentionOptions& options) = 0;
  // Takes a free slot and pins the sequence's host KV (or shares one, see SparseSequenceOptions).
  // FailedPrecondition without ConfigureSparse or with every slot taken; InvalidArgument for a
  // capacity above the configured max_capacity.
  [[nodiscard]] virtual absl::Status AddSparseSequence(SequenceId id, int64_t capacity,
                                                       const SparseSequenceOptions& options) = 0;
  // Device memory held for the sequence: its KV cache (dense), or its share of the sparse state
  // (one slot's resident rows, summaries, hot cache and step buffers).
  [[nodiscard]] virtual absl::StatusOr<int64_t> SequenceDeviceBytes(SequenceId id) const = 0;
  // The K/V rows the last Forward appended to a sparse sequence whose past comes from a
  // SparseRowSource, in host memory: [n_layers, 2 (K, V), n_kv_heads, head_dim] bf16 bits, keys
  // with RoPE, for position length - 1 (valid until the next Forward). NotFound / FailedPrecondition
  // (not such a sequence, or no Forward since it was added).
  [[nodiscard]] virtual absl::StatusOr<std::span<const uint16_t>> SparseNewRows(
      SequenceId id) const = 0;
  // Registers host memory (page aligned, e.g. a read-only mapping of the KV store's pool) with
  // CUDA as mapped memory and returns its device-side address, for SparseRowSource::base; the
  // same range registered twice returns the first address. read_only: the GPU never writes it
  // (cudaHostRegisterReadOnly where the device supports it). The region stays registered until
  // UnregisterHostRegion or the model's destruction; the caller keeps the memory mapped until
  // then. THREAD-SAFE (like AcquireSparseHostKv): may run on any thread.
  [[nodiscard]] virtual absl::StatusOr<const void*> RegisterHostRegion(const void* host,
                                                                       size_t bytes,
                                                                       bool read_only) = 0;
  [[nodiscard]] virtual absl::Status UnregisterHostRegion(const void* host) = 0;
  virtual SparseStats sparse_stats() const = 0;
  // Device bytes of one sparse slot (its share of the sparse state); 0 without ConfigureSparse.
  virtual int64_t sparse_slot_device_bytes() const = 0;
  // As of the last Forward (the slot's counters come back with every sparse Forward; no
  // synchronization here). NotFound for an unknown or dense sequence.
  [[nodiscard]] virtual absl::StatusOr<SparseSequenceCounters> SparseCounters(
      SequenceId id) const = 0;
  // For tests: later sparse Forwards copy layer `layer`'s query, selection and attention output
  // back (sparse_snapshot()); -1 turns it off. Slows each Forward down.
  virtual void SnapshotSparseLayerForTesting(int layer) = 0;
  virtual const SparseLayerSnapshot& sparse_snapshot() const = 0;
  // For tests: the bf16 bits of a sparse sequence's host KV, [n_layers, n_kv_heads, capacity, 2,
  // head_dim] (valid until the sequence is released).
  [[nodiscard]] virtual absl::StatusOr<std::span<const uint16_t>> SparseHostKvForTesting(
      SequenceId id) const = 0;

  // Prefill summaries (see PrefillSummaryOptions): the method built for `build_summaries`
  // chunks of sequences added AFTER this call (AddSequence reserves the buffers). InvalidArgument
  // for bad options; ResourceExhausted is answered later, by AddSequence.
  [[nodiscard]] virtual absl::Status SetPrefillSummaries(const PrefillSummaryOptions& options) = 0;
  // GPU time of the last Forward's summary builds: the sum over layers of each build's own
  // span on its stream (CUDA events after its wait on the layer's K append), ms; 0 when none.
  // Overlapped with the main stream, that is the builds' time while sharing the GPU.
  virtual double last_summary_build_ms() const = 0;
  // Host time of the last Forward spent making the builds' host plans (clusterkv), ms.
  virtual double last_summary_plan_ms() const = 0;
  // For tests: copies the sequence's summaries back. NotFound / FailedPrecondition (no buffers).
  [[nodiscard]] virtual absl::StatusOr<PrefillSummaryData> PrefillSummariesForTesting(
      SequenceId id) const = 0;
  // For tests: builds the summaries again over the sequence's current cache (every layer, the
  // same kernels and plan, on the main stream, synchronously) into the same buffers.
  [[nodiscard]] virtual absl::Status RebuildPrefillSummariesForTesting(SequenceId id) = 0;

  // KV export (see KvExportOptions). BeginKvExport: NotFound for an unknown id;
  // FailedPrecondition for a sparse sequence, one already exporting or one that holds tokens;
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

// Where a GPU sits on the host: its PCI bus id (cudaDeviceGetPCIBusId) and NUMA node
// (/sys/bus/pci/devices/<bus id>/numa_node; -1 when the host reports none, as one-node hosts and
// many VMs do), and the host's NUMA nodes that have memory (/sys/devices/system/node/has_memory).
struct HostTopology {
  std::string gpu_pci_bus_id;
  int gpu_numa_node = -1;
  std::vector<int> memory_nodes;
};
[[nodiscard]] absl::StatusOr<HostTopology> GetHostTopology(int device);

// The host -> GPU link as sparse sequences use it, measured on a pinned host buffer placed as
// SparseSequenceOptions::host_numa_node (-1: cudaHostAlloc): the ceilings `kvr bench decode`
// prints its gather rates against. Each figure is the best of `repeats` timed runs (CUDA
// events), after one untimed run; each probe's copy is checked against the host buffer.
struct HostLinkProbe {
  int numa_node = -1;
  double on_node_fraction = -1;  // sampled pages found on numa_node (-1: unbound or unknown)
  std::string how;  // "cudaHostAlloc", "mmap", "mbind" or "first-touch" (mbind refused)
  bool huge_pages = false;
  double huge_fraction = -1;  // huge_pages: the buffer's share in transparent huge pages
  int64_t bytes = 0;
  double h2d_copy_gbps = 0;        // cudaMemcpyAsync pinned host -> device (copy engine)
  double zero_copy_read_gbps = 0;  // a coalesced kernel reading the mapped buffer (16 B/thread)
  double zero_copy_rows_gbps = 0;  // random 512-byte rows, one warp per row (the gather's shape)
};
[[nodiscard]] absl::StatusOr<HostLinkProbe> MeasureHostLink(int device, int numa_node,
                                                            bool huge_pages, int64_t bytes,
                                                            int repeats);

}  // namespace kvr::model
