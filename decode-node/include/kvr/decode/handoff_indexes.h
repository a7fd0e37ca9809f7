#pragma once
// A handoff's retrieval indexes: the method's summaries of every layer, as the prefill node
// built and shipped them, deserialized into the CPU index of the method. Both decode backends
// select with them (the CPU backend for every method; the CUDA backend for the methods it has
// no GPU selector for).

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kvr/decode/engine.h"
#include "kvr/model/config.h"
#include "kvr/retrieval/index.h"
#include "kvr/retrieval/registry.h"

namespace kvr::decode {

// One index per layer (layer order), sized for the prompt (size() == h.prompt_tokens), with
// IndexParams from the handoff's retrieval settings and `assets` (a2ats' codebooks). `full`
// ships no summaries: its entries are null (every candidate is selected). InvalidArgument
// "handoff of sequence <id>: ..." naming the layer: an unknown method, a layer out of range,
// sent twice or missing, summaries of another method or length, or none where the method has.
[[nodiscard]] absl::StatusOr<std::vector<std::unique_ptr<retrieval::RetrievalIndex>>>
IndexesFromHandoff(const Handoff& h, const model::ModelConfig& config,
                   const retrieval::MethodRegistry& registry,
                   std::shared_ptr<const retrieval::MethodAssets> assets);

}  // namespace kvr::decode
