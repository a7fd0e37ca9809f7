// clusterkv: centroid scoring, top clusters, cluster-ordered expansion to token ids.
//
//  1. internal::GroupScores (exact.cu) over the centroids (fp32 or bf16): GQA-aggregated q.mu
//     per cluster ([rows, RowLd(max_clusters)]), the same kernels as `exact` with row_count =
//     n_clusters.
//  2. BatchedTopK of the top first_pick clusters (default max(64, budget / 8); ascending ids).
//  3. ClusterKvExpandKernel, one CTA per row: ranks the chosen clusters by (score desc, cluster
//     asc) like the CPU's TopKIndices, counts each cluster's candidate members (a warp per
//     cluster, coalesced), walks the ranks to
//     find how many each contributes (a block scan) (last one trimmed to its first candidate
//     members in stored order), gathers them and sorts them ascending (bitonic, shared memory).
//     A row whose chosen clusters hold fewer candidates than its budget while more clusters
//     exist is marked short and writes nothing.
//  4. Only when a row is short (decided on the device: the launches always run, the others'
//     rows are empty): 2 and 3 again for the short rows over min(n_clusters, budget + 256)
//     clusters, the CPU's limit. The top first_pick clusters are the first first_pick of those
//     in the same order, so a row that was not short has the selection the full ranking gives.
// Bytes: centroids, head_dim * 4 (fp32) or 2 (bf16) bytes per cluster and KV head (~6.5 MiB per
// sequence at 128K with L/80 fp32 clusters, Llama-3-8B), plus the members of the chosen clusters.

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kvr/common/cuda/cuda_util.h"
#include "kvr/common/status.h"
#include "kvr/retrieval/cuda/selection.cuh"
#include "select_common.cuh"
#include "topk_device.cuh"

