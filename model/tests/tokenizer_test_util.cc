#include "tokenizer_test_util.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "kvr/common/status.h"
#include "kvr/model/gguf.h"

namespace kvr::model::testing {

absl::StatusOr<TokenizerSpec> ReadTokenizerSpec(const std::string& gguf_path) {
  KVR_ASSIGN_OR_RETURN(GgufFile file, GgufFile::Open(gguf_path));
  TokenizerSpec spec;
  KVR_ASSIGN_OR_RETURN(absl::string_view model, file.GetString("tokenizer.ggml.model"));
  spec.model = std::string(model);
  if (file.Has("tokenizer.ggml.pre")) {
    KVR_ASSIGN_OR_RETURN(absl::string_view pre, file.GetString("tokenizer.ggml.pre"));
    spec.pre = std::string(pre);
  }
  KVR_ASSIGN_OR_RETURN(spec.tokens, file.GetStringArray("tokenizer.ggml.tokens"));
  KVR_ASSIGN_OR_RETURN(spec.token_types, file.GetArray<int32_t>("tokenizer.ggml.token_type"));
  KVR_ASSIGN_OR_RETURN(spec.merges, file.GetStringArray("tokenizer.ggml.merges"));
  auto read_id = [&](const char* key, int32_t& out) -> absl::Status {
    if (!file.Has(key)) return absl::OkStatus();
    KVR_ASSIGN_OR_RETURN(int64_t v, file.GetInt(key));
    out = static_cast<int32_t>(v);
    return absl::OkStatus();
  };
  KVR_RETURN_IF_ERROR(read_id("tokenizer.ggml.bos_token_id", spec.bos_id));
  KVR_RETURN_IF_ERROR(read_id("tokenizer.ggml.eos_token_id", spec.eos_id));
  KVR_RETURN_IF_ERROR(read_id("tokenizer.ggml.eot_token_id", spec.eot_id));
  KVR_RETURN_IF_ERROR(read_id("tokenizer.ggml.unknown_token_id", spec.unk_id));
  KVR_RETURN_IF_ERROR(read_id("tokenizer.ggml.padding_token_id", spec.pad_id));
  if (file.Has("tokenizer.ggml.add_bos_token")) {
    KVR_ASSIGN_OR_RETURN(spec.add_bos, file.GetBool("tokenizer.ggml.add_bos_token"));
  }
  if (file.Has("tokenizer.chat_template")) {
    KVR_ASSIGN_OR_RETURN(absl::string_view tmpl, file.GetString("tokenizer.chat_template"));
    spec.chat_template = std::string(tmpl);
  }
  return spec;
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
