// The pariskv lane of the GPU sparse decode (pariskv_lane.cuh).

#include "pariskv_lane.cuh"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kvr/common/status.h"

namespace kvr::retrieval::cuda {
namespace {

using kvr::cuda::Alloc;
using kvr::cuda::AllocPinned;

// Rows of meta_ ([kGroups + 2 * slots, slots]): the tokens each slot's codes cover after the
// step's encode, the planned slots ordered by budget group, the position each slot encodes (-1:
// none), then per budget group g the candidate ranges (rows kGroups + 2 g, + 1) that only the
// group's slots have non-empty.
constexpr int kTokens = 0, kList = 1, kEncode = 2, kGroups = 3;

// The K half of row `pos` of (slot, h) for every KV head, bf16 -> fp32 into keys [slots, kv, d].
// Block i: the i-th planned slot (list[i]), skipped when it encodes nothing.
__global__ void PoolKeysKernel(kvr::cuda::KvPoolView pool, const int32_t* list,
                               const int32_t* encode, int n_kv, int head_dim, float* keys) {
  const int slot = list[blockIdx.x];
  const int32_t pos = encode[slot];
  if (pos < 0) return;
  const size_t row_bytes = 2 * static_cast<size_t>(head_dim) * sizeof(__nv_bfloat16);
  for (int i = threadIdx.x; i < n_kv * head_dim; i += blockDim.x) {
    const int h = i / head_dim, j = i % head_dim;
    const auto* row = static_cast<const __nv_bfloat16*>(
        kvr::cuda::KvPoolRow(pool, int64_t{slot} * n_kv + h, pos, row_bytes));
    keys[(int64_t{slot} * n_kv + h) * head_dim + j] = __bfloat162float(row[j]);
  }
}

// The planned slots' selections (rows of ids / counts) from the lane's buffers into `out`.
// `budget` = the group's (the lane's rows, [slots, n_kv, budget]) into rows of `out_budget`.
__global__ void CopySlotsKernel(const int32_t* list, int n_kv, int budget, int out_budget,
                                const int32_t* ids, const int32_t* counts, int32_t* out_ids,
                                int32_t* out_counts) {
  const int64_t slot = list[blockIdx.x];
  for (int64_t i = threadIdx.x; i < int64_t{n_kv} * out_budget; i += blockDim.x) {
    const int64_t h = i / out_budget, j = i % out_budget;
    out_ids[(slot * n_kv + h) * out_budget + j] =
        j < budget ? ids[(slot * n_kv + h) * budget + j] : -1;
  }
  if (threadIdx.x < n_kv) out_counts[slot * n_kv + threadIdx.x] = counts[slot * n_kv + threadIdx.x];
}

}  // namespace

absl::StatusOr<std::unique_ptr<ParisKvLane>> ParisKvLane::Create(const model::ModelConfig& c,
                                                                 int slots, int64_t max_tokens,
                                                                 int budget, cudaStream_t stream) {
  std::unique_ptr<ParisKvLane> lane(new ParisKvLane());
  ParisKvLane& l = *lane;
  l.n_layers_ = c.n_layers;
  l.n_heads_ = c.n_heads;
  l.n_kv_ = c.n_kv_heads;
  l.head_dim_ = c.head_dim;
  l.slots_ = slots;
  l.budget_ = budget;
  l.max_tokens_ = max_tokens;
  if (c.head_dim != 64 && c.head_dim != 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("pariskv lane: head_dim ", c.head_dim, " (the GPU selector takes 64 or 128)"));
  }
  // ParisKvOptions' default sub-space dimension m = 8: B = P / 8 sub-spaces of 256 centroids.
  l.padded_ = c.head_dim;
  l.sub_ = l.padded_ / 8;
  l.centroids_ = 256;
  l.codec_.resize(c.n_layers);
  l.codec_set_.assign(c.n_layers, false);
  const int64_t heads = int64_t{c.n_layers} * slots * c.n_kv_heads;
  KVR_RETURN_IF_ERROR(Alloc(l.codes_, heads * max_tokens * (l.padded_ / 2)));
  KVR_RETURN_IF_ERROR(Alloc(l.weights_, heads * max_tokens * l.sub_));
  KVR_RETURN_IF_ERROR(Alloc(l.counts_, heads * l.sub_ * l.centroids_));
  KVR_RETURN_IF_ERROR(Alloc(l.meta_, (kGroups + 2 * int64_t{slots}) * slots));
  KVR_RETURN_IF_ERROR(AllocPinned(l.h_meta_, (kGroups + 2 * int64_t{slots}) * slots));
  KVR_RETURN_IF_ERROR(Alloc(l.ids_, int64_t{slots} * c.n_kv_heads * budget));
  KVR_RETURN_IF_ERROR(Alloc(l.sel_counts_, int64_t{slots} * c.n_kv_heads));
  KVR_RETURN_IF_ERROR(Alloc(l.keys_, int64_t{slots} * c.n_kv_heads * c.head_dim));
  // The workspace depends on the codec's shape only (not its seed or levels).
  ParisKvSelectParams p;
  p.batch = slots;
  p.n_heads = c.n_heads;
  p.n_kv_heads = c.n_kv_heads;
  p.codec.head_dim = c.head_dim;
  p.codec.padded_dim = l.padded_;
  p.codec.subspace_dim = 8;
  p.max_tokens = static_cast<int>(max_tokens);
  p.max_candidates = static_cast<int>(max_tokens);
  p.out.budget = budget;
  l.ws_bytes_ = ParisKvSelectWorkspaceBytes(p);
  KVR_RETURN_IF_ERROR(Alloc(l.ws_, static_cast<int64_t>(l.ws_bytes_) + 256));
  l.bytes_ = static_cast<int64_t>(l.codes_.bytes() + l.weights_.bytes() + l.counts_.bytes() +
                                  l.meta_.bytes() + l.ids_.bytes() + l.sel_counts_.bytes() +
                                  l.keys_.bytes() + l.ws_.bytes());
  KVR_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return lane;
}

