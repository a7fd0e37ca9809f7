// A build without nvcc: no GPU summary builders (prefill_summaries.h).

#include "kvr/retrieval/cuda/prefill_summaries.h"

namespace kvr::retrieval::cuda {

bool PrefillSummaryBuilders::Ships(const model::ModelConfig&, std::string_view,
                                   const IndexParams&) {
  return false;
}

absl::StatusOr<std::unique_ptr<PrefillSummaryBuilders>> PrefillSummaryBuilders::Create(
    const model::ModelConfig&, int) {
  return absl::UnimplementedError("GPU prefill summaries: this build of kvr has no CUDA");
}

}  // namespace kvr::retrieval::cuda
