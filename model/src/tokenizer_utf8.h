#pragma once
// UTF-8 and GPT-2 byte-level helpers shared by the tokenizer sources (internal header).

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvr::model::internal {

// Debian's Abseil is built with its own absl::string_view (ABSL_OPTION_USE_STD_STRING_VIEW 0),
// so std::string_view must be converted before it reaches absl::StrCat and friends.
inline absl::string_view Av(std::string_view s) { return {s.data(), s.size()}; }

// Offset of the first byte that does not start a well-formed UTF-8 sequence (RFC 3629: no
// overlongs, no surrogates, nothing above U+10FFFF), or std::string_view::npos when `text` is
// valid throughout.
size_t FindInvalidUtf8(std::string_view text);

// Appends `bytes` to `out`, replacing every maximal ill-formed subpart with U+FFFD. This is
// the policy of Rust's String::from_utf8_lossy (and Unicode's "substitution of maximal
// subparts"), which is what Hugging Face decoders apply.
void AppendUtf8Lossy(std::string_view bytes, std::string& out);

// Length of the trailing bytes of `bytes` that form a proper prefix of a well-formed UTF-8
// sequence (0..3): what a streaming decoder must hold back until more bytes arrive.
size_t IncompleteUtf8Tail(std::string_view bytes);

// Number of bytes of the UTF-8 sequence starting with lead byte `lead` (1 for invalid leads,
// so that callers always make progress).
inline size_t Utf8SequenceLength(uint8_t lead) {
  if (lead < 0x80) return 1;
  if ((lead & 0xE0) == 0xC0) return 2;
  if ((lead & 0xF0) == 0xE0) return 3;
  if ((lead & 0xF8) == 0xF0) return 4;
  return 1;
}

// Writes the Unicode NFC form of valid UTF-8 `text` to `out` (tokenizer.json "NFC" normalizer,
// used by Qwen2). Implemented with ICU in tokenizer_normalize.cc.
[[nodiscard]] absl::Status NormalizeNfc(std::string_view text, std::string& out);

// Appends the UTF-8 encoding of code point `cp` (< 0x110000) to `out`.
void AppendCodePoint(uint32_t cp, std::string& out);

// GPT-2's reversible byte <-> unicode mapping (openai/gpt-2 encoder.py `bytes_to_unicode`):
// printable bytes map to themselves, the other 68 to U+0100.. in byte order, so that every
// byte has a visible, non-whitespace character in the vocabulary.
class ByteLevelAlphabet {
 public:
  ByteLevelAlphabet();

  // The UTF-8 text of the character that stands for `byte`.
  std::string_view Encode(uint8_t byte) const { return encoded_[byte]; }
  // The byte a character stands for, or -1 when `cp` is not in the alphabet.
  int Decode(uint32_t cp) const { return cp < decoded_.size() ? decoded_[cp] : -1; }

 private:
  std::array<std::string, 256> encoded_;
  std::array<int16_t, 324> decoded_;  // code points of the alphabet are all < 324
};

}  // namespace kvr::model::internal
