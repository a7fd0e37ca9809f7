#include "kvr/model/tokenizer.h"

#include "absl/status/status.h"

namespace kvr::model {

struct Tokenizer::Impl {
  std::string pre;
  std::string chat_template;
  std::vector<int32_t> eog;
};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

absl::StatusOr<Tokenizer> Tokenizer::FromGgufMetadata(const TokenizerSpec& spec) {
  return absl::UnimplementedError("Tokenizer::FromGgufMetadata: not written yet");
}
absl::StatusOr<Tokenizer> Tokenizer::FromTokenizerJson(const std::string& path) {
  return absl::UnimplementedError("Tokenizer::FromTokenizerJson: not written yet");
}
absl::StatusOr<Tokenizer> Tokenizer::FromHuggingFaceDir(const std::string& dir) {
  return absl::UnimplementedError("Tokenizer::FromHuggingFaceDir: not written yet");
}
absl::StatusOr<std::vector<int32_t>> Tokenizer::Encode(std::string_view text,
                                                       const EncodeOptions& options) const {
  return absl::UnimplementedError("Tokenizer::Encode: not written yet");
}
absl::StatusOr<std::string> Tokenizer::Decode(std::span<const int32_t> ids,
                                              const DecodeOptions& options) const {
  return absl::UnimplementedError("Tokenizer::Decode: not written yet");
}
absl::StatusOr<std::string_view> Tokenizer::IdToPiece(int32_t id) const {
  return absl::UnimplementedError("Tokenizer::IdToPiece: not written yet");
}
absl::StatusOr<std::string> Tokenizer::TokenBytes(int32_t id) const {
  return absl::UnimplementedError("Tokenizer::TokenBytes: not written yet");
}
absl::StatusOr<int32_t> Tokenizer::PieceToId(std::string_view piece) const {
  return absl::UnimplementedError("Tokenizer::PieceToId: not written yet");
}
int32_t Tokenizer::vocab_size() const { return 0; }
TokenType Tokenizer::token_type(int32_t id) const { return TokenType::kUndefined; }
int32_t Tokenizer::bos_id() const { return -1; }
int32_t Tokenizer::eos_id() const { return -1; }
int32_t Tokenizer::eot_id() const { return -1; }
bool Tokenizer::add_bos() const { return false; }
std::span<const int32_t> Tokenizer::end_of_generation_ids() const { return impl_->eog; }
bool Tokenizer::IsEndOfGeneration(int32_t id) const { return false; }
const std::string& Tokenizer::pre_tokenizer() const { return impl_->pre; }
const std::string& Tokenizer::chat_template() const { return impl_->chat_template; }
absl::StatusOr<std::string> Tokenizer::ApplyChatTemplate(std::span<const ChatMessage> messages,
                                                         bool add_generation_prompt) const {
  return absl::UnimplementedError("Tokenizer::ApplyChatTemplate: not written yet");
}

TokenStreamDecoder::TokenStreamDecoder(const Tokenizer& tokenizer, DecodeOptions options)
    : tokenizer_(&tokenizer), options_(options) {}
absl::StatusOr<std::string> TokenStreamDecoder::Push(int32_t id) {
  return absl::UnimplementedError("TokenStreamDecoder::Push: not written yet");
}
std::string TokenStreamDecoder::Flush() { return {}; }

}  // namespace kvr::model
