#pragma once
// The GPU sparse decode (DESIGN.md 4b): a per-layer device attention hook of the CUDA model
// runtime (model::CudaAttention, kvr/model/cuda_model.h) that attends a decode step's query over
// the sink rows, a ring of the local window and the rows a retrieval method selects from the
// sequence's full KV in host memory. The decode node's data path on one GPU.
//
// - A sequence's FULL KV stays in host memory that the GPU reads zero-copy, through a page
//   table per slot (kvr/common/cuda/kv_pool.h): either the KV store's own pages (a
//   SparseRowSource: the store's pool mapped into this process and registered with CUDA,
//   RegisterHostRegion; the decode node's path, no copy of the past) or a pinned host KV of its
//   own, [n_layers, n_kv_heads, capacity, 2 (K | V), head_dim] bf16 (benchmarks and tests, and
//   rows a caller writes itself: HostKv).
// - On the GPU it keeps only: the sink rows and a ring of the local window (the "resident"
//   rows), the method's summaries (quest: bf16 (or fp32) per-page key min/max; clusterkv:
//   bf16 centroids, member lists) and a hot cache of recently fetched rows (hot_cache.cuh).
// - Its part of a decode step, per layer (Attend, between the model's QKV GEMM and its O GEMM):
//   RoPE (here, not in the model: it is fused with the KV append and the summary update in one
//   kernel), the new K/V row written to the window ring, to the own host KV if any, and to the
//   step's new rows (NewRows: a row source's caller appends them to the store), summaries
//   updated (quest: the page bounds of the new token; clusterkv: the token leaving the window
//   becomes a singleton cluster whose centroid is its key, as the CPU index's pending tokens; no
//   re-clustering on the GPU); ONE select launch for all sequences over the candidates [n_sink,
//   len - local_window); one hot-cache gather (misses read from the store's pages or the host
//   KV); one sparse decode attention over sink + window + selected rows (one softmax).
// - All sequences of one SparseDecodeAttention share the method and its parameters (Configure)
//   and a fixed number of slots: a Forward runs the model's QKV/O/FFN GEMMs and the
//   select/gather/attend launches over ALL slots (empty slots are masked), so size `slots` to
//   the batch that is run.
// - Its sequences are its own (ids apart from the model's dense sequences; a Forward may name
//   the model's dense sequences too, which then run the model's dense path in the same batch:
//   CudaModel::ForwardWithAttention) and take exactly one token per Forward
//   (decode): their past comes from a row source (ActivateSequence over the store's pages: the
//   decode node), from FillSequenceForBenchmark, from rows written into its host KV (HostKv +
//   ActivateSequence) or from token-by-token steps.
//
// This header has no CUDA types: in a build without nvcc the factory and the host link probes
// answer Unimplemented (CONVENTIONS.md 7), so callers link kvr::retrieval_cuda_decode always.
//
// Thread safety: none; the thread that drives the model drives this object too, except
// AcquireHostKv and RegisterHostRegion / UnregisterHostRegion, which any thread may call.

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvr/model/cuda_model.h"
#include "kvr/model/model.h"
#include "kvr/retrieval/cuda/selection_replay.h"

namespace kvr::retrieval {
class MethodAssets;
class RetrievalIndex;
}  // namespace kvr::retrieval

