#pragma once
// Conversions every gRPC shell needs between abseil and the wire: status codes (absl and gRPC
// share the canonical numbering), google.protobuf.Duration and Timestamp.

#include <grpcpp/support/status.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "google/protobuf/duration.pb.h"
#include "google/protobuf/timestamp.pb.h"

namespace kvr::proto {

inline grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

inline absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

inline absl::Duration FromProto(const google::protobuf::Duration& d) {
  return absl::Seconds(d.seconds()) + absl::Nanoseconds(d.nanos());
}

inline void SetDuration(absl::Duration d, google::protobuf::Duration* out) {
  const int64_t nanos = absl::ToInt64Nanoseconds(d);
  out->set_seconds(nanos / 1'000'000'000);
  out->set_nanos(static_cast<int32_t>(nanos % 1'000'000'000));
}

// An unset (all-zero) timestamp means no deadline: InfiniteFuture.
inline absl::Time TimeOf(const google::protobuf::Timestamp& t) {
  if (t.seconds() == 0 && t.nanos() == 0) return absl::InfiniteFuture();
  return absl::FromUnixSeconds(t.seconds()) + absl::Nanoseconds(t.nanos());
}

inline void SetTimestamp(absl::Time t, google::protobuf::Timestamp* out) {
  const int64_t nanos = absl::ToUnixNanos(t);
  out->set_seconds(nanos / 1'000'000'000);
  out->set_nanos(static_cast<int32_t>(nanos % 1'000'000'000));
}

}  // namespace kvr::proto
