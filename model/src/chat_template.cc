#include "kvr/model/chat_template.h"

#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tokenizer_utf8.h"

namespace kvr::model {
namespace {

using internal::Av;

bool Contains(std::string_view text, std::string_view needle) {
  return text.find(needle) != std::string_view::npos;
}

// Python's str.isspace set for the code points a UTF-8 string can start/end with; Jinja's
// `trim` filter and `.strip()` are Python's str.strip(), which removes exactly these.
bool IsPythonSpace(uint32_t cp) {
  return (cp >= 0x9 && cp <= 0xD) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 ||
         cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
         cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

// Decodes the code point starting at s[i] (lenient: a malformed byte counts as itself).
uint32_t DecodeAt(std::string_view s, size_t i, size_t& length) {
  const auto b0 = static_cast<uint8_t>(s[i]);
  length = b0 < 0x80             ? 1
           : (b0 & 0xE0) == 0xC0 ? 2
           : (b0 & 0xF0) == 0xE0 ? 3
           : (b0 & 0xF8) == 0xF0 ? 4
                                 : 1;
  if (length == 1 || i + length > s.size()) {
    length = 1;
    return b0;
  }
  uint32_t cp = b0 & (0xFF >> (length + 1));
  for (size_t k = 1; k < length; ++k) cp = (cp << 6) | (static_cast<uint8_t>(s[i + k]) & 0x3F);
  return cp;
}

std::string_view PythonStrip(std::string_view s) {
  size_t begin = 0;
  while (begin < s.size()) {
    size_t length = 0;
    if (!IsPythonSpace(DecodeAt(s, begin, length))) break;
    begin += length;
  }
  size_t end = s.size();
  while (end > begin) {
    size_t start = end - 1;
    while (start > begin && (static_cast<uint8_t>(s[start]) & 0xC0) == 0x80) --start;
    size_t length = 0;
    if (!IsPythonSpace(DecodeAt(s, start, length)) || start + length != end) break;
    end = start;
  }
  return s.substr(begin, end - begin);
}

// Jinja string literals accept Python escapes; templates stored in JSON often carry "\n" as
// the two characters backslash and n inside the literal.
std::string UnescapeJinjaLiteral(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 1 < s.size()) {
      const char e = s[++i];
      switch (e) {
        case 'n':
          out.push_back('\n');
          break;
        case 't':
          out.push_back('\t');
          break;
        case 'r':
          out.push_back('\r');
          break;
        case '\\':
          out.push_back('\\');
          break;
        case '\'':
          out.push_back('\'');
          break;
        case '"':
          out.push_back('"');
          break;
        default:
          out.push_back('\\');
          out.push_back(e);
          break;
      }
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

// The system prompt a chatml template writes when the conversation has none: the text of a
// string literal '<|im_start|>system\n...<|im_end|>' that contains no template expression.
std::string FindChatMlDefaultSystemPrompt(std::string_view text) {
  constexpr std::string_view kOpen = "<|im_start|>system";
  constexpr std::string_view kClose = "<|im_end|>";
  for (size_t at = text.find(kOpen); at != std::string_view::npos; at = text.find(kOpen, at + 1)) {
    size_t body = at + kOpen.size();
    if (text.compare(body, 1, "\n") == 0) {
      body += 1;
    } else if (text.compare(body, 2, "\\n") == 0) {
      body += 2;
    } else {
      continue;
    }
    const size_t close = text.find(kClose, body);
    if (close == std::string_view::npos) break;
    const std::string_view candidate = text.substr(body, close - body);
    // A quote or a Jinja delimiter in between means the literal ended and an expression (for
    // example messages[0]['content']) supplies the text: not a default prompt.
    if (candidate.find_first_of("'\"{}") != std::string_view::npos) continue;
    return UnescapeJinjaLiteral(candidate);
  }
  return "";
}

absl::Status RequireAlternation(std::span<const ChatMessage> messages, std::string_view family) {
  for (size_t i = 0; i < messages.size(); ++i) {
    const bool expect_user = i % 2 == 0;
    const std::string& role = messages[i].role;
    if (role != "user" && role != "assistant") {
      return absl::InvalidArgumentError(absl::StrCat(
          Av(family), " chat template: message ", i, " has role \"", role,
          "\"; only user and assistant turns (after an optional leading system message) are "
          "supported"));
    }
    if ((role == "user") != expect_user) {
      return absl::InvalidArgumentError(
          absl::StrCat(Av(family),
                       " chat template: conversation roles must alternate user/assistant/user/..., "
                       "but message ",
                       i, " is \"", role, "\""));
    }
  }
  return absl::OkStatus();
}

std::string RenderChatMl(const ChatTemplateInfo& info, std::span<const ChatMessage> messages,
                         const ChatTemplateOptions& options) {
  std::string out;
  for (size_t i = 0; i < messages.size(); ++i) {
    if (i == 0 && !info.default_system_prompt.empty() && messages[0].role != "system") {
      absl::StrAppend(&out, "<|im_start|>system\n", info.default_system_prompt, "<|im_end|>\n");
    }
    absl::StrAppend(&out, "<|im_start|>", messages[i].role, "\n", messages[i].content,
                    "<|im_end|>\n");
  }
  if (options.add_generation_prompt) out.append("<|im_start|>assistant\n");
  return out;
}

absl::StatusOr<std::string> RenderLlama3(const ChatTemplateInfo& info,
                                         std::span<const ChatMessage> messages,
                                         const ChatTemplateOptions& options) {
  std::string out;
  if (info.llama31_system_header) {
    // The 3.1 template reads messages[0] unconditionally.
    if (messages.empty()) {
      return absl::InvalidArgumentError("llama3 chat template: the conversation is empty");
    }
    out = options.bos_token;
    std::string_view system_message;
    if (!messages.empty() && messages[0].role == "system") {
      system_message = PythonStrip(messages[0].content);
      messages = messages.subspan(1);
    }
    absl::StrAppend(&out, "<|start_header_id|>system<|end_header_id|>\n\n",
                    "Cutting Knowledge Date: December 2023\n", "Today Date: 26 Jul 2024\n\n",
                    Av(system_message), "<|eot_id|>");
  }
  // Llama 3.0 writes BOS in front of the first message only (none for an empty conversation).
  if (!info.llama31_system_header && !messages.empty()) out = options.bos_token;
  for (const ChatMessage& message : messages) {
    absl::StrAppend(&out, "<|start_header_id|>", message.role, "<|end_header_id|>\n\n",
                    Av(PythonStrip(message.content)), "<|eot_id|>");
  }
  if (options.add_generation_prompt) {
    out.append("<|start_header_id|>assistant<|end_header_id|>\n\n");
  }
  return out;
}

absl::StatusOr<std::string> RenderLlama2(std::span<const ChatMessage> messages,
                                         const ChatTemplateOptions& options) {
  // The template reads messages[0] unconditionally.
  if (messages.empty()) {
    return absl::InvalidArgumentError("llama2 chat template: the conversation is empty");
  }
  std::string system_message;
  bool has_system = false;
  if (messages[0].role == "system") {
    system_message = messages[0].content;
    has_system = true;
    messages = messages.subspan(1);
  }
  if (auto status = RequireAlternation(messages, "llama2"); !status.ok()) return status;
  std::string out;
  for (size_t i = 0; i < messages.size(); ++i) {
    std::string content = messages[i].content;
    if (i == 0 && has_system) {
      content = absl::StrCat("<<SYS>>\n", system_message, "\n<</SYS>>\n\n", content);
    }
    if (messages[i].role == "user") {
      absl::StrAppend(&out, options.bos_token, "[INST] ", Av(PythonStrip(content)), " [/INST]");
    } else {
      absl::StrAppend(&out, " ", Av(PythonStrip(content)), " ", options.eos_token);
    }
  }
  return out;
}

absl::StatusOr<std::string> RenderMistral(std::span<const ChatMessage> messages,
                                          const ChatTemplateOptions& options) {
  if (auto status = RequireAlternation(messages, "mistral"); !status.ok()) return status;
  std::string out = options.bos_token;
  for (const ChatMessage& message : messages) {
    if (message.role == "user") {
      absl::StrAppend(&out, "[INST] ", message.content, " [/INST]");
    } else {
      absl::StrAppend(&out, message.content, options.eos_token);
    }
  }
  return out;
}

}  // namespace

std::string_view ChatTemplateFamilyName(ChatTemplateFamily family) {
  switch (family) {
    case ChatTemplateFamily::kChatMl:
      return "chatml";
    case ChatTemplateFamily::kLlama3:
      return "llama3";
    case ChatTemplateFamily::kLlama2:
      return "llama2";
    case ChatTemplateFamily::kMistral:
      return "mistral";
  }
  return "unknown";
}

absl::StatusOr<ChatTemplateInfo> DetectChatTemplate(std::string_view template_text) {
  if (template_text.empty()) {
    return absl::InvalidArgumentError("chat template is empty");
  }
  ChatTemplateInfo info;
  if (Contains(template_text, "<|im_start|>")) {
    info.family = ChatTemplateFamily::kChatMl;
    info.default_system_prompt = FindChatMlDefaultSystemPrompt(template_text);
    return info;
  }
  if (Contains(template_text, "<|start_header_id|>")) {
    info.family = ChatTemplateFamily::kLlama3;
    info.llama31_system_header = Contains(template_text, "Cutting Knowledge Date");
    if (info.llama31_system_header && Contains(template_text, "strftime_now")) {
      // Llama 3.2 writes today's date, which a fixed rendering cannot reproduce.
      return absl::UnimplementedError(
          "llama3 chat template that writes the current date (strftime_now, Llama 3.2) is not "
          "supported");
    }
    return info;
  }
  if (Contains(template_text, "[INST]")) {
    info.family = Contains(template_text, "<<SYS>>") ? ChatTemplateFamily::kLlama2
                                                     : ChatTemplateFamily::kMistral;
    return info;
  }
  constexpr size_t kQuoteChars = 120;
  return absl::UnimplementedError(absl::StrCat(
      "unrecognised chat template (kvr renders chatml, llama3, llama2 and mistral templates): \"",
      Av(template_text.substr(0, kQuoteChars)),
      template_text.size() > kQuoteChars ? "...\"" : "\""));
}

absl::StatusOr<std::string> RenderChatTemplate(const ChatTemplateInfo& info,
                                               std::span<const ChatMessage> messages,
                                               const ChatTemplateOptions& options) {
  switch (info.family) {
    case ChatTemplateFamily::kChatMl:
      return RenderChatMl(info, messages, options);
    case ChatTemplateFamily::kLlama3:
      return RenderLlama3(info, messages, options);
    case ChatTemplateFamily::kLlama2:
      return RenderLlama2(messages, options);
    case ChatTemplateFamily::kMistral:
      return RenderMistral(messages, options);
  }
  return absl::InternalError("unknown chat template family");
}

absl::StatusOr<std::string> ApplyChatTemplate(std::string_view template_text,
                                              std::span<const ChatMessage> messages,
                                              const ChatTemplateOptions& options) {
  auto info = DetectChatTemplate(template_text);
  if (!info.ok()) return info.status();
  return RenderChatTemplate(*info, messages, options);
}

}  // namespace kvr::model
