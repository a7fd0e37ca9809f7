#pragma once
// Every retrieval method this build has: the core methods, plus pariskv and a2ats when
// kvr::retrieval_quant is built. Target kvr::retrieval (defined in retrieval/eval.cmake, which
// is included after core and quant).

#include "absl/status/statusor.h"
#include "kvr/retrieval/registry.h"

namespace kvr::retrieval {

[[nodiscard]] absl::StatusOr<MethodRegistry> AllMethods();

}  // namespace kvr::retrieval
