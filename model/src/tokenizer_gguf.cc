#include "kvr/model/tokenizer_gguf.h"

#include <string>

#include "kvr/common/status.h"
#include "kvr/model/gguf.h"

namespace kvr::model {

absl::StatusOr<TokenizerSpec> TokenizerSpecFromGguf(const GgufFile& file) {
  TokenizerSpec spec;
  KVR_ASSIGN_OR_RETURN(absl::string_view model, file.GetString("tokenizer.ggml.model"));
  spec.model = std::string(model);
  if (file.Has("tokenizer.ggml.pre")) {
    KVR_ASSIGN_OR_RETURN(absl::string_view pre, file.GetString("tokenizer.ggml.pre"));
    spec.pre = std::string(pre);
  }
  KVR_ASSIGN_OR_RETURN(spec.tokens, file.GetStringArray("tokenizer.ggml.tokens"));
  if (file.Has("tokenizer.ggml.token_type")) {
    KVR_ASSIGN_OR_RETURN(spec.token_types, file.GetArray<int32_t>("tokenizer.ggml.token_type"));
  }
  if (file.Has("tokenizer.ggml.merges")) {
    KVR_ASSIGN_OR_RETURN(spec.merges, file.GetStringArray("tokenizer.ggml.merges"));
  }
  auto id = [&](const char* key, int32_t& out) -> absl::Status {
    if (!file.Has(key)) return absl::OkStatus();
    KVR_ASSIGN_OR_RETURN(int64_t v, file.GetInt(key));
    out = static_cast<int32_t>(v);
    return absl::OkStatus();
  };
  KVR_RETURN_IF_ERROR(id("tokenizer.ggml.bos_token_id", spec.bos_id));
  KVR_RETURN_IF_ERROR(id("tokenizer.ggml.eos_token_id", spec.eos_id));
  KVR_RETURN_IF_ERROR(id("tokenizer.ggml.eot_token_id", spec.eot_id));
  KVR_RETURN_IF_ERROR(id("tokenizer.ggml.unknown_token_id", spec.unk_id));
  KVR_RETURN_IF_ERROR(id("tokenizer.ggml.padding_token_id", spec.pad_id));
  if (file.Has("tokenizer.ggml.add_bos_token")) {
    KVR_ASSIGN_OR_RETURN(spec.add_bos, file.GetBool("tokenizer.ggml.add_bos_token"));
  }
  if (file.Has("tokenizer.ggml.add_eos_token")) {
    KVR_ASSIGN_OR_RETURN(spec.add_eos, file.GetBool("tokenizer.ggml.add_eos_token"));
  }
  if (file.Has("tokenizer.chat_template")) {
    KVR_ASSIGN_OR_RETURN(absl::string_view t, file.GetString("tokenizer.chat_template"));
    spec.chat_template = std::string(t);
  }
  return spec;
}

}  // namespace kvr::model
