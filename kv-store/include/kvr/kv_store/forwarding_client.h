#pragma once
// ForwardingKvStoreClient: the base of a KvStoreClient decorator (a test's store that counts
// calls, a benchmark's store that drops puts), which then overrides only what it changes.

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "kvr/kv_store/client.h"

namespace kvr::kv_store {

// Forwards every data and sequence call to `inner` (unowned; it must outlive this). Page tables
// and the local pool answer UNIMPLEMENTED naming `name`: rows read through a mapping of the
// pool would bypass the decorator.
class ForwardingKvStoreClient : public KvStoreClient {
 public:
  ForwardingKvStoreClient(KvStoreClient* inner, std::string name)
      : inner_(inner), name_(std::move(name)) {}

  std::unique_ptr<KvStoreOp> StartPutLayer(const LayerRows& rows) override {
    return inner_->StartPutLayer(rows);
  }
  std::unique_ptr<KvStoreOp> StartGather(std::span<const GatherEntry> entries,
                                         std::span<uint8_t> out) override {
    return inner_->StartGather(entries, out);
  }
  absl::StatusOr<CreateResult> CreateSequence(const SequenceRef& ref, const SequenceShape& shape,
                                              uint64_t expected_tokens,
                                              absl::Duration lease) override {
    return inner_->CreateSequence(ref, shape, expected_tokens, lease);
  }
  absl::StatusOr<ForkResult> ForkSequence(const SequenceRef& child, const SequenceRef& parent,
                                          uint64_t rows, uint64_t expected_tokens,
                                          absl::Duration lease) override {
    return inner_->ForkSequence(child, parent, rows, expected_tokens, lease);
  }
  absl::Status RangeRead(std::span<const RangeEntry> ranges, std::span<uint8_t> out) override {
    return inner_->RangeRead(ranges, out);
  }
  absl::Status Release(const SequenceRef& ref, absl::Duration keep) override {
    return inner_->Release(ref, keep);
  }
  absl::Status Lease(const SequenceRef& ref, absl::Duration lease) override {
    return inner_->Lease(ref, lease);
  }
  absl::StatusOr<SequenceInfo> GetSequence(const SequenceRef& ref) override {
    return inner_->GetSequence(ref);
  }
  absl::StatusOr<StoreStats> Stats() override { return inner_->Stats(); }
  absl::Status PutAttachment(const SequenceRef& ref, uint32_t layer, uint64_t rows,
                             std::span<const uint8_t> bytes) override {
    return inner_->PutAttachment(ref, layer, rows, bytes);
  }
  absl::StatusOr<Attachment> GetAttachment(const SequenceRef& ref, uint32_t layer) override {
    return inner_->GetAttachment(ref, layer);
  }
  absl::StatusOr<PageTable> ReservePageTable(const SequenceRef&, uint64_t) override {
    return absl::UnimplementedError(absl::StrCat(name_, ": no page tables"));
  }
  absl::StatusOr<std::shared_ptr<const LocalPoolMapping>> MapLocalPool() override {
    return absl::UnimplementedError(absl::StrCat(name_, ": no local pool"));
  }

 protected:
  KvStoreClient* inner() const { return inner_; }

 private:
  KvStoreClient* inner_;
  std::string name_;
};

}  // namespace kvr::kv_store
