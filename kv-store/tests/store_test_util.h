#pragma once
// What the store core's tests share beyond the test pattern (kvr/kv_store/test_pattern.h).

#include <memory>
#include <utility>

#include "gtest/gtest.h"
#include "kvr/kv_store/store.h"

namespace kvr::kv_store::testing {

// A PagedKvStore of `options`; fails the test, and returns null, when it cannot be made.
inline std::unique_ptr<PagedKvStore> MakeTestStore(StoreOptions options) {
  absl::StatusOr<std::unique_ptr<PagedKvStore>> store = PagedKvStore::Create(std::move(options));
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? *std::move(store) : nullptr;
}

}  // namespace kvr::kv_store::testing
