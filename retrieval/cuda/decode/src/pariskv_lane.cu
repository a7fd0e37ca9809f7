// The pariskv lane of the GPU sparse decode (lanes.cuh).

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kvr/common/status.h"
#include "lanes.cuh"

namespace kvr::retrieval::cuda {
namespace {

using kvr::cuda::Alloc;

// The K half of row `pos` of (slot, h) for every KV head, bf16 -> fp32 into keys [slots, kv, d].
// Block i: the i-th planned slot (list[i]), skipped when no token leaves its window.
__global__ void PoolKeysKernel(kvr::cuda::KvPoolView pool, const int32_t* list,
                               const int32_t* leaving, int n_kv, int head_dim, float* keys) {
  const int slot = list[blockIdx.x];
  const int32_t pos = leaving[slot];
  if (pos < 0) return;
  const size_t row_bytes = 2 * static_cast<size_t>(head_dim) * sizeof(__nv_bfloat16);
  for (int i = threadIdx.x; i < n_kv * head_dim; i += blockDim.x) {
    const int h = i / head_dim, j = i % head_dim;
    const auto* row = static_cast<const __nv_bfloat16*>(
        kvr::cuda::KvPoolRow(pool, int64_t{slot} * n_kv + h, pos, row_bytes));
    keys[(int64_t{slot} * n_kv + h) * head_dim + j] = __bfloat162float(row[j]);
  }
}

class ParisKvLane final : public GpuLane {
 public:
  absl::Status Create(const model::ModelConfig& c, int slots, int64_t max_tokens, int budget,
                      cudaStream_t stream) {
    KVR_RETURN_IF_ERROR(Init("pariskv", c, slots, max_tokens, budget));
    // ParisKvOptions' default sub-space dimension m = 8: B = P / 8 sub-spaces of 256 centroids.
    padded_ = c.head_dim;
    sub_ = padded_ / 8;
    centroids_ = 256;
    codec_.resize(c.n_layers);
    codec_set_.assign(c.n_layers, false);
    const int64_t heads = int64_t{c.n_layers} * slots * c.n_kv_heads;
    KVR_RETURN_IF_ERROR(Alloc(codes_, heads * max_tokens * (padded_ / 2)));
    KVR_RETURN_IF_ERROR(Alloc(weights_, heads * max_tokens * sub_));
    KVR_RETURN_IF_ERROR(Alloc(centroid_counts_, heads * sub_ * centroids_));
    KVR_RETURN_IF_ERROR(Alloc(keys_, int64_t{slots} * c.n_kv_heads * c.head_dim));
    // The workspace depends on the codec's shape only (not its seed or levels).
    ParisKvSelectParams p;
    p.batch = slots;
    p.n_heads = c.n_heads;
    p.n_kv_heads = c.n_kv_heads;
    p.codec.head_dim = c.head_dim;
    p.codec.padded_dim = padded_;
    p.codec.subspace_dim = 8;
    p.max_tokens = static_cast<int>(max_tokens);
    p.max_candidates = static_cast<int>(max_tokens);
    p.out.budget = budget;
    ws_bytes_ = ParisKvSelectWorkspaceBytes(p);
    KVR_RETURN_IF_ERROR(Alloc(ws_, static_cast<int64_t>(ws_bytes_) + 256));
    bytes_ += static_cast<int64_t>(codes_.bytes() + weights_.bytes() + centroid_counts_.bytes() +
                                   keys_.bytes() + ws_.bytes());
    return kvr::cuda::CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }

  absl::Status Activate(int slot, std::span<const RetrievalIndex* const> layers, int64_t n_tokens,
                        int64_t /*capacity*/, cudaStream_t stream) override;

 private:
  absl::Status Prepare(int layer, const kvr::cuda::KvPoolView& pool, cudaStream_t stream) override;
  absl::Status SelectGroup(int layer, const float* query, const kvr::cuda::KvPoolView& pool,
                           const CandidateRanges& cand, int max_candidates,
                           const SelectionOutput& out, cudaStream_t stream) override;

