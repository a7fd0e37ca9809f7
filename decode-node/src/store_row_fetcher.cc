#include "kvr/decode/store_row_fetcher.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace kvr::decode {

StoreRowFetcher::StoreRowFetcher(kv_store::KvStoreClient* store,
                                 std::shared_ptr<kv_store::KvStoreClient> owner,
                                 kv_store::SequenceRef sequence)
    : store_(store), owner_(std::move(owner)), sequence_(std::move(sequence)) {}

absl::Status StoreRowFetcher::Start(std::span<const Rows> rows, std::span<uint8_t> out) {
  if (op_ != nullptr) return absl::InternalError("StoreRowFetcher: a fetch is still running");
  size_t n = 0;
  for (const Rows& r : rows) n += r.positions.size();
  indices_.resize(n);
  entries_.clear();
  size_t at = 0;
  for (const Rows& r : rows) {
    for (size_t i = 0; i < r.positions.size(); ++i) {
      if (r.positions[i] < 0) {
        return absl::InternalError(absl::StrCat("StoreRowFetcher: position ", r.positions[i]));
      }
      indices_[at + i] = static_cast<uint32_t>(r.positions[i]);
    }
    entries_.push_back({sequence_, static_cast<uint32_t>(r.layer),
                        static_cast<uint32_t>(r.kv_head),
                        std::span<const uint32_t>(indices_.data() + at, r.positions.size())});
    at += r.positions.size();
  }
  op_ = store_->StartGather(entries_, out);
  expected_ = out.size_bytes();
  return absl::OkStatus();
}

absl::Status StoreRowFetcher::Wait() {
  if (op_ == nullptr) return absl::InternalError("StoreRowFetcher: no fetch started");
  absl::StatusOr<uint64_t> got = op_->Wait();
  op_.reset();
  if (!got.ok()) {
    return absl::UnavailableError(
        absl::StrCat("reading rows from the store: ", got.status().message()));
  }
  if (*got != expected_) {
    return absl::InternalError(
        absl::StrCat("the store sent ", *got, " bytes of rows, expected ", expected_));
  }
  return absl::OkStatus();
}

}  // namespace kvr::decode
