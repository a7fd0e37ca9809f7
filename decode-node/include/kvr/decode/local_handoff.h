#pragma once
// Plays the prefill node's part in one process, for tests and the decode benchmark: from a
// dense KvCache after prefill, creates the store sequence and puts every prompt row, builds
// one retrieval index per layer and packs the sink/local rows into a `Handoff`, as the
// handoff contract says (decode-node/README.md).

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "kvr/decode/engine.h"
#include "kvr/kv_store/client.h"
#include "kvr/model/kv_cache.h"
#include "kvr/model/model.h"
#include "kvr/retrieval/registry.h"

namespace kvr::decode {

struct LocalHandoffOptions {
  uint64_t sequence_id = 1;
  std::string method = "full";
  retrieval::IndexParams params;  // budget, n_sink, local_window, method options
  SamplingSettings sampling;
  int32_t first_token = 0;
  // `full` only: ship no summaries (the decode node then selects every non-resident row).
  bool empty_full_summaries = false;
};

// `cache` holds the prompt (dense, prompt_tokens = cache.n_tokens()). The store sequence is
// created with room for prompt + max_tokens rows.
[[nodiscard]] absl::StatusOr<Handoff> MakeLocalHandoff(const model::Model& model,
                                                       const model::KvCache& cache,
                                                       const retrieval::MethodRegistry& registry,
                                                       kv_store::KvStoreClient& store,
                                                       const LocalHandoffOptions& options);

}  // namespace kvr::decode
