#pragma once
// Pre-tokenizers: the regex rules that cut text into words before BPE (internal header).

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvr::model::internal {

// One compiled PCRE2 pattern (UTF + UCP, JIT when available). Move-only owner of the code.
class RegexSplitter {
 public:
  // `pattern` is in the Oniguruma/Rust dialect of tokenizer.json; \s and \S are rewritten to
  // Unicode's White_Space set, which is what Hugging Face's engines use (PCRE2 10.42's \s
  // also matches U+180E, which Unicode no longer counts as white space).
  [[nodiscard]] static absl::StatusOr<RegexSplitter> Compile(std::string_view pattern);

  RegexSplitter(RegexSplitter&&) noexcept;
  RegexSplitter& operator=(RegexSplitter&&) noexcept;
  RegexSplitter(const RegexSplitter&) = delete;
  RegexSplitter& operator=(const RegexSplitter&) = delete;
  ~RegexSplitter();

  // Appends the pieces of `text` to `out` with Hugging Face's "Isolated" behaviour: every
  // match is a piece and so is every non-empty gap between matches. `text` must be valid
  // UTF-8 (checked once by the caller).
  [[nodiscard]] absl::Status Split(std::string_view text, std::vector<std::string_view>& out) const;

  const std::string& pattern() const { return pattern_; }

 private:
  struct Code;
  RegexSplitter(std::string pattern, std::unique_ptr<Code> code);
  std::string pattern_;
  std::unique_ptr<Code> code_;
};

// A sequence of splitting steps; each step splits every piece the previous step produced.
class PreTokenizer {
 public:
  // The pre-tokenizer of a GGUF `tokenizer.ggml.pre` value. Sets `canonical_name` ("gpt2",
  // "smollm", "llama3", "qwen2") and `ignore_merges` (llama3 looks whole words up in the
  // vocabulary before merging). Unimplemented for names kvr does not know.
  [[nodiscard]] static absl::StatusOr<PreTokenizer> ForGgufPre(std::string_view pre,
                                                               std::string& canonical_name,
                                                               bool& ignore_merges);
  // Steps given as patterns (from tokenizer.json).
  [[nodiscard]] static absl::StatusOr<PreTokenizer> FromPatterns(
      const std::vector<std::string>& patterns);

  // Regexes of the known families, exposed for tokenizer.json loading.
  static std::string_view Gpt2Pattern();
  static std::string_view DigitsPattern();

  [[nodiscard]] absl::Status Split(std::string_view text, std::vector<std::string_view>& out) const;

  size_t num_steps() const { return steps_.size(); }

 private:
  std::vector<RegexSplitter> steps_;
};

}  // namespace kvr::model::internal
