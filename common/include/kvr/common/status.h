#pragma once
// Status helpers shared by every component. absl::Status / absl::StatusOr<T> are the error
// vocabulary at every module boundary; these macros keep call sites short.

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KVR_STATUS_CONCAT_INNER_(a, b) a##b
#define KVR_STATUS_CONCAT_(a, b) KVR_STATUS_CONCAT_INNER_(a, b)

// KVR_RETURN_IF_ERROR(expr): returns the status of `expr` from the enclosing function when it
// is not OK.
#define KVR_RETURN_IF_ERROR(expr)                      \
  do {                                                 \
    ::absl::Status kvr_status_ = (expr);               \
    if (!kvr_status_.ok()) return kvr_status_;         \
  } while (false)

// KVR_ASSIGN_OR_RETURN(lhs, expr): evaluates the StatusOr `expr`; on error returns its status,
// otherwise moves the value into `lhs` (which may be a declaration: `auto x`).
#define KVR_ASSIGN_OR_RETURN(lhs, expr) \
  KVR_ASSIGN_OR_RETURN_IMPL_(KVR_STATUS_CONCAT_(kvr_statusor_, __LINE__), lhs, expr)
#define KVR_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return tmp.status();              \
  lhs = std::move(tmp).value()
