#pragma once
// The pariskv lane of the GPU sparse decode (SparseDecodeOptions::lanes): sequences whose
// selection is ParisKV's (retrieval/src/pariskv.cc), made on the GPU by ParisKvSelect
// (retrieval/cuda/select), beside the configured method's sequences in the same batch.
//
// Per slot and layer it keeps the CPU index's arrays as ParisKvSelect reads them (selection.cuh:
// 4-bit codes, fp16 weights, per-centroid counts), uploaded at activation from the sequence's
// CPU indexes (the prefill node's summaries, ParisKvLayoutFromIndexes), and extends them on the
// GPU as generated tokens leave the local window: that token's key is read from the row source
// (the store's page, where the decode node appended it `local_window` steps earlier), widened to
// fp32 and encoded by ParisKvEncode, whose bytes equal the CPU index's Append of the same key.
// So a lane sequence selects exactly as the CPU index would on the same (bf16-valued) keys and
// queries.
//
// Layouts, per layer l (P = padded head_dim, B = P / m sub-spaces, 2^m centroids):
//   codes   uint8  [n_layers, slots, n_kv_heads, max_tokens, P / 2]
//   weights uint16 [n_layers, slots, n_kv_heads, max_tokens, B]
//   counts  uint32 [n_layers, slots, n_kv_heads, B, 2^m]
// Sequences must share the lane's codec per layer (the first one activated sets it) and use
// ParisKvOptions' defaults (the caller checks the options); others are refused at activation.

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvr/common/cuda/cuda_util.h"
#include "kvr/common/cuda/kv_pool.h"
#include "kvr/model/config.h"
#include "kvr/retrieval/cuda/selection.cuh"
#include "kvr/retrieval/index.h"

namespace kvr::retrieval::cuda {

class ParisKvLane {
 public:
  // GPU state for `slots` sequences of up to `max_tokens` tokens; selections of `budget` rows.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<ParisKvLane>> Create(
      const model::ModelConfig& config, int slots, int64_t max_tokens, int budget,
      cudaStream_t stream);

  int64_t bytes() const { return bytes_; }

  // The slot's state from the sequence's CPU indexes ([n_layers], each over n_tokens tokens).
  // InvalidArgument when an index is not pariskv, has another codec than the lane's, or holds
  // more tokens than the lane. Synchronous.
  [[nodiscard]] absl::Status Activate(int slot, std::span<const RetrievalIndex* const> layers,
                                      int64_t n_tokens, cudaStream_t stream);

  // A step's plan (host): Clear, then per lane slot of the batch its candidate range, the tokens
  // its index will cover after this step, the position to encode first (-1: none) and its
  // budget (<= the lane's; one selection per distinct budget of the step).
  void Clear();
  void Add(int slot, int32_t cand_begin, int32_t cand_end, int32_t n_tokens, int64_t encode,
           int budget);
  bool empty() const { return planned_.empty(); }
  // Uploads the plan (stream-ordered before the step's layers).
  [[nodiscard]] absl::Status Begin(cudaStream_t stream);
  // Per layer: encode the tokens that left the window (keys read through `pool`, this layer's
  // row pages), select for the lane's slots and write their rows of `out` (the other slots'
  // rows are left as they are).
  [[nodiscard]] absl::Status Select(int layer, const float* query,
                                    const kvr::cuda::KvPoolView& pool, int max_candidates,
                                    const SelectionOutput& out, cudaStream_t stream);

 private:
  ParisKvLane() = default;
  int n_layers_ = 0, n_heads_ = 0, n_kv_ = 0, head_dim_ = 0, slots_ = 0, budget_ = 0;
  int64_t max_tokens_ = 0;
  int padded_ = 0, sub_ = 0, centroids_ = 0;  // P, B, 2^m
  std::vector<ParisKvCodec> codec_;           // per layer
  std::vector<bool> codec_set_;
  int64_t bytes_ = 0;
  kvr::cuda::DeviceBuffer<uint8_t> codes_;
  kvr::cuda::DeviceBuffer<uint16_t> weights_;
  kvr::cuda::DeviceBuffer<uint32_t> counts_;
  kvr::cuda::DeviceBuffer<int32_t> meta_;  // see pariskv_lane.cu (kTokens ...)
  kvr::cuda::PinnedBuffer<int32_t> h_meta_;
  kvr::cuda::DeviceBuffer<int32_t> ids_, sel_counts_;  // the lane's selection [slots, kv, budget]
  kvr::cuda::DeviceBuffer<float> keys_;                // [slots, kv, head_dim] keys to encode
  kvr::cuda::DeviceBuffer<uint8_t> ws_;
  size_t ws_bytes_ = 0;
  struct Planned {
    int slot;
    int64_t encode;
    int budget;
    int32_t cand_begin, cand_end, n_tokens;
  };
  std::vector<Planned> planned_;  // by budget after Begin
  struct Group {
    int budget, first, n;  // planned_[first, first + n) select `budget` rows
  };
  std::vector<Group> groups_;
};

}  // namespace kvr::retrieval::cuda