namespace kvr::retrieval::cuda {

namespace {

using internal::AlignUp;
using internal::RowLd;

constexpr int kThreads = 1024;
constexpr int kExtra = 256;     // clusters ranked beyond the budget (see selection.cuh)
constexpr int kMaxPick = 2304;  // kMaxOutBudget + kExtra (dynamic shared memory: 63.5 KB)
constexpr int kMaxOutBudget = 2048;

int Pick(const ClusterKvSelectParams& p) { return std::min(p.max_clusters, p.out.budget + kExtra); }

ExactSelectParams ScoreParams(const ClusterKvSelectParams& p) {
  ExactSelectParams e;
  e.batch = p.batch;
  e.n_heads = p.n_heads;
  e.n_kv_heads = p.n_kv_heads;
  e.head_dim = p.head_dim;
  e.scale = p.scale;
  e.gqa = p.gqa;
  e.query = p.query;
  e.keys.data = p.centroids;
  e.keys.dtype = p.centroid_dtype;
  e.keys.token_stride = p.head_dim;
  e.keys.head_stride = static_cast<int64_t>(p.max_clusters) * p.head_dim;
  e.keys.batch_stride = static_cast<int64_t>(p.n_kv_heads) * p.max_clusters * p.head_dim;
  e.max_candidates = p.max_clusters;
  e.workspace = p.workspace;
  e.workspace_bytes = p.workspace_bytes;
  return e;
}

int FirstPick(const ClusterKvSelectParams& p) {
  const int want = p.first_pick > 0 ? p.first_pick : std::max(64, p.out.budget / 8);
  return std::min(want, Pick(p));
}

struct Tail {                     // after the scoring workspace
  int32_t* picked = nullptr;      // [rows, pick]
  int32_t* pick_count = nullptr;  // [rows]
  int32_t* short_valid = nullptr;  // [rows]: n_clusters of the rows ranked again, else 0
  size_t bytes = 0;
};

Tail CarveTail(const ClusterKvSelectParams& p, char* base) {
  const size_t rows = static_cast<size_t>(p.batch) * p.n_kv_heads;
  internal::Carver carve(base, AlignUp(internal::GroupScoresWorkspaceBytes(ScoreParams(p))));
  Tail t;
  t.picked = carve.Take<int32_t>(rows * std::max(1, Pick(p)));
  t.pick_count = carve.Take<int32_t>(rows);
  t.short_valid = carve.Take<int32_t>(rows);
  t.bytes = carve.used();
  return t;
}

static __global__ void __launch_bounds__(kThreads)
    ClusterKvExpandKernel(int n_kv_heads, int ld, int pick, int max_clusters, int max_members,
                          const float* __restrict__ scores, const int32_t* __restrict__ picked,
                          const int32_t* __restrict__ pick_count,
                          const int32_t* __restrict__ offsets, const int32_t* __restrict__ members,
                          CandidateRanges cand, int budget, const int32_t* __restrict__ budgets,
                          const int32_t* __restrict__ n_clusters, int32_t* __restrict__ short_valid,
                          const int32_t* __restrict__ only, int32_t* __restrict__ ids,
                          int32_t* __restrict__ counts) {
  const int row = blockIdx.x;
  // The second pass (only != null) expands the rows the first marked short, and no other.
  if (only != nullptr && only[row] == 0) return;
  const int b = row / n_kv_heads;
  // This row's budget; rows stay `budget` apart in ids.
  const int row_budget = budgets != nullptr ? max(0, min(budgets[b], budget)) : budget;
  const int np = pick_count[row];
  const int cb = cand.begin[b], ce = cand.end[b];
  // Dynamic shared memory (ExpandSmemBytes): 6 arrays of kMaxPick + the output buffer.
  extern __shared__ int smem[];
  float* s_score = reinterpret_cast<float*>(smem);  // slot -> score
  int* s_rank = smem + kMaxPick;                    // slot -> rank
  int* s_len = smem + 2 * kMaxPick;                 // rank -> candidate members, then taken
  int* s_pos = smem + 3 * kMaxPick;                 // rank -> output position
  int* s_lo = smem + 4 * kMaxPick;                  // slot -> members [lo, hi)
  int* s_hi = smem + 5 * kMaxPick;
  int* s_out = smem + 6 * kMaxPick;  // [kMaxOutBudget]
  __shared__ int s_total;
  __shared__ int s_warp[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  constexpr int kWarps = kThreads / 32;
  const int32_t* my_picked = picked + static_cast<int64_t>(row) * pick;
  const int32_t* my_off = offsets + static_cast<int64_t>(row) * (max_clusters + 1);
  const int32_t* my_members = members + static_cast<int64_t>(row) * max_members;
  for (int i = threadIdx.x; i < np; i += kThreads) {
    const int c = my_picked[i];
    s_score[i] = scores[static_cast<int64_t>(row) * ld + c];
    s_lo[i] = my_off[c];
    s_hi[i] = my_off[c + 1];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < np; i += kThreads) {
    const float si = s_score[i];
    int r = 0;
    for (int j = 0; j < np; ++j) {
      const float sj = s_score[j];
      r += (sj > si) || (sj == si && j < i);  // slots are ascending cluster ids
    }
    s_rank[i] = r;
  }
  __syncthreads();
  // Candidate members per chosen cluster: each warp takes kBatch clusters at a time and issues
  // kUnroll coalesced loads of 32 members for each of them before using any (clusters average
  // ~80 members: one round trip per kBatch clusters instead of three per cluster), ballots count.
  constexpr int kUnroll = 4;
  constexpr int kBatch = 4;
  for (int i0 = warp * kBatch; i0 < np; i0 += kWarps * kBatch) {
    int lo[kBatch], hi[kBatch], n[kBatch];
#pragma unroll
    for (int q = 0; q < kBatch; ++q) {
      const int i = i0 + q;
      lo[q] = i < np ? s_lo[i] : 0;
      hi[q] = i < np ? s_hi[i] : 0;
      n[q] = 0;
    }
    for (int base = 0;; base += 32 * kUnroll) {
      bool more = false;
#pragma unroll
      for (int q = 0; q < kBatch; ++q) more |= lo[q] + base < hi[q];
      if (!more) break;  // uniform over the warp
      int t[kBatch][kUnroll];
#pragma unroll
      for (int q = 0; q < kBatch; ++q) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int m = lo[q] + base + u * 32 + lane;
          t[q][u] = m < hi[q] ? my_members[m] : -1;
        }
      }
#pragma unroll
      for (int q = 0; q < kBatch; ++q) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          n[q] += __popc(__ballot_sync(0xffffffffu, t[q][u] >= cb && t[q][u] < ce));
        }
      }
    }
    if (lane == 0) {
#pragma unroll
      for (int q = 0; q < kBatch; ++q) {
        if (i0 + q < np) s_len[s_rank[i0 + q]] = n[q];
      }
    }
  }
  __syncthreads();
  // Walk the ranks in parallel: with prefix_r = sum of s_len over ranks < r, the cluster at rank
  // r contributes min(len_r, max(0, budget - prefix_r)) tokens at output position
  // min(prefix_r, budget). Block-wide exclusive scan, kPer consecutive ranks per thread.
  {
    constexpr int kPer = (kMaxPick + kThreads - 1) / kThreads;
    int local[kPer];
    int sum = 0;
    const int first = threadIdx.x * kPer;
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      local[e] = first + e < np ? s_len[first + e] : 0;
      sum += local[e];
    }
    const int incl = internal::WarpInclusiveScan(sum, lane);
    if (lane == 31) s_warp[warp] = incl;
    __syncthreads();
    if (warp == 0) {
      const int v = s_warp[lane];
      const int wi = internal::WarpInclusiveScan(v, lane);
      s_warp[lane] = wi - v;
      if (lane == 31) s_total = min(wi, row_budget);
    }
    __syncthreads();
    int prefix = s_warp[warp] + incl - sum;
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      if (first + e < np) {
        s_pos[first + e] = min(prefix, row_budget);
        s_len[first + e] = min(local[e], max(0, row_budget - prefix));
      }
      prefix += local[e];
    }
  }
  __syncthreads();
  // Gather the taken members (the first s_len[rank] candidates in stored order), same batching.
  const unsigned lt_mask = (1u << lane) - 1u;
  for (int i0 = warp * kBatch; i0 < np; i0 += kWarps * kBatch) {
    int lo[kBatch], hi[kBatch], take[kBatch], pos[kBatch], seen[kBatch];
#pragma unroll
    for (int q = 0; q < kBatch; ++q) {
      const int i = i0 + q;
      const int r = i < np ? s_rank[i] : 0;
      take[q] = i < np ? s_len[r] : 0;
      pos[q] = i < np ? s_pos[r] : 0;
      lo[q] = i < np ? s_lo[i] : 0;
      hi[q] = i < np ? s_hi[i] : 0;
      seen[q] = 0;
    }
    for (int base = 0;; base += 32 * kUnroll) {
      bool more = false;
#pragma unroll
      for (int q = 0; q < kBatch; ++q) more |= seen[q] < take[q] && lo[q] + base < hi[q];
      if (!more) break;  // uniform over the warp
      int t[kBatch][kUnroll];
#pragma unroll
      for (int q = 0; q < kBatch; ++q) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int m = lo[q] + base + u * 32 + lane;
          t[q][u] = (m < hi[q] && seen[q] < take[q]) ? my_members[m] : -1;
        }
      }
