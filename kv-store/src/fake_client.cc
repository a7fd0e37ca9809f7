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

absl::StatusOr<CreateResult> FakeKvStoreClient::CreateSequence(const SequenceRef& ref,
                                                               const SequenceShape& shape,
                                                               uint64_t expected_tokens,
                                                               absl::Duration lease) {
  if (absl::Status st = Injected(); !st.ok()) return st;
  return store_->CreateSequence(ref, shape, expected_tokens, lease);
}

absl::StatusOr<ForkResult> FakeKvStoreClient::ForkSequence(const SequenceRef& child,
                                                           const SequenceRef& parent,
                                                           uint64_t rows, uint64_t expected_tokens,
                                                           absl::Duration lease) {
  if (absl::Status st = Injected(); !st.ok()) return st;
  return store_->ForkSequence(child, parent, rows, expected_tokens, lease);
}

namespace {

// The fake runs every operation synchronously; its op only carries the result.
class DoneOp final : public KvStoreOp {
 public:
  explicit DoneOp(absl::StatusOr<uint64_t> result) : result_(std::move(result)) {}
  bool Done() const override { return true; }
  absl::StatusOr<uint64_t> Wait() override {
    if (waited_) return absl::FailedPreconditionError("KvStoreOp::Wait called twice");
    waited_ = true;
    return std::move(result_);
  }

 private:
  absl::StatusOr<uint64_t> result_;
  bool waited_ = false;
};

}  // namespace

std::unique_ptr<KvStoreOp> FakeKvStoreClient::StartPutLayer(const LayerRows& rows) {
  if (absl::Status st = Injected(); !st.ok()) return std::make_unique<DoneOp>(st);
  return std::make_unique<DoneOp>(store_->Write(rows));
}

std::unique_ptr<KvStoreOp> FakeKvStoreClient::StartGather(std::span<const GatherEntry> entries,
                                                          std::span<uint8_t> out) {
  if (absl::Status st = Injected(); !st.ok()) return std::make_unique<DoneOp>(st);
  absl::Status st = store_->Gather(entries, out);
  if (!st.ok()) return std::make_unique<DoneOp>(st);
  return std::make_unique<DoneOp>(uint64_t{out.size()});
}

absl::Status FakeKvStoreClient::RangeRead(std::span<const RangeEntry> ranges,
                                          std::span<uint8_t> out) {
  if (absl::Status st = Injected(); !st.ok()) return st;
  return store_->RangeRead(ranges, out);
}

absl::Status FakeKvStoreClient::Release(const SequenceRef& ref, absl::Duration keep) {
  if (absl::Status st = Injected(); !st.ok()) return st;
  return store_->Release(ref, keep);
}

absl::Status FakeKvStoreClient::Lease(const SequenceRef& ref, absl::Duration lease) {
  if (absl::Status st = Injected(); !st.ok()) return st;
  return store_->Lease(ref, lease);
}

absl::StatusOr<SequenceInfo> FakeKvStoreClient::GetSequence(const SequenceRef& ref) {
  if (absl::Status st = Injected(); !st.ok()) return st;
  return store_->GetSequence(ref);
}

absl::StatusOr<StoreStats> FakeKvStoreClient::Stats() {
  if (absl::Status st = Injected(); !st.ok()) return st;
  return store_->Stats();
}

absl::StatusOr<PageTable> FakeKvStoreClient::ReservePageTable(const SequenceRef& ref,
                                                              uint64_t rows) {
  if (absl::Status st = Injected(); !st.ok()) return st;
  return store_->ReservePageTable(ref, rows);
}

absl::Status FakeKvStoreClient::PutAttachment(const SequenceRef& ref, uint32_t layer, uint64_t rows,
                                              std::span<const uint8_t> bytes) {
  if (absl::Status st = Injected(); !st.ok()) return st;
  return store_->PutAttachment(ref, layer, rows, bytes);
}

absl::StatusOr<Attachment> FakeKvStoreClient::GetAttachment(const SequenceRef& ref,
                                                            uint32_t layer) {
  if (absl::Status st = Injected(); !st.ok()) return st;
  return store_->GetAttachment(ref, layer);
}

absl::StatusOr<std::shared_ptr<const LocalPoolMapping>> FakeKvStoreClient::MapLocalPool() {
  if (absl::Status st = Injected(); !st.ok()) return st;
  absl::MutexLock lock(&mu_);
  if (local_pool_ == nullptr) {
    const PagePool& pool = store_->pool();
    absl::StatusOr<LocalPoolMapping> mapping =
        LocalPoolMapping::Map(pool.fd(), pool.mapped_bytes(), pool.page_bytes(), pool.pool_id());
    if (!mapping.ok()) return mapping.status();
    local_pool_ = std::make_shared<const LocalPoolMapping>(*std::move(mapping));
  }
  return local_pool_;
}

}  // namespace kvr::kv_store
