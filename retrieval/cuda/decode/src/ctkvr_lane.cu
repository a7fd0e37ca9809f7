// The ctkvr lane of the GPU sparse decode (lanes.cuh): the CPU CtkvrIndex (retrieval/src/ctkvr.cc)
// on the GPU, with its qcIVF kept up to date between selections as the CPU index keeps it.
//
// State per slot, allocated at activation for that sequence (C, rho and its capacity differ per
// sequence), per layer and KV head: C query centroids [C, group, d] (unit) and their norms, per
// entry its threshold (the smallest max-over-group logit of its list) and list length, and the
// lists, each in a fixed-capacity row [C, cap] that grows in place (CtkvrSelectParams::
// list_lengths). The capacity bounds every list for the sequence's whole life: a list gains at
// most one token per step (the one leaving the window), and an entry the FIFO update rewrites
// holds at most max(rho, budget) reranked keys plus the local window's tokens, so
//   cap = max(longest list at activation, max(rho, budget) + local_window + 1)
//         + (capacity - tokens at activation),
// at most the capacity. Per step and layer, for each of the lane's sequences:
//  1. Prepare: the token that left the window joins every list whose centroid ranks it in its
//     top rho (max over the group of scale * |q_g| * (c_g . k) >= the list's threshold), as the
//     CPU's Append (GrowListsKernel).
//  2. CtkvrSelect at the request's budget (the selection), on the keys in the store's pages.
//  3. With the FIFO update on (fifo_size > 0) and candidates present: CtkvrSelect again at
//     keep = max(rho, budget) (the same recall and scores, so its top keep contain the top
//     budget), then RotateEntryKernel writes the decode query over the oldest rotating entry:
//     its unit group queries and norms, the keep reranked ids, their smallest max-over-group
//     logit as the threshold (-inf when the recall held no more than keep ids), and the window's
//     indexed tokens that pass it. The cursor advances once per step with candidates, as the
//     CPU's next_fifo_.
// Arithmetic in the CPU's order (kvr::retrieval::Dot's eight partial sums, no FMA contraction),
// so the discrete choices (list membership, the rotated entry's list) are the CPU's on the same
// bf16-valued keys. Two selections per step where the CPU sorts once: the price of keeping the
// selector's output a set.

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kvr/common/status.h"
#include "kvr/retrieval/ctkvr.h"
#include "kvr/retrieval/cuda/dot8.cuh"
#include "lanes.cuh"