namespace kvr::retrieval::cuda {

using model::SequenceId;

enum class SparseMethod { kQuest, kClusterKv };

// How the row sources' pages hold their rows (the KV store sequence's dtype): bf16 [K | V], or
// fp8 e4m3 rows with one float scale for K and one for V (kvr/common/fp8.h's
// Fp8RowLayout{2, head_dim}: 136 bytes at head_dim 64 against 256; the store's fp8 dtype).
// The GPU decodes fp8 rows to bf16 as it reads them (window ring and summaries at activation,
// every gathered row); the hot cache keeps them in fp8.
enum class SparseRowFormat { kBf16, kFp8E4m3 };

// The shared configuration of a SparseDecodeAttention's sequences (Configure).
// The methods a GPU lane can select (SparseDecodeOptions::lanes).
inline constexpr std::array<std::string_view, 5> kGpuLaneMethods = {"exact", "pariskv", "keydiff",
                                                                    "a2ats", "ctkvr"};
inline bool IsGpuLaneMethod(std::string_view method) {
  return std::find(kGpuLaneMethods.begin(), kGpuLaneMethods.end(), method) !=
         kGpuLaneMethods.end();
}
// "exact, pariskv, keydiff, a2ats", for messages.
inline std::string GpuLaneMethodList() {
  std::string list;
  for (std::string_view m : kGpuLaneMethods) list.append(list.empty() ? "" : ", ").append(m);
  return list;
}

struct SparseDecodeOptions {
  SparseMethod method = SparseMethod::kQuest;
  int slots = 0;              // sparse sequences at once (sizes every per-sequence GPU buffer)
  int64_t max_capacity = 0;   // tokens per sparse sequence (sizes the summaries)
  int budget = 1024;          // selected tokens per KV head and step (quest <= 4096, ckv <= 2048)
  int n_sink = 16;            // always attended, kept on the GPU (decode-node defaults)
  int local_window = 256;     // most recent tokens (incl. the new one), kept on the GPU
  int hot_cache_rows = 1024;  // per (sequence, layer, KV head); 0: no hot cache
  int quest_page_size = 16;
  // quest: page bounds in bf16 (half the bytes the scoring reads every step and half the HBM:
  // ~0.19 GB per SmolLM2 sequence of 128K instead of 0.38), rounded outward so that a page's
  // score stays an upper bound; exact for bf16 rows. false: fp32.
  bool quest_bf16_bounds = true;
  // clusterkv: tokens per cluster of FillSequenceForBenchmark's stand-in clustering, and the
  // singleton clusters room for tokens leaving the window afterwards (dropped past it).
  int clusterkv_tokens_per_cluster = 80;
  int clusterkv_max_pending = 4096;
  // clusterkv: room per KV head for the prefill's clusters; 0: the most the scaled default gives
  // any budget (ClusterKvMaxDefaultClusters(max_capacity), L/8: bf16 centroids of 1 GiB per
  // Llama-3-8B sequence of 128K). A caller that knows its sequences' cluster counts (a fixed
  // budget, or the benchmark's stand-in) reserves only those.
  int64_t clusterkv_prefill_clusters = 0;
  // Smallest page of rows a sequence's row source may have (SparseRowSource::page_rows; the
  // own host KVs use this size): sizes the page tables, [n_layers, slots, n_kv_heads,
  // ceil(max_capacity / min_page_rows)] int32. A 64 KiB store page of bf16 rows holds 128 rows at
  // head_dim 128 and 256 at 64.
  int min_page_rows = 128;
  // The format of every sequence's row source (SparseSequenceOptions::rows) and of the rows its
  // fetcher reads (SparseSequenceOptions::fetch). kFp8E4m3 needs a hot cache, no lanes, and a
  // row source or a fetcher for every sequence (a sequence's own host KV and filled rows are
  // bf16).
  SparseRowFormat row_format = SparseRowFormat::kBf16;
  // Methods selected on the GPU beside `method` ("lanes", src/lanes.cuh), each with GPU state
  // per slot built at activation from the sequence's CPU indexes (SparseSequenceOptions::lane):
  // "exact" (the keys read in place from the row source; no state), "pariskv" (4-bit codes and
  // weights, [n_layers, slots, n_kv_heads, max_capacity] each, encoded on the GPU as generated
  // tokens leave the window), "keydiff" (fp32 scores [n_layers, slots, n_kv_heads,
  // max_capacity] and the running key sums; a generated token is scored as it leaves the
  // window), "a2ats" (codeword ids [n_layers, slots, n_kv_heads, max_capacity] u16 and the
  // codebooks of `method_assets`; a generated token is assigned its codeword as it leaves the
  // window). Empty: none.
  std::vector<std::string> lanes;
  // The node's method assets (a2ats codebooks), for the lanes that need them.
  std::shared_ptr<const MethodAssets> method_assets;
  // Threads that run the host selectors (SparseHostSelector) of a step's sequences in parallel,
  // one sequence per task: 0 = the machine's cores, 1 = on the calling thread.
  int host_select_threads = 0;
  // Benchmarks only: after the configured method has selected (its cost stays in the step),
  // every slot it selected for gets the replayed selection of step (Forward count mod n_steps)
  // instead (selection_replay.h). Must match the model's layers and KV heads.
  std::shared_ptr<const SparseSelectionReplay> replay;
};

// For tests: what one layer of a sparse Forward computed, per slot (SnapshotLayerForTesting).
struct SparseLayerSnapshot {
  int layer = -1;
  std::vector<float> q;         // [slots, n_heads, head_dim]: the (bf16-valued) query
  std::vector<int32_t> ids;     // [slots, n_kv_heads, budget]: the selection (contract of
  std::vector<int32_t> counts;  // [slots, n_kv_heads]         retrieval/cuda selection.cuh)
  std::vector<float> attn;      // [slots, n_heads, head_dim]: attention output (bf16 values)
};

// A sparse sequence's host KV acquired ahead of its slot (SparseDecodeAttention::AcquireHostKv):
// pinned, mapped host memory in HostKv's layout, [n_layers, n_kv_heads, capacity, 2, head_dim]
// bf16, that the caller fills on its own thread while the model runs other sequences, then hands
// to AddSequence (SparseSequenceOptions::host_kv). Buffers come from, and go back to, the
// pool of host KVs (pinning GiBs costs seconds, once).
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
// page_rows) of [K | V] rows (keys with RoPE applied; bf16, or fp8 rows when
// SparseDecodeOptions::row_format says so), at byte `base + pages[(l *
// n_kv_heads + h) * pages_per_head + p] * page_bytes`. The pages must cover every row the
// sequence will hold (its capacity); rows the decode generates are NOT written there (the memory
// may be read-only): each Forward's new rows are handed back (NewRows) for the caller to
// append to the store before they leave the local window.
struct SparseRowSource {
  const void* base = nullptr;  // device-accessible address of page index 0
  int64_t page_bytes = 0;
  int32_t page_rows = 0;  // at least SparseDecodeOptions::min_page_rows
  int32_t pages_per_head = 0;
  std::vector<int32_t> pages;  // [n_layers, n_kv_heads, pages_per_head]
};

// A sparse sequence's past on a KV store the GPU cannot read in place (a store on another host):
// rows are fetched on demand, each step only the selected rows the hot cache misses, batched per
// (sequence, step, layer), into pinned host memory the GPU reads (the staging of the step's
// selection, [slots, n_kv_heads, budget, row]). At activation the sink and window rows are
// fetched once. The decode node implements it over its store client (one gather request per
// call); tests over an in-process store.
//
// Such a sequence holds no page table and no copy of its past: pinned memory per sequence is its
// share of the staging. It needs a selector that reads no rows (a host selector, or the clusterkv
// method activated with its handed-off clusters) and a hot cache (SparseDecodeOptions::
// hot_cache_rows > 0). Called on the thread that drives the model.
class SparseRowFetcher {
 public:
  virtual ~SparseRowFetcher() = default;
  // Rows `positions` of one KV head of `layer`.
  struct Rows {
    int layer = 0;
    int kv_head = 0;
    std::span<const int32_t> positions;
  };
  // Starts reading every request's rows into `out` one after another, as the store keeps them
  // (keys with RoPE): [sum of positions] rows of 2 (K | V) x head_dim bf16, or fp8 rows
  // (Fp8RowLayout{2, head_dim}) when SparseDecodeOptions::row_format is fp8; `out` and the
  // positions stay valid until Wait. One fetch at a time per fetcher.
  [[nodiscard]] virtual absl::Status Start(std::span<const Rows> rows, std::span<uint8_t> out) = 0;
  // Waits for the started fetch; UNAVAILABLE when the store is gone (the sequence's step fails).
  [[nodiscard]] virtual absl::Status Wait() = 0;
};

// A sequence whose selection is made on the host, per layer of each step: a retrieval method
// that has no GPU selector in this object (the configured SparseMethod), run by its CPU index.
// The GPU does the rest of the step as for any sequence (window ring, hot cache, gather from
// the row source, attention); the GPU selector's summaries are not built for it. Costs one
// synchronization per layer of a step with such a sequence (its query comes back, its
// selection goes up). Called on the thread that drives the model.
class SparseHostSelector {
 public:
  virtual ~SparseHostSelector() = default;
  // query: [n_heads, head_dim] fp32 (RoPE applied, bf16-valued) of the token at `position`;
  // candidates [cand_begin, cand_end) (sinks before, the local window after, as the CPU decode
  // path's SelectRequest). Writes, per KV head h, counts[h] <= budget distinct ids in the range
  // into ids[h * budget, h * budget + counts[h]) (any order; the caller sorts them).
  [[nodiscard]] virtual absl::Status Select(int layer, int64_t position,
                                            std::span<const float> query, int64_t cand_begin,
                                            int64_t cand_end, int budget, std::span<int32_t> ids,
                                            std::span<int32_t> counts) = 0;
};

struct SparseSequenceOptions {
  // Select this sequence's rows on the host (see SparseHostSelector) instead of with the
  // configured GPU method. Shared: the caller keeps feeding it (e.g. the generated keys).
  std::shared_ptr<SparseHostSelector> selector;
  // Select with this lane of SparseDecodeOptions::lanes instead (excludes `selector`); its GPU
  // state is built at ActivateSequence from `lane_indexes`, the sequence's CPU index of every
  // layer over the n_tokens of the activation (read then only: they may go afterwards).
  std::string lane;
  std::vector<const RetrievalIndex*> lane_indexes;
  // Rows this sequence's selector (the configured GPU method, a lane or a host selector's
  // request) selects per KV head and step (0: the configured budget; at most it). A batch mixes
  // budgets: the GPU method selects each slot at its own.
  int budget = 0;
  // Read the past from this paged source instead of a host KV of its own (host_kv,
  // share_host_kv_with and the NUMA / huge page fields are then ignored).
  std::optional<SparseRowSource> rows;
  // Or fetch it (SparseRowFetcher; excludes the own host KV fields and a lane). With `rows`
  // too, activation reads the pages in place (ring and the GPU method's summaries: benchmarks
  // over a store on this host) and every step's misses are fetched.
  std::shared_ptr<SparseRowFetcher> fetch;
  // The host KV to adopt, filled by the caller (AcquireHostKv of this SparseDecodeAttention, the
  // same capacity); ActivateSequence then takes its rows. Excludes share_host_kv_with.
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

// Counters of the sparse path since Configure (device counters; profile on only).
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
  int64_t fetched_rows = 0;    // rows its SparseRowFetcher read (0 for rows read in place)
};

// A clusterkv head's real clusters (the prefill node's k-means, as shipped), for
// ActivateSequenceWithClusters.
struct SparseClusterHead {
  std::span<const float> centroids;  // [n_clusters, head_dim]
  std::span<const int32_t> offsets;  // [n_clusters + 1]
  std::span<const int32_t> ids;      // token ids grouped by cluster
};

class SparseDecodeAttention : public model::CudaAttention {
 public:
  ~SparseDecodeAttention() override = default;

