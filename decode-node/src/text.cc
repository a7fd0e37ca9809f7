#include "kvr/decode/text.h"

#include <algorithm>

namespace kvr::decode {

size_t CompleteUtf8Prefix(std::string_view bytes) {
  const size_t n = bytes.size();
  // Find the last lead byte among the last 4 bytes and check that its character is complete.
  for (size_t back = 1; back <= std::min<size_t>(4, n); ++back) {
    const unsigned char c = static_cast<unsigned char>(bytes[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // continuation byte
    size_t need = 1;
    if ((c & 0xE0) == 0xC0)
      need = 2;
    else if ((c & 0xF0) == 0xE0)
      need = 3;
    else if ((c & 0xF8) == 0xF0)
      need = 4;
    return back >= need ? n : n - back;
  }
  return n;  // only continuation bytes: invalid, pass them on (the client sees U+FFFD or bytes)
}

TextStream::TextStream(std::vector<std::string> stops, std::string text_so_far,
                       std::string pending_utf8)
    : pending_(std::move(pending_utf8)) {
  for (std::string& s : stops) {
    if (s.empty()) continue;
    max_stop_ = std::max(max_stop_, s.size());
    stops_.push_back(std::move(s));
  }
  if (max_stop_ > 1 && text_so_far.size() > max_stop_ - 1) {
    text_so_far.erase(0, text_so_far.size() - (max_stop_ - 1));
  }
  tail_ = max_stop_ > 1 ? std::move(text_so_far) : std::string();
}

bool TextStream::Push(std::string_view token_bytes, std::string* out, std::string* matched) {
  pending_.append(token_bytes);
  const size_t complete = CompleteUtf8Prefix(pending_);
  held_.append(pending_, 0, complete);
  pending_.erase(0, complete);
  if (stops_.empty()) {
    out->append(held_);
    held_.clear();
    return false;
  }
  const std::string window = tail_ + held_;
  size_t best = std::string::npos;
  for (const std::string& stop : stops_) {
    const size_t at = window.find(stop);
    if (at != std::string::npos && (best == std::string::npos || at < best)) {
      best = at;
      *matched = stop;
    }
  }
  if (best != std::string::npos) {
    if (best > tail_.size()) out->append(held_, 0, best - tail_.size());
    held_.clear();
    pending_.clear();
    return true;
  }
  // Hold back the longest suffix that starts a stop string.
  size_t hold = 0;
  for (const std::string& stop : stops_) {
    for (size_t len = std::min(stop.size() - 1, held_.size()); len > hold; --len) {
      if (held_.compare(held_.size() - len, len, stop, 0, len) == 0) {
        hold = len;
        break;
      }
    }
  }
  const std::string ready = held_.substr(0, held_.size() - hold);
  out->append(ready);
  held_.erase(0, held_.size() - hold);
  tail_ += ready;
  if (tail_.size() > max_stop_ - 1) tail_.erase(0, tail_.size() - (max_stop_ - 1));
  return false;
}

std::string TextStream::Flush() {
  std::string out = std::move(held_);
  if (!pending_.empty()) out += "\xEF\xBF\xBD";  // U+FFFD, as TokenStreamDecoder::Flush
  held_.clear();
  pending_.clear();
  return out;
}

}  // namespace kvr::decode
