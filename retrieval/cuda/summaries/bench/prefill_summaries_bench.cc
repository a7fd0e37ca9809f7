// Prefill with retrieval summaries built on the GPU (prefill_summaries.h, the model's per-layer
// build hook), random bf16 weights generated on the GPU: one prefill per summary method, in one
// run:
//   prefill_summaries_bench --prefill 8192,32768 --summaries none,quest,keydiff,clusterkv,clusterkv-it3
//       [--serial] [--reps 3]
// each prefill one chunk whose per-layer summary build runs on a side stream (and, with
// --serial, again with the builds on the main stream); columns: wall time (best of the timed
// reps, methods interleaved within each rep), overhead vs 'none' of the same run, the builds'
// own GPU time (sum over layers of each build's span on its stream, CUDA events), the host
// time of the clusterkv plans, and the 5% target. "clusterkv-itN": N k-means iterations.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "kvr/model/cuda_model.h"
#include "kvr/model/dummy.h"
#include "kvr/retrieval/cuda/prefill_summaries.h"

namespace kvr::retrieval::cuda {
namespace {

struct Flags {
  std::string shape = "llama3-8b";
  int layers = 0;
  std::vector<int64_t> prefill = {8192, 32768};
  std::vector<std::string> summaries = {"none", "quest", "keydiff", "clusterkv"};
  bool serial = false;
  int reps = 3;          // rep 0 warms up
  int64_t budget = 256;  // IndexParams budget (its default; clusterkv C0 from it)
};

void Fail(const absl::Status& s, const char* what) {
  if (s.ok()) return;
  std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
  std::exit(1);
}

double Seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// "none" -> empty method.
absl::StatusOr<PrefillSummaryOptions> ParseSummary(const std::string& name, int64_t budget) {
  PrefillSummaryOptions o;
  o.params.budget = budget;
  if (name == "none") return o;
  if (name == "quest" || name == "keydiff" || name == "clusterkv") {
    o.method = name;
  } else if (name.rfind("clusterkv-it", 0) == 0) {
    o.method = "clusterkv";
    o.params.clusterkv.max_iterations = std::atoi(name.c_str() + 12);
    if (o.params.clusterkv.max_iterations < 1) return absl::InvalidArgumentError(name);
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown summary method '", name,
        "' (none, quest, keydiff, clusterkv, clusterkv-itN; ctkvr is not offered in prefill)"));
  }
  return o;
}

int Run(const Flags& f) {
  auto config = model::DummyConfig(f.shape, f.layers);
  Fail(config.status(), "config");
  const model::ModelConfig& c = *config;
  model::CudaModelOptions options;
  options.max_batch_tokens = *std::max_element(f.prefill.begin(), f.prefill.end());
  options.max_sequences = 1;
  auto model_or = model::CreateCudaModelWithRandomWeights(c, 1, options);
  Fail(model_or.status(), "CreateCudaModelWithRandomWeights");
  model::CudaModel& model = **model_or;
  auto builders = PrefillSummaryBuilders::Create(c, options.device);
  Fail(builders.status(), "PrefillSummaryBuilders");
  std::printf("shape %s: %d layers, %.2f GB of bf16 weights on the GPU\n", f.shape.c_str(),
              c.n_layers, model.weight_bytes() / 1e9);
  struct Row {
    std::string name;
    PrefillSummaryOptions opt;
    double best = 1e30, build_ms = 0, plan_ms = 0;
  };
  std::printf("\nprefill with summary building (one sequence, one chunk, logits of the last token;"
              " best of %d reps, methods interleaved; budget %lld)\n",
              f.reps - 1, static_cast<long long>(f.budget));
  std::printf("%7s %-15s %-6s %10s %9s %9s %9s %8s %8s\n", "tokens", "summaries", "stream",
              "time_ms", "overhead", "build_ms", "hidden", "plan_ms", "<=5%");
  model::SequenceId next_id = 1000000;
  for (int64_t t : f.prefill) {
    std::vector<Row> rows;
    for (const std::string& name : f.summaries) {
      auto o = ParseSummary(name, f.budget);
      Fail(o.status(), "--summaries");
      o->side_stream = true;
      rows.push_back({name, *o});
      if (f.serial && !o->method.empty()) {
        o->side_stream = false;
        rows.push_back({name, *o});
      }
    }
    const std::vector<int32_t> tokens(t, 1000);
    std::vector<float> logits(c.vocab);
    for (int rep = 0; rep < f.reps; ++rep) {
      for (Row& r : rows) {
        const model::SequenceId id = next_id++;
        std::unique_ptr<PrefillSummaryBuilder> builder;
        if (!r.opt.method.empty()) {
          auto made = (*builders)->ForSequence(r.opt, t);
          Fail(made.status(), "ForSequence");
          builder = *std::move(made);
        }
        Fail(model.AddSequence(id, t, std::move(builder)), "AddSequence");
        model::CudaSequence s{id, tokens};
        s.build = true;
        const auto t0 = std::chrono::steady_clock::now();
        Fail(model.Forward(std::span(&s, 1), model::LogitsMode::kLast, logits), "Forward");
        const double sec = Seconds(t0, std::chrono::steady_clock::now());
        if (rep > 0 && sec < r.best) {
          r.best = sec;
          r.build_ms = model.last_build_ms();
          r.plan_ms = model.last_build_plan_ms();
        }
        Fail(model.ReleaseSequence(id), "ReleaseSequence");
      }
    }
    const double none_ms = rows[0].name == "none" ? rows[0].best * 1e3 : 0;
    for (const Row& r : rows) {
      const double ms = r.best * 1e3;
      const double over = none_ms > 0 ? ms / none_ms - 1 : 0;
      const bool is_none = r.opt.method.empty();
      // hidden: the share of the builds' own GPU time that did not show up in the wall time.
      const double hidden = r.build_ms > 0 ? 1 - (ms - none_ms) / r.build_ms : 0;
      std::printf("%7lld %-15s %-6s %10.1f %8.2f%% %9.2f %8.0f%% %8.2f %8s\n",
                  static_cast<long long>(t), r.name.c_str(),
                  is_none ? "-" : (*r.opt.side_stream ? "side" : "main"), ms, 100 * over,
                  r.build_ms, 100 * hidden, r.plan_ms,
                  is_none || none_ms == 0 ? "-" : (over <= 0.05 ? "met" : "MISSED"));
    }
  }
  std::printf("(ctkvr: not built during prefill, its queries are not kept; see model/cuda/README.md)\n");
  return 0;
}

}  // namespace
}  // namespace kvr::retrieval::cuda

int main(int argc, char** argv) {
  kvr::retrieval::cuda::Flags f;
  CLI::App app{"Prefill with GPU retrieval summaries (random bf16 weights)"};
  app.add_option("--shape", f.shape, "dummy shape (dummy.h)");
  app.add_option("--layers", f.layers, "override the shape's layer count (0: all)");
  app.add_option("--prefill", f.prefill, "prompt lengths to time")->delimiter(',');
  app.add_option("--summaries", f.summaries,
                 "summary methods to time (none first: the overhead's base)")
      ->delimiter(',');
  app.add_flag("--serial", f.serial, "also run the builds on the main stream");
  app.add_option("--reps", f.reps, "prefills per method (the first warms up)");
  app.add_option("--budget", f.budget, "selection budget (clusterkv's C0 default)");
  CLI11_PARSE(app, argc, argv);
  return kvr::retrieval::cuda::Run(f);
}
