#pragma once
// The CUDA DecodeBackend (backend.h) and the backend choice of kvr-decode (--device).
//
// CUDA backend: one model::CudaModel (bf16 weights on one GPU) whose sparse sequences
// (cuda_model.h) are the running sequences: the GPU keeps sink rows, a window ring, quest page
// bounds and a hot cache per slot; the full KV of each sequence sits in pinned host memory
// mapped into the GPU, read zero-copy by the per-layer gather.
// - ONE method, budget, sink and window for all slots (ConfigureSparse at creation, from the
//   node's settings). A handoff with another method, a bigger budget or another sink/window is
//   refused (InvalidArgument naming the field and the node's setting); a smaller budget runs at
//   the node's budget (more rows, never fewer). Methods: quest, and clusterkv with the
//   handed-off clusters (the prefill node's k-means, parsed at Prepare with options.registry).
// - Prepare (the handoff's thread): pulls ALL the sequence's rows [0, prompt_tokens) from the
//   store with RangeRead, layer by layer in chunks, through a host staging buffer, converting
//   float32 -> bf16 (round to nearest even; bf16 store rows are copied as they are) into a
//   pinned host KV of the model's pool (AcquireSparseHostKv), so the running batch does not wait
//   for the store; beyond `slots` sequences pulled but not joined, the pull waits for Join (on
//   the loop thread, while the batch waits). Join adopts the host KV, copies the sink/window
//   rows to the GPU ring and REBUILDS the quest bounds on the GPU from those rows (clusterkv:
//   uploads the handed-off clusters); the handed-off sink/local rows are not used (the rows
//   are needed anyway, and bounds over the bf16 keys are the ones the GPU's own per-token
//   updates keep).
// - Not done: UCX into CUDA memory and rkey_ptr zero-copy of the store's pool (the store's rows
//   are copied once into this node's pinned memory); generated rows stay in the sequence's host
//   KV and are not appended to the store.
// - Step: one CudaModel::Forward over the running sequences (logits back for the engine's
//   Sampler). Node counters: the rows/bytes pulled at join, range reads, one attend call per
//   layer and step; per-step selection/hot-cache counts stay on the GPU (not reported).
// This header has no CUDA types; in a build without CUDA the factories answer errors.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvr/decode/backend.h"
#include "kvr/decode/config.h"
#include "kvr/decode/engine.h"
#include "kvr/model/cuda_model.h"
#include "kvr/model/model.h"
#include "kvr/retrieval/registry.h"

namespace kvr::decode {

struct CudaDecodeBackendOptions {
  int device = 0;  // for name() only: the model was made on it
  int slots = 8;   // sequences at once (the engine's batch_slots)
  std::string method = "quest";
  int budget = 1024;
  int n_sink = 16;
  int local_window = 256;
  int64_t max_context = 0;  // tokens per sequence (host KV per slot); 0: the model's context
  int64_t hot_cache_bytes = 64 << 20;  // over all slots, layers and KV heads
  int64_t staging_bytes = 64 << 20;    // host staging of one RangeRead at join
  // clusterkv: the handed-off summaries are parsed with it (the node's; not owned, outlives the
  // backend). Required for clusterkv, unused by quest.
  const retrieval::MethodRegistry* registry = nullptr;
};

// The checks the CUDA backend's Prepare makes against its one configuration (exposed for tests
// without a GPU): InvalidArgument "handoff of sequence <id>: <field> ... (this node: ...)".
[[nodiscard]] absl::Status CheckHandoffForCudaBackend(const Handoff& h,
                                                     const CudaDecodeBackendOptions& options);

// The CUDA backend over `model` (owned): ConfigureSparse with the options. Errors name the
// option the model refused.
[[nodiscard]] absl::StatusOr<std::unique_ptr<DecodeBackend>> CreateCudaDecodeBackend(
    std::unique_ptr<model::CudaModel> model, const CudaDecodeBackendOptions& options);

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
