#include "kvr/retrieval/registry.h"

namespace kvr::retrieval {

absl::Status RegisterCoreMethods(MethodRegistry& registry) {
  // The methods are registered here as they land (baselines, clusterkv, ctkvr, keydiff).
  return absl::OkStatus();
}

}  // namespace kvr::retrieval
