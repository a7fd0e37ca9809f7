#include "kvr/model/tokenizer.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tokenizer_impl.h"
#include "tokenizer_utf8.h"

namespace kvr::model {
namespace internal {
namespace {

// Unicode White_Space, as Rust's char::is_whitespace (used by added tokens' lstrip/rstrip).
bool IsWhiteSpace(uint32_t cp) {
  return (cp >= 0x9 && cp <= 0xD) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

// Decodes the code point at text[i] of valid UTF-8.
uint32_t CodePointAt(std::string_view text, size_t i, size_t& length) {
  const auto b0 = static_cast<uint8_t>(text[i]);
  length = Utf8SequenceLength(b0);
  if (length == 1) return b0;
  uint32_t cp = b0 & (0xFF >> (length + 1));
  for (size_t k = 1; k < length; ++k) cp = (cp << 6) | (static_cast<uint8_t>(text[i + k]) & 0x3F);
  return cp;
}

// Start of the code point that ends right before text[end] (valid UTF-8, end > 0).
size_t PreviousCodePointStart(std::string_view text, size_t end) {
  size_t i = end - 1;
  while (i > 0 && (static_cast<uint8_t>(text[i]) & 0xC0) == 0x80) --i;
  return i;
}

// The raw bytes a vocabulary string stands for: through the byte-level alphabet when every
// character belongs to it, else the string's own UTF-8 (Hugging Face's ByteLevel decoder does
// the same for added tokens such as "<|im_start|>" that are spelled in plain text).
std::string TokenToBytes(const ByteLevelAlphabet& alphabet, std::string_view token) {
  std::string bytes;
  bytes.reserve(token.size());
  for (size_t i = 0; i < token.size();) {
    size_t length = 0;
    const int b = alphabet.Decode(CodePointAt(token, i, length));
    if (b < 0) return std::string(token);
    bytes.push_back(static_cast<char>(b));
    i += length;
  }
  return bytes;
}

bool IdInRange(int32_t id, size_t n) { return id >= 0 && static_cast<size_t>(id) < n; }

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer::Impl>> BuildTokenizerImpl(TokenizerParts parts) {
  const size_t n = parts.tokens.size();
  if (n == 0) return absl::InvalidArgumentError("tokenizer vocabulary is empty");
  if (parts.token_types.empty()) {
    parts.token_types.assign(n, static_cast<int32_t>(TokenType::kNormal));
  } else if (parts.token_types.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer has ", n, " tokens but ",
                                                   parts.token_types.size(), " token types"));
  }
  for (auto [name, id] : {std::pair<const char*, int32_t>{"bos", parts.bos_id},
                          {"eos", parts.eos_id},
                          {"eot", parts.eot_id},
                          {"unk", parts.unk_id},
                          {"pad", parts.pad_id}}) {
    if (id != -1 && !IdInRange(id, n)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer ", name, " id ", id, " is outside the vocabulary [0, ", n, ")"));
    }
  }
  if (parts.add_bos && parts.bos_id < 0) {
    return absl::InvalidArgumentError("tokenizer asks to add BOS but has no BOS id");
  }
  if (parts.add_eos && parts.eos_id < 0) {
    return absl::InvalidArgumentError("tokenizer asks to add EOS but has no EOS id");
  }

  BpeModel::Options bpe_options;
  bpe_options.ignore_merges = parts.ignore_merges;
  // GPT-2 style vocabularies have every byte, so unk is never needed; Hugging Face's GPT-2
  // BPE has no unk token either, so a missing byte is dropped rather than mapped to unk.
  bpe_options.unk_id = -1;
  auto bpe = BpeModel::Create(parts.tokens, parts.merges, bpe_options);
  if (!bpe.ok()) return bpe.status();

