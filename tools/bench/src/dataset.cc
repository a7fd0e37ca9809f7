#include "kvr/loadgen/dataset.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <iterator>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "kvr/common/status.h"
#include "nlohmann/json.hpp"

namespace kvr::loadgen {
namespace {

// Common English words: most are one token in byte-level BPE vocabularies, so a word count is
// a fair estimate of the token count when no tokenizer is given.
constexpr std::array<const char*, 96> kWords = {
    "the",    "of",      "and",      "to",    "in",     "is",      "that",  "for",    "it",
    "as",     "was",     "with",     "be",    "by",     "on",      "not",   "he",     "this",
    "are",    "or",      "his",      "from",  "at",     "which",   "but",   "have",   "an",
    "had",    "they",    "you",      "were",  "their",  "one",     "all",   "we",     "can",
    "her",    "has",     "there",    "been",  "if",     "more",    "when",  "will",   "would",
    "who",    "so",      "no",       "time",  "people", "year",    "way",   "day",    "man",
    "thing",  "woman",   "life",     "child", "world",  "school",  "state", "family", "student",
    "group",  "country", "problem",  "hand",  "part",   "place",   "case",  "week",   "company",
    "system", "program", "question", "work",  "number", "night",   "point", "home",   "water",
    "room",   "mother",  "area",     "money", "story",  "fact",    "month", "lot",    "right",
    "study",  "book",    "eye",      "job",   "word",   "business"};

uint32_t WordCount(std::string_view text) {
  uint32_t n = 0;
  bool in_word = false;
  for (char c : text) {
    const bool space = absl::ascii_isspace(static_cast<unsigned char>(c));
    if (!space && !in_word) ++n;
    in_word = !space;
  }
  return n;
}

absl::StatusOr<uint32_t> Count(const TokenCounter& counter, std::string_view text) {
  if (counter) return counter(text);
  return WordCount(text);
}

uint32_t TargetLength(const GeneratedDatasetOptions& o, std::mt19937_64& rng) {
  const int64_t lo = std::max<int64_t>(1, int64_t{o.input_len} - o.input_len_range);
  const int64_t hi = std::max<int64_t>(lo, int64_t{o.input_len} + o.input_len_range);
  return static_cast<uint32_t>(std::uniform_int_distribution<int64_t>(lo, hi)(rng));
}

// Sentences of random words, as a list of words with their punctuation attached so that a
// prefix of n words is a well-formed document.
std::vector<std::string> RandomWords(size_t n, std::mt19937_64& rng) {
  std::vector<std::string> words;
  words.reserve(n);
  std::uniform_int_distribution<size_t> pick(0, kWords.size() - 1);
  std::uniform_int_distribution<int> sentence_len(6, 16);
  int left = 0;
  for (size_t i = 0; i < n; ++i) {
    std::string w = kWords[pick(rng)];
    if (left == 0) {
      left = sentence_len(rng);
      w[0] = absl::ascii_toupper(static_cast<unsigned char>(w[0]));
    }
    if (--left == 0) w += ".";
    words.push_back(std::move(w));
  }
  return words;
}

std::string JoinPrefix(const std::vector<std::string>& words, size_t n) {
  n = std::min(n, words.size());
  return absl::StrJoin(words.begin(), words.begin() + n, " ");
}

}  // namespace

absl::StatusOr<std::vector<Prompt>> SyntheticPrompts(size_t n,
                                                     const GeneratedDatasetOptions& options,
                                                     const TokenCounter& counter) {
  if (options.input_len == 0) return absl::InvalidArgumentError("input_len must be > 0");
  std::mt19937_64 rng(options.seed);
  std::vector<Prompt> prompts;
  prompts.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t target = TargetLength(options, rng);
    // Twice the words leaves room when the tokenizer merges words; the prefix length is then
    // refined from the measured count (the count is nearly proportional to the words).
    const std::vector<std::string> words = RandomWords(2 * size_t{target} + 16, rng);
    size_t n_words = target;
    Prompt p;
    for (int round = 0; round < 3; ++round) {
      p.text = JoinPrefix(words, n_words);
      KVR_ASSIGN_OR_RETURN(p.approx_tokens, Count(counter, p.text));
      if (p.approx_tokens == target || p.approx_tokens == 0) break;
      n_words = std::max<size_t>(
          1, static_cast<size_t>(std::llround(double(n_words) * target / p.approx_tokens)));
    }
    prompts.push_back(std::move(p));
  }
  return prompts;
}

