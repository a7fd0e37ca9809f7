// The a2ats lane of the GPU sparse decode (lanes.cuh).

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kvr/common/status.h"
#include "kvr/retrieval/a2ats.h"
#include "kvr/retrieval/codebook.h"
#include "lanes.cuh"

namespace kvr::retrieval::cuda {
namespace {

using kvr::cuda::Alloc;
using kvr::cuda::AllocPinned;

constexpr int kAssignThreads = 256;

// The codeword id of the key that leaves the window, per (planned slot, KV head): block
// (i, h) for the i-th planned slot, skipped when no token leaves. As the CPU index's Append
// (A2atsIndex::Encode + HeadCodebook::Assign) does: the bf16 key widened to fp32, un-rotated to
// pre-RoPE (double angles, float rotation without contraction, as ApplyRope at -position),
// z = k L, then the first codeword of the largest z . c^z - |c^z|^2 / 2. What may differ from
// the CPU: the order of the fp32 sums (BLAS there) and the device's fp64 pow / cos / sin.
__global__ void __launch_bounds__(kAssignThreads)
    AssignLeavingKernel(kvr::cuda::KvPoolView pool, const int32_t* list, const int32_t* leaving,
                        int n_kv, int head_dim, int rope_style, int rotary_dim, float theta,
                        const float* chol, const float* codewords, const float* half_norms,
                        int codebook_size, int64_t max_tokens, uint16_t* ids) {
  const int slot = list[blockIdx.x];
  const int h = blockIdx.y;
  const int32_t pos = leaving[slot];
  if (pos < 0) return;
  const int d = head_dim;
  __shared__ float k[128];
  __shared__ float z[128];
  __shared__ float best_value[kAssignThreads];
  __shared__ int best_index[kAssignThreads];
  const size_t row_bytes = 2 * static_cast<size_t>(d) * sizeof(__nv_bfloat16);
  const auto* row = static_cast<const __nv_bfloat16*>(
      kvr::cuda::KvPoolRow(pool, int64_t{slot} * n_kv + h, pos, row_bytes));
  for (int i = threadIdx.x; i < d; i += blockDim.x) k[i] = __bfloat162float(row[i]);
  __syncthreads();
  if (rope_style != 0 && pos != 0) {
    const int rot = rotary_dim > 0 ? rotary_dim : d;
    const int half = rot / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
      const double freq = pow(static_cast<double>(theta), -2.0 * i / rot);
      const double angle = -static_cast<double>(pos) * freq;
      const float c = static_cast<float>(cos(angle));
      const float s = static_cast<float>(sin(angle));
      const int a = rope_style == 1 ? 2 * i : i;
      const int b = rope_style == 1 ? 2 * i + 1 : i + half;
      const float x = k[a], y = k[b];
      k[a] = __fsub_rn(__fmul_rn(x, c), __fmul_rn(y, s));
      k[b] = __fadd_rn(__fmul_rn(x, s), __fmul_rn(y, c));
    }
  }
  __syncthreads();
  // z_j = sum_i k_i L[i][j]; L is lower-triangular, so i runs from j.
  const float* l = chol + static_cast<int64_t>(h) * d * d;
  for (int j = threadIdx.x; j < d; j += blockDim.x) {
    float s = 0.f;
    for (int i = j; i < d; ++i) s = fmaf(k[i], l[static_cast<int64_t>(i) * d + j], s);
    z[j] = s;
  }
  __syncthreads();
  const float* cw = codewords + static_cast<int64_t>(h) * codebook_size * d;
  const float* hn = half_norms + static_cast<int64_t>(h) * codebook_size;
  float bv = -INFINITY;
  int bi = codebook_size;
  for (int c = threadIdx.x; c < codebook_size; c += blockDim.x) {
    const float* cz = cw + static_cast<int64_t>(c) * d;
    float s = 0.f;
    for (int j = 0; j < d; ++j) s = fmaf(z[j], cz[j], s);
    const float v = s - hn[c];
    if (v > bv) bv = v, bi = c;  // c rises within a thread: the first of equals stays
  }
  best_value[threadIdx.x] = bv;
  best_index[threadIdx.x] = bi;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      const float ov = best_value[threadIdx.x + stride];
      const int oi = best_index[threadIdx.x + stride];
      if (ov > best_value[threadIdx.x] ||
          (ov == best_value[threadIdx.x] && oi < best_index[threadIdx.x])) {
        best_value[threadIdx.x] = ov;
        best_index[threadIdx.x] = oi;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    ids[(int64_t{slot} * n_kv + h) * max_tokens + pos] =
        static_cast<uint16_t>(min(best_index[0], codebook_size - 1));
  }
}

class A2atsLane final : public GpuLane {
 public:
  absl::Status Create(const model::ModelConfig& c, int slots, int64_t max_tokens, int budget,
                      std::shared_ptr<const MethodAssets> assets, cudaStream_t stream) {
    KVR_RETURN_IF_ERROR(Init("a2ats", c, slots, max_tokens, budget));
    if (assets == nullptr) {
      return absl::FailedPreconditionError(
          "a2ats lane: the node has no a2ats codebooks (setting a2ats_codebooks)");
    }
    books_ = std::dynamic_pointer_cast<const A2atsCodebooks>(assets);
    if (books_ == nullptr || assets->kind() != kA2atsCodebooksKind) {
      return absl::InvalidArgumentError(absl::StrCat("a2ats lane: the node's method assets are '",
                                                     std::string(assets->kind()),
                                                     "', not a2ats codebooks"));
    }
    const ModelFingerprint& m = books_->model();
    if (m.n_layers != c.n_layers || m.n_kv_heads != c.n_kv_heads || m.head_dim != c.head_dim) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a2ats lane: codebooks for ", m.n_layers, " layers x ", m.n_kv_heads, " KV heads x ",
          m.head_dim, ", the model has ", c.n_layers, " x ", c.n_kv_heads, " x ", c.head_dim));
    }
    size_ = books_->head(0, 0).size;
    for (int l = 0; l < c.n_layers; ++l) {
      for (int h = 0; h < c.n_kv_heads; ++h) {
        if (books_->head(l, h).size != size_) {
          return absl::InvalidArgumentError(absl::StrCat(
              "a2ats lane: layer ", l, " KV head ", h, " has ", books_->head(l, h).size,
              " codewords, layer 0 head 0 has ", size_, " (the lane takes one size)"));
        }
      }
    }
    wrope_offset_ = books_->params().wrope_offset;
    rope_ = m.rope;
    const int64_t d = c.head_dim, heads = int64_t{c.n_layers} * c.n_kv_heads;
    KVR_RETURN_IF_ERROR(Alloc(ids_, heads * slots * max_tokens));
    KVR_RETURN_IF_ERROR(Alloc(chol_, heads * d * d));
    KVR_RETURN_IF_ERROR(Alloc(chol_inv_, heads * d * d));
    KVR_RETURN_IF_ERROR(Alloc(codewords_, heads * size_ * d));
    KVR_RETURN_IF_ERROR(Alloc(half_norms_, heads * size_));
    KVR_RETURN_IF_ERROR(Alloc(positions_, slots));
    KVR_RETURN_IF_ERROR(AllocPinned(h_positions_, slots));
    layer_ready_.assign(c.n_layers, false);
    A2atsSelectParams p;
    p.batch = slots;
    p.n_heads = c.n_heads;
    p.n_kv_heads = c.n_kv_heads;
    p.head_dim = c.head_dim;
    p.codebook_size = size_;
    p.max_tokens = static_cast<int>(max_tokens);
    p.max_candidates = static_cast<int>(max_tokens);
    p.out.budget = budget;
    p.rope = rope_;
    // The selector's limits (codebook size, GQA group, budget, RoPE), checked now rather than at
    // the first step, where a refusal would fail the whole batch: with batch 0 it only checks.
    A2atsSelectParams check = p;
    check.batch = 0;
    if (absl::Status s = A2atsSelect(check, stream); !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("a2ats lane (gpu_lanes, a2ats_codebooks): ", s.message()));
    }
    ws_bytes_ = A2atsSelectWorkspaceBytes(p);
    KVR_RETURN_IF_ERROR(Alloc(ws_, static_cast<int64_t>(ws_bytes_) + 256));
    bytes_ +=
        static_cast<int64_t>(ids_.bytes() + chol_.bytes() + chol_inv_.bytes() + codewords_.bytes() +
                             half_norms_.bytes() + positions_.bytes() + ws_.bytes());
    return kvr::cuda::CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }

  absl::Status Activate(int slot, std::span<const RetrievalIndex* const> layers, int64_t n_tokens,
                        int64_t /*capacity*/, cudaStream_t stream) override;

 private:
  absl::Status Prepare(int layer, const kvr::cuda::KvPoolView& pool, cudaStream_t stream) override;
  absl::Status SelectGroup(int layer, const float* query, const kvr::cuda::KvPoolView& pool,
                           const CandidateRanges& cand, int max_candidates,
                           const SelectionOutput& out, cudaStream_t stream) override;

  std::shared_ptr<const A2atsCodebooks> books_;
  int size_ = 0;  // codewords per KV head
  int64_t wrope_offset_ = 0;
  RopeParams rope_;                             // the codebooks' model's
  std::vector<bool> layer_ready_;               // the layer's codebooks are on the GPU
  kvr::cuda::DeviceBuffer<uint16_t> ids_;       // [n_layers, slots, n_kv, max_tokens]
  kvr::cuda::DeviceBuffer<float> chol_;         // [n_layers, n_kv, d, d] L
  kvr::cuda::DeviceBuffer<float> chol_inv_;     // [n_layers, n_kv, d, d] L^-1
  kvr::cuda::DeviceBuffer<float> codewords_;    // [n_layers, n_kv, size, d] C^z
  kvr::cuda::DeviceBuffer<float> half_norms_;   // [n_layers, n_kv, size]
  kvr::cuda::DeviceBuffer<int64_t> positions_;  // [slots] this step's query positions
  kvr::cuda::PinnedBuffer<int64_t> h_positions_;
  kvr::cuda::DeviceBuffer<uint8_t> ws_;
  size_t ws_bytes_ = 0;
};