  auto impl = std::make_unique<Tokenizer::Impl>(std::move(*bpe));
  impl->token_bytes.reserve(n);
  for (const std::string& token : parts.tokens) {
    impl->token_bytes.push_back(TokenToBytes(impl->bpe.alphabet(), token));
  }
  for (const AddedToken& added : parts.added_tokens) {
    if (!IdInRange(added.id, n)) {
      return absl::InvalidArgumentError(absl::StrCat("added token \"", added.content, "\" has id ",
                                                     added.id, " outside the vocabulary"));
    }
    if (added.content.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("added token ", added.id, " is empty"));
    }
    if (FindInvalidUtf8(added.content) != std::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("added token ", added.id, " is not valid UTF-8"));
    }
  }
  impl->added_tokens = std::move(parts.added_tokens);
  // Longest first, so that the first candidate matching at a position is the longest one
  // (Hugging Face matches added tokens leftmost-longest).
  std::stable_sort(
      impl->added_tokens.begin(), impl->added_tokens.end(),
      [](const AddedToken& a, const AddedToken& b) { return a.content.size() > b.content.size(); });
  for (const AddedToken& added : impl->added_tokens) {
    impl->added_first_byte[static_cast<uint8_t>(added.content[0])] = true;
  }

  impl->tokens = std::move(parts.tokens);
  impl->token_types = std::move(parts.token_types);
  impl->pre_tokenizer = std::move(parts.pre_tokenizer);
  impl->pre_name = std::move(parts.pre_name);
  impl->nfc = parts.nfc;
  impl->bos_id = parts.bos_id;
  impl->eos_id = parts.eos_id;
  impl->unk_id = parts.unk_id;
  impl->pad_id = parts.pad_id;
  impl->add_bos = parts.add_bos;
  impl->add_eos = parts.add_eos;
  impl->chat_template = std::move(parts.chat_template);

  auto find_special = [&](std::string_view text) -> int32_t {
    const int32_t id = impl->bpe.Find(text);
    if (id < 0) return -1;
    const auto type = static_cast<TokenType>(impl->token_types[id]);
    return type == TokenType::kControl || type == TokenType::kUserDefined ? id : -1;
  };
  impl->eot_id = parts.eot_id;
  if (impl->eot_id < 0) {
    // As llama.cpp does when the file names no EOT: the end-of-turn token of the chat format.
    for (std::string_view name : {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>"}) {
      if (const int32_t id = find_special(name); id >= 0) {
        impl->eot_id = id;
        break;
      }
    }
  }
  // End-of-generation set: EOS, EOT and the other end markers llama.cpp recognises by name.
  auto add_eog = [&](int32_t id) {
    if (id >= 0 && std::find(impl->end_of_generation.begin(), impl->end_of_generation.end(), id) ==
                       impl->end_of_generation.end()) {
      impl->end_of_generation.push_back(id);
    }
  };
  add_eog(impl->eos_id);
  add_eog(impl->eot_id);
  for (std::string_view name : {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
                                "<|endoftext|>", "<|eom_id|>", "<EOT>", "<|end_of_text|>"}) {
    add_eog(find_special(name));
  }
  return impl;
}

}  // namespace internal

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

absl::StatusOr<Tokenizer> Tokenizer::FromGgufMetadata(const TokenizerSpec& spec) {
  if (spec.model != "gpt2") {
    return absl::UnimplementedError(
        absl::StrCat("tokenizer.ggml.model \"", spec.model,
                     "\" is not supported; kvr implements byte-level BPE (\"gpt2\") only"));
  }
  internal::TokenizerParts parts;
  auto pre = internal::PreTokenizer::ForGgufPre(spec.pre, parts.pre_name, parts.ignore_merges);
  if (!pre.ok()) return pre.status();
  parts.pre_tokenizer = std::move(*pre);
  parts.tokens = spec.tokens;
  parts.token_types = spec.token_types;
  parts.merges.reserve(spec.merges.size());
  for (size_t i = 0; i < spec.merges.size(); ++i) {
    const std::string& merge = spec.merges[i];
    const size_t space = merge.find(' ');
    if (space == std::string::npos || space == 0 || space + 1 == merge.size() ||
        merge.find(' ', space + 1) != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("tokenizer.ggml.merges[", i, "] = \"", merge,
                                                     "\" is not of the form \"left right\""));
    }
    parts.merges.emplace_back(merge.substr(0, space), merge.substr(space + 1));
  }
  // CONTROL tokens are special (parsed only on request); USER_DEFINED ones are always matched
  // whole in text, as both llama.cpp and transformers' GGUF loader do.
  for (size_t id = 0; id < spec.tokens.size() && id < spec.token_types.size(); ++id) {
    const auto type = static_cast<TokenType>(spec.token_types[id]);
    if (type != TokenType::kControl && type != TokenType::kUserDefined) continue;
    if (spec.tokens[id].empty()) continue;
    internal::AddedToken added;
    added.id = static_cast<int32_t>(id);
    added.content = spec.tokens[id];
    added.special = type == TokenType::kControl;
    parts.added_tokens.push_back(std::move(added));
  }
  parts.bos_id = spec.bos_id;
  parts.eos_id = spec.eos_id;
  parts.eot_id = spec.eot_id;
  parts.unk_id = spec.unk_id;
  parts.pad_id = spec.pad_id;
  parts.add_bos = spec.add_bos;
  parts.add_eos = spec.add_eos;
  parts.chat_template = spec.chat_template;
  auto impl = internal::BuildTokenizerImpl(std::move(parts));
  if (!impl.ok()) return impl.status();
  return Tokenizer(std::move(*impl));
}

