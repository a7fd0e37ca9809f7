// Chat templates rendered in C++ against Jinja's rendering of the same template text
// (fixture from model/tests/scripts/tokenizer_make_fixture.py), plus detection and errors.

#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "kvr/common/paths.h"
#include "kvr/model/chat_template.h"
#include "kvr/model/tokenizer.h"
#include "tokenizer_test_util.h"

namespace kvr::model {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

std::vector<ChatMessage> Conversation(const json& messages) {
  std::vector<ChatMessage> out;
  for (const json& m : messages) {
    out.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
  }
  return out;
}

TEST(ChatTemplate, MatchesJinjaOnEveryFixtureCase) {
  auto fixture = testing::ReadReferenceFixture();
  ASSERT_TRUE(fixture.ok()) << fixture.status();
  const json& chat = (*fixture)["chat"];
  int rendered = 0, refused = 0;
  for (const json& c : chat["cases"]) {
    const std::string name = c["template"].get<std::string>();
    const std::string text = chat["templates"][name].get<std::string>();
    const auto messages = Conversation(chat["conversations"][c["conversation"].get<int>()]);
    ChatTemplateOptions options;
    options.add_generation_prompt = c["add_generation_prompt"].get<bool>();
    options.bos_token = c["bos_token"].get<std::string>();
    options.eos_token = c["eos_token"].get<std::string>();
    auto result = ApplyChatTemplate(text, messages, options);
    SCOPED_TRACE(name + " conversation " + std::to_string(c["conversation"].get<int>()) +
                 (options.add_generation_prompt ? " +gen" : ""));
    if (c["rendered"].is_null()) {
      // Jinja raised (roles that do not alternate, a system role mistral cannot express).
      EXPECT_FALSE(result.ok()) << "Jinja raised \"" << c["error"].get<std::string>()
                                << "\" but kvr rendered: " << *result;
      if (!result.ok()) {
        EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
      }
      ++refused;
      continue;
    }
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(*result, c["rendered"].get<std::string>());
    ++rendered;
  }
  EXPECT_GE(rendered, 50);
  EXPECT_GE(refused, 2);
}

TEST(ChatTemplate, DetectsFamiliesAndSmolLmDefaultSystemPrompt) {
  auto fixture = testing::ReadReferenceFixture();
  ASSERT_TRUE(fixture.ok()) << fixture.status();
  const json& templates = (*fixture)["chat"]["templates"];
  auto detect = [&](const char* name) {
    auto info = DetectChatTemplate(templates[name].get<std::string>());
    EXPECT_TRUE(info.ok()) << name << ": " << info.status();
    return info.ok() ? *info : ChatTemplateInfo{};
  };
  EXPECT_EQ(detect("smollm2").family, ChatTemplateFamily::kChatMl);
  EXPECT_EQ(detect("smollm2").default_system_prompt,
            "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
  EXPECT_EQ(detect("qwen2").default_system_prompt, "You are a helpful assistant.");
  EXPECT_EQ(detect("qwen25").default_system_prompt,
            "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.");
  EXPECT_EQ(detect("chatml_plain").default_system_prompt, "");
  EXPECT_EQ(detect("llama3").family, ChatTemplateFamily::kLlama3);
  EXPECT_FALSE(detect("llama3").llama31_system_header);
  EXPECT_TRUE(detect("llama31").llama31_system_header);
  EXPECT_EQ(detect("llama2").family, ChatTemplateFamily::kLlama2);
  EXPECT_EQ(detect("mistral").family, ChatTemplateFamily::kMistral);
}

TEST(ChatTemplate, UnknownOrEmptyTemplatesAreRefused) {
  auto unknown = DetectChatTemplate("{% for m in messages %}<|user|>{{ m.content }}{% endfor %}");
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(unknown.status().message(), HasSubstr("<|user|>"));
  EXPECT_EQ(DetectChatTemplate("").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ChatTemplate, SmolLm2ModelTemplateEncodesToSpecialTokens) {
  auto spec = testing::ReadTokenizerSpec(TestModelPath());
  ASSERT_TRUE(spec.ok()) << spec.status();
  auto tokenizer = Tokenizer::FromGgufMetadata(*spec);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  const std::vector<ChatMessage> messages = {{"user", "Hi"}};
  auto prompt = tokenizer->ApplyChatTemplate(messages, /*add_generation_prompt=*/true);
  ASSERT_TRUE(prompt.ok()) << prompt.status();
  EXPECT_EQ(*prompt,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
            "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  auto ids = tokenizer->Encode(*prompt, {.add_special = false, .parse_special = true});
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(ids->front(), 1);  // <|im_start|>
  EXPECT_EQ(std::count(ids->begin(), ids->end(), 1), 3);
  EXPECT_EQ(std::count(ids->begin(), ids->end(), 2), 2);  // <|im_end|>
}

}  // namespace
}  // namespace kvr::model