absl::Status A2atsLane::Activate(int slot, std::span<const RetrievalIndex* const> layers,
                                 int64_t n_tokens, int64_t, cudaStream_t stream) {
  KVR_RETURN_IF_ERROR(CheckIndexes(layers, n_tokens));
  const int64_t d = head_dim_;
  for (int l = 0; l < n_layers_; ++l) {
    const RetrievalIndex& index = *layers[l];
    if (index.shape().layer != l) {
      return absl::InvalidArgumentError(
          absl::StrCat("a2ats lane: index ", l, " is of layer ", index.shape().layer));
    }
    const int64_t layer_heads = int64_t{l} * n_kv_;
    if (!layer_ready_[l]) {
      // The layer's first sequence: its layout (which checks the method and the codebooks'
      // hash and size against the index) brings L^-1 and the codewords; L and the half norms
      // come from the codebooks.
      const RetrievalIndex* one[] = {&index};
      KVR_ASSIGN_OR_RETURN(const A2atsHostLayout h, A2atsLayoutFromIndexes(one, *books_));
      std::vector<float> chol(static_cast<size_t>(n_kv_ * d * d));
      std::vector<float> norms(static_cast<size_t>(n_kv_) * size_);
      for (int hh = 0; hh < n_kv_; ++hh) {
        const HeadCodebook& book = books_->head(l, hh);
        std::copy(book.chol.begin(), book.chol.end(), chol.begin() + hh * d * d);
        std::copy(book.half_norms.begin(), book.half_norms.end(), norms.begin() + hh * size_);
      }
      KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(chol_.data() + layer_heads * d * d, chol.data(),
                                               chol.size() * sizeof(float), cudaMemcpyHostToDevice,
                                               stream));
      KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(chol_inv_.data() + layer_heads * d * d,
                                               h.chol_inv.data(), h.chol_inv.size() * sizeof(float),
                                               cudaMemcpyHostToDevice, stream));
      KVR_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(codewords_.data() + layer_heads * size_ * d, h.codewords.data(),
                          h.codewords.size() * sizeof(float), cudaMemcpyHostToDevice, stream));
      KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(half_norms_.data() + layer_heads * size_,
                                               norms.data(), norms.size() * sizeof(float),
                                               cudaMemcpyHostToDevice, stream));
      // The host copies above are freed at the end of this block: wait for the copies.
      KVR_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
      layer_ready_[l] = true;
    }
    // The sequence's ids, read through the index's own state (no layout rebuilt per join).
    KVR_ASSIGN_OR_RETURN(const A2atsState st, A2atsStateOf(index));
    if (st.codebook_hash != books_->content_hash() || st.codebook_size != size_ ||
        static_cast<int>(st.ids.size()) != n_kv_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a2ats lane: layer ", l, " was built with other codebooks than the node's (size ",
          st.codebook_size, ", the node's ", size_, ")"));
    }
    const int64_t base = (int64_t{l} * slots_ + slot) * n_kv_;
    for (int hh = 0; hh < n_kv_; ++hh) {
      KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(ids_.data() + (base + hh) * max_tokens_,
                                               st.ids[hh].data(), n_tokens * sizeof(uint16_t),
                                               cudaMemcpyHostToDevice, stream));
    }
  }
  // The ids are read from the indexes, which the caller frees after this returns.
  return kvr::cuda::CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
}

