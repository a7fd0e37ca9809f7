#pragma once
// Conversions between kvr.store.v1 protos, grpc::Status and the store's domain types; shared
// by the gRPC service and the UCX client. Private to kv-store.

#include <chrono>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "kvr/kv_store/local_pool.h"
#include "kvr/kv_store/types.h"
#include "kvr/proto/convert.h"
#include "kvr/store/v1/store.pb.h"

namespace kvr::kv_store {

using ::kvr::proto::ToGrpcStatus;
// The gRPC error with `what` (the call) in front of its message.
inline absl::Status FromGrpc(const grpc::Status& st, const std::string& what) {
  const absl::Status s = ::kvr::proto::FromGrpcStatus(st);
  return s.ok() ? s : absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

inline std::chrono::system_clock::time_point ToChrono(absl::Time t) {
  return absl::ToChronoTime(t);
}

[[nodiscard]] inline absl::StatusOr<SequenceShape> FromProto(const store::v1::SequenceShape& p) {
  auto dtype = DTypeFromInt(static_cast<uint32_t>(p.dtype()));
  if (!dtype.ok()) return dtype.status();
  SequenceShape shape{.n_layers = p.n_layers(), .n_kv_heads = p.n_kv_heads(),
                      .head_dim = p.head_dim(), .dtype = *dtype};
  if (absl::Status st = shape.Validate(); !st.ok()) return st;
  return shape;
}

inline void ToProto(const SequenceShape& shape, store::v1::SequenceShape* p) {
  p->set_n_layers(shape.n_layers);
  p->set_n_kv_heads(shape.n_kv_heads);
  p->set_head_dim(shape.head_dim);
  p->set_dtype(static_cast<store::v1::DType>(shape.dtype));
}

inline void ToProto(const StoreStats& s, store::v1::StatsResponse* p) {
  p->set_capacity_bytes(s.capacity_bytes);
  p->set_used_bytes(s.used_bytes);
  p->set_page_bytes(s.page_bytes);
  p->set_total_pages(s.total_pages);
  p->set_free_pages(s.free_pages);
  p->set_sequences(s.sequences);
  p->set_evictions(s.evictions);
  p->set_expired_sequences(s.expired_sequences);
  p->set_page_backing(s.page_backing);
  p->set_bytes_written(s.bytes_written);
  p->set_bytes_read(s.bytes_read);
  p->set_evictions_expired(s.evictions_expired);
  p->set_evictions_cached_lru(s.evictions_cached_lru);
  p->set_shared_pages(s.shared_pages);
  p->set_forks(s.forks);
  p->set_forked_rows(s.forked_rows);
  p->set_cached_sequences(s.cached_sequences);
  p->set_cached_bytes(s.cached_bytes);
  p->set_evictions_thinned(s.evictions_thinned);
  p->set_thinned_pages(s.thinned_pages);
}

inline void ToProto(const PageTable& t, store::v1::ReservePageTableResponse* p) {
  ToProto(t.shape, p->mutable_shape());
  p->set_tokens_per_page(t.tokens_per_page);
  p->set_page_bytes(t.page_bytes);
  p->set_pages_per_head(t.pages_per_head);
  p->mutable_committed_rows()->Add(t.committed_rows.begin(), t.committed_rows.end());
  p->mutable_pages()->Add(t.pages.begin(), t.pages.end());
}

// Checks that the sizes agree with each other (a table the GPU indexes must be dense).
[[nodiscard]] inline absl::StatusOr<PageTable> FromProto(
    const store::v1::ReservePageTableResponse& p) {
  PageTable t;
  auto shape = FromProto(p.shape());
  if (!shape.ok()) return shape.status();
  t.shape = *shape;
  t.tokens_per_page = p.tokens_per_page();
  t.page_bytes = p.page_bytes();
  t.pages_per_head = p.pages_per_head();
  t.committed_rows.assign(p.committed_rows().begin(), p.committed_rows().end());
  t.pages.assign(p.pages().begin(), p.pages().end());
  if (t.tokens_per_page == 0 || t.page_bytes < t.tokens_per_page * t.shape.RowBytes() ||
      t.committed_rows.size() != t.shape.n_layers ||
      t.pages.size() !=
          uint64_t{t.shape.n_layers} * t.shape.n_kv_heads * uint64_t{t.pages_per_head}) {
    return absl::InternalError(
        absl::StrCat("malformed page table: ", t.shape.n_layers, " layers x ", t.shape.n_kv_heads,
                     " kv heads x ", t.pages_per_head, " pages per head but ", t.pages.size(),
                     " pages, ", t.committed_rows.size(), " committed-row counts, ",
                     t.tokens_per_page, " tokens per page of ", t.page_bytes, " bytes"));
  }
  return t;
}

inline StoreStats FromProto(const store::v1::StatsResponse& p) {
  return {.capacity_bytes = p.capacity_bytes(),
          .used_bytes = p.used_bytes(),
          .page_bytes = p.page_bytes(),
          .total_pages = p.total_pages(),
          .free_pages = p.free_pages(),
          .sequences = p.sequences(),
          .evictions = p.evictions(),
          .expired_sequences = p.expired_sequences(),
          .page_backing = p.page_backing(),
          .bytes_written = p.bytes_written(),
          .bytes_read = p.bytes_read(),
          .evictions_expired = p.evictions_expired(),
          .evictions_cached_lru = p.evictions_cached_lru(),
          .shared_pages = p.shared_pages(),
          .forks = p.forks(),
          .forked_rows = p.forked_rows(),
          .cached_sequences = p.cached_sequences(),
          .cached_bytes = p.cached_bytes(),
          .evictions_thinned = p.evictions_thinned(),
          .thinned_pages = p.thinned_pages()};
}

}  // namespace kvr::kv_store
