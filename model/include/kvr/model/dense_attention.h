#pragma once
// Exact attention over every row of the KV view: the reference implementation of the seam in
// attention.h, and what `kvr generate` uses.
//
// A decode query (one token whose position is past every row) takes one pass over K and V per
// KV head through CpuKernels::attend_rows (online softmax, SIMD), the same kernel the decode
// node runs over its resident and fetched rows, so that the two agree bit for bit on the same
// rows. Other queries (prefill), per (sequence, head, block of queries): the score block with
// one SGEMM, the causal mask, a numerically stable softmax (max subtracted, float32), and a
// second SGEMM by V. Work is spread over the thread pool, whose threads each call a
// single-threaded OpenBLAS (the constructor sets OpenBLAS to one thread when given a pool of
// several, as Model::Create does) so that the cores are not oversubscribed.
//
// Thread safety: Attend may be called from one thread at a time (it uses the pool).

#include <span>

#include "absl/status/status.h"
#include "kvr/model/attention.h"
#include "kvr/model/cpu_kernels.h"

namespace kvr {
class ThreadPool;
}  // namespace kvr

namespace kvr::model {

class DenseAttention final : public Attention {
 public:
  // Query rows of a prompt chunk go to the GEMMs in blocks of `query_block` counted from the
  // chunk's first position, and a block's sums run over the keys up to its last row: rows come
  // out the same however a prompt is cut into chunks as long as every chunk starts on a
  // multiple of the block (what a prefill from a cached prefix relies on).
  static constexpr int kDefaultQueryBlock = 64;
  // `pool` may be null (single-threaded); it must outlive this object.
  explicit DenseAttention(ThreadPool* pool, int query_block = kDefaultQueryBlock);

  [[nodiscard]] absl::Status Attend(const AttentionShape& shape,
                                    std::span<const AttentionRequest> batch) override;

 private:
  ThreadPool* pool_;
  int query_block_;
};

// The rows [first_row, first_row + n_rows) of `kv` for KV head `kv_head`, as attend_rows
// takes them.
AttentionRows KvRowsForHead(const KvView& kv, int kv_head, int head_dim, int64_t first_row,
                            int64_t n_rows);

// Checks one request against the shape: pointers set, counts non-negative, strides large
// enough. Shared with other Attention implementations.
[[nodiscard]] absl::Status ValidateAttentionRequest(const AttentionShape& shape,
                                                    const AttentionRequest& request);

}  // namespace kvr::model
