#include "kvr/common/status.h"
#include "kvr/retrieval/registry.h"

namespace kvr::retrieval {

// Defined next to each method's implementation.
absl::Status RegisterBaselines(MethodRegistry& registry);
absl::Status RegisterClusterKv(MethodRegistry& registry);
absl::Status RegisterCtkvr(MethodRegistry& registry);
absl::Status RegisterKeyDiff(MethodRegistry& registry);

absl::Status RegisterCoreMethods(MethodRegistry& registry) {
  KVR_RETURN_IF_ERROR(RegisterBaselines(registry));
  KVR_RETURN_IF_ERROR(RegisterClusterKv(registry));
  KVR_RETURN_IF_ERROR(RegisterCtkvr(registry));
  KVR_RETURN_IF_ERROR(RegisterKeyDiff(registry));
  return absl::OkStatus();
}

}  // namespace kvr::retrieval
