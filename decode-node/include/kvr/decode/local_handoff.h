#pragma once
// Plays the prefill node's part in one process, for tests and the decode benchmark: from a
// dense KvCache after prefill, creates the store sequence and puts every prompt row, builds
// one retrieval index per layer and packs the sink/local rows into a `Handoff`, as the
// handoff contract says (decode-node/README.md).

#include <cstdint>
#include <string>
#include <vector>

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
  // Element type of the store rows (kvr-prefill's store_dtype): f32, bf16 rounded to nearest
  // even, or fp8_e4m3 (rows put as bf16, which the store encodes). The handoff's sink/local rows
  // are float32 either way.
  kv_store::DType store_dtype = kv_store::DType::kF32;
  // Per layer, the prefill's last queries [n, n_heads, head_dim] (RoPE applied) of the positions
  // [L - n, L), as a prefill node passes them to the index builds (ctkvr needs them); empty:
  // none.
  std::vector<std::vector<float>> queries;
};

// `cache` holds the prompt (dense, prompt_tokens = cache.n_tokens()). The store sequence is
// created with room for prompt + max_tokens rows. A store_dtype other than f32, bf16 or
// fp8_e4m3 is INVALID_ARGUMENT.
[[nodiscard]] absl::StatusOr<Handoff> MakeLocalHandoff(const model::Model& model,
                                                       const model::KvCache& cache,
                                                       const retrieval::MethodRegistry& registry,
                                                       kv_store::KvStoreClient& store,
                                                       const LocalHandoffOptions& options);

}  // namespace kvr::decode
