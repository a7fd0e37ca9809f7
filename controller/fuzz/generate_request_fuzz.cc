// libFuzzer target: the controller's checks of a public Generate request
// (ParseGenerateRequest, ValidateRequestId) on arbitrary protobuf bytes, against one served
// model. Bytes that are not a GenerateRequest are skipped (gRPC refuses them before any
// handler runs). Checked beyond "no crash": a refusal is INVALID_ARGUMENT with a message that
// names a field; an accepted request fits the model's context and has the limits validation
// promises (max_tokens, budget and local_window at least 1, at most kMaxStopStrings stops).

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <variant>
#include <vector>

#include "kvr/controller/validation.h"
#include "kvr/v1/generation.pb.h"

namespace {

void Check(bool ok) {
  if (!ok) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvr::controller;
  kvr::v1::GenerateRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  constexpr uint32_t kContext = 2048;
  static const std::vector<ModelSummary> models = [] {
    ModelSummary m;
    m.info = ModelInfo{"smollm2", kContext, 1000, {{"full", 10.0}, {"clusterkv", 2.0}}};
    m.prefill_nodes = m.decode_nodes = 1;
    return std::vector<ModelSummary>{m};
  }();
  const RequestDefaults defaults;
  const absl::Status id = ValidateRequestId(request.request_id());
  Check(id.ok() || (absl::IsInvalidArgument(id) && !id.message().empty()));
  absl::StatusOr<GenerateParams> params = ParseGenerateRequest(request, models, defaults);
  if (!params.ok()) {
    Check(absl::IsInvalidArgument(params.status()));
    // "field: why".
    Check(params.status().message().find(": ") != absl::string_view::npos);
    return 0;
  }
  const GenerateParams& p = *params;
  Check(p.model == "smollm2");
  Check(p.sampling.max_tokens >= 1 && p.sampling.max_tokens < kContext);
  Check(p.prompt_tokens_bound >= 1 && p.prompt_tokens_bound <= kContext);
  if (std::holds_alternative<std::vector<uint32_t>>(p.prompt)) {
    Check(p.prompt_tokens_bound + p.sampling.max_tokens <= kContext);
  }
  Check(p.retrieval.budget >= 1 && p.retrieval.local_window >= 1);
  Check(p.sampling.stop.size() <= kMaxStopStrings);
  Check(p.sampling.top_p > 0 && p.sampling.top_p <= 1);
  return 0;
}
