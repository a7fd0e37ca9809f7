// Greedy-token agreement of kvr's CPU path with another implementation's greedy decoding of
// the same prompts (model/bench/greedy_vs_llamacpp.sh feeds it llama.cpp's, from
// llamacpp_greedy.cc). kvr is teacher-forced on the other side's tokens: at every step it
// predicts from the same context, and where its argmax differs both top-2 gaps are printed
// (a near tie is a flip any approximation may make; a large gap would be a real divergence).
//
//   model_greedy_agreement --model GGUF --prompts PROMPTS --reference LINES
//                          [--weights packed|float32] [--kv-dtype f16|f32] [--threads 0]
//     PROMPTS: one prompt per line, token ids separated by spaces.
//     LINES: per prompt, the reference's greedy tokens, "|", and its top-2 gap per step.

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "kvr/common/thread_pool.h"
#include "kvr/model/dense_attention.h"
#include "kvr/model/loader.h"
#include "kvr/model/sampler.h"

namespace {

std::vector<std::vector<float>> ReadLines(const std::string& path, bool split_bar,
                                          std::vector<std::vector<float>>* after_bar) {
  std::vector<std::vector<float>> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const size_t bar = split_bar ? line.find('|') : std::string::npos;
    std::istringstream head(line.substr(0, bar));
    std::vector<float>& row = out.emplace_back();
    for (float x; head >> x;) row.push_back(x);
    if (after_bar != nullptr) {
      std::istringstream tail(bar == std::string::npos ? "" : line.substr(bar + 1));
      std::vector<float>& gaps = after_bar->emplace_back();
      for (float x; tail >> x;) gaps.push_back(x);
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "kvr's greedy tokens, teacher-forced on a reference's, and the top-2 gaps where "
      "they differ"};
  std::string model_name, prompts_path, reference_path, weights = "packed", kv_dtype = "f16";
  int threads = 0;
  app.add_option("--model", model_name, "GGUF file")->required();
  app.add_option("--prompts", prompts_path, "one prompt of token ids per line")->required();
  app.add_option("--reference", reference_path, "the reference's tokens | gaps per prompt")
      ->required();
  app.add_option("--weights", weights, "packed|float32")->capture_default_str();
  app.add_option("--kv-dtype", kv_dtype, "f16|f32")->capture_default_str();
  app.add_option("--threads", threads, "pool threads (0 = all cores)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  kvr::ThreadPool pool(threads > 0 ? threads : 0);
  kvr::model::LoadOptions options;
  auto storage = kvr::model::ParseWeightStorage(weights);
  auto kv = kvr::model::ParseKvDType(kv_dtype);
  if (!storage.ok() || !kv.ok()) return std::fprintf(stderr, "bad --weights or --kv-dtype\n"), 2;
  options.weights = *storage;
  options.kv_dtype = *kv;
  auto loaded = kvr::model::LoadModel(model_name, options, &pool);
  if (!loaded.ok()) return std::fprintf(stderr, "%s\n", loaded.status().ToString().c_str()), 1;
  const kvr::model::Model& model = *loaded->model;

  const auto prompts = ReadLines(prompts_path, false, nullptr);
  std::vector<std::vector<float>> ref_gaps;
  const auto ref_tokens = ReadLines(reference_path, true, &ref_gaps);
  if (ref_tokens.size() != prompts.size()) {
    return std::fprintf(stderr, "%zu prompts, %zu reference lines\n", prompts.size(),
                        ref_tokens.size()),
           2;
  }
  int steps = 0, agree = 0;
  for (size_t p = 0; p < prompts.size(); ++p) {
    std::vector<int32_t> ids(prompts[p].begin(), prompts[p].end());
    kvr::model::KvCache cache = model.NewCache();
    kvr::model::DenseAttention attention(&pool);
    auto logits = model.Prefill(0, cache, ids, attention);
    if (!logits.ok()) return std::fprintf(stderr, "%s\n", logits.status().ToString().c_str()), 1;
    std::vector<float> step = *logits;
    int prompt_agree = 0;
    for (size_t s = 0; s < ref_tokens[p].size(); ++s) {
      const int32_t ref = static_cast<int32_t>(ref_tokens[p][s]);
      const int32_t mine = kvr::model::ArgMax(step);
      ++steps;
      if (mine == ref) {
        ++agree, ++prompt_agree;
      } else {
        std::printf(
            "prompt %zu step %zu: reference %d (top-2 gap %.3f), kvr %d (top-2 gap %.3f, "
            "reference's token %.3f below)\n",
            p, s, ref, s < ref_gaps[p].size() ? ref_gaps[p][s] : -1.f, mine, kvr::model::TopTwoGap(step),
            step[mine] - step[ref]);
      }
      if (s + 1 == ref_tokens[p].size()) break;
      const kvr::model::ForwardSequence seq{0, &cache, std::span(&ref, 1)};
      if (!model.Forward(std::span(&seq, 1), attention, kvr::model::LogitsMode::kLast, step).ok()) {
        return 1;
      }
    }
    std::printf("prompt %zu (%zu tokens): %d / %zu steps agree\n", p, ids.size(), prompt_agree,
                ref_tokens[p].size());
  }
  std::printf(
      "greedy agreement, kvr (%s weights, %s KV) teacher-forced on the reference: %d / %d "
      "steps\n",
      weights.c_str(), kv_dtype.c_str(), agree, steps);
  return 0;
}
