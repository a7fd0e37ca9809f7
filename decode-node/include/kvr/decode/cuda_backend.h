#pragma once
// The CUDA DecodeBackend (backend.h) and the backend choice of kvr-decode (--device).
//
// CUDA backend: one model::CudaModel (bf16 weights on one GPU) and its sparse decode (the
// model's per-layer attention hook, retrieval/cuda/decode: sparse_decode.h), whose sequences are
// the running sequences. The GPU keeps, per slot, the sink rows, a window ring,
// the method's summaries and a hot cache; the sequence's past stays in the KV store, and the
// per-layer gather reads the selected rows that miss the hot cache straight from the store's
// pages (the store's pool mapped read-only into this process and registered with CUDA:
// zero-copy over PCIe). The node holds no copy of a sequence's past.
// - ONE GPU method (quest, or clusterkv with the handed-off clusters, the prefill node's
//   k-means), budget, sink and window for all slots (SparseDecodeAttention::Configure at
//   creation, from the node's settings). A request for ANY OTHER method of the node's registry
//   (full, exact, streaming, ctkvr, pariskv, a2ats, keydiff, or the other GPU method) runs in the
//   same batch with its selection made on the host: the method's CPU index per layer,
//   deserialized from the handed-off summaries and fed the generated keys as they leave the
//   window, as on the CPU backend (one synchronization per layer of a step that has such a
//   sequence); the GPU gathers and attends its selection like any other. A handoff with a bigger
//   budget or another sink/window is refused (InvalidArgument naming the field and the node's
//   setting), and so is `full` when its rows exceed gpu_budget (the rows one step gathers)
//   and its KV could not run densely (dense_bytes; rows read in place);
//   every other request runs at its own budget, whichever selector serves it (the GPU method
//   takes a budget per slot).
// - Prepare (the handoff's thread): checks the store sequence (shape, bf16 rows, the prompt's
//   rows committed), reserves its store pages for every row it will hold (prompt + max_tokens,
//   KvStoreClient::ReservePageTable) and maps the store's pool (MapLocalPool, once per store;
//   a store on another host is refused: FailedPrecondition). Join uploads the page tables, copies
//   the sink/window rows from the store pages to the GPU ring and builds the quest bounds from
//   the store's keys on the GPU (clusterkv: uploads the handed-off clusters).
// - Step: one Forward of the sparse decode (the model's ForwardWithAttention) over the running
//   sequences (logits back for the engine's Sampler); then each sequence's new K/V rows (all
//   layers) are appended to the store at their position, asynchronously (one put per layer), waited
//   for at the next step: a row is read from the store only once it has left the local window, many
//   steps later.
// - Counters per sequence (at Leave): rows selected, hot-cache hits and misses, rows and bytes
//   fetched across the link (= misses), rows offloaded; a failed append ends the sequence with
//   UNAVAILABLE (TakeFailures).
// - Rows fetched instead (row_source fetch, or auto with a store on another host): no page table
//   and no mapping; the sink and window rows are read once at Join and, per layer of each step,
//   the selected rows that miss the hot cache, one gather request per sequence through the
//   store client's data plane (UCX), into pinned staging the GPU reads (SparseRowFetcher). Such
//   a sequence's selector reads no rows: quest (whose GPU summaries and lanes read keys from the
//   pages) is selected on the host by its handed-off index, clusterkv on the GPU from its
//   handed-off clusters. A failed read ends the sequence with UNAVAILABLE (TakeFailures).
// This header has no CUDA types; in a build without CUDA the factories answer errors.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvr/decode/backend.h"
#include "kvr/decode/config.h"
#include "kvr/decode/engine.h"
#include "kvr/model/cuda_model.h"
#include "kvr/model/model.h"
#include "kvr/retrieval/cuda/sparse_decode.h"
#include "kvr/retrieval/registry.h"

