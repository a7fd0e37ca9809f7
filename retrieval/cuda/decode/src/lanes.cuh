#pragma once
// GPU lanes of the sparse decode (SparseDecodeOptions::lanes): retrieval methods selected on
// the GPU beside the configured method's sequences, in the same batch. A lane keeps its own GPU
// state per slot (built at activation from the sequence's CPU indexes, the prefill node's
// summaries), selects for its slots only (the other slots see empty candidate ranges) at each
// sequence's budget (one selection per distinct budget of a step, into the lane's rows), and
// copies its slots' selections into the step's selection, which the hot-cache gather and the
// attention then read as any other.
//
//   exact    ExactSelect over the keys read in place from the row source (the store's pages,
//            paged KeyView): no state of its own; the true GQA-aggregated top-k.
//   pariskv  ParisKvSelect over the CPU index's 4-bit codes, fp16 weights and per-centroid
//            counts ([n_layers, slots, n_kv_heads, max_tokens, ...]), uploaded at activation
//            (ParisKvLayoutFromIndexes) and extended on the GPU as generated tokens leave the
//            window: that token's key is read from the row source (where the decode node
//            appended it `local_window` steps earlier), widened to fp32 and encoded by
//            ParisKvEncode, whose bytes equal the CPU index's Append of the same key. Sequences
//            must share the lane's codec per layer (the first activated sets it) and use
//            ParisKvOptions' defaults (the caller checks the options).
//   keydiff  KeyDiffIndex::Select over the CPU index's scores ([n_layers, slots, n_kv_heads,
//            max_tokens] fp32, uploaded at activation through KeyDiffStateOf, no bytes parsed),
//            with the running key sums in double: a token leaving the window is read from the
//            row source, added to its head's sum and scored against it as KeyDiffTracker does,
//            to the last bit. The lane's sequences share one fill (the first activated sets it).
//   a2ats    A2atsSelect over the CPU index's codeword ids ([n_layers, slots, n_kv_heads,
//            max_tokens] u16, uploaded at activation through A2atsLayoutFromIndexes) and the
//            node's codebooks (SparseDecodeOptions::method_assets: L, L^-1, C^z and |C^z|^2 / 2
//            per layer, uploaded with the layer's first sequence); a token leaving the window is
//            read from the row source, un-rotated to pre-RoPE and assigned its nearest codeword
//            in the H-metric, as the CPU index's Append does.
//   ctkvr    CtkvrSelect over the CPU index's qcIVF (centroids, norms, thresholds and lists in
//            fixed-capacity rows per sequence, allocated at activation), grown by the token
//            leaving the window and rotated by the FIFO update after each selection on the GPU,
//            as the CPU index's Append and Select do (ctkvr_lane.cu).
// Each selects as the method's CPU index would on the same (bf16-valued) keys and queries
// (exact up to the order of its fp32 sums).

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvr/common/cuda/cuda_util.h"
#include "kvr/common/cuda/kv_pool.h"
#include "kvr/model/config.h"
#include "kvr/retrieval/cuda/selection.cuh"
#include "kvr/retrieval/index.h"

namespace kvr::retrieval::cuda {

class GpuLane {
 public:
  virtual ~GpuLane() = default;
  const std::string& method() const { return method_; }
  // Device bytes held (state, plan, selection rows, workspace).
  int64_t bytes() const { return bytes_; }

  // The slot's state from the sequence's CPU indexes ([n_layers], each over n_tokens tokens) for
  // a sequence that may grow to `capacity` tokens. InvalidArgument when the indexes do not fit
  // the lane (method, codec, size, GPU memory for a per-sequence state). Synchronous.
  [[nodiscard]] virtual absl::Status Activate(int slot,
                                              std::span<const RetrievalIndex* const> layers,
                                              int64_t n_tokens, int64_t capacity,
                                              cudaStream_t stream) = 0;

  // A step's plan (host): Clear, then per lane slot of the batch its candidate range, the tokens
  // its state covers after this step, the position that leaves the window this step (-1: none),
  // its budget (<= the lane's) and the position of its query (the token decoded this step).
  void Clear();
  void Add(int slot, int32_t cand_begin, int32_t cand_end, int32_t n_tokens, int64_t leaving,
           int budget, int64_t position);
  bool empty() const { return planned_.empty(); }
  // Uploads the plan (stream-ordered before the step's layers).
  [[nodiscard]] absl::Status Begin(cudaStream_t stream);
  // Per layer: the lane's upkeep (Prepare), then its selections; writes its slots' rows of `out`
  // (budget = the lane's), leaving the other slots' rows as they are. `pool`: this layer's rows.
  [[nodiscard]] absl::Status Select(int layer, const float* query,
                                    const kvr::cuda::KvPoolView& pool, int max_candidates,
                                    const SelectionOutput& out, cudaStream_t stream);