absl::Status A2atsLane::Prepare(int layer, const kvr::cuda::KvPoolView& pool, cudaStream_t stream) {
  if (layer == 0) {
    // The step's query positions, once per step (the select re-rotates each query to b).
    for (const Planned& p : planned_) h_positions_.data()[p.slot] = p.position;
    KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(positions_.data(), h_positions_.data(),
                                             slots_ * sizeof(int64_t), cudaMemcpyHostToDevice,
                                             stream));
  }
  // Tokens that left the window get their codeword ids (one per slot and step at most).
  if (std::none_of(planned_.begin(), planned_.end(),
                   [](const Planned& p) { return p.leaving >= 0; })) {
    return absl::OkStatus();
  }
  const int64_t layer_heads = int64_t{layer} * n_kv_, d = head_dim_;
  AssignLeavingKernel<<<dim3(static_cast<unsigned>(planned_.size()), n_kv_), kAssignThreads, 0,
                        stream>>>(
      pool, planned_slots(), slot_leaving(), n_kv_, head_dim_, static_cast<int>(rope_.style),
      rope_.rotary_dim, rope_.theta, chol_.data() + layer_heads * d * d,
      codewords_.data() + layer_heads * size_ * d, half_norms_.data() + layer_heads * size_, size_,
      max_tokens_, ids_.data() + int64_t{layer} * slots_ * n_kv_ * max_tokens_);
  return kvr::cuda::LastLaunchStatus("AssignLeavingKernel");
}