namespace kvr::retrieval::cuda {
namespace {

using kvr::cuda::Alloc;

constexpr int kMaxGroupLane = 8;  // CtkvrSelect's largest GQA group

// kvr::retrieval::Dot in the CPU's order (dot8.cuh), as CtkvrSelect's rerank computes it.
using internal::Dot8N;

__device__ __forceinline__ const __nv_bfloat16* KeyRow(const kvr::cuda::KvPoolView& pool,
                                                       int64_t bh, int64_t t, int head_dim) {
  const size_t row_bytes = 2 * static_cast<size_t>(head_dim) * sizeof(__nv_bfloat16);  // [K | V]
  return static_cast<const __nv_bfloat16*>(kvr::cuda::KvPoolRow(pool, bh, t, row_bytes));
}

// One slot's layer of the lane state (device pointers), per KV head h at + h * stride.
struct LayerState {
  float* centroids;    // [n_kv, C, group, d]
  float* norms;        // [n_kv, C, group]
  float* thresholds;   // [n_kv, C]
  int32_t* lengths;    // [n_kv, C]
  int32_t* offsets;    // [n_kv, C + 1]: c * cap (constant)
  int32_t* counts;     // [n_kv]: C (constant; CtkvrSelectParams::n_centroids)
  int32_t* lists;      // [n_kv, C, cap]
  int n_centroids, cap;
};

// Append's insertion test for the token leaving the window (`token`), every entry of every KV
// head: grid (entry chunks of 32, n_kv), 8 lanes per entry.
template <int kD>
__global__ void __launch_bounds__(256)
    GrowListsKernel(LayerState s, kvr::cuda::KvPoolView pool, int slot, int n_kv, int group,
                    float scale, int32_t token) {
  const int h = blockIdx.y;
  __shared__ float k[kD];
  const __nv_bfloat16* row = KeyRow(pool, int64_t{slot} * n_kv + h, token, kD);
  for (int i = threadIdx.x; i < kD; i += blockDim.x) k[i] = __bfloat162float(row[i]);
  __syncthreads();
  const int e = blockIdx.x * 32 + (threadIdx.x >> 3);
  const bool valid = e < s.n_centroids;
  const int ee = valid ? e : 0;
  const int64_t entry = int64_t{h} * s.n_centroids + ee;
  const int len = s.lengths[entry];
  float best = -INFINITY;
  for (int g = 0; g < group; ++g) {
    const float dot = Dot8N<kD>(s.centroids + (entry * group + g) * kD, k);
    // scale * e.norms[g] * Dot(...), left to right.
    best = fmaxf(best, __fmul_rn(__fmul_rn(scale, s.norms[entry * group + g]), dot));
  }
  if (!valid || (threadIdx.x & 7) != 0 || len == 0) return;
  if (best >= s.thresholds[entry]) {
    // cap bounds every list for the sequence's life (top of the file); the test only keeps a
    // wrong bound from writing past the row.
    if (len < s.cap) {
      s.lists[entry * s.cap + len] = token;  // ids grow: the list stays ascending
      s.lengths[entry] = len + 1;
    }
  }
}

// The FIFO update of entry `e` for every KV head (block h) whose recall was not empty: see the top
// of the file. kept / kept_counts: the selection at `keep` ([n_kv, keep] ascending ids);
// recalled: the recall's sizes [n_kv]; window tokens [cand_end, n_tokens) are tested too.
template <int kD>
__global__ void __launch_bounds__(256)
    RotateEntryKernel(LayerState s, kvr::cuda::KvPoolView pool, int slot, int n_kv, int group,
                      float scale, const float* query, int e, int keep, const int32_t* kept,
                      const int32_t* kept_counts, const int32_t* recalled, int32_t cand_end,
                      int32_t n_tokens) {
  const int h = blockIdx.x;
  const int nr = recalled[h];
  if (nr <= 0) return;
  __shared__ float q[kMaxGroupLane * kD];   // the group's queries as given
  __shared__ float qn[kMaxGroupLane * kD];  // unit-normalised
  __shared__ float qnorm[kMaxGroupLane];
  __shared__ float mins[32];
  __shared__ int pass[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* qsrc = query + int64_t{h} * group * kD;
  for (int i = threadIdx.x; i < group * kD; i += blockDim.x) q[i] = qn[i] = qsrc[i];
  __syncthreads();
  if (warp < group) {  // NormaliseGroup: Norm in Dot order, then a division per element
    const float nrm = sqrtf(Dot8N<kD>(q + warp * kD, q + warp * kD));
    __syncwarp();
    if (nrm > 0.f) {
      for (int i = lane; i < kD; i += 32) qn[warp * kD + i] = __fdiv_rn(q[warp * kD + i], nrm);
    }
    if (lane == 0) qnorm[warp] = nrm;
  }
  const int64_t bh = int64_t{slot} * n_kv + h;
  const int64_t entry = int64_t{h} * s.n_centroids + e;
  const int n_kept = kept_counts[h];
  const int32_t* ids = kept + int64_t{h} * keep;
  // Max-over-group logit (scale * Dot(q_g, k), the CPU's logits_) of token t; 8 lanes.
  auto max_logit = [&](int32_t t) {
    const __nv_bfloat16* k = KeyRow(pool, bh, t, kD);
    float m = -INFINITY;
    for (int g = 0; g < group; ++g) m = fmaxf(m, __fmul_rn(scale, Dot8N<kD>(q + g * kD, k)));
    return m;
  };
  // The threshold: the smallest max-over-group logit of the kept keys.
  float low = INFINITY;
  for (int base = 0; base < n_kept; base += 32) {
    const int i = base + (threadIdx.x >> 3);
    const float m = max_logit(ids[i < n_kept ? i : 0]);
    if (i < n_kept) low = fminf(low, m);
  }
  for (int o = 16; o > 0; o >>= 1) low = fminf(low, __shfl_xor_sync(0xffffffffu, low, o));
  if (lane == 0) mins[warp] = low;
  __syncthreads();
  float threshold = INFINITY;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) threshold = fminf(threshold, mins[w]);
  // Every recalled key listed: later keys always join.
  if (nr <= keep) threshold = -INFINITY;
  int32_t* list = s.lists + entry * s.cap;
  int len = min(n_kept, s.cap);
  for (int i = threadIdx.x; i < len; i += blockDim.x) list[i] = ids[i];
  // The window's indexed keys that pass, ascending (32 per round, compacted by thread 0).
  for (int base = cand_end; base < n_tokens; base += 32) {
    const int i = base + (threadIdx.x >> 3);
    const float m = max_logit(i < n_tokens ? i : base);
    if ((threadIdx.x & 7) == 0) pass[threadIdx.x >> 3] = i < n_tokens && m >= threshold;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int j = 0; j < 32; ++j) {
        if (pass[j] && len < s.cap) list[len++] = base + j;
      }
      pass[0] = len;  // broadcast
    }
    __syncthreads();
    len = pass[0];
    __syncthreads();
  }
  for (int i = threadIdx.x; i < group * kD; i += blockDim.x) {
    s.centroids[entry * group * kD + i] = qn[i];
  }
  if (threadIdx.x < group) s.norms[entry * group + threadIdx.x] = qnorm[threadIdx.x];
  if (threadIdx.x == 0) {
    s.thresholds[entry] = threshold;
    s.lengths[entry] = len;
  }
}

