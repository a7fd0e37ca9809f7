// Encoding speed of scaled fp8 rows (kvr/common/fp8.h) on this CPU: what the KV store spends on
// every row written to an fp8 sequence. Prints M values/s of EncodeFp8Row (the store's call)
// and of the same rows encoded one value at a time with FloatToFp8E4m3 (the scalar path that
// EncodeFp8's vector body must equal), best of --repeats, on Gaussian rows.
//   fp8_encode_bench [--head-dim 64] [--rows 262144] [--repeats 5]

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include <CLI/CLI.hpp>

#include "kvr/common/fp8.h"

namespace {

template <typename F>
double BestSeconds(int repeats, F&& f) {
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("fp8 row encoding speed (kvr/common/fp8.h)");
  int head_dim = 64, rows = 1 << 18, repeats = 5;
  app.add_option("--head-dim", head_dim, "values per K (and per V) vector")->capture_default_str();
  app.add_option("--rows", rows, "rows [k | v] encoded per run")->capture_default_str();
  app.add_option("--repeats", repeats, "runs, best kept")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  const kvr::Fp8RowLayout layout{2, head_dim};
  const size_t row_values = 2 * static_cast<size_t>(head_dim);
  std::vector<float> x(static_cast<size_t>(rows) * row_values);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (float& v : x) v = normal(rng);
  std::vector<uint8_t> out(static_cast<size_t>(rows) * layout.RowBytes());
  const double rows_s = BestSeconds(repeats, [&] {
    for (int r = 0; r < rows; ++r) {
      kvr::EncodeFp8Row(layout, x.data() + r * row_values, out.data() + r * layout.RowBytes());
    }
  });
  const double scalar_s = BestSeconds(repeats, [&] {
    for (int r = 0; r < rows; ++r) {
      for (int half = 0; half < 2; ++half) {
        const float* src = x.data() + r * row_values + half * head_dim;
        const float scale = kvr::Fp8Scale(src, static_cast<size_t>(head_dim));
        uint8_t* codes = out.data() + r * layout.RowBytes() + half * head_dim;
        for (int i = 0; i < head_dim; ++i) codes[i] = kvr::FloatToFp8E4m3(src[i] / scale);
      }
    }
  });
  const double values = static_cast<double>(rows) * row_values;
  std::printf("head_dim %d, %d rows, best of %d\n", head_dim, rows, repeats);
  std::printf("  EncodeFp8Row                       %8.1f M values/s (%.2f GB/s of bf16 input)\n",
              values / rows_s / 1e6, 2 * values / rows_s / 1e9);
  std::printf("  one value at a time (FloatToFp8E4m3) %6.1f M values/s\n", values / scalar_s / 1e6);
  return 0;
}
