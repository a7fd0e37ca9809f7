// CUDA graphs of dense greedy decode steps (CudaModelOptions::cuda_graphs): the same tokens as
// the same model run launch by launch, across batch sizes, sequences that change between
// replays (the graph serves any sequences of its batch size), contexts that cross a change of
// the attention's split count, and the fallbacks (Forward with logits, profiling). CTest label
// `gpu`.

#include <cstdio>
#include <vector>

#include "gtest/gtest.h"
#include "kvr/model/cuda_model.h"
#include "kvr/model/dummy.h"

namespace kvr::model {
namespace {

std::unique_ptr<CudaModel> Make(const ModelConfig& c, bool graphs) {
  CudaModelOptions o;
  o.max_batch_tokens = 512;
  o.max_sequences = 8;
  o.cuda_graphs = graphs;
  auto m = CreateCudaModelWithRandomWeights(c, 7, o);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

// Prefills sequences 1..n with different prompts, then decodes `steps` greedy steps over the
// batches in `schedule` (sequence ids), cycling. Returns every step's tokens.
std::vector<std::vector<int32_t>> Decode(CudaModel& m, const ModelConfig& c, int n, int prompt,
                                      const std::vector<std::vector<SequenceId>>& schedule,
                                      int steps) {
  std::vector<std::vector<int32_t>> out;
  std::vector<int32_t> last(n + 1, 0);
  for (int s = 1; s <= n; ++s) {
    EXPECT_TRUE(m.AddSequence(s, prompt + steps + 1).ok());
    std::vector<int32_t> ids(prompt + s);  // different lengths
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 31 + s * 7) % c.vocab);
    const CudaSequence seq{static_cast<SequenceId>(s), ids};
    std::vector<int32_t> next(1);
    EXPECT_TRUE(m.ForwardGreedy(std::span(&seq, 1), next).ok());
    last[s] = next[0];
  }
  for (int step = 0; step < steps; ++step) {
    const std::vector<SequenceId>& ids = schedule[step % schedule.size()];
    std::vector<CudaSequence> batch;
    for (SequenceId id : ids) batch.push_back({id, std::span(&last[id], 1)});
    std::vector<int32_t> next(ids.size());
    const absl::Status st = m.ForwardGreedy(batch, next);
    EXPECT_TRUE(st.ok()) << st;
    if (!st.ok()) break;
    for (size_t b = 0; b < ids.size(); ++b) last[ids[b]] = next[b];
    out.push_back(next);
  }
  return out;
}

TEST(CudaGraphTest, GreedyDecodeMatchesLaunchByLaunch) {
  if (!CudaModelAvailable()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
  for (const char* shape : {"smollm2-135m", "llama3-8b"}) {
    SCOPED_TRACE(shape);
    auto c = DummyConfig(shape, 2);
    ASSERT_TRUE(c.ok());
    // Batches of 1, 3 and 2, with different members: one graph per (size, splits), replayed
    // for other sequences of the same size.
    const std::vector<std::vector<SequenceId>> schedule = {{1}, {2, 3, 4}, {5, 1}, {3}, {4, 2, 5},
                                                           {2, 3}};
    // A prompt that starts below the 64-keys-per-split cap and grows past it: the split count
    // changes along the way (a new graph), at least for batch 1.
    auto plain = Make(*c, false);
    auto graphs = Make(*c, true);
    ASSERT_TRUE(plain && graphs);
    const auto want = Decode(*plain, *c, 5, 100, schedule, 60);
    const auto got = Decode(*graphs, *c, 5, 100, schedule, 60);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got[i], want[i]) << "step " << i;
    const CudaGraphStats g = graphs->graph_stats();
    EXPECT_EQ(plain->graph_stats().replays, 0);
    // 60 decode steps as graphs (the prefills are not decode steps); fewer captures than steps.
    EXPECT_EQ(g.replays, 60);
    EXPECT_GE(g.captures, 3);
    EXPECT_LT(g.captures, 30);
    std::printf("[ graphs ] %s: %lld decode steps replayed from %lld captured graphs, tokens equal\n",
                shape, static_cast<long long>(g.replays), static_cast<long long>(g.captures));

    // Not graphed: Forward (logits back) and profiling.
    std::vector<float> logits(c->vocab);
    int32_t token = 1;
    const CudaSequence s{1, std::span(&token, 1)};
    ASSERT_TRUE(graphs->Forward(std::span(&s, 1), LogitsMode::kLast, logits).ok());
    graphs->set_profile(true);
    std::vector<int32_t> next(1);
    ASSERT_TRUE(graphs->ForwardGreedy(std::span(&s, 1), next).ok());
    EXPECT_EQ(graphs->graph_stats().replays, 60);
    EXPECT_GT(graphs->last_profile().total_ms, 0);
  }
}

}  // namespace
}  // namespace kvr::model