absl::StatusOr<std::vector<Prompt>> PasskeyPrompts(size_t n, const GeneratedDatasetOptions& options,
                                                   const TokenCounter& counter) {
  if (options.input_len == 0) return absl::InvalidArgumentError("input_len must be > 0");
  // The haystack of the passkey-retrieval task (Mohtashami & Jaggi 2023, also used by the
  // retrieval papers' evaluations).
  constexpr std::string_view kIntro =
      "There is an important piece of information hidden inside a lot of irrelevant text. "
      "Find it and memorize it. I will quiz you about it.";
  constexpr std::string_view kFiller =
      " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
      "again.";
  constexpr std::string_view kQuestion = " What is the pass key? The pass key is";
  KVR_ASSIGN_OR_RETURN(const uint32_t intro_tokens, Count(counter, kIntro));
  KVR_ASSIGN_OR_RETURN(const uint32_t filler_tokens, Count(counter, kFiller));
  KVR_ASSIGN_OR_RETURN(const uint32_t question_tokens, Count(counter, kQuestion));

  std::mt19937_64 rng(options.seed);
  std::uniform_int_distribution<int> digits(10000, 99999);
  std::uniform_real_distribution<double> depth(0.1, 0.9);
  std::vector<Prompt> prompts;
  prompts.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t target = TargetLength(options, rng);
    Prompt p;
    p.passkey = absl::StrCat(digits(rng));
    const std::string needle = absl::StrCat(" The pass key is ", p.passkey, ". Remember it. ",
                                            p.passkey, " is the pass key.");
    KVR_ASSIGN_OR_RETURN(const uint32_t needle_tokens, Count(counter, needle));
    const int64_t room = int64_t{target} - intro_tokens - question_tokens - needle_tokens;
    const int64_t repeats = std::max<int64_t>(1, room / std::max<uint32_t>(1, filler_tokens));
    const int64_t before = std::llround(depth(rng) * repeats);
    std::string text(kIntro);
    for (int64_t r = 0; r < repeats; ++r) {
      if (r == before) text += needle;
      text += kFiller;
    }
    if (before >= repeats) text += needle;
    text += kQuestion;
    p.text = std::move(text);
    KVR_ASSIGN_OR_RETURN(p.approx_tokens, Count(counter, p.text));
    prompts.push_back(std::move(p));
  }
  return prompts;
}

absl::StatusOr<std::vector<Prompt>> ParseJsonl(std::istream& in, const std::string& source_name,
                                               const TokenCounter& counter) {
  std::vector<Prompt> prompts;
  std::string line;
  for (int line_no = 1; std::getline(in, line); ++line_no) {
    if (absl::StripAsciiWhitespace(line).empty()) continue;
    auto fail = [&](std::string_view what) {
      return absl::InvalidArgumentError(
          absl::StrCat(source_name, ":", line_no, ": ", std::string(what)));
    };
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return fail("not valid JSON");
    if (!j.is_object()) return fail("expected a JSON object");
    const bool has_prompt = j.contains("prompt");
    const bool has_messages = j.contains("messages");
    if (has_prompt == has_messages) return fail("needs exactly one of \"prompt\", \"messages\"");
    Prompt p;
    if (has_prompt) {
      if (!j["prompt"].is_string() || j["prompt"].get_ref<const std::string&>().empty()) {
        return fail("\"prompt\" must be a non-empty string");
      }
      p.text = j["prompt"].get<std::string>();
      KVR_ASSIGN_OR_RETURN(p.approx_tokens, Count(counter, p.text));
    } else {
      const nlohmann::json& m = j["messages"];
      if (!m.is_array() || m.empty()) return fail("\"messages\" must be a non-empty array");
      for (size_t k = 0; k < m.size(); ++k) {
        if (!m[k].is_object() || !m[k].contains("role") || !m[k]["role"].is_string() ||
            !m[k].contains("content") || !m[k]["content"].is_string()) {
          return fail(absl::StrCat("messages[", k, "] needs string \"role\" and \"content\""));
        }
        p.messages.push_back({m[k]["role"].get<std::string>(), m[k]["content"].get<std::string>()});
        KVR_ASSIGN_OR_RETURN(const uint32_t t, Count(counter, p.messages.back().content));
        p.approx_tokens += t;
      }
    }
    if (j.contains("max_tokens")) {
      const nlohmann::json& mt = j["max_tokens"];
      if (!mt.is_number_integer() || mt.get<int64_t>() <= 0 ||
          mt.get<int64_t>() > int64_t{UINT32_MAX}) {
        return fail("\"max_tokens\" must be a positive integer");
      }
      p.max_tokens = static_cast<uint32_t>(mt.get<int64_t>());
    }
    prompts.push_back(std::move(p));
  }
  if (prompts.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(source_name, ": no prompts in the file"));
  }
  return prompts;
}

