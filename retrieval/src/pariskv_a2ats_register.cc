// RegisterQuantMethods (declared in kvr/retrieval/registry.h): the one place where the quant
// methods join a MethodRegistry.

#include "kvr/common/status.h"
#include "kvr/retrieval/a2ats.h"
#include "kvr/retrieval/pariskv.h"
#include "kvr/retrieval/registry.h"

namespace kvr::retrieval {

absl::Status RegisterQuantMethods(MethodRegistry& registry) {
  KVR_RETURN_IF_ERROR(registry.Register(
      std::string(kParisKvMethodName),
      "ParisKV: SRHT-rotated sign-pattern collision voting, then 4-bit rerank (drift-free)",
      MakeParisKvIndex, DeserializeParisKvIndex));
  KVR_RETURN_IF_ERROR(registry.Register(
      std::string(kA2atsMethodName),
      "A2ATS: windowed RoPE + query-aware VQ, one codeword id per token (needs a codebook file "
      "from `kvr calibrate`)",
      MakeA2atsIndex, DeserializeA2atsIndex));
  return absl::OkStatus();
}

}  // namespace kvr::retrieval
