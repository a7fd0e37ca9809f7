#include "kvr/node/serving_model.h"

#include <utility>

#include "kvr/retrieval/all_methods.h"
#include "kvr/retrieval/codebook.h"

namespace kvr::node {

absl::StatusOr<ServingModel> LoadServingModel(const std::string& model, const std::string& device,
                                              const std::string& a2ats_codebooks,
                                              ThreadPool* pool) {
  model::LoadOptions load_options;
  load_options.weights =
      device == "cuda" ? model::WeightStorage::kFloat32 : model::WeightStorage::kPacked;
  absl::StatusOr<model::LoadedModel> loaded = model::LoadModel(model, load_options, pool);
  if (!loaded.ok()) return loaded.status();
  absl::StatusOr<retrieval::MethodRegistry> methods = retrieval::AllMethods();
  if (!methods.ok()) return methods.status();
  ServingModel out{.loaded = *std::move(loaded), .methods = *std::move(methods)};
  if (!a2ats_codebooks.empty()) {
    absl::StatusOr<std::shared_ptr<const retrieval::A2atsCodebooks>> books =
        retrieval::LoadCodebooksFor(*out.loaded.model, a2ats_codebooks);
    // Codebooks that do not fit the model are a configuration the node cannot serve.
    if (!books.ok()) return absl::InvalidArgumentError(books.status().message());
    out.a2ats_assets = *std::move(books);
  }
  return out;
}

}  // namespace kvr::node