namespace kvr::decode {

struct CudaDecodeBackendOptions {
  int device = 0;  // for name() only: the model was made on it
  int slots = 8;   // sequences at once (the engine's batch_slots)
  std::string method = "quest";
  // Methods selected on the GPU beside `method`, by lanes of the sparse decode built from the
  // handed-off CPU indexes (SparseDecodeOptions::lanes): "exact", "pariskv", "keydiff", "ctkvr",
  // "a2ats" (with method_assets). A request for one with method options of its own is selected on
  // the host.
  std::vector<std::string> lanes;
  int budget = 1024;
  int n_sink = 16;
  int local_window = 256;
  int64_t max_context = 0;  // tokens per sequence (host KV per slot); 0: the model's context
  int64_t hot_cache_bytes = 64 << 20;  // over all slots, layers and KV heads
  // > 0: the hot cache takes this fraction of the GPU memory still free once the weights and
  // the sparse state are allocated (on top of hot_cache_bytes), up to max_context rows per
  // (slot, layer, KV head): sized by the GPU, not by a fixed byte budget. Memory later wanted
  // by others on the same GPU (a prefill node there) is not counted: leave them room.
  double hot_cache_fraction = 0;
  // Smallest store page (in rows) the node takes: sizes the GPU page tables
  // (SparseDecodeOptions::min_page_rows). A 16 KiB page holds 64 bf16 rows at head_dim 64.
  int min_page_rows = 64;
  // Where a sequence's rows are read (DecodeConfig::gpu_row_source): "in-place" (the store's
  // pool mapped; a store on another host is refused), "fetch" (always through the store's data
  // plane), "auto" (in place when the store offers its pool on this host, else fetched).
  std::string row_source = "in-place";
  // The store dtype of every sequence's rows (DecodeConfig::gpu_row_format): "bf16", or "fp8"
  // (kv_store::DType::kFp8E4m3: read in place or fetched as SparseDecodeOptions::row_format
  // kFp8E4m3, half the bytes a bf16 row moves, and kept fp8 in the hot cache; no lanes). A
  // sequence of the other dtype is refused.
  std::string row_format = "bf16";
  // The node's registry (not owned, outlives the backend): clusterkv's handed-off clusters are
  // parsed with it, and a request for a method other than `method` is selected on the host by
  // the method's CPU index deserialized with it (none: only `method` is served).
  const retrieval::MethodRegistry* registry = nullptr;
  // Method assets of the host-selected methods (a2ats' codebooks); may be null.
  std::shared_ptr<const retrieval::MethodAssets> method_assets;
  // Dense when it pays: a sequence whose rows are read in place and that holds at most
  // dense_max_tokens (prompt + max_tokens) runs densely, its whole KV in HBM (the model's own
  // dense sequence, filled from the store's pages at Join) in the same batch as the sparse ones,
  // where sparse decoding would not be faster (measured: BENCHMARKS.md "Where sparse stops
  // paying"); so does a `full` request of any length. Their KV takes at most dense_bytes of HBM
  // together; a sequence that finds no room runs sparse (`full`: ResourceExhausted). Their
  // generated rows are not appended to the store (nothing reads them there: the window and the
  // dense cache hold them). 0: none. dense_bytes_per_token is the model's KV per token (set by
  // CreateCudaDecodeBackend; the admission check reads it).
  int64_t dense_max_tokens = 0;
  int64_t dense_bytes = 0;
  int64_t dense_bytes_per_token = 0;
};

// The checks the CUDA backend's Prepare makes against its one configuration (exposed for tests
// without a GPU): InvalidArgument "handoff of sequence <id>: <field> ... (this node: ...)".
[[nodiscard]] absl::Status CheckHandoffForCudaBackend(const Handoff& h,
                                                      const CudaDecodeBackendOptions& options);

// The CUDA backend over `model` (owned): a sparse decode over it (CreateSparseDecodeAttention),
// configured with the options. Errors name the
// option the model refused. `observer` (may be null; not owned, outlives the backend) gets each
// step's hot-cache hits and misses, bytes fetched and appended, and the resident summary bytes.
[[nodiscard]] absl::StatusOr<std::unique_ptr<DecodeBackend>> CreateCudaDecodeBackend(
    std::unique_ptr<model::CudaModel> model, const CudaDecodeBackendOptions& options,
    DecodeObserver* observer = nullptr);
// As above, with the sparse decode over `model` made by the caller (CreateSparseDecodeAttention;
// the backend configures it): a benchmark keeps a pointer to it to run raw steps over the
// running sequences. InvalidArgument when `sparse` is null or not over `model`.
[[nodiscard]] absl::StatusOr<std::unique_ptr<DecodeBackend>> CreateCudaDecodeBackend(
    std::unique_ptr<model::CudaModel> model,
    std::unique_ptr<retrieval::cuda::SparseDecodeAttention> sparse,
    const CudaDecodeBackendOptions& options, DecodeObserver* observer = nullptr);

// The backend `config.device` names: "cpu" over `model` (not owned; with the config's
// hot_cache_bytes, quality_sample_rate and `assets`), or "cuda": `model`'s weights uploaded once
// to GPU config.cuda_device, sparse state from the gpu_* settings. Errors name the setting:
// FailedPrecondition for "cuda" in a build without CUDA or on a machine without a usable GPU;
// InvalidArgument for settings the CUDA backend cannot take (quality_sample_rate > 0,
// gpu_max_context above the model's context, limits of the GPU selector).
[[nodiscard]] absl::StatusOr<std::unique_ptr<DecodeBackend>> MakeDecodeBackend(
    const DecodeConfig& config, const model::Model* model,
    const retrieval::MethodRegistry* registry,
    std::shared_ptr<const retrieval::MethodAssets> assets, DecodeObserver* observer);

}  // namespace kvr::decode
