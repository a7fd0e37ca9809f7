#include "kvr/retrieval/cuda/gather.cuh"

#include "absl/strings/str_cat.h"
#include "kvr/common/cuda/cuda_util.h"

namespace kvr::retrieval::cuda {
namespace {

// One thread per 16-byte chunk: thread t handles chunk t % chunks_per_row of slot
// t / chunks_per_row (flattened [batch, n_kv_heads, budget]). Consecutive threads read
// consecutive chunks of one row (coalesced), and the grid keeps many independent 16-byte reads
// in flight, which is what a zero-copy read over PCIe needs to approach the link rate.
__global__ void GatherRowsKernel(KvPoolView pool, const int32_t* __restrict__ ids,
                                 const int32_t* __restrict__ counts, uint4* __restrict__ out,
                                 int budget, int chunks_per_row, int64_t total_chunks) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= total_chunks) return;
  const int64_t slot = t / chunks_per_row;  // [batch * n_kv_heads * budget]
  const int chunk = static_cast<int>(t - slot * chunks_per_row);
  const int64_t bh = slot / budget;
  const int i = static_cast<int>(slot - bh * budget);
  if (i >= counts[bh]) return;
  const int32_t id = ids[slot];
  if (id < 0) return;
  const auto* row = static_cast<const uint4*>(KvPoolRow(pool, bh, id, chunks_per_row * 16));
  out[slot * chunks_per_row + chunk] = row[chunk];
}

}  // namespace

absl::Status GatherRows(const GatherParams& p, cudaStream_t stream) {
  if (p.batch <= 0 || p.n_kv_heads <= 0 || p.budget <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("GatherRows: empty shape batch=", p.batch,
                                                   " n_kv_heads=", p.n_kv_heads,
                                                   " budget=", p.budget));
  }
  if (p.head_dim != 64 && p.head_dim != 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("GatherRows: head_dim must be 64 or 128, got ", p.head_dim));
  }
  if (!KvPoolViewSet(p.pool) || !p.ids || !p.counts || !p.out) {
    return absl::InvalidArgumentError("GatherRows: null pool tables, ids, counts or out");
  }
  if (p.pool.n_kv_heads != p.n_kv_heads) {
    return absl::InvalidArgumentError(absl::StrCat("GatherRows: pool.n_kv_heads ",
                                                   p.pool.n_kv_heads, " != ", p.n_kv_heads));
  }
  const int chunks_per_row = static_cast<int>(RowBytes(p.dtype, p.head_dim) / 16);
  const int64_t total = static_cast<int64_t>(p.batch) * p.n_kv_heads * p.budget * chunks_per_row;
  constexpr int kThreads = 256;
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  GatherRowsKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      p.pool, p.ids, p.counts,
      static_cast<uint4*>(p.out), p.budget, chunks_per_row, total);
  return kvr::cuda::LastLaunchStatus("GatherRowsKernel");
}

}  // namespace kvr::retrieval::cuda