absl::StatusOr<std::vector<Prompt>> LoadJsonl(const std::string& path,
                                              const TokenCounter& counter) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read dataset file ", path));
  return ParseJsonl(in, path, counter);
}

absl::StatusOr<std::vector<Prompt>> ParseShareGpt(std::string_view json_text,
                                                  const std::string& source_name,
                                                  size_t max_prompts,
                                                  const ShareGptOptions& options,
                                                  const TokenCounter& counter) {
  const nlohmann::json j = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded())
    return absl::InvalidArgumentError(absl::StrCat(source_name, ": not valid JSON"));
  if (!j.is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(
        source_name,
        ": expected a JSON array of {\"conversations\": [{\"from\", \"value\"}, ...]}"));
  }
  // The shape of every entry is checked before sampling, so that a malformed file fails
  // whatever the seed.
  for (size_t i = 0; i < j.size(); ++i) {
    auto fail = [&](std::string_view what) {
      return absl::InvalidArgumentError(
          absl::StrCat(source_name, ": entry ", i, ": ", std::string(what)));
    };
    const nlohmann::json& entry = j[i];
    if (!entry.is_object()) return fail("expected an object");
    const auto conversations = entry.find("conversations");
    if (conversations == entry.end() || !conversations->is_array()) {
      return fail("needs a \"conversations\" array");
    }
    for (size_t k = 0; k < conversations->size() && k < 2; ++k) {
      const nlohmann::json& turn = (*conversations)[k];
      if (!turn.is_object() || !turn.contains("value") || !turn["value"].is_string()) {
        return fail(absl::StrCat("conversations[", k, "] needs a string \"value\""));
      }
    }
  }
  std::vector<size_t> order(j.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::mt19937_64 rng(options.seed);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<Prompt> prompts;
  for (const size_t i : order) {
    if (prompts.size() >= max_prompts) break;
    const nlohmann::json& conversations = j[i]["conversations"];
    if (conversations.size() < 2) continue;
    Prompt p;
    p.text = conversations[0]["value"].get<std::string>();
    KVR_ASSIGN_OR_RETURN(p.approx_tokens, Count(counter, p.text));
    uint32_t output_len = 0;
    if (options.output_len) {
      output_len = *options.output_len;
    } else {
      KVR_ASSIGN_OR_RETURN(output_len,
                           Count(counter, conversations[1]["value"].get_ref<const std::string&>()));
    }
    if (p.approx_tokens < options.min_len ||
        (!options.output_len && output_len < options.min_len) ||
        p.approx_tokens > options.max_prompt_len ||
        uint64_t{p.approx_tokens} + output_len > options.max_total_len) {
      continue;
    }
    p.max_tokens = output_len;
    prompts.push_back(std::move(p));
  }
  if (prompts.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source_name, ": no conversation of ", j.size(),
                     " has a prompt and a reply within the limits (two turns; prompt and reply >= ",
                     options.min_len, " tokens, prompt <= ", options.max_prompt_len,
                     ", prompt + reply <= ", options.max_total_len, ")"));
  }
  return prompts;
}

absl::StatusOr<std::vector<Prompt>> LoadShareGpt(const std::string& path, size_t max_prompts,
                                                 const ShareGptOptions& options,
                                                 const TokenCounter& counter) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read dataset file ", path));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return ParseShareGpt(text, path, max_prompts, options, counter);
}

bool PasskeyAnswered(const Prompt& prompt, std::string_view generated) {
  return !prompt.passkey.empty() && generated.find(prompt.passkey) != std::string_view::npos;
}

}  // namespace kvr::loadgen
