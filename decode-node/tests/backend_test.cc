// The decode node's backend choice (--device) and the CUDA backend's refusals, on the CPU: the
// settings parse (flag / file / env) and name bad values, "cpu" makes the CPU backend, "cuda"
// without a usable GPU (or with settings it cannot take) fails naming the setting, and handoffs
// that do not fit the CUDA node's one method / budget / sink / window are refused naming the
// field and the node's setting.

#include <fstream>
#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvr/common/thread_pool.h"
#include "kvr/decode/config.h"
#include "kvr/decode/cuda_backend.h"
#include "kvr/decode/engine.h"
#include "kvr/model/loader.h"
#include "kvr/retrieval/all_methods.h"
#include "test_util.h"

namespace kvr::decode {
namespace {

using ::testing::HasSubstr;

std::optional<std::string> NoEnv(const std::string&) { return std::nullopt; }

TEST(DecodeBackendConfigTest, DeviceAndGpuSettingsParseFromFlagFileAndEnv) {
  auto c = node::ResolveConfig(DecodeSettings(), {}, std::nullopt, NoEnv);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->device, "cpu");
  EXPECT_EQ(c->gpu_method, "quest");
  EXPECT_EQ(c->gpu_budget, 1024u);
  EXPECT_EQ(c->gpu_n_sink, 64u);  // the controller's default_n_sink / default_local_window
  EXPECT_EQ(c->gpu_local_window, 512u);
  EXPECT_EQ(c->gpu_max_context, 0u);

  const std::string path = ::testing::TempDir() + "/decode_backend_test.yaml";
  std::ofstream(path) << "device: cuda\ngpu_budget: 512\n";
  auto env = [](const std::string& name) -> std::optional<std::string> {
    if (name == "KVR_DECODE_CUDA_DEVICE") return "2";
    if (name == "KVR_DECODE_GPU_BUDGET") return "64";
    if (name == "KVR_DECODE_GPU_LOCAL_WINDOW") return "128";
    return std::nullopt;
  };
  c = node::ResolveConfig(DecodeSettings(), {{"gpu_max_context", "32768"}}, path, env);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->device, "cuda");           // file
  EXPECT_EQ(c->gpu_budget, 512u);         // file over env
  EXPECT_EQ(c->cuda_device, 2u);          // env
  EXPECT_EQ(c->gpu_local_window, 128u);   // env
  EXPECT_EQ(c->gpu_max_context, 32768u);  // flag
  EXPECT_THAT(node::FormatConfig(DecodeSettings(), *c), HasSubstr("device: cuda"));
  EXPECT_THAT(node::FormatConfig(DecodeSettings(), *c), HasSubstr("gpu_budget: 512"));
  std::remove(path.c_str());

  auto bad = node::ResolveConfig(DecodeSettings(), {{"device", "tpu"}}, std::nullopt, NoEnv);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("device (flag --device)"));
  auto ckv =
      node::ResolveConfig(DecodeSettings(), {{"gpu_method", "clusterkv"}}, std::nullopt, NoEnv);
  ASSERT_TRUE(ckv.ok()) << ckv.status();
  EXPECT_EQ(ckv->gpu_method, "clusterkv");
  bad = node::ResolveConfig(DecodeSettings(), {{"gpu_method", "ctkvr"}}, std::nullopt, NoEnv);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("gpu_method (flag --gpu-method)"));
  EXPECT_THAT(bad.status().message(), HasSubstr("one of quest, clusterkv"));
  bad = node::ResolveConfig(DecodeSettings(), {{"gpu_budget", "0"}}, std::nullopt, NoEnv);
  EXPECT_THAT(bad.status().message(), HasSubstr("gpu_budget"));
}

class MakeDecodeBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model::LoadOptions options;
    options.format = model::LoadFormat::kDummy;
    auto loaded = model::LoadModel("tiny", options, &pool_);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    model_ = std::move(loaded->model);
    registry_ = *retrieval::AllMethods();
  }
  ThreadPool pool_{1};
  std::unique_ptr<model::Model> model_;
  retrieval::MethodRegistry registry_;
};

TEST_F(MakeDecodeBackendTest, CpuDeviceIsTheCpuBackend) {
  DecodeConfig c;
  auto backend = MakeDecodeBackend(c, model_.get(), &registry_, nullptr, nullptr);
  ASSERT_TRUE(backend.ok()) << backend.status();
  EXPECT_EQ((*backend)->name(), "cpu");
  EXPECT_EQ((*backend)->max_sequence_tokens(), model_->config().context_length);
}

