#include "pretokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "tokenizer_utf8.h"

namespace kvr::model::internal {
namespace {

// GPT-2's split rule as Hugging Face tokenizers' ByteLevel pre-tokenizer applies it
// (tokenizers/src/pre_tokenizers/byte_level.rs; the trailing `|\s+` is HF's addition to
// openai/gpt-2 encoder.py so that trailing white space is kept).
constexpr std::string_view kGpt2 =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// SmolLM2 (and StarCoder): tokenizer.json has Sequence[Digits(individual_digits=true),
// ByteLevel(use_regex=true)]; llama.cpp's llama-vocab.cpp maps pre "smollm" to the same two
// steps ("\\p{N}" then the GPT-2 rule). Rust's char::is_numeric, which Digits uses, is \p{N}.
constexpr std::string_view kDigits = R"(\p{N})";

// Llama 3: the Split regex of Meta-Llama-3's tokenizer.json (also transformers'
// integrations/gguf `_LLAMA3_SPLIT` and llama.cpp's LLAMA_VOCAB_PRE_TYPE_LLAMA3 original).
constexpr std::string_view kLlama3 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// Qwen2: the Split regex of Qwen2's tokenizer.json (transformers models/qwen2
// PRETOKENIZE_REGEX; llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2 original). Single digits.
constexpr std::string_view kQwen2 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// Unicode's White_Space property (PropList.txt), the meaning of \s in Oniguruma and Rust.
constexpr std::string_view kWhiteSpaceItems =
    R"(\x{9}-\x{d}\x{20}\x{85}\x{a0}\x{1680}\x{2000}-\x{200a}\x{2028}\x{2029}\x{202f}\x{205f}\x{3000})";

// Rewrites \s and \S so that PCRE2 matches exactly White_Space (see RegexSplitter::Compile).
absl::StatusOr<std::string> AdaptPattern(std::string_view pattern) {
  std::string out;
  out.reserve(pattern.size() * 2);
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[i + 1];
      ++i;
      if (e == 's') {
        if (in_class) {
          out.append(kWhiteSpaceItems.data(), kWhiteSpaceItems.size());
        } else {
          absl::StrAppend(&out, "[", Av(kWhiteSpaceItems), "]");
        }
      } else if (e == 'S') {
        if (in_class) {
          return absl::UnimplementedError(
              absl::StrCat("pre-tokenizer regex uses \\S inside a character class: ", Av(pattern)));
        }
        absl::StrAppend(&out, "[^", Av(kWhiteSpaceItems), "]");
      } else {
        out.push_back('\\');
        out.push_back(e);
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out.push_back(c);
      // A ']' right after '[' or '[^' is a literal, not the end of the class.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out.push_back(pattern[++i]);
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out.push_back(pattern[++i]);
      continue;
    }
    if (in_class && c == ']') in_class = false;
    out.push_back(c);
  }
  return out;
}

}  // namespace

struct RegexSplitter::Code {
  pcre2_code* code = nullptr;
  ~Code() { pcre2_code_free(code); }
};

RegexSplitter::RegexSplitter(std::string pattern, std::unique_ptr<Code> code)
    : pattern_(std::move(pattern)), code_(std::move(code)) {}
RegexSplitter::RegexSplitter(RegexSplitter&&) noexcept = default;
RegexSplitter& RegexSplitter::operator=(RegexSplitter&&) noexcept = default;
RegexSplitter::~RegexSplitter() = default;

absl::StatusOr<RegexSplitter> RegexSplitter::Compile(std::string_view pattern) {
  auto adapted = AdaptPattern(pattern);
  if (!adapted.ok()) return adapted.status();
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  auto code = std::make_unique<Code>();
  code->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(adapted->data()), adapted->size(),
                             PCRE2_UTF | PCRE2_UCP, &error_code, &error_offset, nullptr);
  if (code->code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error_code, message, sizeof(message));
    return absl::InvalidArgumentError(absl::StrCat(
        "pre-tokenizer regex does not compile (", reinterpret_cast<const char*>(message),
        " at offset ", error_offset, "): ", Av(pattern)));
  }
  // JIT is an optimisation only: when it is unavailable pcre2_match interprets the pattern.
  (void)pcre2_jit_compile(code->code, PCRE2_JIT_COMPLETE);
  return RegexSplitter(std::string(pattern), std::move(code));
}

