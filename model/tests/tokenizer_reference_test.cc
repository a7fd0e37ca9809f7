// The SmolLM2-135M-Instruct tokenizer (from its GGUF) against the Hugging Face reference
// fixture: exact ids on every string, decode, streaming decode and the tokenizer.json loader.

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "kvr/common/paths.h"
#include "kvr/model/tokenizer.h"
#include "tokenizer_test_util.h"

namespace kvr::model {
namespace {

using nlohmann::json;

std::string Printable(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c == '\n') {
      out += "\\n";
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  return out;
}

// SmolLM2's vocabulary written as a Hugging Face tokenizer.json with the given pre_tokenizer
// and normalizer nodes; control tokens become special added tokens.
void WriteTokenizerJson(const TokenizerSpec& spec, const std::filesystem::path& path,
                        const json& pre_tokenizer, const json& normalizer, bool ignore_merges) {
  json vocab = json::object();
  json added = json::array();
  for (size_t id = 0; id < spec.tokens.size(); ++id) {
    vocab[spec.tokens[id]] = id;
    if (spec.token_types[id] == static_cast<int32_t>(TokenType::kControl)) {
      added.push_back({{"id", id},
                       {"content", spec.tokens[id]},
                       {"single_word", false},
                       {"lstrip", false},
                       {"rstrip", false},
                       {"normalized", false},
                       {"special", true}});
    }
  }
  json merges = json::array();
  for (size_t i = 0; i < spec.merges.size(); ++i) {
    const std::string& m = spec.merges[i];
    const size_t space = m.find(' ');
    // Alternate the legacy "a b" and the newer ["a", "b"] spellings to exercise both.
    if (i % 2 == 0) {
      merges.push_back(m);
    } else {
      merges.push_back(json::array({m.substr(0, space), m.substr(space + 1)}));
    }
  }
  json root = {{"version", "1.0"},
               {"added_tokens", added},
               {"normalizer", normalizer},
               {"pre_tokenizer", pre_tokenizer},
               {"post_processor", nullptr},
               {"decoder",
                {{"type", "ByteLevel"},
                 {"add_prefix_space", true},
                 {"trim_offsets", true},
                 {"use_regex", true}}},
               {"model",
                {{"type", "BPE"},
                 {"dropout", nullptr},
                 {"unk_token", nullptr},
                 {"fuse_unk", false},
                 {"byte_fallback", false},
                 {"ignore_merges", ignore_merges},
                 {"vocab", vocab},
                 {"merges", merges}}}};
  std::ofstream(path) << root.dump();
}

class SmolLm2TokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto spec = testing::ReadTokenizerSpec(TestModelPath());
    ASSERT_TRUE(spec.ok()) << "reading " << TestModelPath() << ": " << spec.status()
                           << " (scripts/fetch-model.sh puts the model there)";
    spec_ = new TokenizerSpec(std::move(*spec));
    auto tokenizer = Tokenizer::FromGgufMetadata(*spec_);
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    tokenizer_ = new Tokenizer(std::move(*tokenizer));
    auto fixture = testing::ReadReferenceFixture();
    ASSERT_TRUE(fixture.ok()) << fixture.status();
    fixture_ = new json(std::move(*fixture));
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    delete fixture_;
    delete spec_;
  }

  // Encodes every fixture string with `tokenizer` and compares with `ids_key` (falling back to
  // "ids"); returns the number of mismatches and reports the first few.
  static int CountMismatches(const Tokenizer& tokenizer, bool parse_special, const char* ids_key) {
    int mismatches = 0;
    for (const json& c : (*fixture_)["cases"]) {
      const std::string text = c["text"].get<std::string>();
      const auto expected =
          (c.contains(ids_key) ? c[ids_key] : c["ids"]).get<std::vector<int32_t>>();
      auto ids = tokenizer.Encode(text, {.add_special = false, .parse_special = parse_special});
      if (!ids.ok() || *ids != expected) {
        if (++mismatches <= 5) {
          ADD_FAILURE() << "text \"" << Printable(text) << "\": "
                        << (ids.ok() ? ::testing::PrintToString(*ids) : ids.status().ToString())
                        << " != reference " << ::testing::PrintToString(expected);
        }
      }
    }
    return mismatches;
  }