absl::Status ParisKvLane::Activate(int slot, std::span<const RetrievalIndex* const> layers,
                                   int64_t n_tokens, cudaStream_t stream) {
  auto bad = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("pariskv lane: ", parts...));
  };
  if (static_cast<int>(layers.size()) != n_layers_) {
    return bad(layers.size(), " indexes for ", n_layers_, " layers");
  }
  if (n_tokens > max_tokens_) return bad(n_tokens, " tokens, the lane holds ", max_tokens_);
  const int64_t head_codes = max_tokens_ * (padded_ / 2), head_weights = max_tokens_ * sub_,
                head_counts = int64_t{sub_} * centroids_;
  for (int l = 0; l < n_layers_; ++l) {
    if (layers[l] == nullptr || layers[l]->size() != n_tokens) {
      return bad("layer ", l, ": no index over ", n_tokens, " tokens");
    }
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
    KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(counts_.data() + base * head_counts, h.counts.data(),
                                             h.counts.size() * sizeof(uint32_t),
                                             cudaMemcpyHostToDevice, stream));
    // The host layout is freed at the end of this iteration: wait for the copies.
    KVR_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  }
  return absl::OkStatus();
}

void ParisKvLane::Clear() {
  planned_.clear();
  groups_.clear();
}

void ParisKvLane::Add(int slot, int32_t cand_begin, int32_t cand_end, int32_t n_tokens,
                      int64_t encode, int budget) {
  planned_.push_back({slot, encode, budget, cand_begin, cand_end, n_tokens});
}

absl::Status ParisKvLane::Begin(cudaStream_t stream) {
  if (planned_.empty()) return absl::OkStatus();
  std::stable_sort(planned_.begin(), planned_.end(),
                   [](const Planned& a, const Planned& b) { return a.budget < b.budget; });
  int32_t* m = h_meta_.data();
  const int64_t S = slots_;
  std::fill(m, m + kGroups * S, 0);
  std::fill(m + kEncode * S, m + (kEncode + 1) * S, -1);
  for (size_t i = 0; i < planned_.size(); ++i) {
    const Planned& p = planned_[i];
    if (groups_.empty() || groups_.back().budget != p.budget) {
      const int64_t g = static_cast<int64_t>(groups_.size());
      std::fill(m + (kGroups + 2 * g) * S, m + (kGroups + 2 * g + 2) * S, 0);
      groups_.push_back({p.budget, static_cast<int>(i), 0});
    }
    const int64_t g = static_cast<int64_t>(groups_.size()) - 1;
    ++groups_.back().n;
    m[kTokens * S + p.slot] = p.n_tokens;
    m[kList * S + static_cast<int64_t>(i)] = p.slot;
    m[kEncode * S + p.slot] = static_cast<int32_t>(p.encode);
    m[(kGroups + 2 * g) * S + p.slot] = p.cand_begin;
    m[(kGroups + 2 * g + 1) * S + p.slot] = p.cand_end;
  }
  const int64_t rows = kGroups + 2 * static_cast<int64_t>(groups_.size());
  KVR_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(meta_.data(), m, rows * S * sizeof(int32_t), cudaMemcpyHostToDevice, stream));
  return absl::OkStatus();
}