absl::Status RegexSplitter::Split(std::string_view text, std::vector<std::string_view>& out) const {
  if (text.empty()) return absl::OkStatus();
  pcre2_match_data* match = pcre2_match_data_create_from_pattern(code_->code, nullptr);
  if (match == nullptr) return absl::ResourceExhaustedError("pcre2_match_data_create failed");
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t gap_start = 0;  // end of the previous match
  size_t pos = 0;
  absl::Status status;
  while (pos < text.size()) {
    int rc =
        pcre2_match(code_->code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, match, nullptr);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
      // Very long runs can exhaust the JIT's 32 KiB stack; the interpreter uses the heap.
      rc = pcre2_match(code_->code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT,
                       match, nullptr);
    }
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof(message));
      status = absl::InternalError(absl::StrCat("pre-tokenizer regex match failed: ",
                                                reinterpret_cast<const char*>(message)));
      break;
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match);
    const size_t begin = ovector[0];
    const size_t end = ovector[1];
    if (end == begin) {
      // Empty match: nothing to emit; step over one character so the scan progresses.
      pos = begin + Utf8SequenceLength(static_cast<uint8_t>(text[begin]));
      continue;
    }
    if (begin > gap_start) out.push_back(text.substr(gap_start, begin - gap_start));
    out.push_back(text.substr(begin, end - begin));
    gap_start = end;
    pos = end;
  }
  if (status.ok() && gap_start < text.size()) out.push_back(text.substr(gap_start));
  pcre2_match_data_free(match);
  return status;
}

std::string_view PreTokenizer::Gpt2Pattern() { return kGpt2; }
std::string_view PreTokenizer::DigitsPattern() { return kDigits; }

absl::StatusOr<PreTokenizer> PreTokenizer::FromPatterns(const std::vector<std::string>& patterns) {
  PreTokenizer result;
  for (const std::string& pattern : patterns) {
    auto step = RegexSplitter::Compile(pattern);
    if (!step.ok()) return step.status();
    result.steps_.push_back(std::move(*step));
  }
  return result;
}

absl::StatusOr<PreTokenizer> PreTokenizer::ForGgufPre(std::string_view pre,
                                                      std::string& canonical_name,
                                                      bool& ignore_merges) {
  // Names as llama.cpp's convert_hf_to_gguf.py writes them (llama-vocab.cpp lists the same
  // families). An absent/"default" value on a gpt2 model gets GPT-2's rule, as transformers does.
  ignore_merges = false;
  std::vector<std::string> patterns;
  if (pre.empty() || pre == "default" || pre == "gpt2" || pre == "gpt-2" || pre == "mpt" ||
      pre == "olmo" || pre == "jais") {
    canonical_name = "gpt2";
    patterns = {std::string(kGpt2)};
  } else if (pre == "smollm" || pre == "starcoder" || pre == "refact" || pre == "command-r" ||
             pre == "codeshell" || pre == "exaone" || pre == "minerva-7b") {
    canonical_name = "smollm";
    patterns = {std::string(kDigits), std::string(kGpt2)};
  } else if (pre == "llama3" || pre == "llama-v3" || pre == "llama-bpe" || pre == "falcon3" ||
             pre == "dbrx" || pre == "smaug-bpe") {
    canonical_name = "llama3";
    patterns = {std::string(kLlama3)};
    // Llama 3's tokenizer.json sets "ignore_merges": true; llama.cpp does the same for this
    // pre-tokenizer type.
    ignore_merges = true;
  } else if (pre == "qwen2" || pre == "deepseek-r1-qwen" || pre == "stablelm2") {
    canonical_name = "qwen2";
    patterns = {std::string(kQwen2)};
  } else {
    return absl::UnimplementedError(
        absl::StrCat("tokenizer.ggml.pre \"", Av(pre),
                     "\" is not supported (known: gpt2, smollm, llama-bpe/llama3, qwen2 and "
                     "their aliases)"));
  }
  return FromPatterns(patterns);
}

absl::Status PreTokenizer::Split(std::string_view text, std::vector<std::string_view>& out) const {
  if (steps_.empty()) {
    if (!text.empty()) out.push_back(text);
    return absl::OkStatus();
  }
  std::vector<std::string_view> current{text};
  std::vector<std::string_view> next;
  for (size_t s = 0; s < steps_.size(); ++s) {
    std::vector<std::string_view>& target = s + 1 == steps_.size() ? out : next;
    for (std::string_view piece : current) {
      if (auto status = steps_[s].Split(piece, target); !status.ok()) return status;
    }
    if (s + 1 < steps_.size()) {
      current.swap(next);
      next.clear();
    }
  }
  return absl::OkStatus();
}

}  // namespace kvr::model::internal
