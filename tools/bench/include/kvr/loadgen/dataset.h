#pragma once
// The prompts `kvr bench` sends: synthetic long documents, passkey-retrieval tasks (scored by
// whether the answer contains the key) and JSONL files.

#include <cstdint>
#include <functional>
#include <istream>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace kvr::loadgen {

struct ChatTurn {
  std::string role;
  std::string content;
};

struct Prompt {
  // Exactly one of `text` / `messages` is used: messages when not empty.
  std::string text;
  std::vector<ChatTurn> messages;
  // Per-prompt output length (JSONL "max_tokens"); nullopt: the run's --output-len.
  std::optional<uint32_t> max_tokens;
  // The client's estimate of the prompt's tokens (tokenizer count, else words); the server's
  // count replaces it in the results when it reports one.
  uint32_t approx_tokens = 0;
  // Passkey prompts: the key the answer must contain.
  std::string passkey;
};

// Counts the tokens of a text (the model's tokenizer). Optional everywhere: without it a
// word (or a chat message's words) counts as one token.
using TokenCounter = std::function<absl::StatusOr<uint32_t>(std::string_view)>;

struct GeneratedDatasetOptions {
  uint32_t input_len = 1024;     // target tokens per prompt
  uint32_t input_len_range = 0;  // each prompt's target is uniform in input_len +- this
  uint64_t seed = 0;
};

// `n` documents of random English words in sentences, each close to its target length.
[[nodiscard]] absl::StatusOr<std::vector<Prompt>> SyntheticPrompts(
    size_t n, const GeneratedDatasetOptions& options, const TokenCounter& counter = nullptr);

// `n` passkey-retrieval prompts (a repetitive haystack with "The pass key is NNNNN." at a
// random depth, then the question), each close to its target length.
[[nodiscard]] absl::StatusOr<std::vector<Prompt>> PasskeyPrompts(
    size_t n, const GeneratedDatasetOptions& options, const TokenCounter& counter = nullptr);

// One JSON object per line: {"prompt": "..."} or {"messages": [{"role", "content"}, ...]},
// optional "max_tokens" (positive integer). Blank lines are skipped. Errors are
// InvalidArgument naming `source_name`, the line number and what was wrong.
[[nodiscard]] absl::StatusOr<std::vector<Prompt>> ParseJsonl(std::istream& in,
                                                             const std::string& source_name,
                                                             const TokenCounter& counter = nullptr);
[[nodiscard]] absl::StatusOr<std::vector<Prompt>> LoadJsonl(const std::string& path,
                                                            const TokenCounter& counter = nullptr);

// Whether `generated` answers the passkey prompt (contains its key).
bool PasskeyAnswered(const Prompt& prompt, std::string_view generated);

}  // namespace kvr::loadgen
