// On the real test model (SmolLM2-135M, $KVR_TEST_MODEL): greedy decoding through
// SparseAttention with `full`, or `exact` at a budget >= context, produces exactly the tokens of
// dense attention (DESIGN.md 2's invariant, single process).

#include <filesystem>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "kvr/common/paths.h"
#include "kvr/common/thread_pool.h"
#include "kvr/model/dense_attention.h"
#include "kvr/model/loader.h"
#include "kvr/model/model.h"
#include "kvr/retrieval/registry.h"
#include "kvr/retrieval/sparse_attention.h"

namespace kvr::retrieval {
namespace {

std::vector<int32_t> Greedy(const kvr::model::Model& model, kvr::model::Attention& attention,
                            const std::vector<int32_t>& prompt, int n_new) {
  kvr::model::KvCache cache = model.NewCache();
  auto logits = model.Prefill(1, cache, prompt, attention, 64);
  EXPECT_TRUE(logits.ok()) << logits.status();
  if (!logits.ok()) return {};
  std::vector<int32_t> out;
  std::vector<float> lg = *logits;
  for (int i = 0; i < n_new; ++i) {
    const int32_t next = static_cast<int32_t>(std::max_element(lg.begin(), lg.end()) - lg.begin());
    out.push_back(next);
    kvr::model::ForwardSequence seq{1, &cache, {&next, 1}};
    absl::Status st = model.Forward({&seq, 1}, attention, kvr::model::LogitsMode::kLast, lg);
    EXPECT_TRUE(st.ok()) << st;
    if (!st.ok()) break;
  }
  attention.Release(1);
  return out;
}

TEST(ModelGreedyTest, FullAndExactAtFullBudgetMatchDense) {
  const std::string path = kvr::TestModelPath();
  if (!std::filesystem::exists(path)) GTEST_SKIP() << "no test model at " << path;
  ThreadPool pool(0);
  auto loaded = kvr::model::LoadModel(path, {}, &pool);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_TRUE(loaded->tokenizer.has_value());
  auto prompt = loaded->tokenizer->Encode(
      "The GNU General Public License is a free, copyleft license for software and other kinds "
      "of works. The licenses for most software and other practical works are designed to take "
      "away your freedom to share and change the works. By contrast, the GNU General Public "
      "License is intended to guarantee your freedom to share and change all versions of a "
      "program--to make sure it remains free software for all its users. We, the Free Software "
      "Foundation, use the GNU General Public License for most of our software; it applies also "
      "to any other work released this way by its authors. When we speak of free software,");
  ASSERT_TRUE(prompt.ok());
  const kvr::model::Model& model = *loaded->model;
  kvr::model::DenseAttention dense(&pool);
  const std::vector<int32_t> reference = Greedy(model, dense, *prompt, 24);
  ASSERT_EQ(reference.size(), 24u);

  MethodRegistry registry;
  ASSERT_TRUE(RegisterCoreMethods(registry).ok());
  for (const char* method : {"full", "exact"}) {
    SparseAttentionOptions opt;
    opt.method = method;
    opt.n_layers = model.config().n_layers;
    opt.params.budget = 100000;  // >= context
    opt.params.n_sink = 4;
    opt.params.local_window = 16;
    auto sparse = SparseAttention::Create(&registry, opt);
    ASSERT_TRUE(sparse.ok()) << sparse.status();
    EXPECT_EQ(Greedy(model, **sparse, *prompt, 24), reference) << method;
    EXPECT_GT((*sparse)->stats().selected_rows, 0) << method;  // the sparse path really ran
  }
  // And a small budget really changes the computation (it is not dense in disguise).
  SparseAttentionOptions small;
  small.method = "exact";
  small.n_layers = model.config().n_layers;
  small.params.budget = 4;
  small.params.n_sink = 4;
  small.params.local_window = 8;
  auto sparse = SparseAttention::Create(&registry, small);
  ASSERT_TRUE(sparse.ok());
  Greedy(model, **sparse, *prompt, 4);
  EXPECT_EQ((*sparse)->stats().selected_rows,
            4LL * model.config().n_layers * model.config().n_kv_heads * 4);
}

}  // namespace
}  // namespace kvr::retrieval
