#pragma once
// The long-context tasks of `kvr eval endpoint` (RULER-style, Hsieh et al. 2024), each sample
// generated from a seed and fitted to a length in tokens, and the rule that scores an answer.
//
//   niah_single        a 6-7 digit pass key hidden at one depth of a repetitive haystack;
//   niah_multikey      four "special magic numbers" for four keys; asks for one key's;
//   niah_multivalue    four numbers for one key at four depths; asks for all of them;
//   variable_tracking  two chains "VAR A = 12345.", "VAR B = VAR A.", ... in the haystack;
//                      asks which variables equal one chain's value (all five names);
//   common_words       a numbered list of words, one of them far more frequent than any
//                      other; asks for the most common;
//   qa_licenses        a generated fact inserted at one depth of real text (the licence
//                      texts every Debian machine has, /usr/share/common-licenses); asks for it.
//
// Nothing is stored: keys, values, names and depths come from the seed, so a sample is the
// same for the same (seed, task, length, index) and its answer is known. Every prompt is raw
// text (no chat template) that ends with the start of the answer ("... The pass key is"), which
// is what a small model completes best, and is at most `target_tokens` by the counter given.

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace kvr::eval_endpoint {

// Counts the tokens of a text (the served model's tokenizer, BOS included where the model
// adds one, so that the count is what the server will report).
using TokenCounter = std::function<absl::StatusOr<uint32_t>(std::string_view)>;

// The task names above, in the order reports list them.
const std::vector<std::string>& TaskNames();

// Where a needle went: its text and its character offset in the prompt.
struct Needle {
  std::string text;
  size_t offset = 0;
  double depth = 0;  // the depth asked for, 0..1 of the haystack
};

struct Sample {
  std::string task;
  uint32_t index = 0;          // the sample's number within (task, length)
  uint32_t target_tokens = 0;  // the most tokens the prompt may have
  uint32_t prompt_tokens = 0;  // the prompt's tokens by the counter
  std::string prompt;
  // The answer's parts; the score is the fraction of them the answer contains (common_words:
  // one word, scored by the first candidate word the answer names).
  std::vector<std::string> answers;
  // common_words: every word of the list, so that the first one named can be told.
  std::vector<std::string> candidates;
  uint32_t max_tokens = 16;  // to generate; enough for the answer and a little more
  // The haystack's character range in the prompt and the needles placed in it (the variable
  // assignments for variable_tracking; none for common_words).
  size_t haystack_begin = 0, haystack_end = 0;
  std::vector<Needle> needles;
};

struct SampleSpec {
  std::string task;
  uint32_t target_tokens = 1024;
  uint64_t seed = 0;
  uint32_t index = 0;
  // qa_licenses: the lines of the text to hide the fact in (ReadCorpus), not empty.
  const std::vector<std::string>* corpus = nullptr;
};

// One sample. InvalidArgument for an unknown task, a missing corpus, or a target too short to
// hold the task's frame, question and needles; the counter's errors as they are.
[[nodiscard]] absl::StatusOr<Sample> GenerateSample(const SampleSpec& spec,
                                                    const TokenCounter& counter);

// The non-empty lines of the regular files in `dir`, files in name order, each file once
// (symlinks to a file already read are skipped: GPL -> GPL-3). `names` gets the files read.
// NotFound when the folder has no readable text.
[[nodiscard]] absl::StatusOr<std::vector<std::string>> ReadCorpus(
    const std::string& dir, std::vector<std::string>* names = nullptr);

// The sample's score of `answer`, 0..1: the fraction of `answers` found in it as whole words
// (case-insensitive; a number must be a whole run of digits, so 123456 is not in 1234567);
// common_words: 1 when the first of `candidates` the answer names is the answer, else 0.
double Score(const Sample& sample, std::string_view answer);

// The answer normalised for comparing two runs' answers: whitespace runs as one space, none at
// either end.
std::string NormalizeAnswer(std::string_view answer);

}  // namespace kvr::eval_endpoint