absl::Status A2atsLane::SelectGroup(int layer, const float* query, const kvr::cuda::KvPoolView&,
                                    const CandidateRanges& cand, int max_candidates,
                                    const SelectionOutput& out, cudaStream_t stream) {
  const int64_t layer_heads = int64_t{layer} * n_kv_, d = head_dim_;
  A2atsSelectParams p;
  SetSelectShape(p, slots_);
  p.rope = rope_;
  p.wrope_offset = wrope_offset_;
  p.codebook_size = size_;
  p.chol_inv = chol_inv_.data() + layer_heads * d * d;
  p.codewords = codewords_.data() + layer_heads * size_ * d;
  p.query = query;
  p.query_position = positions_.data();
  p.ids = ids_.data() + int64_t{layer} * slots_ * n_kv_ * max_tokens_;
  p.n_tokens = slot_tokens();
  p.max_tokens = static_cast<int>(max_tokens_);
  SetSelectCall(p, cand, max_candidates, out, ws_.data(), ws_bytes_);
  return A2atsSelect(p, stream);
}

}  // namespace

absl::StatusOr<std::unique_ptr<GpuLane>> CreateA2atsLane(const model::ModelConfig& config,
                                                         int slots, int64_t max_tokens, int budget,
                                                         std::shared_ptr<const MethodAssets> assets,
                                                         cudaStream_t stream) {
  if (config.head_dim != 64 && config.head_dim != 128) {
    return absl::InvalidArgumentError(absl::StrCat("a2ats lane: head_dim ", config.head_dim,
                                                   " (the GPU selector takes 64 or 128)"));
  }
  auto lane = std::make_unique<A2atsLane>();
  KVR_RETURN_IF_ERROR(lane->Create(config, slots, max_tokens, budget, std::move(assets), stream));
  return std::unique_ptr<GpuLane>(std::move(lane));
}

}  // namespace kvr::retrieval::cuda