  static TokenizerSpec* spec_;
  static Tokenizer* tokenizer_;
  static json* fixture_;
};

TokenizerSpec* SmolLm2TokenizerTest::spec_ = nullptr;
Tokenizer* SmolLm2TokenizerTest::tokenizer_ = nullptr;
json* SmolLm2TokenizerTest::fixture_ = nullptr;

TEST_F(SmolLm2TokenizerTest, FixtureCoversTheRequiredKindsOfText) {
  const json& cases = (*fixture_)["cases"];
  ASSERT_GE(cases.size(), 2000u);
  int with_special = 0, with_digits = 0, with_non_ascii = 0, with_space_runs = 0;
  for (const json& c : cases) {
    const std::string text = c["text"].get<std::string>();
    with_special += c.contains("ids_no_special");
    with_digits += text.find_first_of("0123456789") != std::string::npos;
    with_non_ascii += std::any_of(text.begin(), text.end(), [](char ch) { return ch & 0x80; });
    with_space_runs +=
        text.find("  ") != std::string::npos || text.find("\n\n") != std::string::npos;
  }
  EXPECT_GE(with_special, 100);
  EXPECT_GE(with_digits, 300);
  EXPECT_GE(with_non_ascii, 500);
  EXPECT_GE(with_space_runs, 100);
}

