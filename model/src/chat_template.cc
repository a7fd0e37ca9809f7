#include "kvr/model/chat_template.h"

#include "absl/status/status.h"

namespace kvr::model {

std::string_view ChatTemplateFamilyName(ChatTemplateFamily family) {
  switch (family) {
    case ChatTemplateFamily::kChatMl: return "chatml";
    case ChatTemplateFamily::kLlama3: return "llama3";
    case ChatTemplateFamily::kLlama2: return "llama2";
    case ChatTemplateFamily::kMistral: return "mistral";
  }
  return "unknown";
}

absl::StatusOr<ChatTemplateInfo> DetectChatTemplate(std::string_view template_text) {
  return absl::UnimplementedError("DetectChatTemplate: not written yet");
}

absl::StatusOr<std::string> ApplyChatTemplate(std::string_view template_text,
                                              std::span<const ChatMessage> messages,
                                              const ChatTemplateOptions& options) {
  return absl::UnimplementedError("ApplyChatTemplate: not written yet");
}

absl::StatusOr<std::string> RenderChatTemplate(const ChatTemplateInfo& info,
                                               std::span<const ChatMessage> messages,
                                               const ChatTemplateOptions& options) {
  return absl::UnimplementedError("RenderChatTemplate: not written yet");
}

}  // namespace kvr::model
