#pragma once
// Named model shapes for `--load-format dummy`: the real configs of well-known models with
// random weights (weights.h RandomWeights), for performance work without the files.

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvr/model/config.h"

namespace kvr::model {

// "smollm2-135m", "qwen2-0.5b", "llama3-8b", and "tiny" (2 layers, hidden 64: for tests).
std::vector<std::string> DummyShapeNames();

// The config of a named shape. `n_layers_override` > 0 replaces the layer count (llama3-8b has
// 32 layers = 30 GiB of float32 weights, more than a small machine holds; see LoadModel).
// NotFound listing the known names for an unknown one.
[[nodiscard]] absl::StatusOr<ModelConfig> DummyConfig(absl::string_view shape,
                                                      int n_layers_override = 0);

}  // namespace kvr::model
