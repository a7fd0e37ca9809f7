#include "kvr/model/loader.h"

#include <unistd.h>

#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kvr/common/paths.h"
#include "kvr/common/status.h"
#include "kvr/model/dummy.h"
#include "kvr/model/gguf.h"
#include "kvr/model/safetensors.h"

namespace kvr::model {

absl::StatusOr<LoadFormat> ParseLoadFormat(absl::string_view name) {
  if (name == "auto") return LoadFormat::kAuto;
  if (name == "gguf") return LoadFormat::kGguf;
  if (name == "hf") return LoadFormat::kHf;
  if (name == "dummy") return LoadFormat::kDummy;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown load format '", name, "'; expected auto, gguf, hf or dummy"));
}

namespace {

// Refuses weights that cannot fit in memory, before allocating them.
absl::Status CheckFits(const ModelConfig& config) {
  const int64_t bytes = config.ParameterCount() * static_cast<int64_t>(sizeof(float));
  const int64_t memory = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
  // Leave room for activations, the KV cache and everything else on the machine.
  const int64_t budget = memory / 10 * 8;
  if (bytes <= budget) return absl::OkStatus();
  ModelConfig one = config;
  one.n_layers = 1;
  ModelConfig zero = config;
  zero.n_layers = 0;
  const int64_t per_layer = (one.ParameterCount() - zero.ParameterCount()) * 4;
  const int64_t fixed = zero.ParameterCount() * 4;
  const int64_t fit = per_layer > 0 ? std::max<int64_t>(0, (budget - fixed) / per_layer) : 0;
  return absl::ResourceExhaustedError(absl::StrCat(
      "model '", config.name, "' needs ", bytes >> 20, " MiB of float32 weights (", config.n_layers,
      " layers) but this machine has ", memory >> 20, " MiB; at most ", fit,
      " layers fit (override the layer count, e.g. --layers ", std::min<int64_t>(fit, 8), ")"));
}

}  // namespace

absl::StatusOr<WeightStorage> ParseWeightStorage(absl::string_view name) {
  if (name == "packed") return WeightStorage::kPacked;
  if (name == "float32") return WeightStorage::kFloat32;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown weight storage '", name, "' (packed or float32)"));
}

absl::StatusOr<LoadedModel> LoadModel(const std::string& model, const LoadOptions& options,
                                      ThreadPool* pool) {
  LoadedModel loaded;
  if (options.format == LoadFormat::kDummy) {
    KVR_ASSIGN_OR_RETURN(ModelConfig config, DummyConfig(model, options.dummy_layers));
    KVR_RETURN_IF_ERROR(CheckFits(config));
    KVR_ASSIGN_OR_RETURN(ModelWeights weights, RandomWeights(config, options.dummy_seed, pool));
    KVR_ASSIGN_OR_RETURN(
        loaded.model, Model::Create(std::move(config), std::move(weights), pool, options.kv_dtype));
    loaded.source = absl::StrCat("dummy:", model);
    return loaded;
  }
  std::string path = model;
  if (model == "smollm2-135m-instruct") path = TestModelPath();
  std::error_code ec;
  const bool is_dir = std::filesystem::is_directory(path, ec);
  const bool is_file = std::filesystem::is_regular_file(path, ec);
  if (!is_dir && !is_file) {
    return absl::NotFoundError(absl::StrCat(
        "model '", model, "' is not a file, a directory or a known name (smollm2-135m-instruct",
        model == path ? "" : absl::StrCat(" -> ", path, ", which does not exist"),
        "); for random weights of a named shape use --load-format dummy"));
  }
  LoadFormat format = options.format;
  if (format == LoadFormat::kAuto) format = is_dir ? LoadFormat::kHf : LoadFormat::kGguf;
  loaded.source = path;
  if (format == LoadFormat::kGguf) {
    if (!is_file) return absl::InvalidArgumentError(absl::StrCat("'", path, "' is not a file"));
    KVR_ASSIGN_OR_RETURN(GgufFile file, GgufFile::Open(path));
    KVR_ASSIGN_OR_RETURN(ModelConfig config, ConfigFromGguf(file));
    KVR_ASSIGN_OR_RETURN(TokenizerSpec spec, TokenizerSpecFromGguf(file));
    KVR_ASSIGN_OR_RETURN(Tokenizer tokenizer, Tokenizer::FromGgufMetadata(spec));
    loaded.tokenizer.emplace(std::move(tokenizer));
    KVR_ASSIGN_OR_RETURN(ModelWeights weights, LoadGgufWeights(file, config, pool, options.weights));
    KVR_ASSIGN_OR_RETURN(
        loaded.model, Model::Create(std::move(config), std::move(weights), pool, options.kv_dtype));
    return loaded;
  }
  if (!is_dir) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", path, "' is not a directory (a Hugging Face checkpoint is one)"));
  }
  KVR_ASSIGN_OR_RETURN(SafetensorsCheckpoint checkpoint, SafetensorsCheckpoint::Open(path));
  KVR_ASSIGN_OR_RETURN(ModelConfig config, ConfigFromHfJson(checkpoint.config()));
  // Some configs omit tie_word_embeddings although the checkpoint has no lm_head.
  if (!checkpoint.HasTensor("lm_head.weight")) config.tied_embeddings = true;
  KVR_ASSIGN_OR_RETURN(Tokenizer tokenizer, Tokenizer::FromHuggingFaceDir(path));
  loaded.tokenizer.emplace(std::move(tokenizer));
  KVR_ASSIGN_OR_RETURN(ModelWeights weights, LoadHfWeights(checkpoint, config, pool));
  KVR_ASSIGN_OR_RETURN(
      loaded.model, Model::Create(std::move(config), std::move(weights), pool, options.kv_dtype));
  return loaded;
}

}  // namespace kvr::model
