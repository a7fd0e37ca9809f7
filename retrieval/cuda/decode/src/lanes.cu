// GPU lanes of the sparse decode (lanes.cuh): the plan and copy every lane shares, and the exact
// lane.

#include "lanes.cuh"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kvr/common/status.h"

namespace kvr::retrieval::cuda {
namespace {

using kvr::cuda::Alloc;
using kvr::cuda::AllocPinned;

// Rows of meta_ ([kGroups + 2 * slots, slots]): the tokens each slot's state covers after the
// step, the planned slots ordered by budget group, the position leaving each slot's window (-1:
// none), then per budget group g the candidate ranges (rows kGroups + 2 g, + 1) that only the
// group's slots have non-empty.
constexpr int kTokens = 0, kList = 1, kLeaving = 2, kGroups = 3;

// A group's selections (the lane's rows [slots, n_kv, budget]) into rows of `out_budget`.
__global__ void CopySlotsKernel(const int32_t* list, int n_kv, int budget, int out_budget,
                                const int32_t* ids, const int32_t* counts, int32_t* out_ids,
                                int32_t* out_counts) {
  const int64_t slot = list[blockIdx.x];
  for (int64_t i = threadIdx.x; i < int64_t{n_kv} * out_budget; i += blockDim.x) {
    const int64_t h = i / out_budget, j = i % out_budget;
    out_ids[(slot * n_kv + h) * out_budget + j] =
        j < budget ? ids[(slot * n_kv + h) * budget + j] : -1;
  }
  if (threadIdx.x < n_kv) {
    out_counts[slot * n_kv + threadIdx.x] = counts[slot * n_kv + threadIdx.x];
  }
}

// exact: the keys read in place through the layer's page tables; nothing kept per slot.
class ExactLane final : public GpuLane {
 public:
  absl::Status Create(const model::ModelConfig& c, int slots, int64_t max_tokens, int budget,
                      cudaStream_t stream) {
    KVR_RETURN_IF_ERROR(Init("exact", c, slots, max_tokens, budget));
    ExactSelectParams p = Params(nullptr, {}, {}, static_cast<int>(max_tokens), {budget});
    ws_bytes_ = ExactSelectWorkspaceBytes(p);
    KVR_RETURN_IF_ERROR(Alloc(ws_, static_cast<int64_t>(ws_bytes_) + 256));
    bytes_ += static_cast<int64_t>(ws_.bytes());
    return kvr::cuda::CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }
  absl::Status Activate(int, std::span<const RetrievalIndex* const>, int64_t, int64_t,
                        cudaStream_t) override {
    return absl::OkStatus();  // the keys are the row source's
  }

 private:
  ExactSelectParams Params(const float* query, const kvr::cuda::KvPoolView& pool,
                           const CandidateRanges& cand, int max_candidates,
                           const SelectionOutput& out) const {
    ExactSelectParams p;
    SetSelectShape(p, slots_);
    p.query = query;
    p.keys.dtype = KeyDType::kBf16;
    p.keys.pool = pool;
    p.keys.row_bytes = 4 * int64_t{head_dim_};  // bf16 [K | V]
    p.cand = cand;
    p.max_candidates = max_candidates;
    p.out = out;
    return p;
  }
  absl::Status SelectGroup(int, const float* query, const kvr::cuda::KvPoolView& pool,
                           const CandidateRanges& cand, int max_candidates,
                           const SelectionOutput& out, cudaStream_t stream) override {
    ExactSelectParams p = Params(query, pool, cand, max_candidates, out);
    p.workspace = ws_.data();
    p.workspace_bytes = ws_bytes_;
    return ExactSelect(p, stream);
  }
  kvr::cuda::DeviceBuffer<uint8_t> ws_;
  size_t ws_bytes_ = 0;
};

}  // namespace

absl::Status GpuLane::Init(std::string method, const model::ModelConfig& c, int slots,
                           int64_t max_tokens, int budget) {
  method_ = std::move(method);
  max_tokens_ = max_tokens;
  n_layers_ = c.n_layers;
  n_heads_ = c.n_heads;
  n_kv_ = c.n_kv_heads;
  head_dim_ = c.head_dim;
  slots_ = slots;
  budget_ = budget;
  KVR_RETURN_IF_ERROR(Alloc(meta_, (kGroups + 2 * int64_t{slots}) * slots));
  KVR_RETURN_IF_ERROR(AllocPinned(h_meta_, (kGroups + 2 * int64_t{slots}) * slots));
  KVR_RETURN_IF_ERROR(Alloc(ids_, int64_t{slots} * c.n_kv_heads * budget));
  KVR_RETURN_IF_ERROR(Alloc(counts_, int64_t{slots} * c.n_kv_heads));
  bytes_ = static_cast<int64_t>(meta_.bytes() + ids_.bytes() + counts_.bytes());
  return absl::OkStatus();
}

absl::Status GpuLane::CheckIndexes(std::span<const RetrievalIndex* const> layers,
                                   int64_t n_tokens) const {
  auto bad = [this](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(method_, " lane: ", parts...));
  };
  if (static_cast<int>(layers.size()) != n_layers_) {
    return bad(layers.size(), " indexes for ", n_layers_, " layers");
  }
  if (n_tokens > max_tokens_) return bad(n_tokens, " tokens, the lane holds ", max_tokens_);
  for (int l = 0; l < n_layers_; ++l) {
    if (layers[l] == nullptr || layers[l]->size() != n_tokens) {
      return bad("layer ", l, ": no index over ", n_tokens, " tokens");
    }
  }
  return absl::OkStatus();
}

