#pragma once
// Helpers shared by the tokenizer tests and benchmark.

#include <string>

#include <nlohmann/json.hpp>
#include "absl/status/statusor.h"
#include "kvr/model/tokenizer.h"

namespace kvr::model::testing {

// TokenizerSpec from the `tokenizer.*` metadata of the GGUF file at `gguf_path`
// (TokenizerSpecFromGguf, as the runtime's loader reads it).
[[nodiscard]] absl::StatusOr<TokenizerSpec> ReadTokenizerSpec(const std::string& gguf_path);

// The reference fixture written by model/tests/scripts/tokenizer_make_fixture.py.
[[nodiscard]] absl::StatusOr<nlohmann::json> ReadReferenceFixture();

}  // namespace kvr::model::testing