class CtkvrLane final : public GpuLane {
 public:
  absl::Status Create(const model::ModelConfig& c, int slots, int64_t max_tokens, int budget,
                      int local_window, cudaStream_t stream) {
    KVR_RETURN_IF_ERROR(Init("ctkvr", c, slots, max_tokens, budget));
    if (c.n_heads / c.n_kv_heads > kMaxGroupLane) {
      return absl::InvalidArgumentError(absl::StrCat("ctkvr lane: a GQA group of ",
                                                     c.n_heads / c.n_kv_heads, " (at most ",
                                                     kMaxGroupLane, ")"));
    }
    local_window_ = std::max(0, local_window);
    slot_.resize(slots);
    KVR_RETURN_IF_ERROR(Alloc(kept_counts_, int64_t{n_kv_}));
    KVR_RETURN_IF_ERROR(Alloc(recalled_, int64_t{n_kv_}));
    bytes_ += static_cast<int64_t>(kept_counts_.bytes() + recalled_.bytes());
    return kvr::cuda::CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }

  absl::Status Activate(int slot, std::span<const RetrievalIndex* const> layers, int64_t n_tokens,
                        int64_t capacity, cudaStream_t stream) override;

 private:
  // One sequence's state (see the top of the file).
  struct Slot {
    kvr::cuda::DeviceBuffer<uint8_t> state;
    int n_centroids = 0, cap = 0, rho = 0, n_recall = 0, fifo_size = 0;
    GqaAggregation gqa = GqaAggregation::kSumSoftmax;
    std::vector<int64_t> cursor;  // [n_layers] Selects with candidates so far
    int64_t layer_bytes = 0;
  };
  LayerState StateOf(int slot, int layer) const;
  CtkvrSelectParams SelectParams(int slot, int layer, const float* query,
                                 const kvr::cuda::KvPoolView& pool, const CandidateRanges& cand,
                                 int budget) const;
  absl::Status Reserve(size_t ws_bytes, int keep);
  absl::Status Prepare(int layer, const kvr::cuda::KvPoolView& pool, cudaStream_t stream) override;
  absl::Status SelectGroup(int layer, const float* query, const kvr::cuda::KvPoolView& pool,
                           const CandidateRanges& cand, int max_candidates,
                           const SelectionOutput& out, cudaStream_t stream) override;

  int local_window_ = 0;
  std::vector<Slot> slot_;
  kvr::cuda::DeviceBuffer<uint8_t> ws_;  // the selections' workspace (one after another)
  kvr::cuda::DeviceBuffer<int32_t> kept_, kept_counts_, recalled_;
  int keep_ld_ = 0;
};

// Byte offsets of a slot's layer state (LayerState's arrays, 256-byte aligned).
struct StateLayout {
  int64_t centroids, norms, thresholds, lengths, offsets, counts, lists, bytes;
};
StateLayout LayoutFor(int n_kv, int c, int group, int d, int cap) {
  StateLayout l{};
  int64_t off = 0;
  auto take = [&](int64_t bytes) {
    const int64_t at = off;
    off += (bytes + 255) / 256 * 256;
    return at;
  };
  l.centroids = take(int64_t{n_kv} * c * group * d * 4);
  l.norms = take(int64_t{n_kv} * c * group * 4);
  l.thresholds = take(int64_t{n_kv} * c * 4);
  l.lengths = take(int64_t{n_kv} * c * 4);
  l.offsets = take(int64_t{n_kv} * (c + 1) * 4);
  l.counts = take(int64_t{n_kv} * 4);
  l.lists = take(int64_t{n_kv} * c * cap * 4);
  l.bytes = off;
  return l;
}

