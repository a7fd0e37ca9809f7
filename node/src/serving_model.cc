#include "kvr/node/serving_model.h"

#include <iostream>
#include <utility>

#include "absl/status/statusor.h"
#include "kvr/retrieval/all_methods.h"
#include "kvr/retrieval/codebook.h"

namespace kvr::node {

std::optional<ServingModel> LoadServingModelOrExit(const std::string& program,
                                                   const std::string& model,
                                                   const std::string& device,
                                                   const std::string& a2ats_codebooks,
                                                   ThreadPool* pool, int* exit_code) {
  // "<program>: <why>" on stderr, and the exit status.
  auto fail = [&](const auto& why, int status) {
    std::cerr << program << ": " << why << "\n";
    *exit_code = status;
    return std::nullopt;
  };
  model::LoadOptions load_options;
  load_options.weights =
      device == "cuda" ? model::WeightStorage::kFloat32 : model::WeightStorage::kPacked;
  absl::StatusOr<model::LoadedModel> loaded = model::LoadModel(model, load_options, pool);
  if (!loaded.ok()) return fail(loaded.status(), 1);
  absl::StatusOr<retrieval::MethodRegistry> methods = retrieval::AllMethods();
  if (!methods.ok()) return fail(methods.status(), 1);
  ServingModel out{.loaded = *std::move(loaded), .methods = *std::move(methods)};
  if (!a2ats_codebooks.empty()) {
    absl::StatusOr<std::shared_ptr<const retrieval::A2atsCodebooks>> books =
        retrieval::LoadCodebooksFor(*out.loaded.model, a2ats_codebooks);
    // Codebooks that do not fit the model are a configuration the node cannot serve.
    if (!books.ok()) return fail(books.status().message(), 2);
    out.a2ats_assets = *std::move(books);
  }
  return out;
}

}  // namespace kvr::node