#pragma unroll
      for (int q = 0; q < kBatch; ++q) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const bool ok = t[q][u] >= cb && t[q][u] < ce;
          const unsigned ball = __ballot_sync(0xffffffffu, ok);
          const int idx = seen[q] + __popc(ball & lt_mask);
          if (ok && idx < take[q]) s_out[pos[q] + idx] = t[q][u];
          seen[q] += __popc(ball);
        }
      }
    }
  }
  __syncthreads();
  const int total = s_total;
  if (short_valid != nullptr) {
    // First pass: short when the chosen clusters could not fill the budget while others exist
    // and candidates are left for them (every candidate token is in one cluster: a row that
    // took all of its candidates is done). Uniform over the block: s_total and np are shared.
    const bool is_short =
        total < min(row_budget, max(0, ce - cb)) && np == pick && np < n_clusters[row];
    if (threadIdx.x == 0) short_valid[row] = is_short ? n_clusters[row] : 0;
    if (is_short) return;
  }
  int size = 1;
  while (size < total) size <<= 1;
  for (int i = total + threadIdx.x; i < size; i += kThreads) s_out[i] = INT_MAX;
  __syncthreads();
  // Bitonic sort of s_out[0, size) ascending.
  for (int k = 2; k <= size; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < size; i += kThreads) {
        const int l = i ^ j;
        if (l > i) {
          const int a = s_out[i], c = s_out[l];
          const bool up = (i & k) == 0;
          if ((a > c) == up) {
            s_out[i] = c;
            s_out[l] = a;
          }
        }
      }
      __syncthreads();
    }
  }
  int32_t* out = ids + static_cast<int64_t>(row) * budget;
  for (int i = threadIdx.x; i < budget; i += kThreads) out[i] = i < total ? s_out[i] : -1;
  if (threadIdx.x == 0) counts[row] = total;
}

}  // namespace

