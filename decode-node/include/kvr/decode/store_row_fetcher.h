#pragma once
// The GPU sparse decode's row fetcher (retrieval/cuda sparse_decode.h: SparseRowFetcher) over a
// KV store client: each Start is ONE gather request through the client's data plane (UCX to a
// kvr-store, in-process for the fake store of tests) for the rows of one store sequence. Used by
// the CUDA decode node for a sequence whose store it cannot read in place, and by `kvr bench
// decode` for its fetched placement.
//
// Thread safety: one fetch at a time (as the interface); the store client is thread-safe.

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "kvr/kv_store/client.h"
#include "kvr/retrieval/cuda/sparse_decode.h"

namespace kvr::decode {

class StoreRowFetcher final : public retrieval::cuda::SparseRowFetcher {
 public:
  // `store` must outlive the fetcher unless `owner` (may be null) keeps it alive.
  StoreRowFetcher(kv_store::KvStoreClient* store, std::shared_ptr<kv_store::KvStoreClient> owner,
                  kv_store::SequenceRef sequence);
  // InternalError for a negative position or a fetch still running.
  absl::Status Start(std::span<const Rows> rows, std::span<uint8_t> out) override;
  // UNAVAILABLE naming the store's error when the gather failed; InternalError when the store
  // sent another byte count than the rows need.
  absl::Status Wait() override;

 private:
  kv_store::KvStoreClient* store_;
  std::shared_ptr<kv_store::KvStoreClient> owner_;
  kv_store::SequenceRef sequence_;
  std::vector<uint32_t> indices_;
  std::vector<kv_store::GatherEntry> entries_;
  std::unique_ptr<kv_store::KvStoreOp> op_;
  uint64_t expected_ = 0;
};

}  // namespace kvr::decode
