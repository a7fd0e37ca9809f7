#pragma once
// The CUDA PrefillBackend (prefill_backend.h) and the backend choice of kvr-prefill (--device).
//
// CUDA backend: one model::CudaModel (bf16 weights on one GPU), one request at a time. A
// Prefill adds a dense sequence of capacity L, starts its KV export (cuda_model.h,
// KvExportOptions: per layer, float32 rows [0, L) and the last max_queries queries copied
// device-to-host into pinned buffers on a copy stream while the next layers compute), runs the
// prompt in chunks of min(chunk_tokens, the model's max_batch_tokens), and hands each layer to
// on_layer from the CUDA runtime's callback thread as soon as its copies of the last chunk are
// done. With PrefillCall::prefix_rows P, the reused rows go into the cache first
// (CudaModel::AppendRows, filled by load_prefix_bf16 into the export's buffer, so the layers
// still cover [0, L)) and the chunks start at P. `check` is polled before every chunk (a chunk
// runs all layers in one Forward) and before each prefix layer's load. The
// PrefillRows it returns end the export and free the sequence; the pinned buffers go back to
// the model's pool for the next request.
// This header has no CUDA types; in a build without CUDA the factories answer Unimplemented.

#include <memory>

#include "absl/status/statusor.h"
#include "kvr/model/cuda_model.h"
#include "kvr/model/model.h"
#include "kvr/prefill_node/config.h"
#include "kvr/prefill_node/prefill_backend.h"

namespace kvr::prefill_node {

// A backend over `model` (owned). `max_chunk_tokens` must not exceed the model's
// max_batch_tokens (the caller made the model; it is what chunks are capped to).
// gpu_summaries: for a call whose method has a GPU builder that ships (quest, clusterkv:
// retrieval/cuda/.../prefill_summaries.h), the summaries are built on the GPU while the prompt
// runs (the sequence's per-layer build hook with the call's IndexParams; the chunk that
// completes the prompt builds) and exported with each layer's rows (LayerTask::summary), so the
// engine only serialises them; other methods leave it unset.
[[nodiscard]] absl::StatusOr<std::unique_ptr<PrefillBackend>> CreateCudaPrefillBackend(
    std::unique_ptr<model::CudaModel> model, int device, int64_t max_chunk_tokens,
    bool gpu_summaries = true);

// The backend `config.device` names: "cpu" over `model` (not owned), or "cuda": the weights of
// `model` uploaded once to GPU `config.cuda_device` (activations sized for config.chunk_tokens).
// Errors name the setting: FailedPrecondition for "cuda" in a build without CUDA or on a machine
// without a usable GPU, the CUDA error for a bad device ordinal or a model that does not fit.
[[nodiscard]] absl::StatusOr<std::unique_ptr<PrefillBackend>> MakePrefillBackend(
    const PrefillConfig& config, const model::Model* model);

}  // namespace kvr::prefill_node
