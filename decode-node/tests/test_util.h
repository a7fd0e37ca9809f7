#pragma once
// Helpers for the decode-node tests: an in-process store, a store wrapper that counts calls
// and a cache's rows rounded to bf16.

#include <atomic>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kvr/common/half.h"
#include "kvr/kv_store/client.h"
#include "kvr/kv_store/forwarding_client.h"
#include "kvr/model/kv_cache.h"

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

// Forwards to another client and counts gathers, puts, range reads and releases.
class CountingStore final : public kv_store::ForwardingKvStoreClient {
 public:
  explicit CountingStore(kv_store::KvStoreClient* inner)
      : ForwardingKvStoreClient(inner, "CountingStore") {}
  std::unique_ptr<kv_store::KvStoreOp> StartPutLayer(const kv_store::LayerRows& rows) override {
    ++puts;
    return inner()->StartPutLayer(rows);
  }
  std::unique_ptr<kv_store::KvStoreOp> StartGather(std::span<const kv_store::GatherEntry> entries,
                                                   std::span<uint8_t> out) override {
    ++gathers;
    for (const auto& e : entries) gathered_rows += static_cast<int64_t>(e.indices.size());
    return inner()->StartGather(entries, out);
  }
  absl::Status RangeRead(std::span<const kv_store::RangeEntry> ranges,
                         std::span<uint8_t> out) override {
    ++range_reads;
    return inner()->RangeRead(ranges, out);
  }
  absl::Status Release(const kv_store::SequenceRef& ref, absl::Duration keep) override {
    ++releases;
    return inner()->Release(ref, keep);
  }

  std::atomic<int64_t> puts{0}, gathers{0}, gathered_rows{0}, releases{0}, range_reads{0};
};

// [n, heads, dim] Gaussian values.
inline std::vector<float> RandomTensor(int64_t n, int heads, int dim, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> v(n * heads * dim);
  for (float& x : v) x = nd(rng);
  return v;
}

// A float32 cache holding `cache`'s rows rounded to bf16 values (exact in f32 and in bf16): what
// a node that reads bf16 store rows has in its window.
inline model::KvCache RoundedToBf16(const model::KvCache& cache) {
  model::KvCache out(cache.n_layers(), cache.n_kv_heads(), cache.head_dim());
  const int64_t row = cache.row_floats();
  for (int l = 0; l < cache.n_layers(); ++l) {
    const model::KvView kv = cache.View(l);
    std::vector<float> k(kv.n_rows * row), v(kv.n_rows * row);
    for (int64_t t = 0; t < kv.n_rows; ++t) {
      for (int64_t i = 0; i < row; ++i) {
        k[t * row + i] = Bf16ToFloat(FloatToBf16(kv.k[t * kv.row_stride + i]));
        v[t * row + i] = Bf16ToFloat(FloatToBf16(kv.v[t * kv.row_stride + i]));
      }
    }
    EXPECT_TRUE(out.Append(l, kv.n_rows, k.data(), v.data(), row).ok());
  }
  return out;
}

}  // namespace kvr::decode::testing