 protected:
  struct Planned {
    int slot;
    int64_t leaving;
    int budget;
    int32_t cand_begin, cand_end, n_tokens;
    int64_t position;
  };
  // Sets the shape and allocates the plan and selection rows; `bytes_` counts them.
  [[nodiscard]] absl::Status Init(std::string method, const model::ModelConfig& config, int slots,
                                  int64_t max_tokens, int budget);
  // Activate's checks every lane with state makes: one index per layer, each over `n_tokens`
  // tokens, at most max_tokens_ (InvalidArgument naming the lane and what does not fit).
  [[nodiscard]] absl::Status CheckIndexes(std::span<const RetrievalIndex* const> layers,
                                          int64_t n_tokens) const;
  // Before a layer's selections (pariskv: the leaving tokens' codes).
  [[nodiscard]] virtual absl::Status Prepare(int layer, const kvr::cuda::KvPoolView& pool,
                                             cudaStream_t stream) {
    return absl::OkStatus();
  }
  // One selection over every slot (others have empty ranges) into `out` (the lane's rows).
  [[nodiscard]] virtual absl::Status SelectGroup(int layer, const float* query,
                                                 const kvr::cuda::KvPoolView& pool,
                                                 const CandidateRanges& cand, int max_candidates,
                                                 const SelectionOutput& out,
                                                 cudaStream_t stream) = 0;
  // Device rows of the uploaded plan: planned slots (by budget), per-slot tokens and leaving
  // positions (-1: none).
  const int32_t* planned_slots() const;
  const int32_t* slot_tokens() const;
  const int32_t* slot_leaving() const;
  // A selector's attention shape over `batch` sequences: the model's.
  template <typename P>
  void SetSelectShape(P& p, int batch) const {
    SetAttentionShape(p, batch, n_heads_, n_kv_, head_dim_);
  }
  // A SelectGroup call's candidates, output rows and the lane's selector workspace.
  template <typename P>
  static void SetSelectCall(P& p, const CandidateRanges& cand, int max_candidates,
                            const SelectionOutput& out, void* workspace, size_t workspace_bytes) {
    p.cand = cand;
    p.max_candidates = max_candidates;
    p.out = out;
    p.workspace = workspace;
    p.workspace_bytes = workspace_bytes;
  }

  std::string method_;
  int n_layers_ = 0, n_heads_ = 0, n_kv_ = 0, head_dim_ = 0, slots_ = 0, budget_ = 0;
  int64_t max_tokens_ = 0;  // tokens per slot the lane's state holds
  int64_t bytes_ = 0;
  std::vector<Planned> planned_;  // by budget after Begin

 private:
  struct Group {
    int budget, first, n;  // planned_[first, first + n) select `budget` rows
  };
  std::vector<Group> groups_;
  kvr::cuda::DeviceBuffer<int32_t> meta_;  // see lanes.cu (kTokens ...)
  kvr::cuda::PinnedBuffer<int32_t> h_meta_;
  kvr::cuda::DeviceBuffer<int32_t> ids_, counts_;  // the lane's selection [slots, kv, budget]
};

// The lanes (see the top of this file), for `slots` sequences of up to `max_tokens` tokens,
// selecting at most `budget` rows per KV head.
[[nodiscard]] absl::StatusOr<std::unique_ptr<GpuLane>> CreateExactLane(
    const model::ModelConfig& config, int slots, int64_t max_tokens, int budget,
    cudaStream_t stream);
[[nodiscard]] absl::StatusOr<std::unique_ptr<GpuLane>> CreateParisKvLane(
    const model::ModelConfig& config, int slots, int64_t max_tokens, int budget,
    cudaStream_t stream);
[[nodiscard]] absl::StatusOr<std::unique_ptr<GpuLane>> CreateKeyDiffLane(
    const model::ModelConfig& config, int slots, int64_t max_tokens, int budget,
    cudaStream_t stream);
// `local_window`: the decode's window (bounds the lists a FIFO update writes).
[[nodiscard]] absl::StatusOr<std::unique_ptr<GpuLane>> CreateCtkvrLane(
    const model::ModelConfig& config, int slots, int64_t max_tokens, int budget, int local_window,
    cudaStream_t stream);
// `assets`: the node's a2ats codebooks (FailedPrecondition without them).
[[nodiscard]] absl::StatusOr<std::unique_ptr<GpuLane>> CreateA2atsLane(
    const model::ModelConfig& config, int slots, int64_t max_tokens, int budget,
    std::shared_ptr<const MethodAssets> assets, cudaStream_t stream);
// The lane of `method` (one of kGpuLaneMethods, sparse_decode.h); InvalidArgument otherwise.
// `assets`: the node's method assets (a2ats: its codebooks; may be null for the others).
[[nodiscard]] absl::StatusOr<std::unique_ptr<GpuLane>> CreateGpuLane(
    std::string_view method, const model::ModelConfig& config, int slots, int64_t max_tokens,
    int budget, int local_window, std::shared_ptr<const MethodAssets> assets, cudaStream_t stream);

}  // namespace kvr::retrieval::cuda
