#include "kvr/decode/handoff_indexes.h"

#include <span>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvr/retrieval/model_shape.h"

namespace kvr::decode {

absl::StatusOr<std::vector<std::unique_ptr<retrieval::RetrievalIndex>>> IndexesFromHandoff(
    const Handoff& h, const model::ModelConfig& c, const retrieval::MethodRegistry& registry,
    std::shared_ptr<const retrieval::MethodAssets> assets) {
  auto bad = [&](auto&&... parts) {
    return absl::InvalidArgumentError(
        absl::StrCat("handoff of sequence ", h.sequence_id, ": ", parts...));
  };
  if (!registry.Has(h.method)) {
    return bad("retrieval.method '", h.method, "' is not supported here");
  }
  retrieval::IndexParams params;
  params.budget = h.budget;
  params.n_sink = h.n_sink;
  params.local_window = h.local_window;
  params.options = h.options;
  params.assets = std::move(assets);
  std::vector<std::unique_ptr<retrieval::RetrievalIndex>> indexes(c.n_layers);
  std::vector<bool> seen(c.n_layers, false);
  for (const HandoffLayerData& layer : h.layers) {
    if (layer.layer < 0 || layer.layer >= c.n_layers || seen[layer.layer]) {
      return bad("layer ", layer.layer, " is out of range or sent twice");
    }
    seen[layer.layer] = true;
    if (layer.summaries.empty()) {
      if (h.method != "full") {
        return bad("layer ", layer.layer, ": no summaries for method '", h.method, "'");
      }
      continue;  // null index: every non-resident position
    }
    const retrieval::IndexShape shape = retrieval::IndexShapeOf(c, layer.layer);
    absl::StatusOr<std::unique_ptr<retrieval::RetrievalIndex>> index = retrieval::DeserializeIndex(
        std::span(reinterpret_cast<const uint8_t*>(layer.summaries.data()), layer.summaries.size()),
        registry, params, &shape);
    if (!index.ok()) return bad("layer ", layer.layer, " summaries: ", index.status().message());
    if ((*index)->method() != h.method || (*index)->size() != h.prompt_tokens) {
      return bad("layer ", layer.layer, " summaries are method '", std::string((*index)->method()),
                 "' over ", (*index)->size(), " tokens; expected '", h.method, "' over ",
                 h.prompt_tokens);
    }
    indexes[layer.layer] = std::move(*index);
  }
  for (int l = 0; l < c.n_layers; ++l) {
    if (!seen[l]) return bad("no data for layer ", l);
  }
  return indexes;
}

}  // namespace kvr::decode
