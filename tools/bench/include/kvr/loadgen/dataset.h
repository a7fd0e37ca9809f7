#pragma once
// The prompts `kvr bench` sends: synthetic long documents, passkey-retrieval tasks (scored by
// whether the answer contains the key), JSONL files and ShareGPT conversations (the JSON that
// `vllm bench serve --dataset-name sharegpt` reads).

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

struct ShareGptOptions {
  // Every prompt's max_tokens; nullopt: the token length of the conversation's reply (as
  // vLLM's --sharegpt-output-len).
  std::optional<uint32_t> output_len;
  // vLLM's limits on a sampled pair (benchmarks/datasets.py, is_valid_sequence): prompt and
  // reply at least `min_len` tokens (the reply's check is skipped with a fixed output_len),
  // the prompt at most `max_prompt_len`, prompt + reply at most `max_total_len`.
  uint32_t min_len = 4;
  uint32_t max_prompt_len = 1024;
  uint32_t max_total_len = 2048;
  uint64_t seed = 0;  // the order conversations are sampled in
};

// ShareGPT JSON (e.g. ShareGPT_V3_unfiltered_cleaned_split.json): an array of
// {"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}, ...]}.
// Sampled as vLLM does: the entries are shuffled (seeded), those with fewer than two turns are
// skipped, the first turn's value is the prompt (sent as text: a chat backend wraps it in a
// user message) and the second's length its max_tokens; pairs outside the limits above are
// skipped; sampling stops after `max_prompts`. Errors are InvalidArgument naming
// `source_name`, the entry's index and what was wrong (an entry or turn of the wrong shape),
// or that no conversation fit the limits.
[[nodiscard]] absl::StatusOr<std::vector<Prompt>> ParseShareGpt(
    std::string_view json_text, const std::string& source_name, size_t max_prompts,
    const ShareGptOptions& options, const TokenCounter& counter = nullptr);
[[nodiscard]] absl::StatusOr<std::vector<Prompt>> LoadShareGpt(
    const std::string& path, size_t max_prompts, const ShareGptOptions& options,
    const TokenCounter& counter = nullptr);

// Whether `generated` answers the passkey prompt (contains its key).
bool PasskeyAnswered(const Prompt& prompt, std::string_view generated);

}  // namespace kvr::loadgen
