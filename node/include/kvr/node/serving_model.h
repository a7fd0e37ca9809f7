#pragma once
// What a worker node (kvr-prefill, kvr-decode) serves with, loaded once at start: the model,
// the retrieval methods and, when given, the A2ATS codebooks of the model.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kvr/model/loader.h"
#include "kvr/retrieval/registry.h"

namespace kvr {
class ThreadPool;
}  // namespace kvr

namespace kvr::node {

struct ServingModel {
  model::LoadedModel loaded;
  retrieval::MethodRegistry methods;
  // The A2ATS codebooks (what method a2ats is offered with); null when none were given.
  std::shared_ptr<const retrieval::MethodAssets> a2ats_assets;
};

// Loads `model` (model::LoadModel) with float32 weights for device "cuda" (what the CUDA
// backend uploads) and GGUF weights kept packed otherwise (the CPU forward pass); `pool` must
// outlive the model. Loads the codebooks at `a2ats_codebooks` (none when empty), checked
// against the model: INVALID_ARGUMENT with the loader's message when they cannot be used.
// Other errors are the loader's and the method registry's.
[[nodiscard]] absl::StatusOr<ServingModel> LoadServingModel(const std::string& model,
                                                            const std::string& device,
                                                            const std::string& a2ats_codebooks,
                                                            ThreadPool* pool);

}  // namespace kvr::node
