#include "kvr/kv_store/client.h"

namespace kvr::kv_store {

absl::StatusOr<std::unique_ptr<FakeKvStoreClient>> FakeKvStoreClient::Create(
    StoreOptions options) {
  auto store = PagedKvStore::Create(std::move(options));
  if (!store.ok()) return store.status();
  return std::unique_ptr<FakeKvStoreClient>(new FakeKvStoreClient(*std::move(store)));
}

void FakeKvStoreClient::InjectFailure(absl::Status status) {
  absl::MutexLock lock(&mu_);
  injected_ = std::move(status);
}

absl::Status FakeKvStoreClient::Injected() const {
  absl::MutexLock lock(&mu_);
  return injected_;
}

absl::StatusOr<CreateResult> FakeKvStoreClient::CreateSequence(SequenceId id,
                                                               const SequenceShape& shape,
                                                               uint64_t expected_tokens,
                                                               absl::Duration lease) {
  if (absl::Status st = Injected(); !st.ok()) return st;
  return store_->CreateSequence(id, shape, expected_tokens, lease);
}

absl::StatusOr<uint64_t> FakeKvStoreClient::PutLayer(const LayerRows& rows) {
  if (absl::Status st = Injected(); !st.ok()) return st;
  return store_->Write(rows);
}

absl::Status FakeKvStoreClient::Gather(std::span<const GatherEntry> entries,
                                       std::span<uint8_t> out) {
  if (absl::Status st = Injected(); !st.ok()) return st;
  return store_->Gather(entries, out);
}

absl::Status FakeKvStoreClient::RangeRead(std::span<const RangeEntry> ranges,
                                          std::span<uint8_t> out) {
  if (absl::Status st = Injected(); !st.ok()) return st;
  return store_->RangeRead(ranges, out);
}

absl::Status FakeKvStoreClient::Release(SequenceId id, absl::Duration keep) {
  if (absl::Status st = Injected(); !st.ok()) return st;
  return store_->Release(id, keep);
}

absl::Status FakeKvStoreClient::Lease(SequenceId id, absl::Duration lease) {
  if (absl::Status st = Injected(); !st.ok()) return st;
  return store_->Lease(id, lease);
}

absl::StatusOr<SequenceInfo> FakeKvStoreClient::GetSequence(SequenceId id) {
  if (absl::Status st = Injected(); !st.ok()) return st;
  return store_->GetSequence(id);
}

absl::StatusOr<StoreStats> FakeKvStoreClient::Stats() {
  if (absl::Status st = Injected(); !st.ok()) return st;
  return store_->Stats();
}

}  // namespace kvr::kv_store
