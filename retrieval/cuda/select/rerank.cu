// The shared tail of the pariskv and ctkvr reranks (quant_common.cuh): group aggregation, top-k,
// index -> token id mapping.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kvr/common/cuda/cuda_util.h"
#include "kvr/common/status.h"
#include "quant_common.cuh"
#include "select_common.cuh"

namespace kvr::retrieval::cuda {

namespace internal {
namespace {

// ids[row, j] = id_map[row, ids[row, j]] for j < counts[row]; in place. id_map rows are ascending
// and the top-k wrote ascending indices, so the mapped ids stay ascending.
static __global__ void __launch_bounds__(256)
    RemapIdsKernel(int budget, int ld, const int32_t* __restrict__ id_map,
                   const int32_t* __restrict__ counts, int32_t* __restrict__ ids) {
  const int row = blockIdx.x;
  const int n = counts[row];
  int32_t* out = ids + static_cast<int64_t>(row) * budget;
  const int32_t* map = id_map + static_cast<int64_t>(row) * ld;
  for (int j = threadIdx.x; j < n; j += blockDim.x) out[j] = map[out[j]];
}

}  // namespace

absl::Status FinishRerank(const RerankTail& t, cudaStream_t stream) {
  const int rows = t.batch * t.n_kv_heads;
  if (rows == 0) return absl::OkStatus();
  if (t.gqa == GqaAggregation::kSumSoftmax) {
    LseKernel<<<rows, 32 * t.group, 0, stream>>>(t.group, t.chunk, t.n_chunks, t.partials,
                                                 t.n_valid, t.lse);
    KVR_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    const dim3 grid(std::max(1, (t.max_items + 1023) / 1024), t.n_kv_heads, t.batch);
    SoftmaxAggregateKernel<<<grid, 256, 0, stream>>>(t.n_kv_heads, t.group, t.ld, t.logits, t.lse,
                                                     t.n_valid, t.scores);
    KVR_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  TopKParams k;
  k.rows = rows;
  k.row_stride = t.ld;
  k.scores = t.scores;
  k.n_valid = t.n_valid;
  k.id_offset = nullptr;
  k.out = t.out;
  k.workspace = t.topk_workspace;
  k.workspace_bytes = t.topk_workspace_bytes;
  KVR_RETURN_IF_ERROR(LaunchBatchedTopK(k, stream));
  RemapIdsKernel<<<rows, 256, 0, stream>>>(t.out.budget, t.ld, t.id_map, t.out.counts, t.out.ids);
  return kvr::cuda::LastLaunchStatus("RemapIdsKernel");
}

}  // namespace internal
}  // namespace kvr::retrieval::cuda
