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

RerankBuffers CarveRerank(Carver& carve, size_t rows, size_t group, int max_items, int chunk,
                          GqaAggregation gqa, int budget) {
  RerankBuffers b;
  b.ld = RowLd(max_items);
  b.ids = carve.Take<int32_t>(rows * b.ld);
  b.n_valid = carve.Take<int32_t>(rows);
  b.n_chunks = (max_items + chunk - 1) / chunk;
  if (gqa == GqaAggregation::kSumSoftmax) {
    b.logits = carve.Take<float>(rows * group * b.ld);
    b.partials = carve.Take<float2>(rows * b.n_chunks * group);
    b.lse = carve.Take<float>(rows * group);
  }
  b.scores = carve.Take<float>(rows * b.ld);
  TopKParams t;
  t.rows = static_cast<int>(rows);
  t.row_stride = b.ld;
  t.out.budget = budget;
  b.topk_bytes = BatchedTopKWorkspaceBytes(t);
  b.topk = carve.TakeBytes(b.topk_bytes);
  return b;
}

absl::Status FinishRerank(int batch, int n_kv_heads, int group, GqaAggregation gqa, int max_items,
                          int chunk, const RerankBuffers& b, const SelectionOutput& out,
                          cudaStream_t stream) {
  const int rows = batch * n_kv_heads;
  if (rows == 0) return absl::OkStatus();
  if (gqa == GqaAggregation::kSumSoftmax) {
    KVR_RETURN_IF_ERROR(SoftmaxAggregate(batch, n_kv_heads, group, chunk, b.n_chunks, b.ld,
                                         max_items, b.logits, b.partials, b.n_valid, b.lse,
                                         b.scores, stream));
  }
  TopKParams k;
  k.rows = rows;
  k.row_stride = b.ld;
  k.scores = b.scores;
  k.n_valid = b.n_valid;
  k.id_offset = nullptr;
  k.out = out;
  k.workspace = b.topk;
  k.workspace_bytes = b.topk_bytes;
  KVR_RETURN_IF_ERROR(LaunchBatchedTopK(k, stream));
  RemapIdsKernel<<<rows, 256, 0, stream>>>(out.budget, b.ld, b.ids, out.counts, out.ids);
  return kvr::cuda::LastLaunchStatus("RemapIdsKernel");
}

}  // namespace internal
}  // namespace kvr::retrieval::cuda
