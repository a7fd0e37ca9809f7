// Tokenizer unit tests on hand-made vocabularies: BPE merge order, pre-tokenizer splits,
// special tokens, UTF-8 handling, streaming decode, tokenizer.json parsing and bad input.

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "kvr/model/tokenizer.h"
#include "pretokenizer.h"
#include "tokenizer_utf8.h"

namespace kvr::model {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// GPT-2's byte-level spelling of raw bytes, written independently of the library:
// printable bytes stand for themselves, the rest for U+0100 + their order.
std::string Spell(std::string_view bytes) {
  std::vector<std::string> table(256);
  int extra = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const int cp = printable ? b : 256 + extra++;
    std::string s;
    if (cp < 0x80) {
      s.push_back(static_cast<char>(cp));
    } else {
      s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    table[b] = s;
  }
  std::string out;
  for (unsigned char c : bytes) out += table[c];
  return out;
}

// A vocabulary of the 256 byte tokens plus `extra` raw strings (ids 256, 257, ...), with the
// given merges (raw strings, rank = order).
TokenizerSpec TinySpec(const std::vector<std::string>& extra,
                       const std::vector<std::pair<std::string, std::string>>& merges,
                       std::string pre = "gpt2") {
  TokenizerSpec spec;
  spec.pre = std::move(pre);
  for (int b = 0; b < 256; ++b) spec.tokens.push_back(Spell(std::string(1, static_cast<char>(b))));
  for (const auto& s : extra) spec.tokens.push_back(Spell(s));
  for (const auto& [l, r] : merges) spec.merges.push_back(Spell(l) + " " + Spell(r));
  return spec;
}

int32_t Byte(char c) { return static_cast<uint8_t>(c); }

std::vector<int32_t> EncodeOk(const Tokenizer& t, std::string_view text, EncodeOptions o = {}) {
  auto ids = t.Encode(text, o);
  EXPECT_TRUE(ids.ok()) << ids.status();
  return ids.ok() ? *ids : std::vector<int32_t>{};
}

TEST(Bpe, AppliesMergesByRankThenLeftmost) {
  // "b c" outranks "a b": "abc" -> a + bc although "ab" comes first in the text.
  auto t = Tokenizer::FromGgufMetadata(TinySpec({"bc", "ab"}, {{"b", "c"}, {"a", "b"}}));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT(EncodeOk(*t, "abc"), ElementsAre(Byte('a'), 256));
  EXPECT_THAT(EncodeOk(*t, "ab"), ElementsAre(257));
  // Equal ranks for overlapping pairs: the leftmost merges first ("aaa" -> aa + a).
  auto t2 = Tokenizer::FromGgufMetadata(TinySpec({"aa"}, {{"a", "a"}}));
  ASSERT_TRUE(t2.ok());
  EXPECT_THAT(EncodeOk(*t2, "aaa"), ElementsAre(256, Byte('a')));
  EXPECT_THAT(EncodeOk(*t2, "aaaa"), ElementsAre(256, 256));
}

TEST(Bpe, BuildsWordsFromEarlierMerges) {
  auto t = Tokenizer::FromGgufMetadata(
      TinySpec({"he", "ll", "hell", "hello", " w", " wo"},
               {{"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}, {" ", "w"}, {" w", "o"}}));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT(EncodeOk(*t, "hello world"), ElementsAre(259, 261, Byte('r'), Byte('l'), Byte('d')));
  // The cache must give the same answer the second time.
  EXPECT_THAT(EncodeOk(*t, "hello hello"), ElementsAre(259, Byte(' '), 259));
  EXPECT_EQ(*t->Decode(EncodeOk(*t, "hello world")), "hello world");
}

TEST(Bpe, IgnoreMergesLooksUpWholeWords) {
  // Llama 3 ("llama-bpe") looks a word up before merging: "abc" is a token although no merge
  // produces it.
  auto t = Tokenizer::FromGgufMetadata(TinySpec({"abc"}, {}, "llama-bpe"));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT(EncodeOk(*t, "abc"), ElementsAre(256));
  auto gpt2 = Tokenizer::FromGgufMetadata(TinySpec({"abc"}, {}, "gpt2"));
  ASSERT_TRUE(gpt2.ok());
  EXPECT_THAT(EncodeOk(*gpt2, "abc"), ElementsAre(Byte('a'), Byte('b'), Byte('c')));
}

std::vector<std::string> Split(std::string_view pre, std::string_view text) {
  std::string name;
  bool ignore_merges = false;
  auto p = internal::PreTokenizer::ForGgufPre(pre, name, ignore_merges);
  EXPECT_TRUE(p.ok()) << p.status();
  std::vector<std::string_view> pieces;
  EXPECT_TRUE(p->Split(text, pieces).ok());
  return {pieces.begin(), pieces.end()};
}

TEST(PreTokenizer, Gpt2Rule) {
  EXPECT_THAT(Split("gpt2", "Hello  world 123 I'm"),
              ElementsAre("Hello", " ", " world", " 123", " I", "'m"));
  EXPECT_THAT(Split("gpt2", "a  \n\tb  "), ElementsAre("a", "  \n", "\t", "b", "  "));
  EXPECT_THAT(Split("gpt2", "x+=1;"), ElementsAre("x", "+=", "1", ";"));
}

TEST(PreTokenizer, SmolLmSplitsEveryDigit) {
  EXPECT_THAT(Split("smollm", "a 123"), ElementsAre("a", " ", "1", "2", "3"));
  EXPECT_THAT(Split("smollm", "v1.25"), ElementsAre("v", "1", ".", "2", "5"));
  // Digits of other scripts are \p{N} too (Arabic-Indic, fullwidth, superscript, fractions).
  EXPECT_THAT(Split("smollm", "\xd9\xa3\xef\xbc\x91\xc2\xb2\xc2\xbd"),
              ElementsAre("\xd9\xa3", "\xef\xbc\x91", "\xc2\xb2", "\xc2\xbd"));
}

TEST(PreTokenizer, Llama3GroupsDigitsByThreeAndFoldsCase) {
  EXPECT_THAT(Split("llama-bpe", "Hello 1234567"), ElementsAre("Hello", " ", "123", "456", "7"));
  EXPECT_THAT(Split("llama-bpe", "IT'S ok\n\n  x"),
              ElementsAre("IT", "'S", " ok", "\n\n", " ", " x"));
}

TEST(PreTokenizer, Qwen2SplitsSingleDigits) {
  EXPECT_THAT(Split("qwen2", "ab 12"), ElementsAre("ab", " ", "1", "2"));
}

TEST(PreTokenizer, WhiteSpaceIsUnicodeWhiteSpace) {
  // U+0085 is white space; U+180E (Mongolian vowel separator) and U+200B are not, although
  // PCRE2's own \s still counts U+180E.
  EXPECT_THAT(Split("gpt2",
                    "a\xc2\x85"
                    "b"),
              ElementsAre("a", "\xc2\x85", "b"));
  EXPECT_THAT(Split("gpt2",
                    "a\xe1\xa0\x8e"
                    "b"),
              ElementsAre("a", "\xe1\xa0\x8e", "b"));
  EXPECT_THAT(Split("gpt2",
                    "a \xe2\x80\x8b"
                    "b"),
              ElementsAre("a", " \xe2\x80\x8b", "b"));
}

TEST(Normalize, NfcComposes) {
  std::string out;
  ASSERT_TRUE(internal::NormalizeNfc("e\xcc\x81", out).ok());     // e + U+0301
  EXPECT_EQ(out, "\xc3\xa9");                                     // U+00E9
  ASSERT_TRUE(internal::NormalizeNfc("\xe2\x84\xab", out).ok());  // U+212B ANGSTROM SIGN
  EXPECT_EQ(out, "\xc3\x85");                                     // U+00C5
  ASSERT_TRUE(internal::NormalizeNfc("plain ascii", out).ok());
  EXPECT_EQ(out, "plain ascii");
}

TEST(PreTokenizer, UnknownNameIsRefusedByName) {
  std::string name;
  bool ignore_merges = false;
  auto p = internal::PreTokenizer::ForGgufPre("klingon", name, ignore_merges);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(p.status().message(), HasSubstr("klingon"));
}

TokenizerSpec SpecialSpec() {
  TokenizerSpec spec = TinySpec({"<|a|>", "<|a|>b", "<user>", "<s>"}, {});
  spec.token_types.assign(spec.tokens.size(), static_cast<int32_t>(TokenType::kNormal));
  spec.token_types[256] = static_cast<int32_t>(TokenType::kControl);
  spec.token_types[257] = static_cast<int32_t>(TokenType::kControl);
  spec.token_types[258] = static_cast<int32_t>(TokenType::kUserDefined);
  spec.token_types[259] = static_cast<int32_t>(TokenType::kControl);
  spec.bos_id = 259;
  spec.eos_id = 256;
  return spec;
}

TEST(SpecialTokens, ParsedOnlyWhenAskedAndLongestWins) {
  auto t = Tokenizer::FromGgufMetadata(SpecialSpec());
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT(EncodeOk(*t, "x<|a|>y", {.parse_special = true}),
              ElementsAre(Byte('x'), 256, Byte('y')));
  EXPECT_THAT(EncodeOk(*t, "<|a|>b", {.parse_special = true}), ElementsAre(257));
  // Not parsed: the text is ordinary bytes.
  EXPECT_EQ(EncodeOk(*t, "<|a|>", {.parse_special = false}).size(), 5u);
  // User-defined tokens are always matched.
  EXPECT_THAT(EncodeOk(*t, "<user>", {.parse_special = false}), ElementsAre(258));
}

TEST(SpecialTokens, AddSpecialAddsBosWhenTheModelSaysSo) {
  TokenizerSpec spec = SpecialSpec();
  spec.add_bos = true;
  auto t = Tokenizer::FromGgufMetadata(spec);
  ASSERT_TRUE(t.ok());
  EXPECT_THAT(EncodeOk(*t, "x", {.add_special = true}), ElementsAre(259, Byte('x')));
  EXPECT_THAT(EncodeOk(*t, "x", {.add_special = false}), ElementsAre(Byte('x')));
  EXPECT_THAT(EncodeOk(*t, "", {.add_special = true}), ElementsAre(259));
  EXPECT_EQ(*t->Decode(std::vector<int32_t>{259, Byte('x'), 256}, {.skip_special = true}), "x");
  EXPECT_EQ(*t->Decode(std::vector<int32_t>{259, Byte('x'), 256}), "<s>x<|a|>");
}

TEST(Decode, InvalidUtf8BecomesReplacementCharacters) {
  auto t = Tokenizer::FromGgufMetadata(TinySpec({}, {}));
  ASSERT_TRUE(t.ok());
  // E4 BD A0 is U+4F60; alone, E4 BD is one maximal ill-formed subpart -> one U+FFFD.
  EXPECT_EQ(*t->Decode(std::vector<int32_t>{0xE4, 0xBD, 0xA0}), "\xe4\xbd\xa0");
  EXPECT_EQ(*t->Decode(std::vector<int32_t>{0xE4, 0xBD, 'x'}), "\xef\xbf\xbdx");
  EXPECT_EQ(*t->Decode(std::vector<int32_t>{0xFF, 0x80}), "\xef\xbf\xbd\xef\xbf\xbd");
  EXPECT_EQ(*t->Decode(std::vector<int32_t>{0xED, 0xA0, 0x80}),  // a surrogate: 3 subparts
            "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd");
  auto bad = t->Decode(std::vector<int32_t>{5, 256});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(bad.status().message(), HasSubstr("256"));
}

TEST(Decode, StreamHoldsBackIncompleteCharacters) {
  auto t = Tokenizer::FromGgufMetadata(TinySpec({}, {}));
  ASSERT_TRUE(t.ok());
  TokenStreamDecoder stream(*t);
  EXPECT_EQ(*stream.Push('a'), "a");
  EXPECT_EQ(*stream.Push(0xF0), "");  // U+1F600 = F0 9F 98 80
  EXPECT_EQ(*stream.Push(0x9F), "");
  EXPECT_EQ(*stream.Push(0x98), "");
  EXPECT_EQ(*stream.Push(0x80), "\xf0\x9f\x98\x80");
  // A byte that can never continue is released at once as U+FFFD.
  EXPECT_EQ(*stream.Push(0xE4), "");
  EXPECT_EQ(*stream.Push('b'),
            "\xef\xbf\xbd"
            "b");
  EXPECT_EQ(*stream.Push(0xE4), "");
  EXPECT_EQ(stream.Flush(), "\xef\xbf\xbd");
  EXPECT_EQ(stream.Flush(), "");
  EXPECT_FALSE(stream.Push(100000).ok());
}

TEST(Encode, RejectsInvalidUtf8NamingTheOffset) {
  auto t = Tokenizer::FromGgufMetadata(TinySpec({}, {}));
  ASSERT_TRUE(t.ok());
  auto ids = t->Encode("ok\xc3(");
  ASSERT_FALSE(ids.ok());
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ids.status().message(), HasSubstr("offset 2"));
  EXPECT_FALSE(t->Encode("\xed\xa0\x80").ok());  // surrogate
  EXPECT_FALSE(t->Encode("\xc0\xaf").ok());      // overlong
  EXPECT_TRUE(t->Encode(std::string_view("a\0b", 3)).ok());
}

TEST(Encode, LongRunsDoNotExhaustTheRegexEngine) {
  auto t = Tokenizer::FromGgufMetadata(TinySpec({}, {}));
  ASSERT_TRUE(t.ok());
  const std::string spaces(200000, ' ');
  auto ids = t->Encode(spaces + "x");
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(ids->size(), spaces.size() + 1);
}

TEST(Load, BadSpecsGetClearErrors) {
  TokenizerSpec spec = TinySpec({"ab"}, {{"a", "b"}});
  spec.model = "llama";
  auto r = Tokenizer::FromGgufMetadata(spec);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(r.status().message(), HasSubstr("llama"));

  spec = TinySpec({"ab"}, {});
  spec.merges = {"a"};
  r = Tokenizer::FromGgufMetadata(spec);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("merges[0]"));

  spec = TinySpec({}, {{"a", "b"}});  // "ab" is not in the vocabulary
  r = Tokenizer::FromGgufMetadata(spec);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("merge 0"));

  spec = TinySpec({}, {});
  spec.eos_id = 999;
  r = Tokenizer::FromGgufMetadata(spec);
  EXPECT_THAT(r.status().message(), HasSubstr("eos id 999"));

  spec = TinySpec({}, {});
  spec.token_types = {1, 1};
  r = Tokenizer::FromGgufMetadata(spec);
  EXPECT_THAT(r.status().message(), HasSubstr("token types"));

  spec = TinySpec({}, {});
  spec.pre = "unknown-pre";
  r = Tokenizer::FromGgufMetadata(spec);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(r.status().message(), HasSubstr("unknown-pre"));
}

class TokenizerJsonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("kvr_tokenizer_test_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name) << text;
    return (dir_ / name).string();
  }
  std::filesystem::path dir_;
};

// A Llama-3-shaped tokenizer.json: Split regex + ByteLevel(use_regex=false), ignore_merges,
// BOS added by a TemplateProcessing post-processor, an lstrip added token.
constexpr char kTinyJson[] = R"({
  "version": "1.0",
  "added_tokens": [
    {"id": 6, "content": "<|begin_of_text|>", "special": true, "lstrip": false, "rstrip": false,
     "single_word": false, "normalized": false},
    {"id": 7, "content": "<mask>", "special": false, "lstrip": true, "rstrip": false,
     "single_word": false, "normalized": true}
  ],
  "normalizer": null,
  "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}|\\s+|[^\\s\\p{N}]+"},
     "behavior": "Isolated", "invert": false},
    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]},
  "post_processor": {"type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
               {"Sequence": {"id": "A", "type_id": 0}}]},
  "decoder": {"type": "ByteLevel"},
  "model": {"type": "BPE", "byte_fallback": false, "ignore_merges": true,
    "vocab": {"1": 0, "2": 1, "12": 2, "Ġ": 3, "a": 4, "b": 5},
    "merges": ["1 2"]}
})";

