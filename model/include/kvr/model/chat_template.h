#pragma once
// Chat templates, rendered in C++ for the template families kvr supports.
//
// GGUF and tokenizer_config.json carry the chat template as Jinja text. Rather than embed a
// Jinja engine, kvr recognises the known families from the template text and renders them
// directly; anything else is refused with Unimplemented naming the template, so a new family
// is a visible, deliberate addition rather than a silently wrong prompt.

#include <span>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace kvr::model {

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
};

enum class ChatTemplateFamily {
  kChatMl,   // <|im_start|>role\n...<|im_end|>\n (SmolLM2, Qwen2); may insert a default system
             // prompt
  kLlama3,   // <|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|> (3.0 and 3.1 layouts)
  kLlama2,   // <s>[INST] <<SYS>>\n...\n<</SYS>>\n\n... [/INST] ... </s>
  kMistral,  // <s>[INST] ... [/INST]...</s> (Mistral-7B-Instruct v0.1/v0.2: no system role)
};

std::string_view ChatTemplateFamilyName(ChatTemplateFamily family);

// A recognised template: its family plus what the renderer needs from the template text.
struct ChatTemplateInfo {
  ChatTemplateFamily family = ChatTemplateFamily::kChatMl;
  // chatml: the system prompt the template inserts when the conversation has none (SmolLM2's
  // "You are a helpful AI assistant named SmolLM, ...", Qwen2's "You are a helpful
  // assistant."); empty when the template inserts none.
  std::string default_system_prompt;
  // llama3: the 3.1 layout, which always writes a system header with "Cutting Knowledge
  // Date: December 2023" and "Today Date: 26 Jul 2024" (the template's default date_string).
  bool llama31_system_header = false;
};

// Identifies the family of `template_text`. Unimplemented (quoting the start of the template)
// when it is not one kvr can render; InvalidArgument when it is empty.
[[nodiscard]] absl::StatusOr<ChatTemplateInfo> DetectChatTemplate(std::string_view template_text);

struct ChatTemplateOptions {
  bool add_generation_prompt = true;  // end with the header of an assistant turn
  std::string bos_token;  // text of BOS, for templates that write it (llama2/3, mistral)
  std::string eos_token;  // text of EOS, for templates that write it (llama2, mistral)
};

// Renders `messages` as `template_text` would. InvalidArgument for a role the family cannot
// express (e.g. a system message after the first turn for llama2/mistral).
[[nodiscard]] absl::StatusOr<std::string> ApplyChatTemplate(std::string_view template_text,
                                                            std::span<const ChatMessage> messages,
                                                            const ChatTemplateOptions& options);

// The same for an already-detected template.
[[nodiscard]] absl::StatusOr<std::string> RenderChatTemplate(const ChatTemplateInfo& info,
                                                             std::span<const ChatMessage> messages,
                                                             const ChatTemplateOptions& options);

}  // namespace kvr::model
