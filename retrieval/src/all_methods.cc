#include "kvr/retrieval/all_methods.h"

#include "kvr/common/status.h"

namespace kvr::retrieval {

absl::StatusOr<MethodRegistry> AllMethods() {
  MethodRegistry registry;
  KVR_RETURN_IF_ERROR(RegisterCoreMethods(registry));
  // Defined by eval.cmake when kvr::retrieval_quant is part of the build: the #if lives in this
  // source file, not in a public header.
#ifdef KVR_RETRIEVAL_HAVE_QUANT
  KVR_RETURN_IF_ERROR(RegisterQuantMethods(registry));
#endif
  return registry;
}

}  // namespace kvr::retrieval
