#pragma once
// Helpers shared by the tokenizer tests and benchmark.

#include <string>

#include <nlohmann/json.hpp>
#include "absl/status/statusor.h"
#include "kvr/model/tokenizer.h"

namespace kvr::model::testing {

// TokenizerSpec from the `tokenizer.*` metadata of a GGUF file (the runtime's loader does the
// same through TokenizerSpecFromGguf; the tests read it here so they depend only on the
// format reader).
[[nodiscard]] absl::StatusOr<TokenizerSpec> ReadTokenizerSpec(const std::string& gguf_path);

// The reference fixture written by model/tests/scripts/tokenizer_make_fixture.py.
[[nodiscard]] absl::StatusOr<nlohmann::json> ReadReferenceFixture();

}  // namespace kvr::model::testing