  int padded_ = 0, sub_ = 0, centroids_ = 0;  // P, B, 2^m
  std::vector<ParisKvCodec> codec_;           // per layer
  std::vector<bool> codec_set_;
  kvr::cuda::DeviceBuffer<uint8_t> codes_;
  kvr::cuda::DeviceBuffer<uint16_t> weights_;
  kvr::cuda::DeviceBuffer<uint32_t> centroid_counts_;
  kvr::cuda::DeviceBuffer<float> keys_;  // [slots, kv, head_dim] keys to encode
  kvr::cuda::DeviceBuffer<uint8_t> ws_;
  size_t ws_bytes_ = 0;
};

absl::Status ParisKvLane::Activate(int slot, std::span<const RetrievalIndex* const> layers,
                                   int64_t n_tokens, int64_t, cudaStream_t stream) {
  auto bad = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("pariskv lane: ", parts...));
  };
  KVR_RETURN_IF_ERROR(CheckIndexes(layers, n_tokens));
  const int64_t head_codes = max_tokens_ * (padded_ / 2), head_weights = max_tokens_ * sub_,
                head_counts = int64_t{sub_} * centroids_;
  for (int l = 0; l < n_layers_; ++l) {
    const RetrievalIndex* one[] = {layers[l]};
    KVR_ASSIGN_OR_RETURN(ParisKvHostLayout h, ParisKvLayoutFromIndexes(one));
    const ParisKvCodec& c = h.codec;
    if (c.padded_dim != padded_ || c.subspace_dim != 8 || c.head_dim != head_dim_) {
      return bad("layer ", l, ": codec P ", c.padded_dim, " m ", c.subspace_dim,
                 " (the lane takes m 8)");
    }
    if (codec_set_[l] && (codec_[l].rotation_seed != c.rotation_seed ||
                          !std::equal(c.levels, c.levels + 8, codec_[l].levels))) {
      return bad("layer ", l, ": another codec than the lane's sequences");
    }
    codec_[l] = c;
    codec_set_[l] = true;
    // h: one sequence, [n_kv, max_tokens(h), ...] with h.max_tokens = max(1, n_tokens).
    const int64_t base = (int64_t{l} * slots_ + slot) * n_kv_;
    for (int hh = 0; hh < n_kv_; ++hh) {
      KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(codes_.data() + (base + hh) * head_codes,
                                               h.codes.data() + hh * h.max_tokens * (padded_ / 2),
                                               n_tokens * (padded_ / 2), cudaMemcpyHostToDevice,
                                               stream));
      KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
          weights_.data() + (base + hh) * head_weights, h.weights.data() + hh * h.max_tokens * sub_,
          n_tokens * sub_ * sizeof(uint16_t), cudaMemcpyHostToDevice, stream));
    }
    KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(centroid_counts_.data() + base * head_counts,
                                             h.counts.data(), h.counts.size() * sizeof(uint32_t),
                                             cudaMemcpyHostToDevice, stream));
    // The host layout is freed at the end of this iteration: wait for the copies.
    KVR_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  }
  return absl::OkStatus();
}

absl::Status ParisKvLane::Prepare(int layer, const kvr::cuda::KvPoolView& pool,
                                  cudaStream_t stream) {
  // Tokens that left the window join the slot's codes (one per slot and step at most).
  if (std::none_of(planned_.begin(), planned_.end(),
                   [](const Planned& p) { return p.leaving >= 0; })) {
    return absl::OkStatus();
  }
  PoolKeysKernel<<<static_cast<int>(planned_.size()), 256, 0, stream>>>(
      pool, planned_slots(), slot_leaving(), n_kv_, head_dim_, keys_.data());
  KVR_RETURN_IF_ERROR(kvr::cuda::LastLaunchStatus("PoolKeysKernel"));
  const int64_t layer_heads = int64_t{layer} * slots_ * n_kv_;
  for (const Planned& p : planned_) {
    if (p.leaving < 0) continue;
    const int64_t base = layer_heads + int64_t{p.slot} * n_kv_;
    ParisKvEncodeParams e;
    e.n_tokens = 1;
    e.n_kv_heads = n_kv_;
    e.codec = codec_[layer];
    e.keys.data = keys_.data() + int64_t{p.slot} * n_kv_ * head_dim_;
    e.keys.dtype = KeyDType::kF32;
    e.keys.token_stride = int64_t{n_kv_} * head_dim_;
    e.keys.head_stride = head_dim_;
    e.first = static_cast<int>(p.leaving);
    e.codes = codes_.data() + base * max_tokens_ * (padded_ / 2);
    e.codes_head_stride = max_tokens_ * (padded_ / 2);
    e.weights = weights_.data() + base * max_tokens_ * sub_;
    e.weights_head_stride = max_tokens_ * sub_;
    e.counts = centroid_counts_.data() + base * sub_ * centroids_;
    KVR_RETURN_IF_ERROR(ParisKvEncode(e, stream));
  }
  return absl::OkStatus();
}

absl::Status ParisKvLane::SelectGroup(int layer, const float* query, const kvr::cuda::KvPoolView&,
                                      const CandidateRanges& cand, int max_candidates,
                                      const SelectionOutput& out, cudaStream_t stream) {
  const int64_t layer_heads = int64_t{layer} * slots_ * n_kv_;
  ParisKvSelectParams p;
  SetSelectShape(p, slots_);
  p.codec = codec_[layer];
  p.query = query;
  p.codes = codes_.data() + layer_heads * max_tokens_ * (padded_ / 2);
  p.weights = weights_.data() + layer_heads * max_tokens_ * sub_;
  p.counts = centroid_counts_.data() + layer_heads * sub_ * centroids_;
  p.n_tokens = slot_tokens();
  p.max_tokens = static_cast<int>(max_tokens_);
  SetSelectCall(p, cand, max_candidates, out, ws_.data(), ws_bytes_);
  return ParisKvSelect(p, stream);
}

}  // namespace

absl::StatusOr<std::unique_ptr<GpuLane>> CreateParisKvLane(const model::ModelConfig& config,
                                                           int slots, int64_t max_tokens,
                                                           int budget, cudaStream_t stream) {
  if (config.head_dim != 64 && config.head_dim != 128) {
    return absl::InvalidArgumentError(absl::StrCat("pariskv lane: head_dim ", config.head_dim,
                                                   " (the GPU selector takes 64 or 128)"));
  }
  auto lane = std::make_unique<ParisKvLane>();
  KVR_RETURN_IF_ERROR(lane->Create(config, slots, max_tokens, budget, stream));
  return std::unique_ptr<GpuLane>(std::move(lane));
}

}  // namespace kvr::retrieval::cuda