absl::StatusOr<std::vector<int32_t>> Tokenizer::Encode(std::string_view text,
                                                       const EncodeOptions& options) const {
  if (const size_t bad = internal::FindInvalidUtf8(text); bad != std::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "text to encode is not valid UTF-8: bad byte 0x",
        absl::Hex(static_cast<uint8_t>(text[bad]), absl::kZeroPad2), " at offset ", bad));
  }
  const Impl& impl = *impl_;
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 2);
  if (options.add_special && impl.add_bos) ids.push_back(impl.bos_id);

  std::vector<std::string_view> words;
  std::string normalized;  // owns the NFC text the words point into
  auto encode_text = [&](std::string_view segment) -> absl::Status {
    words.clear();
    if (impl.nfc) {
      if (auto status = internal::NormalizeNfc(segment, normalized); !status.ok()) return status;
      segment = normalized;
    }
    if (auto status = impl.pre_tokenizer.Split(segment, words); !status.ok()) return status;
    for (std::string_view word : words) impl.bpe.EncodeWord(word, ids);
    return absl::OkStatus();
  };

  // Cut out added tokens first (leftmost-longest), then pre-tokenize and merge the text
  // between them.
  size_t segment_start = 0;
  size_t i = 0;
  while (i < text.size()) {
    if (!impl.added_first_byte[static_cast<uint8_t>(text[i])]) {
      ++i;
      continue;
    }
    const internal::AddedToken* match = nullptr;
    for (const internal::AddedToken& added : impl.added_tokens) {
      if (added.special && !options.parse_special) continue;
      if (text.compare(i, added.content.size(), added.content) == 0) {
        match = &added;
        break;
      }
    }
    if (match == nullptr) {
      ++i;
      continue;
    }
    size_t begin = i;
    size_t end = i + match->content.size();
    if (match->lstrip) {
      while (begin > segment_start) {
        const size_t prev = internal::PreviousCodePointStart(text, begin);
        size_t length = 0;
        if (!internal::IsWhiteSpace(internal::CodePointAt(text, prev, length))) break;
        begin = prev;
      }
    }
    if (match->rstrip) {
      while (end < text.size()) {
        size_t length = 0;
        if (!internal::IsWhiteSpace(internal::CodePointAt(text, end, length))) break;
        end += length;
      }
    }
    if (begin > segment_start) {
      if (auto status = encode_text(text.substr(segment_start, begin - segment_start));
          !status.ok()) {
        return status;
      }
    }
    ids.push_back(match->id);
    segment_start = end;
    i = end;
  }
  if (segment_start < text.size()) {
    if (auto status = encode_text(text.substr(segment_start)); !status.ok()) return status;
  }
  if (options.add_special && impl.add_eos) ids.push_back(impl.eos_id);
  return ids;
}