TEST_F(SmolLm2TokenizerTest, VocabularyAndSpecialIds) {
  EXPECT_EQ(tokenizer_->vocab_size(), 49152);
  EXPECT_EQ(tokenizer_->pre_tokenizer(), "smollm");
  EXPECT_EQ(tokenizer_->bos_id(), 1);
  EXPECT_EQ(tokenizer_->eos_id(), 2);
  EXPECT_EQ(tokenizer_->eot_id(), 2);  // <|im_end|>
  EXPECT_FALSE(tokenizer_->add_bos());
  EXPECT_TRUE(tokenizer_->IsEndOfGeneration(2));
  EXPECT_TRUE(tokenizer_->IsEndOfGeneration(0));  // <|endoftext|>
  EXPECT_FALSE(tokenizer_->IsEndOfGeneration(1));
  EXPECT_EQ(tokenizer_->token_type(1), TokenType::kControl);
  EXPECT_EQ(*tokenizer_->IdToPiece(1), "<|im_start|>");
  EXPECT_EQ(*tokenizer_->PieceToId("<|im_end|>"), 2);
  EXPECT_EQ(tokenizer_->PieceToId("no such token").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(SmolLm2TokenizerTest, IdsEqualReferenceOnEveryString) {
  EXPECT_EQ(CountMismatches(*tokenizer_, /*parse_special=*/true, "ids"), 0);
}

// The same vocabulary under the other pre-tokenizer families (the fixture stores the
// reference ids where they differ from SmolLM2's; strings over 2,000 characters are left out).
TEST_F(SmolLm2TokenizerTest, OtherPreTokenizerFamiliesEqualReference) {
  const json& variants = (*fixture_)["pre_tokenizer_variants"];
  ASSERT_EQ(variants.size(), 4u);
  for (const auto& [pre, diffs] : variants.items()) {
    SCOPED_TRACE("tokenizer.ggml.pre = " + pre);
    EXPECT_GE(diffs.size(), 100u);  // the families really do split differently
    absl::StatusOr<Tokenizer> tokenizer = absl::UnknownError("unset");
    if (pre == "qwen2+nfc") {
      // Qwen2's tokenizer.json layout: NFC, Split(regex) + ByteLevel(use_regex=false).
      const auto path = std::filesystem::temp_directory_path() /
                        ("kvr_tokenizer_qwen2_" + std::to_string(::getpid()) + ".json");
      const std::string qwen2_regex =
          R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
      WriteTokenizerJson(*spec_, path,
                         {{"type", "Sequence"},
                          {"pretokenizers", json::array({{{"type", "Split"},
                                                          {"pattern", {{"Regex", qwen2_regex}}},
                                                          {"behavior", "Isolated"},
                                                          {"invert", false}},
                                                         {{"type", "ByteLevel"},
                                                          {"add_prefix_space", false},
                                                          {"trim_offsets", false},
                                                          {"use_regex", false}}})}},
                         {{"type", "NFC"}}, /*ignore_merges=*/false);
      tokenizer = Tokenizer::FromTokenizerJson(path.string());
      std::filesystem::remove(path);
    } else {
      TokenizerSpec spec = *spec_;
      spec.pre = pre;
      tokenizer = Tokenizer::FromGgufMetadata(spec);
    }
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    int mismatches = 0, compared = 0;
    const json& cases = (*fixture_)["cases"];
    for (size_t i = 0; i < cases.size(); ++i) {
      const std::string text = cases[i]["text"].get<std::string>();
      if (text.size() > 2000 * 4) continue;
      const std::string key = std::to_string(i);
      const auto expected =
          (diffs.contains(key) ? diffs[key] : cases[i]["ids"]).get<std::vector<int32_t>>();
      // Byte length is an upper bound on the script's character count; check it exactly.
      size_t chars = 0;
      for (unsigned char ch : text) chars += (ch & 0xC0) != 0x80;
      if (chars > 2000) continue;
      auto ids = tokenizer->Encode(text, {.add_special = false, .parse_special = true});
      ++compared;
      if (!ids.ok() || *ids != expected) {
        if (++mismatches <= 5) {
          ADD_FAILURE() << "text \"" << Printable(text) << "\": "
                        << (ids.ok() ? ::testing::PrintToString(*ids) : ids.status().ToString())
                        << " != reference " << ::testing::PrintToString(expected);
        }
      }
    }
    EXPECT_GE(compared, 2000);
    EXPECT_EQ(mismatches, 0);
  }
}

TEST_F(SmolLm2TokenizerTest, IdsEqualReferenceWhenSpecialTokensAreNotParsed) {
  EXPECT_EQ(CountMismatches(*tokenizer_, /*parse_special=*/false, "ids_no_special"), 0);
}

// Encode is const and shares a word cache between threads: concurrent use gives the same ids.
TEST_F(SmolLm2TokenizerTest, ConcurrentEncodeGivesTheSameIds) {
  TokenizerSpec spec = *spec_;
  auto tokenizer = Tokenizer::FromGgufMetadata(spec);  // fresh, so threads fill the cache together
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  const json& cases = (*fixture_)["cases"];
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      // Each thread walks the cases from a different starting point.
      for (size_t k = 0; k < cases.size(); ++k) {
        const json& c = cases[(k + t * cases.size() / 4) % cases.size()];
        auto ids = tokenizer->Encode(c["text"].get<std::string>(),
                                     {.add_special = false, .parse_special = true});
        if (!ids.ok() || *ids != c["ids"].get<std::vector<int32_t>>()) ++mismatches;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(mismatches.load(), 0);
}

TEST_F(SmolLm2TokenizerTest, DecodeEqualsReferenceAndRoundTrips) {
  int mismatches = 0;
  for (const json& c : (*fixture_)["cases"]) {
    const std::string text = c["text"].get<std::string>();
    const std::string expected = c.contains("decoded") ? c["decoded"].get<std::string>() : text;
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    auto decoded = tokenizer_->Decode(ids);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    if (*decoded != expected && ++mismatches <= 5) {
      ADD_FAILURE() << "decode of \"" << Printable(text) << "\" gave \"" << Printable(*decoded)
                    << "\", reference \"" << Printable(expected) << "\"";
    }
    // Byte-level BPE loses nothing: decoding the ids gives the text back.
    EXPECT_EQ(*decoded, text);
  }
  EXPECT_EQ(mismatches, 0);
}

TEST_F(SmolLm2TokenizerTest, StreamingDecodeNeverSplitsCharactersAndEqualsDecode) {
  int checked = 0;
  for (const json& c : (*fixture_)["cases"]) {
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    TokenStreamDecoder stream(*tokenizer_);
    std::string streamed;
    for (int32_t id : ids) {
      auto piece = stream.Push(id);
      ASSERT_TRUE(piece.ok()) << piece.status();
      // Every piece is complete UTF-8 on its own: re-encoding it loses nothing.
      auto again = tokenizer_->Encode(*piece, {.add_special = false, .parse_special = true});
      ASSERT_TRUE(again.ok()) << "streamed piece is not valid UTF-8: " << again.status();
      streamed += *piece;
    }
    streamed += stream.Flush();
    EXPECT_EQ(streamed, *tokenizer_->Decode(ids));
    ++checked;
  }
  EXPECT_GE(checked, 2000);
}

TEST_F(SmolLm2TokenizerTest, AddSpecialFollowsTheModel) {
  // SmolLM2's GGUF says add_bos_token = false: add_special adds nothing.
  auto with = tokenizer_->Encode("Hi", {.add_special = true});
  auto without = tokenizer_->Encode("Hi", {.add_special = false});
  ASSERT_TRUE(with.ok() && without.ok());
  EXPECT_EQ(*with, *without);
  TokenizerSpec spec = *spec_;
  spec.add_bos = true;
  auto bos_tokenizer = Tokenizer::FromGgufMetadata(spec);
  ASSERT_TRUE(bos_tokenizer.ok()) << bos_tokenizer.status();
  auto ids = bos_tokenizer->Encode("Hi", {.add_special = true});
  ASSERT_TRUE(ids.ok());
  ASSERT_EQ(ids->size(), without->size() + 1);
  EXPECT_EQ((*ids)[0], 1);
}

// The same vocabulary written as a Hugging Face tokenizer.json (SmolLM2's layout: Digits +
// ByteLevel pre-tokenizer, control tokens as special added tokens) must encode identically.
TEST_F(SmolLm2TokenizerTest, TokenizerJsonGivesTheSameIds) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("kvr_tokenizer_json_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  WriteTokenizerJson(
      *spec_, dir / "tokenizer.json",
      {{"type", "Sequence"},
       {"pretokenizers", json::array({{{"type", "Digits"}, {"individual_digits", true}},
                                      {{"type", "ByteLevel"},
                                       {"add_prefix_space", false},
                                       {"trim_offsets", true},
                                       {"use_regex", true}}})}},
      nullptr, /*ignore_merges=*/false);
  std::ofstream(dir / "tokenizer_config.json")
      << json({{"bos_token", "<|im_start|>"},
               {"eos_token", {{"content", "<|im_end|>"}, {"special", true}}},
               {"add_bos_token", false},
               {"chat_template", spec_->chat_template}})
             .dump();

  auto from_json = Tokenizer::FromTokenizerJson((dir / "tokenizer.json").string());
  ASSERT_TRUE(from_json.ok()) << from_json.status();
  EXPECT_EQ(CountMismatches(*from_json, /*parse_special=*/true, "ids"), 0);

  auto from_dir = Tokenizer::FromHuggingFaceDir(dir.string());
  ASSERT_TRUE(from_dir.ok()) << from_dir.status();
  EXPECT_EQ(from_dir->bos_id(), 1);
  EXPECT_EQ(from_dir->eos_id(), 2);
  EXPECT_EQ(from_dir->chat_template(), spec_->chat_template);
  EXPECT_EQ(CountMismatches(*from_dir, /*parse_special=*/false, "ids_no_special"), 0);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvr::model
