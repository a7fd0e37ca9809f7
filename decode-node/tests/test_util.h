#pragma once
// Helpers for the decode-node tests: an in-process store and a store wrapper that counts
// calls.

#include <atomic>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kvr/kv_store/client.h"

namespace kvr::decode::testing {

inline std::unique_ptr<kv_store::FakeKvStoreClient> MakeFakeStore(uint64_t bytes = 64 << 20) {
  kv_store::StoreOptions options;
  options.pool.capacity_bytes = bytes;
  options.pool.page_bytes = 16 * 1024;
  options.pool.try_huge_pages = false;
  auto store = kv_store::FakeKvStoreClient::Create(options);
  EXPECT_TRUE(store.ok()) << store.status();
  return std::move(*store);
}

// Forwards to another client and counts gathers, puts and range reads.
class CountingStore final : public kv_store::KvStoreClient {
 public:
  explicit CountingStore(kv_store::KvStoreClient* inner) : inner_(inner) {}
  std::unique_ptr<kv_store::KvStoreOp> StartPutLayer(const kv_store::LayerRows& rows) override {
    ++puts;
    return inner_->StartPutLayer(rows);
  }
  std::unique_ptr<kv_store::KvStoreOp> StartGather(std::span<const kv_store::GatherEntry> entries,
                                                   std::span<uint8_t> out) override {
    ++gathers;
    for (const auto& e : entries) gathered_rows += static_cast<int64_t>(e.indices.size());
    return inner_->StartGather(entries, out);
  }
  absl::StatusOr<kv_store::CreateResult> CreateSequence(const kv_store::SequenceRef& ref,
                                                        const kv_store::SequenceShape& shape,
                                                        uint64_t expected,
                                                        absl::Duration lease) override {
    return inner_->CreateSequence(ref, shape, expected, lease);
  }
  absl::StatusOr<kv_store::ForkResult> ForkSequence(const kv_store::SequenceRef& child,
                                                    const kv_store::SequenceRef& parent,
                                                    uint64_t rows, uint64_t expected,
                                                    absl::Duration lease) override {
    return inner_->ForkSequence(child, parent, rows, expected, lease);
  }
  absl::Status RangeRead(std::span<const kv_store::RangeEntry> ranges,
                         std::span<uint8_t> out) override {
    ++range_reads;
    return inner_->RangeRead(ranges, out);
  }
  absl::Status Release(const kv_store::SequenceRef& ref, absl::Duration keep) override {
    ++releases;
    return inner_->Release(ref, keep);
  }
  absl::Status Lease(const kv_store::SequenceRef& ref, absl::Duration lease) override {
    return inner_->Lease(ref, lease);
  }
  absl::StatusOr<kv_store::SequenceInfo> GetSequence(const kv_store::SequenceRef& ref) override {
    return inner_->GetSequence(ref);
  }
  absl::StatusOr<kv_store::StoreStats> Stats() override { return inner_->Stats(); }
  absl::StatusOr<kv_store::PageTable> ReservePageTable(const kv_store::SequenceRef&,
                                                       uint64_t) override {
    return absl::UnimplementedError("CountingStore: no page tables");
  }
  absl::StatusOr<std::shared_ptr<const kv_store::LocalPoolMapping>> MapLocalPool() override {
    return absl::UnimplementedError("CountingStore: no local pool");
  }

  std::atomic<int64_t> puts{0}, gathers{0}, gathered_rows{0}, releases{0}, range_reads{0};

 private:
  kv_store::KvStoreClient* inner_;
};

// [n, heads, dim] Gaussian values.
inline std::vector<float> RandomTensor(int64_t n, int heads, int dim, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> v(n * heads * dim);
  for (float& x : v) x = nd(rng);
  return v;
}

}  // namespace kvr::decode::testing