LayerState CtkvrLane::StateOf(int slot, int layer) const {
  const Slot& s = slot_[slot];
  const StateLayout l = LayoutFor(n_kv_, s.n_centroids, n_heads_ / n_kv_, head_dim_, s.cap);
  uint8_t* base = const_cast<uint8_t*>(s.state.data()) + layer * s.layer_bytes;
  return {reinterpret_cast<float*>(base + l.centroids),
          reinterpret_cast<float*>(base + l.norms),
          reinterpret_cast<float*>(base + l.thresholds),
          reinterpret_cast<int32_t*>(base + l.lengths),
          reinterpret_cast<int32_t*>(base + l.offsets),
          reinterpret_cast<int32_t*>(base + l.counts),
          reinterpret_cast<int32_t*>(base + l.lists),
          s.n_centroids,
          s.cap};
}

absl::Status CtkvrLane::Reserve(size_t ws_bytes, int keep) {
  if (ws_.bytes() < ws_bytes + 256) {
    KVR_RETURN_IF_ERROR(Alloc(ws_, static_cast<int64_t>(ws_bytes) + 256));
  }
  if (keep > keep_ld_) {
    KVR_RETURN_IF_ERROR(Alloc(kept_, int64_t{n_kv_} * keep));
    keep_ld_ = keep;
  }
  return absl::OkStatus();
}

