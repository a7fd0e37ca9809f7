#pragma once
// Text of a generated stream on the decode node: token bytes -> UTF-8 text that never splits a
// character, with stop strings. Continues where the prefill node stopped (its text and any
// bytes of an incomplete character it held back).
//
// Stop strings are not returned: text that could be the start of a stop string is held back
// until it is known not to be one. Text the prefill node already returned cannot be taken
// back, so a stop string starting there ends the stream with nothing more.
//
// Thread safety: none (one stream, one thread).

#include <string>
#include <string_view>
#include <vector>

namespace kvr::decode {

// Length of the longest prefix of `bytes` that does not end inside a UTF-8 character.
size_t CompleteUtf8Prefix(std::string_view bytes);

class TextStream {
 public:
  TextStream() = default;
  TextStream(std::vector<std::string> stops, std::string text_so_far, std::string pending_utf8);

  // Adds one token's bytes and appends the text now safe to return to `out`. True when a stop
  // string matched: `out` got the text before it and `matched` the stop string.
  bool Push(std::string_view token_bytes, std::string* out, std::string* matched);
  // At the end (EOS, length): the held-back text, incomplete bytes as U+FFFD.
  std::string Flush();

 private:
  std::vector<std::string> stops_;
  size_t max_stop_ = 0;
  std::string tail_;     // the last max_stop_ - 1 bytes already returned (prefill's included)
  std::string held_;     // complete text held back (a possible stop-string prefix)
  std::string pending_;  // bytes of an incomplete UTF-8 character
};

}  // namespace kvr::decode