absl::StatusOr<std::string> Tokenizer::Decode(std::span<const int32_t> ids,
                                              const DecodeOptions& options) const {
  std::string bytes;
  for (size_t k = 0; k < ids.size(); ++k) {
    const int32_t id = ids[k];
    if (!internal::IdInRange(id, impl_->tokens.size())) {
      return absl::OutOfRangeError(absl::StrCat("token id ", id, " at position ", k,
                                                " is outside the vocabulary [0, ",
                                                impl_->tokens.size(), ")"));
    }
    if (options.skip_special &&
        static_cast<TokenType>(impl_->token_types[id]) == TokenType::kControl) {
      continue;
    }
    bytes.append(impl_->token_bytes[id]);
  }
  std::string text;
  text.reserve(bytes.size());
  internal::AppendUtf8Lossy(bytes, text);
  return text;
}

absl::StatusOr<std::string_view> Tokenizer::IdToPiece(int32_t id) const {
  if (!internal::IdInRange(id, impl_->tokens.size())) {
    return absl::OutOfRangeError(absl::StrCat("token id ", id, " is outside the vocabulary"));
  }
  return std::string_view(impl_->tokens[id]);
}

absl::StatusOr<std::string> Tokenizer::TokenBytes(int32_t id) const {
  if (!internal::IdInRange(id, impl_->tokens.size())) {
    return absl::OutOfRangeError(absl::StrCat("token id ", id, " is outside the vocabulary"));
  }
  return impl_->token_bytes[id];
}

absl::StatusOr<int32_t> Tokenizer::PieceToId(std::string_view piece) const {
  const int32_t id = impl_->bpe.Find(piece);
  if (id < 0)
    return absl::NotFoundError(
        absl::StrCat("\"", internal::Av(piece), "\" is not in the vocabulary"));
  return id;
}

int32_t Tokenizer::vocab_size() const { return static_cast<int32_t>(impl_->tokens.size()); }
TokenType Tokenizer::token_type(int32_t id) const {
  if (!internal::IdInRange(id, impl_->tokens.size())) return TokenType::kUndefined;
  return static_cast<TokenType>(impl_->token_types[id]);
}
int32_t Tokenizer::bos_id() const { return impl_->bos_id; }
int32_t Tokenizer::eos_id() const { return impl_->eos_id; }
int32_t Tokenizer::eot_id() const { return impl_->eot_id; }
bool Tokenizer::add_bos() const { return impl_->add_bos; }
std::span<const int32_t> Tokenizer::end_of_generation_ids() const {
  return impl_->end_of_generation;
}
bool Tokenizer::IsEndOfGeneration(int32_t id) const {
  return std::find(impl_->end_of_generation.begin(), impl_->end_of_generation.end(), id) !=
         impl_->end_of_generation.end();
}
const std::string& Tokenizer::pre_tokenizer() const { return impl_->pre_name; }
const std::string& Tokenizer::chat_template() const { return impl_->chat_template; }

absl::StatusOr<std::string> Tokenizer::ApplyChatTemplate(std::span<const ChatMessage> messages,
                                                         bool add_generation_prompt) const {
  if (impl_->chat_template.empty()) {
    return absl::FailedPreconditionError("the model has no chat template");
  }
  ChatTemplateOptions options;
  options.add_generation_prompt = add_generation_prompt;
  if (impl_->bos_id >= 0) options.bos_token = impl_->token_bytes[impl_->bos_id];
  if (impl_->eos_id >= 0) options.eos_token = impl_->token_bytes[impl_->eos_id];
  return model::ApplyChatTemplate(impl_->chat_template, messages, options);
}

TokenStreamDecoder::TokenStreamDecoder(const Tokenizer& tokenizer, DecodeOptions options)
    : tokenizer_(&tokenizer), options_(options) {}

absl::StatusOr<std::string> TokenStreamDecoder::Push(int32_t id) {
  if (options_.skip_special && tokenizer_->token_type(id) == TokenType::kControl) return "";
  auto bytes = tokenizer_->TokenBytes(id);
  if (!bytes.ok()) return bytes.status();
  pending_.append(*bytes);
  const size_t hold = internal::IncompleteUtf8Tail(pending_);
  std::string text;
  internal::AppendUtf8Lossy(std::string_view(pending_).substr(0, pending_.size() - hold), text);
  pending_.erase(0, pending_.size() - hold);
  return text;
}

std::string TokenStreamDecoder::Flush() {
  std::string text;
  internal::AppendUtf8Lossy(pending_, text);
  pending_.clear();
  return text;
}

}  // namespace kvr::model
