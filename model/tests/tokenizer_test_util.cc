#include "tokenizer_test_util.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "kvr/common/status.h"
#include "kvr/model/gguf.h"
#include "kvr/model/tokenizer_gguf.h"

namespace kvr::model::testing {

absl::StatusOr<TokenizerSpec> ReadTokenizerSpec(const std::string& gguf_path) {
  KVR_ASSIGN_OR_RETURN(GgufFile file, GgufFile::Open(gguf_path));
  return TokenizerSpecFromGguf(file);
}

absl::StatusOr<nlohmann::json> ReadReferenceFixture() {
  const std::string path = std::string(KVR_TOKENIZER_FIXTURES) + "/smollm2_reference.json";
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open fixture ", path));
  std::ostringstream text;
  text << in.rdbuf();
  nlohmann::json parsed = nlohmann::json::parse(text.str(), nullptr, false);
  if (parsed.is_discarded()) return absl::DataLossError(absl::StrCat(path, " is not valid JSON"));
  return parsed;
}

}  // namespace kvr::model::testing