size_t ClusterKvSelectWorkspaceBytes(const ClusterKvSelectParams& p) {
  return CarveTail(p, nullptr).bytes;
}

absl::Status ClusterKvSelect(const ClusterKvSelectParams& p, cudaStream_t stream) {
  if (p.out.budget < 1 || p.out.budget > kMaxOutBudget) {
    return absl::InvalidArgumentError(absl::StrCat("ClusterKvSelect: budget must be in [1, ",
                                                   kMaxOutBudget, "], got ", p.out.budget));
  }
  if (p.max_clusters < 1 || p.max_members < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("ClusterKvSelect: max_clusters and max_members must be >= 1, got ",
                     p.max_clusters, ", ", p.max_members));
  }
  if (p.centroid_dtype != KeyDType::kF32 && p.centroid_dtype != KeyDType::kBf16) {
    return absl::InvalidArgumentError("ClusterKvSelect: centroids must be fp32 or bf16");
  }
  if (p.batch == 0) return absl::OkStatus();
  if (p.n_clusters == nullptr || p.offsets == nullptr || p.members == nullptr ||
      p.cand.begin == nullptr || p.cand.end == nullptr || p.out.ids == nullptr ||
      p.out.counts == nullptr) {
    return absl::InvalidArgumentError("ClusterKvSelect: null cluster tables, candidates or output");
  }
  const Tail tail = CarveTail(p, static_cast<char*>(p.workspace));
  if (p.workspace == nullptr || p.workspace_bytes < tail.bytes) {
    return absl::InvalidArgumentError(absl::StrCat("ClusterKvSelect: workspace of ",
                                                   p.workspace_bytes, " bytes, need ", tail.bytes));
  }
  const ExactSelectParams e = ScoreParams(p);
  KVR_RETURN_IF_ERROR(internal::GroupScores(e, p.n_clusters, stream));
  const int rows = p.batch * p.n_kv_heads;
  const int ld = RowLd(p.max_clusters);
  const auto* scores = static_cast<const float*>(p.workspace);  // GroupScores writes them first
  constexpr int kSmemBytes = (6 * kMaxPick + kMaxOutBudget) * sizeof(int);
  KVR_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      ClusterKvExpandKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  // Rank `pick` clusters of the rows with n_valid clusters (0: none) and expand them.
  auto pass = [&](int pick, const int32_t* n_valid, int32_t* short_valid, const int32_t* only) {
    TopKParams t;
    t.rows = rows;
    t.row_stride = ld;
    t.scores = scores;
    t.n_valid = n_valid;
    t.id_offset = nullptr;
    t.out = {pick, tail.picked, tail.pick_count};
    KVR_RETURN_IF_ERROR(LaunchBatchedTopK(t, stream));
    ClusterKvExpandKernel<<<rows, kThreads, kSmemBytes, stream>>>(
        p.n_kv_heads, ld, pick, p.max_clusters, p.max_members, scores, tail.picked, tail.pick_count,
        p.offsets, p.members, p.cand, p.out.budget, p.budgets, p.n_clusters, short_valid, only,
        p.out.ids, p.out.counts);
    return kvr::cuda::LastLaunchStatus("ClusterKvExpandKernel");
  };
  const int first = FirstPick(p), full = Pick(p);
  if (first >= full) return pass(full, p.n_clusters, nullptr, nullptr);
  KVR_RETURN_IF_ERROR(pass(first, p.n_clusters, tail.short_valid, nullptr));
  return pass(full, tail.short_valid, nullptr, tail.short_valid);
}

}  // namespace kvr::retrieval::cuda