TEST_F(MakeDecodeBackendTest, CudaDeviceWithoutAGpuFailsNamingTheSetting) {
  DecodeConfig c;
  c.device = "cuda";
  c.quality_sample_rate = 0.5;
  auto backend = MakeDecodeBackend(c, model_.get(), &registry_, nullptr, nullptr);
  EXPECT_EQ(backend.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(backend.status().message(), HasSubstr("quality_sample_rate"));
  c.quality_sample_rate = 0;
  backend = MakeDecodeBackend(c, model_.get(), &registry_, nullptr, nullptr);
  if (model::CudaModelAvailable()) {
    GTEST_SKIP() << "a GPU is usable here: the no-GPU error cannot be seen";
  }
  EXPECT_EQ(backend.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(backend.status().message(), HasSubstr("--device cuda"));
  EXPECT_THAT(backend.status().message(), HasSubstr("--device cpu"));
}

// The GPU node the handoff checks run against: quest with budget 256, 16 sink and 64 window
// tokens, 1000 tokens of context.
CudaDecodeBackendOptions QuestNode() {
  CudaDecodeBackendOptions o;
  o.method = "quest";
  o.budget = 256;
  o.n_sink = 16;
  o.local_window = 64;
  o.max_context = 1000;
  return o;
}

TEST(CudaBackendCheckTest, RefusesHandoffsThatDoNotFitTheNode) {
  const CudaDecodeBackendOptions o = QuestNode();
  Handoff h;
  h.sequence_id = 7;
  h.method = "quest";
  h.budget = 256;
  h.n_sink = 16;
  h.local_window = 64;
  h.prompt_tokens = 500;
  EXPECT_TRUE(CheckHandoffForCudaBackend(h, o).ok());
  h.budget = 100;  // smaller: runs at the node's budget
  EXPECT_TRUE(CheckHandoffForCudaBackend(h, o).ok());

  auto refused = [&](Handoff x, const std::string& field, const std::string& setting) {
    const absl::Status s = CheckHandoffForCudaBackend(x, o);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_THAT(s.message(), HasSubstr("handoff of sequence 7"));
    EXPECT_THAT(s.message(), HasSubstr(field));
    EXPECT_THAT(s.message(), HasSubstr(setting));
  };
  // Each: one field of `h` changed, the field as the error names it, the node setting it names.
  const struct {
    void (*change)(Handoff&);
    const char* field;
    const char* setting;
  } kRefused[] = {
      {[](Handoff& x) { x.method = "clusterkv"; }, "retrieval.method 'clusterkv'", "gpu_method"},
      {[](Handoff& x) { x.budget = 257; }, "retrieval.budget 257", "gpu_budget 256"},
      {[](Handoff& x) { x.n_sink = 4; }, "retrieval.n_sink 4", "gpu_n_sink 16"},
      {[](Handoff& x) { x.local_window = 256; }, "retrieval.local_window 256",
       "gpu_local_window 64"},
      {[](Handoff& x) { x.prompt_tokens = 1000; }, "prompt_tokens 1000", "gpu_max_context 1000"},
  };
  for (const auto& r : kRefused) {
    Handoff x = h;
    r.change(x);
    refused(x, r.field, r.setting);
  }
}

// With the node's registry, methods other than the GPU method are accepted (selected on the
// host by their CPU index); a method the registry lacks is refused naming it, and `full` is
// refused when its rows would exceed what one step gathers.
TEST(CudaBackendCheckTest, HostSelectsTheRegistrysOtherMethods) {
  const retrieval::MethodRegistry registry = *retrieval::AllMethods();
  CudaDecodeBackendOptions o = QuestNode();
  o.registry = &registry;
  Handoff h;
  h.sequence_id = 7;
  h.budget = 128;
  h.n_sink = 16;
  h.local_window = 64;
  h.prompt_tokens = 200;
  h.sampling.max_tokens = 50;
  for (const char* m :
       {"exact", "streaming", "clusterkv", "ctkvr", "pariskv", "a2ats", "keydiff", "full"}) {
    h.method = m;
    EXPECT_TRUE(CheckHandoffForCudaBackend(h, o).ok()) << m;
  }
  h.method = "nosuch";
  absl::Status s = CheckHandoffForCudaBackend(h, o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("retrieval.method 'nosuch' is not supported here"));
  // full: 400 + 50 - 16 - 64 = 370 rows > gpu_budget 256.
  h.method = "full";
  h.prompt_tokens = 400;
  s = CheckHandoffForCudaBackend(h, o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("up to 370 rows"));
  EXPECT_THAT(s.message(), HasSubstr("gpu_budget 256"));
  h.method = "quest";  // the GPU method selects its budget whatever the prompt
  EXPECT_TRUE(CheckHandoffForCudaBackend(h, o).ok());
  // Unless it runs densely: its 450 tokens of KV fit gpu_dense_bytes (rows read in place).
  h.method = "full";
  o.dense_bytes_per_token = 1000;
  o.dense_bytes = 450 * 1000;
  EXPECT_TRUE(CheckHandoffForCudaBackend(h, o).ok());
  o.dense_bytes = 450 * 1000 - 1;
  s = CheckHandoffForCudaBackend(h, o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("gpu_dense_bytes 449999"));
  o.dense_bytes = 450 * 1000;
  o.row_source = "fetch";  // fetched rows never run densely
  s = CheckHandoffForCudaBackend(h, o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("rows fetched never run densely"));
}

// What the engine tests' backends share: a 2-layer, 16-token vocabulary model shape and nothing
// to join, leave or count.
class TestBackend : public DecodeBackend {
 public:
  TestBackend() {
    config_.n_layers = 2;
    config_.vocab = 16;
    config_.context_length = 1000;
  }
  const model::ModelConfig& config() const override { return config_; }
  int64_t max_sequence_tokens() const override { return config_.context_length; }
  absl::Status Join(const Handoff&, std::unique_ptr<BackendSequence>) override {
    return absl::OkStatus();
  }
  RetrievalCounters Leave(uint64_t) override { return {}; }
  NodeCounters node_counters() const override { return {}; }
  int64_t SummaryBytes(uint64_t) const override { return 0; }

 protected:
  model::ModelConfig config_;
};

// A handoff of a 10-token prompt for TestBackend's 2 layers, in `store`.
Handoff TestHandoff(kv_store::KvStoreClient* store, uint64_t id) {
  Handoff h;
  h.sequence_id = id;
  h.store_capability = kv_store::Capability::Generate();
  h.store = store;
  h.prompt_tokens = 10;
  h.layers.resize(2);
  return h;
}

// A backend that counts the prepared sequence states alive (what a real backend holds for a
// sequence between Prepare and Join: the CUDA backend's pinned host KV) and drops them at Join.
class CountingBackend final : public TestBackend {
 public:
  struct State final : BackendSequence {
    explicit State(int* live) : live(live) { ++*live; }
    ~State() override { --*live; }
    int64_t resident_bytes() const override { return 100; }
    int* live;
  };
  std::string name() const override { return "counting"; }
  absl::StatusOr<std::unique_ptr<BackendSequence>> Prepare(Handoff&) const override {
    return std::make_unique<State>(&live);
  }
  absl::Status Step(std::span<const uint64_t>, std::span<const int32_t>,
                    std::span<float> logits) override {
    std::fill(logits.begin(), logits.end(), 0.f);
    return absl::OkStatus();
  }

  mutable int live = 0;
};

TEST(EngineBackendStateTest, ASequenceThatEndsWaitingFreesItsBackendStateAtOnce) {
  auto store = testing::MakeFakeStore();
  auto backend = std::make_unique<CountingBackend>();
  CountingBackend* counting = backend.get();
  auto engine = DecodeEngine::Create(std::move(backend), nullptr, {.batch_slots = 1});
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto handoff = [&](uint64_t id) {
    Handoff h = TestHandoff(store.get(), id);
    h.sampling.max_tokens = 100;
    return h;
  };
  ASSERT_TRUE((*engine)->Admit(handoff(1)).ok());
  ASSERT_TRUE((*engine)->Admit(handoff(2)).ok());
  EXPECT_EQ(counting->live, 2);
  EXPECT_TRUE((*engine)->Step());  // 1 joins (its state goes to the backend), 2 waits
  EXPECT_EQ(counting->live, 1);
  EXPECT_TRUE((*engine)->Cancel(2, "client went away"));
  EXPECT_TRUE((*engine)->Step());
  // 2 ended while waiting; its outcome is not collected yet, its backend state is gone.
  EXPECT_TRUE((*engine)->Has(2));
  EXPECT_EQ(counting->live, 0);
  EXPECT_TRUE(absl::IsCancelled((*engine)->Next(2, absl::Now()).status()));
}

// A backend whose logits put every sequence's next token at (token + 1) % vocab, on the host
// (Step) or picked where the logits are (StepGreedy); it counts both.
class GreedyStepBackend final : public TestBackend {
 public:
  struct State final : BackendSequence {
    int64_t resident_bytes() const override { return 100; }
  };
  std::string name() const override { return "greedy-step"; }
  absl::StatusOr<std::unique_ptr<BackendSequence>> Prepare(Handoff&) const override {
    return std::make_unique<State>();
  }
  absl::Status Step(std::span<const uint64_t> ids, std::span<const int32_t> tokens,
                    std::span<float> logits) override {
    ++steps;
    std::fill(logits.begin(), logits.end(), 0.f);
    for (size_t b = 0; b < ids.size(); ++b) {
      logits[b * config_.vocab + (tokens[b] + 1) % config_.vocab] = 50.f;
    }
    return absl::OkStatus();
  }
  bool HasStepGreedy() const override { return true; }
  absl::Status StepGreedy(std::span<const uint64_t> ids, std::span<const int32_t> tokens,
                          std::span<int32_t> next) override {
    ++greedy_steps;
    for (size_t b = 0; b < ids.size(); ++b) {
      next[b] = no_finite_logit ? -1 : (tokens[b] + 1) % config_.vocab;
    }
    return absl::OkStatus();
  }

  int steps = 0, greedy_steps = 0;
  bool no_finite_logit = false;
};

Handoff GreedyTestHandoff(kv_store::KvStoreClient* store, uint64_t id, float temperature) {
  Handoff h = TestHandoff(store, id);
  h.first_token = 3;
  h.sampling.max_tokens = 5;
  h.sampling.temperature = temperature;
  h.sampling.ignore_eos = true;
  return h;
}

std::vector<int32_t> AllTokens(DecodeEngine& engine, uint64_t id) {
  std::vector<int32_t> tokens;
  for (int i = 0; i < 20; ++i) {
    absl::StatusOr<StreamChunk> c = engine.Next(id, absl::Now());
    if (!c.ok()) break;
    tokens.insert(tokens.end(), c->tokens.begin(), c->tokens.end());
    if (c->completion.has_value()) break;
  }
  return tokens;
}

// An engine over a GreedyStepBackend (`backend` set up by the caller) that admitted one greedy
// test handoff per temperature (ids 1, 2, ...) and stepped until nothing was left to run.
std::unique_ptr<DecodeEngine> RunGreedyEngine(kv_store::KvStoreClient* store,
                                              std::unique_ptr<GreedyStepBackend> backend,
                                              const std::vector<float>& temperatures) {
  auto engine = DecodeEngine::Create(std::move(backend), nullptr,
                                     {.batch_slots = static_cast<int>(temperatures.size())});
  EXPECT_TRUE(engine.ok()) << engine.status();
  if (!engine.ok()) return nullptr;
  for (size_t i = 0; i < temperatures.size(); ++i) {
    EXPECT_TRUE((*engine)->Admit(GreedyTestHandoff(store, i + 1, temperatures[i])).ok());
  }
  while ((*engine)->Step()) {
  }
  return std::move(*engine);
}

TEST(EngineGreedyStepTest, AllGreedyBatchesTakeTheBackendsGreedyStepOthersTheLogits) {
  auto store = testing::MakeFakeStore();
  {
    auto backend = std::make_unique<GreedyStepBackend>();
    GreedyStepBackend* b = backend.get();
    auto engine = RunGreedyEngine(store.get(), std::move(backend), {0.f, 0.f});
    ASSERT_NE(engine, nullptr);
    EXPECT_GT(b->greedy_steps, 0);
    EXPECT_EQ(b->steps, 0);
    // After the first token (the prefill node streams it), each the previous plus one: what the
    // logits would have given.
    EXPECT_EQ(AllTokens(*engine, 1), (std::vector<int32_t>{4, 5, 6, 7}));
    EXPECT_EQ(AllTokens(*engine, 2), (std::vector<int32_t>{4, 5, 6, 7}));
  }
  {
    // One sampling sequence in the batch: the logits come back for every sequence.
    auto backend = std::make_unique<GreedyStepBackend>();
    GreedyStepBackend* b = backend.get();
    auto engine = RunGreedyEngine(store.get(), std::move(backend), {0.f, 0.7f});
    ASSERT_NE(engine, nullptr);
    EXPECT_EQ(b->greedy_steps, 0);
    EXPECT_GT(b->steps, 0);
    EXPECT_EQ(AllTokens(*engine, 1), (std::vector<int32_t>{4, 5, 6, 7}));
  }
  {
    // No finite logit: the sequence fails as the host sampler fails it.
    auto backend = std::make_unique<GreedyStepBackend>();
    backend->no_finite_logit = true;
    auto engine = RunGreedyEngine(store.get(), std::move(backend), {0.f});
    ASSERT_NE(engine, nullptr);
    absl::StatusOr<StreamChunk> c = engine->Next(1, absl::Now());
    while (c.ok() && !c->completion.has_value()) c = engine->Next(1, absl::Now());
    ASSERT_FALSE(c.ok());
    EXPECT_THAT(c.status().message(), HasSubstr("no finite logit"));
  }
}

}  // namespace
}  // namespace kvr::decode
