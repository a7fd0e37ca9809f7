#pragma once
// The state behind kvr::model::Tokenizer, shared by its loaders (internal header).

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "bpe.h"
#include "kvr/model/tokenizer.h"
#include "pretokenizer.h"

namespace kvr::model {

namespace internal {

// A token matched verbatim in text before pre-tokenization (Hugging Face "added tokens",
// GGUF CONTROL and USER_DEFINED tokens).
struct AddedToken {
  int32_t id = -1;
  std::string content;
  bool special = false;  // matched only when EncodeOptions::parse_special
  bool lstrip = false;   // swallows white space on its left
  bool rstrip = false;   // swallows white space on its right
};

// Everything a loader gathers; BuildTokenizerImpl validates it and builds the tables.
struct TokenizerParts {
  std::vector<std::string> tokens;   // [vocab_size] byte-level spelling
  std::vector<int32_t> token_types;  // [vocab_size] TokenType values
  std::vector<std::pair<std::string, std::string>> merges;
  PreTokenizer pre_tokenizer;
  std::string pre_name;
  bool ignore_merges = false;
  bool nfc = false;  // normalise text between added tokens to NFC before pre-tokenizing
  std::vector<AddedToken> added_tokens;
  int32_t bos_id = -1, eos_id = -1, eot_id = -1, unk_id = -1, pad_id = -1;
  bool add_bos = false, add_eos = false;
  std::string chat_template;
};

}  // namespace internal

struct Tokenizer::Impl {
  std::vector<std::string> tokens;
  std::vector<int32_t> token_types;
  std::vector<std::string> token_bytes;  // [vocab_size] raw bytes each token stands for
  internal::BpeModel bpe;
  internal::PreTokenizer pre_tokenizer;
  std::string pre_name;
  bool nfc = false;
  std::vector<internal::AddedToken> added_tokens;  // longest first
  bool added_first_byte[256] = {};                 // bytes that can start an added token
  int32_t bos_id = -1, eos_id = -1, eot_id = -1, unk_id = -1, pad_id = -1;
  bool add_bos = false, add_eos = false;
  std::vector<int32_t> end_of_generation;
  std::string chat_template;

  explicit Impl(internal::BpeModel model) : bpe(std::move(model)) {}
};

namespace internal {
[[nodiscard]] absl::StatusOr<std::unique_ptr<Tokenizer::Impl>> BuildTokenizerImpl(
    TokenizerParts parts);
}  // namespace internal

}  // namespace kvr::model
