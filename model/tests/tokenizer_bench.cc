// Encode throughput of the SmolLM2 tokenizer on a long text (the reference fixture's strings
// joined), single thread. Prints tokens/s for a cold word cache and a warm one.
//
//   build-*/model/tokenizer_bench [repeats]

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "kvr/common/paths.h"
#include "kvr/model/tokenizer.h"
#include "tokenizer_test_util.h"

int main(int argc, char** argv) {
  using kvr::model::Tokenizer;
  const int repeats = argc > 1 ? std::atoi(argv[1]) : 5;
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
  for (int pass = 0; pass < 2; ++pass) {
    // A fresh tokenizer per measurement so that the first pass starts with an empty cache.
    auto tokenizer = Tokenizer::FromGgufMetadata(*spec);
    if (!tokenizer.ok()) {
      std::fprintf(stderr, "%s\n", tokenizer.status().ToString().c_str());
      return 1;
    }
    const int runs = pass == 0 ? 1 : repeats;
    if (pass == 1) (void)tokenizer->Encode(text);  // warm the word cache
    size_t tokens = 0;
    const auto start = std::chrono::steady_clock::now();
    for (int r = 0; r < runs; ++r) {
      auto ids = tokenizer->Encode(text, {.add_special = false, .parse_special = true});
      if (!ids.ok()) return 1;
      tokens += ids->size();
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("%s cache: %zu bytes -> %zu tokens per run, %.2f M tokens/s, %.1f MB/s\n",
                pass == 0 ? "cold" : "warm", text.size(), tokens / runs, tokens / seconds / 1e6,
                text.size() * double(runs) / seconds / 1e6);
  }
  return 0;
}