absl::Status CtkvrLane::Activate(int slot, std::span<const RetrievalIndex* const> layers,
                                 int64_t n_tokens, int64_t capacity, cudaStream_t stream) {
  auto bad = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("ctkvr lane: ", parts...));
  };
  KVR_RETURN_IF_ERROR(CheckIndexes(layers, n_tokens));
  capacity = std::min(std::max(capacity, n_tokens), max_tokens_);
  const int group = n_heads_ / n_kv_;
  std::vector<CtkvrState> states;
  states.reserve(n_layers_);
  int64_t longest = 0;
  for (int l = 0; l < n_layers_; ++l) {
    KVR_ASSIGN_OR_RETURN(CtkvrState st, CtkvrStateOf(*layers[l]));
    if (l > 0 && (st.n_centroids != states[0].n_centroids || st.rho != states[0].rho ||
                  st.n_recall != states[0].n_recall || st.fifo_size != states[0].fifo_size ||
                  st.gqa != states[0].gqa)) {
      return bad("layer ", l, " has other parameters than layer 0");
    }
    if (st.n_recall < 1 || st.n_recall > 32) return bad("C' ", st.n_recall, " outside [1, 32]");
    if (st.n_centroids < 1 || st.n_centroids * 4 > 200 * 1024) {
      return bad(st.n_centroids, " centroids (the selector takes 1 to 51200)");
    }
    for (const auto& head : st.heads) {
      for (const CtkvrState::Entry& e : head) {
        longest = std::max<int64_t>(longest, static_cast<int64_t>(e.list.size()));
      }
    }
    states.push_back(std::move(st));
  }
  const CtkvrState& s0 = states[0];
  const int64_t keep = std::max<int64_t>(s0.rho, budget_);
  if (keep > kMaxBudget) {
    return bad("rho ", s0.rho, " and budget ", budget_, " keep ", keep,
               " keys per rotated entry (at most ", kMaxBudget, ")");
  }
  const int64_t cap =
      std::min<int64_t>(std::max<int64_t>(1, capacity),
                        std::max(longest, keep + local_window_ + 1) + (capacity - n_tokens));
  Slot& s = slot_[slot];
  s.n_centroids = static_cast<int>(s0.n_centroids);
  s.cap = static_cast<int>(cap);
  s.rho = static_cast<int>(s0.rho);
  s.n_recall = static_cast<int>(s0.n_recall);
  s.fifo_size = static_cast<int>(s0.fifo_size);
  s.gqa = s0.gqa;
  s.cursor.assign(n_layers_, 0);
  const StateLayout lay = LayoutFor(n_kv_, s.n_centroids, group, head_dim_, s.cap);
  s.layer_bytes = lay.bytes;
  const int64_t want = lay.bytes * n_layers_;
  if (static_cast<int64_t>(s.state.bytes()) < want) {
    s.state = {};
    if (absl::Status st = Alloc(s.state, want); !st.ok()) {
      return bad(want, " bytes of GPU memory for the sequence's qcIVF: ", st.message());
    }
  }
  // Host images of one layer, uploaded in turn (the copies are waited for before reuse).
  const int C = s.n_centroids;
  std::vector<uint8_t> image(static_cast<size_t>(lay.bytes));
  for (int l = 0; l < n_layers_; ++l) {
    const CtkvrState& st = states[l];
    std::fill(image.begin(), image.end(), 0);
    auto* cent = reinterpret_cast<float*>(image.data() + lay.centroids);
    auto* norms = reinterpret_cast<float*>(image.data() + lay.norms);
    auto* thr = reinterpret_cast<float*>(image.data() + lay.thresholds);
    auto* lens = reinterpret_cast<int32_t*>(image.data() + lay.lengths);
    auto* offs = reinterpret_cast<int32_t*>(image.data() + lay.offsets);
    auto* lists = reinterpret_cast<int32_t*>(image.data() + lay.lists);
    auto* counts = reinterpret_cast<int32_t*>(image.data() + lay.counts);
    for (int h = 0; h < n_kv_; ++h) {
      counts[h] = C;
      for (int c = 0; c <= C; ++c) offs[int64_t{h} * (C + 1) + c] = c * s.cap;
      for (int c = 0; c < C; ++c) {
        const CtkvrState::Entry& e = st.heads[h][c];
        const int64_t entry = int64_t{h} * C + c;
        if (!e.centroid.empty() && (e.centroid.size() != static_cast<size_t>(group) * head_dim_ ||
                                    e.norms.size() != static_cast<size_t>(group))) {
          return bad("layer ", l, " head ", h, " entry ", c, ": a centroid of the wrong size");
        }
        std::copy(e.centroid.begin(), e.centroid.end(), cent + entry * group * head_dim_);
        std::copy(e.norms.begin(), e.norms.end(), norms + entry * group);
        thr[entry] = e.threshold;
        lens[entry] = static_cast<int32_t>(e.list.size());
        std::copy(e.list.begin(), e.list.end(), lists + entry * s.cap);
      }
    }
    s.cursor[l] = st.next_fifo;
    KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.state.data() + l * lay.bytes, image.data(),
                                             image.size(), cudaMemcpyHostToDevice, stream));
    KVR_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  }
  // The workspace of the larger of the two selections.
  CtkvrSelectParams p = SelectParams(slot, 0, nullptr, {}, {}, static_cast<int>(keep));
  KVR_RETURN_IF_ERROR(Reserve(CtkvrSelectWorkspaceBytes(p), static_cast<int>(keep)));
  return absl::OkStatus();
}

CtkvrSelectParams CtkvrLane::SelectParams(int slot, int layer, const float* query,
                                          const kvr::cuda::KvPoolView& pool,
                                          const CandidateRanges& cand, int budget) const {
  const Slot& s = slot_[slot];
  const LayerState st = StateOf(slot, layer);
  CtkvrSelectParams p;
  SetSelectShape(p, 1);
  p.gqa = s.gqa;
  p.n_recall = s.n_recall;
  p.query = query;
  p.centroids = st.centroids;
  p.n_centroids = st.counts;
  p.list_offsets = st.offsets;
  p.lists = st.lists;
  p.list_lengths = st.lengths;
  p.max_centroids = s.n_centroids;
  p.max_list_entries = s.n_centroids * s.cap;
  p.max_list_length = s.cap;
  p.max_tokens = static_cast<int>(max_tokens_);
  p.keys.dtype = KeyDType::kBf16;
  p.keys.pool = pool;
  p.keys.row_bytes = 4 * int64_t{head_dim_};  // bf16 [K | V]
  p.cand = cand;
  p.out.budget = budget;
  return p;
}

