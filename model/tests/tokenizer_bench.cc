// Encode throughput of the SmolLM2 tokenizer on a long text (the reference fixture's strings
// joined: mixed scripts, code, numbers, special tokens), one thread. Prints the best of N runs
// for a cold word cache (a fresh tokenizer per run) and a warm one.
//
//   build-*/model/tokenizer_bench [runs]

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "kvr/common/paths.h"
#include "kvr/model/tokenizer.h"
#include "tokenizer_test_util.h"

namespace {

double Seconds(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  using kvr::model::Tokenizer;
  const int runs = argc > 1 ? std::max(1, std::atoi(argv[1])) : 5;
  auto spec = kvr::model::testing::ReadTokenizerSpec(kvr::TestModelPath());
  auto fixture = kvr::model::testing::ReadReferenceFixture();
  if (!spec.ok() || !fixture.ok()) {
    std::fprintf(stderr, "setup failed: %s / %s\n", spec.status().ToString().c_str(),
                 fixture.status().ToString().c_str());
    return 1;
  }
  std::string text;
  for (const auto& c : (*fixture)["cases"]) {
    text += c["text"].get<std::string>();
    text += "\n";
  }
  const kvr::model::EncodeOptions options{.add_special = false, .parse_special = true};
  size_t tokens = 0;
  double best_cold = 1e30, best_warm = 1e30, best_build = 1e30;
  for (int r = 0; r < runs; ++r) {
    auto build_start = std::chrono::steady_clock::now();
    auto tokenizer = Tokenizer::FromGgufMetadata(*spec);
    best_build = std::min(best_build, Seconds(build_start));
    if (!tokenizer.ok()) {
      std::fprintf(stderr, "%s\n", tokenizer.status().ToString().c_str());
      return 1;
    }
    auto start = std::chrono::steady_clock::now();
    auto ids = tokenizer->Encode(text, options);
    best_cold = std::min(best_cold, Seconds(start));
    if (!ids.ok()) return 1;
    tokens = ids->size();
    start = std::chrono::steady_clock::now();
    ids = tokenizer->Encode(text, options);
    best_warm = std::min(best_warm, Seconds(start));
  }
  std::printf("building the tokenizer (%zu tokens, %zu merges): %.1f ms\n", spec->tokens.size(),
              spec->merges.size(), best_build * 1e3);
  for (auto [name, seconds] : {std::pair{"cold", best_cold}, std::pair{"warm", best_warm}}) {
    std::printf(
        "%s word cache: %zu bytes -> %zu tokens in %.1f ms: %.2f M tokens/s, %.1f MB/s "
        "(best of %d)\n",
        name, text.size(), tokens, seconds * 1e3, tokens / seconds / 1e6,
        text.size() / seconds / 1e6, runs);
  }
  return 0;
}