  // The model this attends for (not owned; outlives this object).
  virtual model::CudaModel& cuda_model() const = 0;

  // Sets up the shared GPU state (see the top of this file), replacing any earlier one.
  // FailedPrecondition while sequences exist; ResourceExhausted when the GPU is full;
  // InvalidArgument for bad options (method limits, window/sink, slots above the model's
  // max_sequences or max_batch_tokens). slots = 0 frees the state.
  [[nodiscard]] virtual absl::Status Configure(const SparseDecodeOptions& options) = 0;
  // Takes a free slot and pins the sequence's host KV (or shares one, see SparseSequenceOptions).
  // FailedPrecondition without Configure or with every slot taken; AlreadyExists for a known id;
  // InvalidArgument for a capacity above the configured max_capacity.
  [[nodiscard]] virtual absl::Status AddSequence(SequenceId id, int64_t capacity,
                                                 const SparseSequenceOptions& options) = 0;
  // Frees the sequence's slot. NotFound for an unknown id.
  [[nodiscard]] virtual absl::Status ReleaseSequence(SequenceId id) = 0;
  // Tokens the sequence holds.
  [[nodiscard]] virtual absl::StatusOr<int64_t> SequenceLength(SequenceId id) const = 0;
  // Device memory held for the sequence: its share of the sparse state (one slot's resident
  // rows, summaries, hot cache and step buffers).
  [[nodiscard]] virtual absl::StatusOr<int64_t> SequenceDeviceBytes(SequenceId id) const = 0;

