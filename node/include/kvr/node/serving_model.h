#pragma once
// What a worker node (kvr-prefill, kvr-decode) serves with, loaded once at start: the model,
// the retrieval methods and, when given, the A2ATS codebooks of the model.

#include <memory>
#include <optional>
#include <string>

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
// against the model. On failure prints "<program>: <why>" to stderr and returns nullopt with
// `*exit_code` set, as LoadConfigOrExit does: 1 when the model or the methods cannot be loaded
// (the status with its code: NOT_FOUND for a missing file), 2 when the codebooks cannot be used
// (the loader's message).
[[nodiscard]] std::optional<ServingModel> LoadServingModelOrExit(const std::string& program,
                                                                 const std::string& model,
                                                                 const std::string& device,
                                                                 const std::string& a2ats_codebooks,
                                                                 ThreadPool* pool, int* exit_code);

}  // namespace kvr::node
