// libFuzzer target: the byte-level BPE tokenizer on untrusted text and ids, as a public
// request reaches it: Encode (special tokens parsed or not), Decode and the streaming decoder
// of arbitrary ids, and the chat template with fuzzed message contents. The tokenizer is
// built once from a small GPT-2-style vocabulary (256 byte tokens, a few merges, ChatML
// control tokens) with the SmolLM2 pre-tokenizer and chat template.
// Checked beyond "no crash": encoding valid UTF-8 without special tokens and decoding the ids
// gives the text back.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvr/model/tokenizer.h"

namespace {

// GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to U+0100 onwards.
std::vector<std::string> ByteTokens() {
  std::vector<std::string> out(256);
  int next = 256;
  auto utf8 = [](int cp) {
    std::string s;
    if (cp < 0x80) {
      s += static_cast<char>(cp);
    } else {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
    return s;
  };
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    out[b] = utf8(printable ? b : next++);
  }
  return out;
}

const kvr::model::Tokenizer& TheTokenizer() {
  static const kvr::model::Tokenizer* tokenizer = [] {
    kvr::model::TokenizerSpec spec;
    spec.pre = "smollm";
    spec.tokens = ByteTokens();
    spec.token_types.assign(spec.tokens.size(), 1);
    // Merges over the byte tokens ("Ġ" is the space byte).
    for (const char* m : {"Ġ t", "h e", "Ġt he", "Ġ a", "i n", "e r", "o n", "Ġ s", "a n"}) {
      spec.merges.push_back(m);
      std::string merged = m;
      merged.erase(merged.find(' '), 1);
      spec.tokens.push_back(merged);
      spec.token_types.push_back(1);
    }
    for (const char* special : {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}) {
      spec.tokens.push_back(special);
      spec.token_types.push_back(3);
    }
    const int32_t n = static_cast<int32_t>(spec.tokens.size());
    spec.bos_id = n - 2;
    spec.eos_id = n - 1;
    spec.eot_id = n - 1;
    spec.chat_template =
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nYou are a helpful AI assistant<|im_end|>\\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
        "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
        "{% endif %}";
    auto t = kvr::model::Tokenizer::FromGgufMetadata(spec);
    if (!t.ok()) std::abort();
    return new kvr::model::Tokenizer(std::move(*t));
  }();
  return *tokenizer;
}

bool ValidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<uint8_t>(s[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    uint32_t cp = n == 1 ? c : c & (0x7F >> n);
    for (size_t k = 1; k < n; ++k) {
      const auto d = static_cast<uint8_t>(s[i + k]);
      if ((d >> 6) != 2) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    if ((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000) ||
        cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return false;
    }
    i += n;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const kvr::model::Tokenizer& tokenizer = TheTokenizer();
  const uint8_t mode = data[0];
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  switch (mode % 4) {
    case 0: {  // untrusted text: round trip
      auto ids = tokenizer.Encode(text, {.add_special = false, .parse_special = false});
      if (ids.ok() && ValidUtf8(text)) {
        auto back = tokenizer.Decode(*ids);
        if (!back.ok() || *back != text) std::abort();
      }
      break;
    }
    case 1: {  // special tokens parsed (chat-rendered prompts)
      auto ids = tokenizer.Encode(text, {.add_special = true, .parse_special = true});
      if (ids.ok()) (void)tokenizer.Decode(*ids, {.skip_special = (mode & 4) != 0});
      break;
    }
    case 2: {  // arbitrary ids, out of range and negative included
      std::vector<int32_t> ids;
      for (size_t i = 0; i + 2 <= text.size(); i += 2) {
        const int v = static_cast<uint8_t>(text[i]) | (static_cast<uint8_t>(text[i + 1]) << 8);
        ids.push_back((mode & 8) ? v - 32768 : v % 300);
      }
      (void)tokenizer.Decode(ids, {.skip_special = (mode & 4) != 0});
      kvr::model::TokenStreamDecoder stream(tokenizer);
      for (int32_t id : ids) (void)stream.Push(id);
      (void)stream.Flush();
      break;
    }
    case 3: {  // chat messages: role and content from the input
      std::vector<kvr::model::ChatMessage> messages;
      size_t at = 0;
      while (at < text.size() && messages.size() < 8) {
        const size_t end = std::min(text.size(), text.find('\x01', at));
        const char* roles[] = {"system", "user", "assistant"};
        messages.push_back({roles[messages.size() % 3], std::string(text.substr(at, end - at))});
        at = end + 1;
      }
      auto rendered = tokenizer.ApplyChatTemplate(messages, (mode & 4) != 0);
      if (rendered.ok()) {
        (void)tokenizer.Encode(*rendered, {.add_special = false, .parse_special = true});
      }
      break;
    }
  }
  return 0;
}