TEST_F(TokenizerJsonTest, LoadsALlama3ShapedFile) {
  auto t = Tokenizer::FromTokenizerJson(Write("tokenizer.json", kTinyJson));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->vocab_size(), 8);
  EXPECT_EQ(t->bos_id(), 6);
  EXPECT_TRUE(t->add_bos());
  EXPECT_THAT(EncodeOk(*t, "12 ab"), ElementsAre(6, 2, 3, 4, 5));
  // lstrip: "<mask>" swallows the spaces before it.
  EXPECT_THAT(EncodeOk(*t, "a  <mask>", {.add_special = false}), ElementsAre(4, 7));
  EXPECT_EQ(*t->Decode(std::vector<int32_t>{6, 2, 3, 4}), "<|begin_of_text|>12 a");
}

TEST_F(TokenizerJsonTest, RefusesWhatItCannotDoByName) {
  std::string lowercase = kTinyJson;
  lowercase.replace(lowercase.find("\"normalizer\": null"), 18,
                    R"("normalizer": {"type": "Lowercase"})");
  auto r = Tokenizer::FromTokenizerJson(Write("a.json", lowercase));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(r.status().message(), HasSubstr("Lowercase"));

  std::string unigram = kTinyJson;
  unigram.replace(unigram.find("\"type\": \"BPE\""), 13, R"("type": "Unigram")");
  r = Tokenizer::FromTokenizerJson(Write("b.json", unigram));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(r.status().message(), HasSubstr("Unigram"));

  r = Tokenizer::FromTokenizerJson(Write("c.json", "{not json"));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);

  std::string wrong_type = kTinyJson;
  wrong_type.replace(wrong_type.find("\"ignore_merges\": true"), 21, R"("ignore_merges": "yes")");
  r = Tokenizer::FromTokenizerJson(Write("d.json", wrong_type));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);

  r = Tokenizer::FromTokenizerJson((dir_ / "missing.json").string());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvr::model