absl::Status ParisKvLane::Select(int layer, const float* query, const kvr::cuda::KvPoolView& pool,
                                 int max_candidates, const SelectionOutput& out,
                                 cudaStream_t stream) {
  if (planned_.empty()) return absl::OkStatus();
  const int n = static_cast<int>(planned_.size());
  const int32_t* list = meta_.data() + int64_t{kList} * slots_;
  const int64_t layer_heads = int64_t{layer} * slots_ * n_kv_;
  // Tokens that left the window join the slot's codes (one per slot and step at most).
  if (std::any_of(planned_.begin(), planned_.end(),
                  [](const Planned& p) { return p.encode >= 0; })) {
    PoolKeysKernel<<<n, 256, 0, stream>>>(pool, list, meta_.data() + int64_t{kEncode} * slots_,
                                          n_kv_, head_dim_, keys_.data());
    KVR_RETURN_IF_ERROR(kvr::cuda::LastLaunchStatus("PoolKeysKernel"));
    for (const Planned& p : planned_) {
      if (p.encode < 0) continue;
      const int64_t base = layer_heads + int64_t{p.slot} * n_kv_;
      ParisKvEncodeParams e;
      e.n_tokens = 1;
      e.n_kv_heads = n_kv_;
      e.codec = codec_[layer];
      e.keys = keys_.data() + int64_t{p.slot} * n_kv_ * head_dim_;
      e.key_token_stride = int64_t{n_kv_} * head_dim_;
      e.first = static_cast<int>(p.encode);
      e.codes = codes_.data() + base * max_tokens_ * (padded_ / 2);
      e.codes_head_stride = max_tokens_ * (padded_ / 2);
      e.weights = weights_.data() + base * max_tokens_ * sub_;
      e.weights_head_stride = max_tokens_ * sub_;
      e.counts = counts_.data() + base * sub_ * centroids_;
      KVR_RETURN_IF_ERROR(ParisKvEncode(e, stream));
    }
  }
  for (const Group& g : groups_) {
    const int64_t gi = &g - groups_.data();
    ParisKvSelectParams p;
    p.batch = slots_;
    p.n_heads = n_heads_;
    p.n_kv_heads = n_kv_;
    p.scale = 1.f / std::sqrt(static_cast<float>(head_dim_));
    p.codec = codec_[layer];
    p.query = query;
    p.codes = codes_.data() + layer_heads * max_tokens_ * (padded_ / 2);
    p.weights = weights_.data() + layer_heads * max_tokens_ * sub_;
    p.counts = counts_.data() + layer_heads * sub_ * centroids_;
    p.n_tokens = meta_.data() + int64_t{kTokens} * slots_;
    p.max_tokens = static_cast<int>(max_tokens_);
    p.cand = {meta_.data() + (kGroups + 2 * gi) * slots_,
              meta_.data() + (kGroups + 2 * gi + 1) * slots_};
    p.max_candidates = std::max(1, max_candidates);
    p.out = {g.budget, ids_.data(), sel_counts_.data()};
    p.workspace = ws_.data();
    p.workspace_bytes = ws_bytes_;
    KVR_RETURN_IF_ERROR(ParisKvSelect(p, stream));
    CopySlotsKernel<<<g.n, 256, 0, stream>>>(list + g.first, n_kv_, g.budget, out.budget,
                                             ids_.data(), sel_counts_.data(), out.ids, out.counts);
    KVR_RETURN_IF_ERROR(kvr::cuda::LastLaunchStatus("CopySlotsKernel"));
  }
  return absl::OkStatus();
}

}  // namespace kvr::retrieval::cuda