absl::Status CtkvrLane::Prepare(int layer, const kvr::cuda::KvPoolView& pool, cudaStream_t stream) {
  const float scale = 1.f / std::sqrt(static_cast<float>(head_dim_));
  for (const Planned& p : planned_) {
    if (p.leaving < 0) continue;
    const LayerState st = StateOf(p.slot, layer);
    const dim3 grid((st.n_centroids + 31) / 32, n_kv_);
    const int group = n_heads_ / n_kv_;
    if (head_dim_ == 64) {
      GrowListsKernel<64><<<grid, 256, 0, stream>>>(st, pool, p.slot, n_kv_, group, scale,
                                                    static_cast<int32_t>(p.leaving));
    } else {
      GrowListsKernel<128><<<grid, 256, 0, stream>>>(st, pool, p.slot, n_kv_, group, scale,
                                                     static_cast<int32_t>(p.leaving));
    }
    KVR_RETURN_IF_ERROR(kvr::cuda::LastLaunchStatus("GrowListsKernel"));
  }
  return absl::OkStatus();
}

absl::Status CtkvrLane::SelectGroup(int layer, const float* query,
                                    const kvr::cuda::KvPoolView& pool, const CandidateRanges& cand,
                                    int, const SelectionOutput& out, cudaStream_t stream) {
  const float scale = 1.f / std::sqrt(static_cast<float>(head_dim_));
  const int group = n_heads_ / n_kv_;
  for (const Planned& p : planned_) {
    if (p.budget != out.budget) continue;  // another group's
    Slot& s = slot_[p.slot];
    // This slot's rows of the batch-wide inputs and outputs: a selection of batch 1.
    kvr::cuda::KvPoolView one = pool;
    one.slots += p.slot;
    one.pages += int64_t{p.slot} * n_kv_ * pool.max_pages;
    const float* q = query + int64_t{p.slot} * n_heads_ * head_dim_;
    const CandidateRanges c{cand.begin + p.slot, cand.end + p.slot};
    CtkvrSelectParams sp = SelectParams(p.slot, layer, q, one, c, out.budget);
    sp.out = {out.budget, out.ids + int64_t{p.slot} * n_kv_ * out.budget,
              out.counts + int64_t{p.slot} * n_kv_};
    sp.workspace = ws_.data();
    sp.workspace_bytes = ws_.bytes();
    KVR_RETURN_IF_ERROR(CtkvrSelect(sp, stream));
    if (s.fifo_size <= 0 || p.cand_end <= p.cand_begin) continue;
    // The FIFO update (the CPU's Select skips it, and its cursor, without candidates).
    const int keep = std::max(s.rho, out.budget);
    sp.out = {keep, kept_.data(), kept_counts_.data()};
    sp.n_recalled = recalled_.data();
    KVR_RETURN_IF_ERROR(CtkvrSelect(sp, stream));
    const int e = s.n_centroids - s.fifo_size + static_cast<int>(s.cursor[layer] % s.fifo_size);
    const LayerState st = StateOf(p.slot, layer);
    if (head_dim_ == 64) {
      RotateEntryKernel<64><<<n_kv_, 256, 0, stream>>>(st, pool, p.slot, n_kv_, group, scale, q, e,
                                                       keep, kept_.data(), kept_counts_.data(),
                                                       recalled_.data(), p.cand_end, p.n_tokens);
    } else {
      RotateEntryKernel<128><<<n_kv_, 256, 0, stream>>>(st, pool, p.slot, n_kv_, group, scale, q, e,
                                                        keep, kept_.data(), kept_counts_.data(),
                                                        recalled_.data(), p.cand_end, p.n_tokens);
    }
    KVR_RETURN_IF_ERROR(kvr::cuda::LastLaunchStatus("RotateEntryKernel"));
    ++s.cursor[layer];
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<GpuLane>> CreateCtkvrLane(const model::ModelConfig& config,
                                                         int slots, int64_t max_tokens, int budget,
                                                         int local_window, cudaStream_t stream) {
  if (config.head_dim != 64 && config.head_dim != 128) {
    return absl::InvalidArgumentError(absl::StrCat("ctkvr lane: head_dim ", config.head_dim,
                                                   " (the GPU selector takes 64 or 128)"));
  }
  auto lane = std::make_unique<CtkvrLane>();
  KVR_RETURN_IF_ERROR(lane->Create(config, slots, max_tokens, budget, local_window, stream));
  return std::unique_ptr<GpuLane>(std::move(lane));
}

}  // namespace kvr::retrieval::cuda
