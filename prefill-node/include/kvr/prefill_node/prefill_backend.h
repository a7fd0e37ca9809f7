#pragma once
// The prefill node's model backend seam: PrefillEngine runs a prompt through a
// PrefillBackend and gets, per layer, as soon as the layer is final, ALL its K/V rows [0, L) as
// float32 host memory plus its last prefill queries (a LayerTask), while the later layers still
// compute. The engine does not care where the forward ran:
// - the CPU backend (MakeCpuPrefillBackend): model::Model::Prefill with dense attention wrapped
//   so that each layer's last chunk hands out the KvCache's rows;
// - the CUDA backend (prefill_cuda_backend.h): model::CudaModel with its per-layer KV export
//   (cuda_model.h, KvExportOptions): rows converted to float32 on the GPU and copied
//   device-to-host into pinned buffers on a copy stream, overlapped with the next layers.
// Either way the engine puts the rows to the store in EngineOptions::store_dtype (bf16 narrows
// the CUDA backend's widened bf16 values back exactly), so decode nodes see no difference.

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvr/model/attention.h"
#include "kvr/model/config.h"
#include "kvr/model/cuda_model.h"
#include "kvr/model/model.h"
#include "kvr/retrieval/index.h"

namespace kvr::prefill_node {

// One layer, final: its rows and last queries. The pointers are views into memory owned by the
// PrefillRows of the Prefill call that made the task (valid until that object is destroyed).
struct LayerTask {
  int layer = 0;
  model::KvView kv;                // rows [0, L), float32, row_stride >= n_kv_heads * head_dim
  // Or, when the backend exports bf16 rows (PrefillCall::bf16_rows and a backend that keeps its
  // cache in bf16: CUDA), rows [0, L) as bf16 bits, K and V each [L, n_kv_heads * head_dim];
  // kv.k / kv.v are then null (kv.n_rows and row_stride still set).
  const uint16_t* k_bf16 = nullptr;
  const uint16_t* v_bf16 = nullptr;
  const float* queries = nullptr;  // [n_queries, n_heads, head_dim], RoPE applied
  int64_t n_queries = 0;
  int64_t queries_first_position = 0;  // L - n_queries
  // When the backend built the layer's retrieval summary itself (the CUDA backend: quest and
  // clusterkv on the GPU while the prompt runs), its shipped bytes as SerializeIndex writes them
  // for the CPU index in the same state, given the layer's shape; called on the engine's worker
  // thread, valid as long as the views above. Empty: the engine builds the index from `kv`.
  std::function<absl::StatusOr<std::vector<uint8_t>>(const retrieval::IndexShape&)> summary;
};

// Owns the memory that a Prefill call's LayerTasks point into (a KvCache, pinned export
// buffers and the sequence on the GPU). Destroy it only after every consumer of those views is
// done (the engine: after the store puts completed), under the same exclusion as Prefill.
class PrefillRows {
 public:
  virtual ~PrefillRows() = default;
};

struct PrefillCall {
  model::SequenceId sequence = 0;
  std::span<const int32_t> ids;  // the prompt, L = ids.size() >= 1
  int64_t chunk_tokens = 512;    // prompt tokens per forward chunk (at most; a backend may cap
                                 // it: PrefillBackend::ChunkTokens says to what)
  int64_t max_queries = 512;     // last prefill queries per layer in each LayerTask
  // The request's retrieval method and parameters (clusterkv.* options applied or not): a
  // backend may build that method's summaries itself and hand them out in LayerTask::summary.
  std::string method;
  const retrieval::IndexParams* params = nullptr;
  // The rows go to the store as bf16 (a bf16 store, or an fp8 one, which takes bf16): a backend
  // whose cache holds bf16 may hand them out as such (LayerTask::k_bf16 / v_bf16) instead of
  // widening them to float32.
  bool bf16_rows = false;
  // Prefix reuse: rows [0, prefix_rows) of the prompt are not computed but loaded, before the
  // rest is, in chunks of chunk_tokens from prefix_rows (prefix_rows a multiple of
  // PrefixAlignment()). load_prefix(layer, k, v) fills the layer's K and V of those rows
  // ([prefix_rows, n_kv_heads * head_dim] floats each, as the model's cache holds them). The
  // layer tasks still cover all rows [0, L); their queries are those of the computed tokens
  // only. Only for a backend whose SupportsPrefix() is true.
  int64_t prefix_rows = 0;
  std::function<absl::Status(int layer, std::span<float> k, std::span<float> v)> load_prefix;
  // The same rows as bf16 bits, for a backend whose cache holds bf16 (CUDA): exact from a bf16
  // store; from a float32 store the values rounded to nearest even, exact when they are
  // widened bf16 (what a CUDA prefill puts into a float32 store; a CPU prefill's float32 rows
  // would be rounded).
  std::function<absl::Status(int layer, std::span<uint16_t> k, std::span<uint16_t> v)>
      load_prefix_bf16;
  // Called once per layer (in layer order for both backends), possibly from another thread
  // (the CUDA backend: a CUDA runtime thread); must neither block nor call CUDA: queue the task.
  std::function<void(LayerTask&&)> on_layer;
  // Polled at least once per chunk (the CPU backend: per layer and chunk); an error stops the
  // prefill and is returned.
  std::function<absl::Status()> check;
};

class PrefillBackend {
 public:
  virtual ~PrefillBackend() = default;
  virtual const model::ModelConfig& config() const = 0;
  // "cpu" or "cuda:<device>", for logs and the effective config.
  virtual std::string name() const = 0;
  // Whether Prefill honours PrefillCall::prefix_rows (else the engine computes the whole
  // prompt), and the multiple of rows a prefix must end on for the rest to come out bit for
  // bit as a cold prefill computes it (0: only whole chunks, of ChunkTokens()).
  virtual bool SupportsPrefix() const { return false; }
  virtual int64_t PrefixAlignment() const { return 0; }
  // The chunk length Prefill really computes in when asked for `requested` tokens per chunk (a
  // backend may cap it). The engine aligns a reused prefix to it, so that the computed chunks
  // are a cold prefill's.
  virtual int64_t ChunkTokens(int64_t requested) const { return requested; }
  // Runs the prompt; returns the logits of its last token [vocab]. `rows` is set before the
  // first on_layer call (also when Prefill then fails). One call at a time per backend.
  [[nodiscard]] virtual absl::StatusOr<std::vector<float>> Prefill(
      const PrefillCall& call, std::unique_ptr<PrefillRows>* rows) = 0;
};

// The CPU backend over `model` (not owned; must outlive the backend).
std::unique_ptr<PrefillBackend> MakeCpuPrefillBackend(const model::Model* model);

}  // namespace kvr::prefill_node
