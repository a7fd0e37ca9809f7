#include "tokenizer_utf8.h"

namespace kvr::model::internal {
namespace {

// Length of the well-formed prefix of the UTF-8 sequence at `s[i]` (following the table of
// Unicode 15 §3.9 D92 for valid second bytes) and whether it is complete.
struct SequenceScan {
  size_t valid_prefix = 0;  // bytes that could start a well-formed sequence
  size_t needed = 0;        // bytes the full sequence has; 0 when the lead byte is invalid
};

SequenceScan ScanSequence(std::string_view s, size_t i) {
  const auto b0 = static_cast<uint8_t>(s[i]);
  if (b0 < 0x80) return {1, 1};
  size_t needed;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    needed = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    needed = 3;
    if (b0 == 0xE0) lo = 0xA0;  // no overlongs
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    needed = 4;
    if (b0 == 0xF0) lo = 0x90;  // no overlongs
    if (b0 == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    return {0, 0};
  }
  size_t k = 1;
  while (k < needed && i + k < s.size()) {
    const auto b = static_cast<uint8_t>(s[i + k]);
    const bool ok = k == 1 ? (b >= lo && b <= hi) : (b >= 0x80 && b <= 0xBF);
    if (!ok) break;
    ++k;
  }
  return {k, needed};
}

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

}  // namespace

size_t FindInvalidUtf8(std::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    const auto b = static_cast<uint8_t>(text[i]);
    if (b < 0x80) {
      ++i;
      continue;
    }
    const SequenceScan scan = ScanSequence(text, i);
    if (scan.needed == 0 || scan.valid_prefix != scan.needed) return i;
    i += scan.needed;
  }
  return std::string_view::npos;
}

void AppendUtf8Lossy(std::string_view bytes, std::string& out) {
  size_t i = 0;
  size_t run_start = 0;  // start of the current run of well-formed text
  while (i < bytes.size()) {
    if (static_cast<uint8_t>(bytes[i]) < 0x80) {
      ++i;
      continue;
    }
    const SequenceScan scan = ScanSequence(bytes, i);
    if (scan.needed != 0 && scan.valid_prefix == scan.needed) {
      i += scan.needed;
      continue;
    }
    out.append(bytes.substr(run_start, i - run_start));
    out.append(kReplacement);
    // A maximal subpart is the well-formed prefix (at least the one offending byte).
    i += scan.valid_prefix == 0 ? 1 : scan.valid_prefix;
    run_start = i;
  }
  out.append(bytes.substr(run_start));
}

size_t IncompleteUtf8Tail(std::string_view bytes) {
  const size_t n = bytes.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const size_t i = n - back;
    const auto b = static_cast<uint8_t>(bytes[i]);
    if ((b & 0xC0) == 0x80) continue;  // continuation byte: look further back for the lead
    const SequenceScan scan = ScanSequence(bytes, i);
    // Hold back only a proper, so far well-formed prefix that reaches the end.
    if (scan.needed > back && scan.valid_prefix == back) return back;
    return 0;
  }
  return 0;
}

void AppendCodePoint(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

ByteLevelAlphabet::ByteLevelAlphabet() {
  decoded_.fill(-1);
  uint32_t next_extra = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    const uint32_t cp = printable ? static_cast<uint32_t>(b) : next_extra++;
    AppendCodePoint(cp, encoded_[b]);
    decoded_[cp] = static_cast<int16_t>(b);
  }
}

}  // namespace kvr::model::internal