  // For benchmarks: sets the sequence's length to `n_tokens` with deterministic random K/V rows
  // (no forward pass): fills the host KV (skipped when a shared host KV already holds this
  // seed; the model's random fill, CudaModel::FillRandomBf16), copies the sink and window rows
  // to the GPU ring and builds the summaries on the GPU (quest: page min/max; clusterkv: a
  // SYNTHETIC stand-in for k-means: contiguous runs of clusterkv_tokens_per_cluster candidates,
  // centroid = their mean key). FailedPrecondition for a sequence over a row source.
  [[nodiscard]] virtual absl::Status FillSequenceForBenchmark(SequenceId id, int64_t n_tokens,
                                                              uint64_t seed) = 0;
  // A real past. With a row source (the decode node: the KV store's pages),
  // ActivateSequence(id, n_tokens) alone: rows [0, n_tokens) must be in the pages; a slot over
  // the same source already activated at the same length is copied instead (HBM to HBM). With
  // an own host KV, in two steps: HostKv hands out the sequence's host KV to write rows [0,
  // n_tokens) of every (layer, KV head) into: bf16 bits, [n_layers, n_kv_heads, capacity, 2 (K |
  // V), head_dim], keys with RoPE applied (as the model's own rows). ActivateSequence(id,
  // n_tokens) then sets the length and prepares the GPU side as FillSequenceForBenchmark does,
  // from those rows: the sink and window rows copied to the ring, the summaries built on the GPU
  // (quest: the page min/max of the bf16 keys; clusterkv: the SYNTHETIC stand-in clustering, not
  // k-means), the slot's hot cache cleared. The view stays valid until the sequence is released;
  // write it only between Forward calls. Errors: NotFound (unknown id), FailedPrecondition (a
  // host KV shared with another sequence, or Activate on a sequence that already holds tokens),
  // InvalidArgument (n_tokens outside [1, capacity]).
  [[nodiscard]] virtual absl::StatusOr<std::span<uint16_t>> HostKv(SequenceId id) = 0;
  // A free host KV of `capacity` tokens from the pool (or a new one), for a sequence to come
  // (SparseSequenceOptions::host_kv). THREAD-SAFE: may be called from any thread while another
  // drives the model (it touches only the pool, under a mutex, and pins memory).
  // InvalidArgument for a capacity outside [1, context length]; ResourceExhausted when the
  // memory cannot be pinned.
  [[nodiscard]] virtual absl::StatusOr<std::shared_ptr<SparseHostKvBuffer>> AcquireHostKv(
      int64_t capacity) = 0;
  [[nodiscard]] virtual absl::Status ActivateSequence(SequenceId id, int64_t n_tokens) = 0;
  // As ActivateSequence, for clusterkv with REAL clusters (the prefill node's k-means, as
  // shipped): `heads` is [n_layers * n_kv_heads] (layer-major), each head's clusters over the
  // prompt. Members outside [n_sink, n_tokens - local_window) are dropped (sinks and the window
  // are resident; tokens leave the window as singleton clusters, as for any sequence), then
  // empty clusters. InvalidArgument for a quest configuration, a wrong head count, or more
  // clusters / members than the slot holds.
  [[nodiscard]] virtual absl::Status ActivateSequenceWithClusters(
      SequenceId id, int64_t n_tokens, std::span<const SparseClusterHead> heads) = 0;