const int32_t* GpuLane::planned_slots() const { return meta_.data() + int64_t{kList} * slots_; }
const int32_t* GpuLane::slot_tokens() const { return meta_.data() + int64_t{kTokens} * slots_; }
const int32_t* GpuLane::slot_leaving() const { return meta_.data() + int64_t{kLeaving} * slots_; }

void GpuLane::Clear() {
  planned_.clear();
  groups_.clear();
}

void GpuLane::Add(int slot, int32_t cand_begin, int32_t cand_end, int32_t n_tokens, int64_t leaving,
                  int budget, int64_t position) {
  planned_.push_back({slot, leaving, budget, cand_begin, cand_end, n_tokens, position});
}

absl::Status GpuLane::Begin(cudaStream_t stream) {
  if (planned_.empty()) return absl::OkStatus();
  std::stable_sort(planned_.begin(), planned_.end(),
                   [](const Planned& a, const Planned& b) { return a.budget < b.budget; });
  int32_t* m = h_meta_.data();
  const int64_t S = slots_;
  std::fill(m, m + kGroups * S, 0);
  std::fill(m + kLeaving * S, m + (kLeaving + 1) * S, -1);
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
    m[kLeaving * S + p.slot] = static_cast<int32_t>(p.leaving);
    m[(kGroups + 2 * g) * S + p.slot] = p.cand_begin;
    m[(kGroups + 2 * g + 1) * S + p.slot] = p.cand_end;
  }
  const int64_t rows = kGroups + 2 * static_cast<int64_t>(groups_.size());
  KVR_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(meta_.data(), m, rows * S * sizeof(int32_t), cudaMemcpyHostToDevice, stream));
  return absl::OkStatus();
}

absl::Status GpuLane::Select(int layer, const float* query, const kvr::cuda::KvPoolView& pool,
                             int max_candidates, const SelectionOutput& out, cudaStream_t stream) {
  if (planned_.empty()) return absl::OkStatus();
  KVR_RETURN_IF_ERROR(Prepare(layer, pool, stream));
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    const Group& g = groups_[gi];
    const int64_t row = kGroups + 2 * static_cast<int64_t>(gi);
    const CandidateRanges cand{meta_.data() + row * slots_, meta_.data() + (row + 1) * slots_};
    KVR_RETURN_IF_ERROR(SelectGroup(layer, query, pool, cand, std::max(1, max_candidates),
                                    {g.budget, ids_.data(), counts_.data()}, stream));
    CopySlotsKernel<<<g.n, 256, 0, stream>>>(planned_slots() + g.first, n_kv_, g.budget, out.budget,
                                             ids_.data(), counts_.data(), out.ids, out.counts);
    KVR_RETURN_IF_ERROR(kvr::cuda::LastLaunchStatus("CopySlotsKernel"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<GpuLane>> CreateExactLane(const model::ModelConfig& config,
                                                         int slots, int64_t max_tokens, int budget,
                                                         cudaStream_t stream) {
  if (config.head_dim != 64 && config.head_dim != 128) {
    return absl::InvalidArgumentError(absl::StrCat("exact lane: head_dim ", config.head_dim,
                                                   " (the GPU selector takes 64 or 128)"));
  }
  auto lane = std::make_unique<ExactLane>();
  KVR_RETURN_IF_ERROR(lane->Create(config, slots, max_tokens, budget, stream));
  return std::unique_ptr<GpuLane>(std::move(lane));
}

absl::StatusOr<std::unique_ptr<GpuLane>> CreateGpuLane(
    std::string_view method, const model::ModelConfig& config, int slots, int64_t max_tokens,
    int budget, int local_window, std::shared_ptr<const MethodAssets> assets, cudaStream_t stream) {
  if (method == "exact") return CreateExactLane(config, slots, max_tokens, budget, stream);
  if (method == "pariskv") return CreateParisKvLane(config, slots, max_tokens, budget, stream);
  if (method == "keydiff") return CreateKeyDiffLane(config, slots, max_tokens, budget, stream);
  if (method == "ctkvr") {
    return CreateCtkvrLane(config, slots, max_tokens, budget, local_window, stream);
  }
  if (method == "a2ats") {
    return CreateA2atsLane(config, slots, max_tokens, budget, std::move(assets), stream);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("no GPU lane for method '", std::string(method), "'"));
}

}  // namespace kvr::retrieval::cuda
