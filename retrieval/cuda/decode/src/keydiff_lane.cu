// The keydiff lane of the GPU sparse decode (lanes.cuh).

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kvr/common/status.h"
#include "kvr/retrieval/keydiff.h"
#include "lanes.cuh"

namespace kvr::retrieval::cuda {
namespace {

using kvr::cuda::Alloc;

// A token leaving the window joins its (slot, head)'s running key sum and is scored against it,
// as KeyDiffTracker::Add then Score on the host: the key's bf16 values widened, the sums in
// double in index order (one thread per (slot, head): head_dim terms, once per step and layer),
// so the score is the host's to the last bit. Block i: the i-th planned slot; thread h: head h.
__global__ void KeyDiffAppendKernel(kvr::cuda::KvPoolView pool, const int32_t* list,
                                    const int32_t* leaving, int n_kv, int head_dim,
                                    int64_t max_tokens, double* sums, int64_t* counts,
                                    float* scores) {
  const int slot = list[blockIdx.x];
  const int32_t pos = leaving[slot];
  const int h = threadIdx.x;
  if (pos < 0 || h >= n_kv) return;
  const size_t row_bytes = 2 * static_cast<size_t>(head_dim) * sizeof(__nv_bfloat16);
  const auto* key = static_cast<const __nv_bfloat16*>(
      kvr::cuda::KvPoolRow(pool, int64_t{slot} * n_kv + h, pos, row_bytes));
  const int64_t head = int64_t{slot} * n_kv + h;
  double* sum = sums + head * head_dim;
  for (int i = 0; i < head_dim; ++i) sum[i] += __bfloat162float(key[i]);
  ++counts[head];
  // Explicit roundings: a contracted multiply-add (FMA) would round once where the host rounds
  // twice.
  double dot = 0, nk = 0, ns = 0;
  for (int i = 0; i < head_dim; ++i) {
    const double k = __bfloat162float(key[i]);
    dot = __dadd_rn(dot, __dmul_rn(k, sum[i]));
    nk = __dadd_rn(nk, __dmul_rn(k, k));
    ns = __dadd_rn(ns, __dmul_rn(sum[i], sum[i]));
  }
  scores[head * max_tokens + pos] =
      (nk == 0 || ns == 0) ? 0.f : static_cast<float>(dot / sqrt(nk * ns));
}

// Per (slot, head) row: the negated scores of the candidates [begin, end) at the row's start
// (most distinctive = lowest cosine = largest negated score), their count and first position.
__global__ void KeyDiffCandidatesKernel(const float* scores, int64_t max_tokens, int n_kv,
                                        CandidateRanges cand, float* neg, int32_t* n_valid,
                                        int32_t* offset) {
  const int row = blockIdx.x;  // slot * n_kv + h
  const int slot = row / n_kv;
  const int32_t begin = cand.begin[slot], end = cand.end[slot];
  const int32_t n = end > begin ? end - begin : 0;
  if (threadIdx.x == 0) {
    n_valid[row] = n;
    offset[row] = begin;
  }
  const float* s = scores + int64_t{row} * max_tokens + begin;
  float* o = neg + int64_t{row} * max_tokens;
  for (int32_t i = threadIdx.x; i < n; i += blockDim.x) o[i] = -s[i];
}

// The top-k rows ([rows, k]) into the group's output rows ([rows, budget], -1 padded).
__global__ void KeyDiffRestrideKernel(const int32_t* ids, int k, int budget, int32_t* out_ids) {
  const int64_t row = blockIdx.x;
  for (int j = threadIdx.x; j < budget; j += blockDim.x) {
    out_ids[row * budget + j] = j < k ? ids[row * k + j] : -1;
  }
}

class KeyDiffLane final : public GpuLane {
 public:
  absl::Status Create(const model::ModelConfig& c, int slots, int64_t max_tokens, int budget,
                      cudaStream_t stream) {
    KVR_RETURN_IF_ERROR(Init("keydiff", c, slots, max_tokens, budget));
    const int64_t heads = int64_t{c.n_layers} * slots * c.n_kv_heads;
    const int64_t rows = int64_t{slots} * c.n_kv_heads;
    KVR_RETURN_IF_ERROR(Alloc(scores_, heads * max_tokens));
    KVR_RETURN_IF_ERROR(Alloc(sums_, heads * c.head_dim));
    KVR_RETURN_IF_ERROR(Alloc(counts_, heads));
    KVR_RETURN_IF_ERROR(Alloc(neg_, rows * max_tokens));
    KVR_RETURN_IF_ERROR(Alloc(n_valid_, rows));
    KVR_RETURN_IF_ERROR(Alloc(offset_, rows));
    KVR_RETURN_IF_ERROR(Alloc(top_ids_, rows * budget));
    TopKParams p = TopK({budget, nullptr, nullptr});
    ws_bytes_ = BatchedTopKWorkspaceBytes(p);
    KVR_RETURN_IF_ERROR(Alloc(ws_, static_cast<int64_t>(ws_bytes_) + 256));
    bytes_ += static_cast<int64_t>(scores_.bytes() + sums_.bytes() + counts_.bytes() +
                                   neg_.bytes() + n_valid_.bytes() + offset_.bytes() +
                                   top_ids_.bytes() + ws_.bytes());
    return kvr::cuda::CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }

  absl::Status Activate(int slot, std::span<const RetrievalIndex* const> layers, int64_t n_tokens,
                        int64_t /*capacity*/, cudaStream_t stream) override {
    auto bad = [](auto&&... parts) {
      return absl::InvalidArgumentError(absl::StrCat("keydiff lane: ", parts...));
    };
    KVR_RETURN_IF_ERROR(CheckIndexes(layers, n_tokens));
    for (int l = 0; l < n_layers_; ++l) {
      KVR_ASSIGN_OR_RETURN(const KeyDiffState st, KeyDiffStateOf(*layers[l]));
      if (static_cast<int>(st.heads.size()) != n_kv_) {
        return bad("layer ", l, ": ", st.heads.size(), " KV heads, the model has ", n_kv_);
      }
      if (fill_set_ && st.fill != fill_) {
        return bad("layer ", l, ": fill ", st.fill, ", the lane's sequences use ", fill_);
      }
      fill_ = st.fill;
      fill_set_ = true;
      const int64_t base = (int64_t{l} * slots_ + slot) * n_kv_;
      for (int h = 0; h < n_kv_; ++h) {
        const KeyDiffState::Head& hd = st.heads[h];
        if (static_cast<int64_t>(hd.scores.size()) != n_tokens ||
            static_cast<int>(hd.sum.size()) != head_dim_) {
          return bad("layer ", l, " head ", h, ": ", hd.scores.size(), " scores, a sum of ",
                     hd.sum.size());
        }
        KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(scores_.data() + (base + h) * max_tokens_,
                                                 hd.scores.data(), n_tokens * sizeof(float),
                                                 cudaMemcpyHostToDevice, stream));
        KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(sums_.data() + (base + h) * head_dim_,
                                                 hd.sum.data(), head_dim_ * sizeof(double),
                                                 cudaMemcpyHostToDevice, stream));
        KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(counts_.data() + base + h, &hd.count,
                                                 sizeof(int64_t), cudaMemcpyHostToDevice,
                                                 stream));
      }
      // The spans point into the index, which the caller frees after this call.
      KVR_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    }
    return absl::OkStatus();
  }

 private:
  TopKParams TopK(const SelectionOutput& out) const {
    TopKParams p;
    p.rows = slots_ * n_kv_;
    p.row_stride = max_tokens_;
    p.scores = neg_.data();
    p.n_valid = n_valid_.data();
    p.id_offset = offset_.data();
    p.out = out;
    return p;
  }

  absl::Status Prepare(int layer, const kvr::cuda::KvPoolView& pool,
                       cudaStream_t stream) override {
    if (std::none_of(planned_.begin(), planned_.end(),
                     [](const Planned& p) { return p.leaving >= 0; })) {
      return absl::OkStatus();
    }
    const int64_t heads = int64_t{layer} * slots_ * n_kv_;
    KeyDiffAppendKernel<<<static_cast<int>(planned_.size()), 32 * ((n_kv_ + 31) / 32), 0,
                          stream>>>(pool, planned_slots(), slot_leaving(), n_kv_, head_dim_,
                                    max_tokens_, sums_.data() + heads * head_dim_,
                                    counts_.data() + heads, scores_.data() + heads * max_tokens_);
    return kvr::cuda::LastLaunchStatus("KeyDiffAppendKernel");
  }

  // KeyDiffIndex::Select: per KV head, the max(1, floor(fill * budget)) candidates of lowest
  // score, ascending ids; ties to the lower position (TopKIndices; BatchedTopK's rule too).
  absl::Status SelectGroup(int layer, const float*, const kvr::cuda::KvPoolView&,
                           const CandidateRanges& cand, int, const SelectionOutput& out,
                           cudaStream_t stream) override {
    const int rows = slots_ * n_kv_;
    const int k = std::min(
        out.budget,
        std::max(1, static_cast<int>(std::floor(fill_ * static_cast<double>(out.budget)))));
    const float* scores = scores_.data() + int64_t{layer} * slots_ * n_kv_ * max_tokens_;
    KeyDiffCandidatesKernel<<<rows, 256, 0, stream>>>(scores, max_tokens_, n_kv_, cand,
                                                       neg_.data(), n_valid_.data(),
                                                       offset_.data());
    KVR_RETURN_IF_ERROR(kvr::cuda::LastLaunchStatus("KeyDiffCandidatesKernel"));
    TopKParams p = TopK({k, top_ids_.data(), out.counts});
    p.workspace = ws_.data();
    p.workspace_bytes = ws_bytes_;
    KVR_RETURN_IF_ERROR(BatchedTopK(p, stream));
    KeyDiffRestrideKernel<<<rows, 128, 0, stream>>>(top_ids_.data(), k, out.budget, out.ids);
    return kvr::cuda::LastLaunchStatus("KeyDiffRestrideKernel");
  }

  float fill_ = 1.f;
  bool fill_set_ = false;
  kvr::cuda::DeviceBuffer<float> scores_;    // [n_layers, slots, n_kv, max_tokens]
  kvr::cuda::DeviceBuffer<double> sums_;     // [n_layers, slots, n_kv, head_dim]
  kvr::cuda::DeviceBuffer<int64_t> counts_;  // [n_layers, slots, n_kv]
  kvr::cuda::DeviceBuffer<float> neg_;       // [slots, n_kv, max_tokens] a layer's candidates
  kvr::cuda::DeviceBuffer<int32_t> n_valid_, offset_;  // [slots, n_kv]
  kvr::cuda::DeviceBuffer<int32_t> top_ids_;           // [slots, n_kv, <= budget]
  kvr::cuda::DeviceBuffer<uint8_t> ws_;
  size_t ws_bytes_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<GpuLane>> CreateKeyDiffLane(const model::ModelConfig& config,
                                                           int slots, int64_t max_tokens,
                                                           int budget, cudaStream_t stream) {
  auto lane = std::make_unique<KeyDiffLane>();
  KVR_RETURN_IF_ERROR(lane->Create(config, slots, max_tokens, budget, stream));
  return std::unique_ptr<GpuLane>(std::move(lane));
}

}  // namespace kvr::retrieval::cuda
