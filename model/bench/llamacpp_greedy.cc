// llama.cpp's own greedy decoding of token-id prompts, with the top-2 logit gap of every step:
// the other side of `model_greedy_agreement` (model/bench/greedy_vs_llamacpp.sh builds this
// file against a llama.cpp build; it is not part of kvr's build, which does not depend on
// llama.cpp).
//
//   llamacpp_greedy MODEL.gguf PROMPTS STEPS THREADS
//     PROMPTS: one prompt per line, token ids separated by spaces.
//   Prints one line per prompt: the STEPS greedy tokens, then "|", then each step's top-2 gap.

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "llama.h"

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s MODEL PROMPTS STEPS THREADS\n", argv[0]);
    return 2;
  }
  const int steps = std::atoi(argv[3]), threads = std::atoi(argv[4]);
  llama_backend_init();
  llama_model* model = llama_model_load_from_file(argv[1], llama_model_default_params());
  if (model == nullptr) return 1;
  const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
  std::ifstream in(argv[2]);
  std::string line;
  while (std::getline(in, line)) {
    std::vector<llama_token> prompt;
    std::istringstream ids(line);
    for (llama_token t; ids >> t;) prompt.push_back(t);
    if (prompt.empty()) continue;
    llama_context_params cp = llama_context_default_params();  // f16 KV cache by default
    cp.n_ctx = static_cast<uint32_t>(prompt.size() + steps + 16);
    cp.n_batch = cp.n_ctx;
    cp.n_threads = cp.n_threads_batch = threads;
    llama_context* ctx = llama_init_from_model(model, cp);
    if (ctx == nullptr) return 1;
    std::vector<llama_token> out;
    std::vector<float> gaps;
    llama_batch batch = llama_batch_get_one(prompt.data(), static_cast<int32_t>(prompt.size()));
    llama_token next = 0;
    for (int s = 0; s < steps; ++s) {
      if (llama_decode(ctx, batch) != 0) return 1;
      const float* logits = llama_get_logits_ith(ctx, -1);
      float first = -1e30f, second = -1e30f;
      for (int i = 0; i < n_vocab; ++i) {
        if (logits[i] > first) {
          second = first;
          first = logits[i];
          next = i;
        } else if (logits[i] > second) {
          second = logits[i];
        }
      }
      out.push_back(next);
      gaps.push_back(first - second);
      batch = llama_batch_get_one(&next, 1);
    }
    for (llama_token t : out) std::printf("%d ", t);
    std::printf("|");
    for (float g : gaps) std::printf(" %.4f", g);
    std::printf("\n");
    llama_free(ctx);
  }
  llama_model_free(model);
  return 0;
}
