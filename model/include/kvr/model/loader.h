#pragma once
// Opens a model by path or name for `kvr generate` and the nodes: GGUF file, Hugging Face
// directory, or a dummy shape; returns the config, the weights and (for real models) the
// tokenizer.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvr/model/model.h"
#include "kvr/model/tokenizer.h"
#include "kvr/model/tokenizer_gguf.h"

namespace kvr {
class ThreadPool;
}  // namespace kvr

namespace kvr::model {

enum class LoadFormat { kAuto, kGguf, kHf, kDummy };

// "auto", "gguf", "hf", "dummy"; InvalidArgument otherwise.
[[nodiscard]] absl::StatusOr<LoadFormat> ParseLoadFormat(absl::string_view name);

struct LoadOptions {
  LoadFormat format = LoadFormat::kAuto;
  uint64_t dummy_seed = 0;
  int dummy_layers = 0;  // > 0 overrides a dummy shape's layer count
  // GGUF weights: kPacked keeps the file's formats (the fast CPU path); kFloat32 dequantises
  // everything at load (the exact reference, and what the CUDA backend uploads from). Hugging
  // Face and dummy weights are float32 either way.
  WeightStorage weights = WeightStorage::kPacked;
  // Precision of the KV rows (Model::Create): half by default, as llama.cpp's CPU path; kF32
  // keeps the exact float32 reference.
  KvDType kv_dtype = KvDType::kF16;
};

// "packed", "float32"; InvalidArgument otherwise.
[[nodiscard]] absl::StatusOr<WeightStorage> ParseWeightStorage(absl::string_view name);

struct LoadedModel {
  std::unique_ptr<Model> model;
  std::optional<Tokenizer> tokenizer;  // absent for dummy weights
  std::string source;                  // the resolved path, or "dummy:<shape>"
};

// `model` is a path (a .gguf file, or a directory with config.json + safetensors), a known name
// ("smollm2-135m-instruct" -> kvr::TestModelPath()), or with kDummy a shape from dummy.h.
// kAuto picks gguf/hf from the path. Weights larger than the machine's memory give
// ResourceExhausted (saying how many layers would fit) rather than an out-of-memory kill.
[[nodiscard]] absl::StatusOr<LoadedModel> LoadModel(const std::string& model,
                                                    const LoadOptions& options, ThreadPool* pool);

}  // namespace kvr::model
