#pragma once
// Exact attention over every row of the KV view: the reference implementation of the seam in
// attention.h, and what `kvr generate` uses.
//
// Per (sequence, head, block of queries) it forms the score block with one SGEMM, applies the
// causal mask, a numerically stable softmax (max subtracted, float32), and multiplies by V with
// a second SGEMM. Work is spread over the thread pool, whose threads each call a
// single-threaded OpenBLAS (the constructor sets OpenBLAS to one thread when given a pool of
// several, as Model::Create does) so that the cores are not oversubscribed.
//
// Thread safety: Attend may be called from one thread at a time (it uses the pool).

#include <span>

#include "absl/status/status.h"
#include "kvr/model/attention.h"

namespace kvr {
class ThreadPool;
}  // namespace kvr

namespace kvr::model {

class DenseAttention final : public Attention {
 public:
  // `pool` may be null (single-threaded); it must outlive this object.
  explicit DenseAttention(ThreadPool* pool, int query_block = 64);

  [[nodiscard]] absl::Status Attend(const AttentionShape& shape,
                                    std::span<const AttentionRequest> batch) override;

 private:
  ThreadPool* pool_;
  int query_block_;
};

// Checks one request against the shape: pointers set, counts non-negative, strides large
// enough. Shared with other Attention implementations.
[[nodiscard]] absl::Status ValidateAttentionRequest(const AttentionShape& shape,
                                                    const AttentionRequest& request);

}  // namespace kvr::model