  // One decode step of this object's sequences (one token each): the model's
  // ForwardWithAttention / ForwardGreedyWithAttention with this hook (see there).
  [[nodiscard]] virtual absl::Status Forward(std::span<const model::CudaSequence> batch,
                                             model::LogitsMode mode, std::span<float> logits) = 0;
  [[nodiscard]] virtual absl::Status ForwardGreedy(std::span<const model::CudaSequence> batch,
                                                   std::span<int32_t> next_tokens) = 0;

  // The K/V rows the last Forward appended to a sequence whose past comes from a
  // SparseRowSource, in host memory: [n_layers, 2 (K, V), n_kv_heads, head_dim] bf16 bits, keys
  // with RoPE, for position length - 1 (valid until the next Forward). NotFound /
  // FailedPrecondition (not such a sequence, or no Forward since it was added).
  [[nodiscard]] virtual absl::StatusOr<std::span<const uint16_t>> NewRows(SequenceId id) const = 0;
  // Registers host memory (page aligned, e.g. a read-only mapping of the KV store's pool) with
  // CUDA as mapped memory and returns its device-side address, for SparseRowSource::base; the
  // same range registered twice returns the first address. read_only: the GPU never writes it
  // (cudaHostRegisterReadOnly where the device supports it). The region stays registered until
  // UnregisterHostRegion or this object's destruction; the caller keeps the memory mapped until
  // then. THREAD-SAFE (like AcquireHostKv): may run on any thread.
  [[nodiscard]] virtual absl::StatusOr<const void*> RegisterHostRegion(const void* host,
                                                                       size_t bytes,
                                                                       bool read_only) = 0;
  [[nodiscard]] virtual absl::Status UnregisterHostRegion(const void* host) = 0;
  virtual SparseStats stats() const = 0;
  // Device bytes of one slot (its share of the sparse state); 0 without Configure.
  virtual int64_t slot_device_bytes() const = 0;
  // As of the last Forward (the slot's counters come back with every Forward; no
  // synchronization here). NotFound for an unknown sequence.
  [[nodiscard]] virtual absl::StatusOr<SparseSequenceCounters> Counters(SequenceId id) const = 0;
  // OK, or the first failure of a fetched sequence's row reads (SparseRowFetcher::Wait's status,
  // annotated): its output since then is void and the caller ends it. NotFound for an unknown
  // sequence.
  [[nodiscard]] virtual absl::Status SequenceFailure(SequenceId id) const = 0;
  // For tests: later Forwards copy layer `layer`'s query, selection and attention output back
  // (snapshot()); -1 turns it off. Slows each Forward down.
  virtual void SnapshotLayerForTesting(int layer) = 0;
  virtual const SparseLayerSnapshot& snapshot() const = 0;
  // For tests: the bf16 bits of a sequence's host KV, [n_layers, n_kv_heads, capacity, 2,
  // head_dim] (valid until the sequence is released).
  [[nodiscard]] virtual absl::StatusOr<std::span<const uint16_t>> HostKvForTesting(
      SequenceId id) const = 0;
};

// A sparse decode over `model` (not owned; it must outlive the result), not configured yet.
// Unimplemented in a build without CUDA.
[[nodiscard]] absl::StatusOr<std::unique_ptr<SparseDecodeAttention>> CreateSparseDecodeAttention(
    model::CudaModel& model);

// Where a GPU sits on the host: its PCI bus id (cudaDeviceGetPCIBusId) and NUMA node
// (/sys/bus/pci/devices/<bus id>/numa_node; -1 when the host reports none, as one-node hosts and
// many VMs do), and the host's NUMA nodes that have memory (/sys/devices/system/node/has_memory).
struct HostTopology {
  std::string gpu_pci_bus_id;
  int gpu_numa_node = -1;
  std::vector<int> memory_nodes;
};
[[nodiscard]] absl::StatusOr<HostTopology> GetHostTopology(int device);

// The host -> GPU link as SparseDecodeAttention's sequences use it, measured on a pinned host
// buffer placed as SparseSequenceOptions::host_numa_node (-1: cudaHostAlloc): the ceilings `kvr
// bench decode` prints its gather rates against. Each figure is the best of `repeats` timed runs
// (CUDA events), after one untimed run; each probe's copy is checked against the host buffer.
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
// The gather's shape over a region already mapped for the GPU (e.g. a KV store's whole pool,
// RegisterHostRegion): GB/s of reading sample_bytes of random 512-byte rows spread over all
// src_bytes (so that address translation covers the region's size), best of `repeats` after one
// untimed run, the rows checked against `host` (the same region's host address).
[[nodiscard]] absl::StatusOr<double> MeasureMappedRows(const void* host, const void* device_src,
                                                       int64_t src_bytes, int64_t sample_bytes,
                                                       int repeats);

}  // namespace kvr::retrieval::cuda
