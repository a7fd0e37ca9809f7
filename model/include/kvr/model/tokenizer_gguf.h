#pragma once
// The tokenizer description of a GGUF file: the one place that reads `tokenizer.*` keys into a
// TokenizerSpec, for the loader, the tools and the tokenizer tests. Its own target
// (kvr::tokenizer_gguf), so that the tokenizer does not depend on the GGUF reader nor the
// tokenizer tests on the runtime.

#include "absl/status/statusor.h"
#include "kvr/model/tokenizer.h"

namespace kvr::model {

class GgufFile;

// The tokenizer description stored in a GGUF file's `tokenizer.*` keys; the optional keys keep
// TokenizerSpec's defaults when absent.
[[nodiscard]] absl::StatusOr<TokenizerSpec> TokenizerSpecFromGguf(const GgufFile& file);

}  // namespace kvr::model
