#pragma once
// Byte-level BPE tokenizer (GPT-2 family: gpt2, llama3, SmolLM2, Qwen2) loaded from GGUF
// metadata or from a Hugging Face tokenizer.json.
//
// Encoding follows Hugging Face `tokenizers` exactly: special (added) tokens are split out
// first when asked for, the rest is cut into words by the model's pre-tokenizer regex, each
// word's bytes are mapped through the GPT-2 byte<->unicode table and merged by BPE rank.
//
// Thread safety: a Tokenizer is immutable after construction; Encode/Decode may be called
// from many threads at once. A TokenStreamDecoder belongs to one stream (one thread).

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "kvr/model/chat_template.h"

namespace kvr::model {

// GGUF `tokenizer.ggml.token_type` values (llama.cpp `llama_token_type`).
enum class TokenType : int32_t {
  kUndefined = 0,
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,      // special tokens such as <|im_start|>; never produced from plain text
  kUserDefined = 4,  // added tokens matched verbatim in text
  kUnused = 5,
  kByte = 6,  // <0xNN> tokens of SentencePiece vocabularies
};

// Plain-data description of a tokenizer, as GGUF stores it (`tokenizer.ggml.*` keys and
// `tokenizer.chat_template`). Keeping it plain data means the tokenizer does not depend on the
// GGUF reader; whoever reads the file fills this in.
struct TokenizerSpec {
  std::string model = "gpt2";   // tokenizer.ggml.model; only "gpt2" (byte-level BPE)
  std::string pre = "default";  // tokenizer.ggml.pre: "gpt2", "llama-bpe", "smollm", "qwen2", ...
  std::vector<std::string> tokens;   // [vocab_size] token strings (byte-level unicode form)
  std::vector<int32_t> token_types;  // [vocab_size] TokenType values, or empty (all normal)
  std::vector<std::string> merges;   // [n_merges] "left right", rank = index
  int32_t bos_id = -1;               // -1: none
  int32_t eos_id = -1;
  int32_t eot_id = -1;  // end of turn (e.g. <|eot_id|>); -1: none
  int32_t unk_id = -1;
  int32_t pad_id = -1;
  bool add_bos = false;       // tokenizer.ggml.add_bos_token
  bool add_eos = false;       // tokenizer.ggml.add_eos_token
  std::string chat_template;  // tokenizer.chat_template (Jinja text), may be empty
};

struct EncodeOptions {
  // Add BOS/EOS where the model's metadata asks for it (TokenizerSpec::add_bos/add_eos), as
  // llama.cpp's `add_special`. Chat prompts rendered from a template usually already contain
  // BOS and should pass false.
  bool add_special = true;
  // Recognise special/added tokens (e.g. "<|im_start|>") written in the text. When false
  // they are encoded as ordinary text, which is what untrusted user input should get.
  bool parse_special = false;
};

struct DecodeOptions {
  // Drop control tokens (BOS, EOS, <|im_end|>, ...) from the output.
  bool skip_special = false;
};

class Tokenizer {
 public:
  // Builds a tokenizer from GGUF-style metadata. Errors name the offending field (unknown
  // model or pre-tokenizer, malformed merge, merge naming an unknown token, id out of range).
  [[nodiscard]] static absl::StatusOr<Tokenizer> FromGgufMetadata(const TokenizerSpec& spec);

  // Loads a Hugging Face tokenizer.json: BPE model (merges as "a b" or ["a", "b"],
  // ignore_merges), pre-tokenizer built from ByteLevel / Split(Isolated) / Digits / Sequence,
  // optional NFC normalizer (Qwen2), added_tokens (special, lstrip, rstrip), ByteLevel decoder
  // and a TemplateProcessing post-processor that adds BOS (Llama 3). Anything else is refused
  // with Unimplemented naming it. Special ids are guessed from conventional added-token names;
  // prefer FromHuggingFaceDir, which reads them from tokenizer_config.json.
  [[nodiscard]] static absl::StatusOr<Tokenizer> FromTokenizerJson(const std::string& path);

  // Loads `dir`/tokenizer.json and, when present, `dir`/tokenizer_config.json (bos/eos tokens,
  // add_bos_token, chat_template).
  [[nodiscard]] static absl::StatusOr<Tokenizer> FromHuggingFaceDir(const std::string& dir);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;
  ~Tokenizer();

  // Token ids of `text`. Fails on text that is not valid UTF-8 (InvalidArgument naming the
  // byte offset); other failures (the regex engine) are internal errors.
  [[nodiscard]] absl::StatusOr<std::vector<int32_t>> Encode(
      std::string_view text, const EncodeOptions& options = {}) const;

  // Text of `ids`. Byte sequences that are not valid UTF-8 become U+FFFD (as Hugging Face
  // does). Fails on an id outside [0, vocab_size).
  [[nodiscard]] absl::StatusOr<std::string> Decode(std::span<const int32_t> ids,
                                                   const DecodeOptions& options = {}) const;

  // The vocabulary string of `id` (byte-level unicode form, e.g. "Ġhello").
  [[nodiscard]] absl::StatusOr<std::string_view> IdToPiece(int32_t id) const;
  // The raw bytes `id` stands for (e.g. " hello"); may be part of a UTF-8 character.
  [[nodiscard]] absl::StatusOr<std::string> TokenBytes(int32_t id) const;
  // The id of the exact vocabulary string `piece`, or NotFound.
  [[nodiscard]] absl::StatusOr<int32_t> PieceToId(std::string_view piece) const;

  int32_t vocab_size() const;
  TokenType token_type(int32_t id) const;  // kUndefined when out of range
  int32_t bos_id() const;                  // -1 when the model has none
  int32_t eos_id() const;
  int32_t eot_id() const;
  bool add_bos() const;
  // Ids that end generation: EOS, EOT and the control tokens llama.cpp also treats as ends
  // (<|im_end|>, <|eot_id|>, <|endoftext|>, <|end_of_text|>, <|eom_id|>, <end_of_turn>, ...).
  std::span<const int32_t> end_of_generation_ids() const;
  bool IsEndOfGeneration(int32_t id) const;

  // "gpt2", "smollm", "llama3" or "qwen2" for GGUF; "tokenizer.json" for JSON loads.
  const std::string& pre_tokenizer() const;
  const std::string& chat_template() const;

  // Renders `messages` with this model's chat template (see chat_template.h), filling in
  // its BOS/EOS token strings. Encode the result with {add_special=false, parse_special=true}.
  [[nodiscard]] absl::StatusOr<std::string> ApplyChatTemplate(std::span<const ChatMessage> messages,
                                                              bool add_generation_prompt) const;

  // Opaque state, defined in model/src (named here only so the loaders there can build it).
  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Turns a stream of token ids into text pieces that never split a UTF-8 character: bytes of
// an incomplete character are held back until the tokens that complete it arrive.
// Holds a reference to the tokenizer, which must outlive it.
class TokenStreamDecoder {
 public:
  explicit TokenStreamDecoder(const Tokenizer& tokenizer, DecodeOptions options = {});

  // Appends `id` and returns the newly completed text (possibly empty).
  [[nodiscard]] absl::StatusOr<std::string> Push(int32_t id);
  // Returns whatever is held back, with incomplete characters replaced by U+FFFD, and resets.
  std::string Flush();

 private:
  const Tokenizer* tokenizer_;
  DecodeOptions options_;
  std::string pending_;  // bytes of an incomplete UTF-8 character
};

}  // namespace kvr::model
