// MakePrefillBackend (--device): the CPU backend, and the CUDA choice's error where no GPU can be
// used (a build without CUDA, or a CI machine without a GPU), which must name the setting.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "kvr/common/thread_pool.h"
#include "kvr/model/cuda_model.h"
#include "kvr/model/dummy.h"
#include "kvr/model/weights.h"
#include "kvr/prefill_node/config.h"
#include "kvr/prefill_node/prefill_cuda_backend.h"

namespace kvr::prefill_node {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<model::Model> TinyModel(ThreadPool* pool) {
  auto config = model::DummyConfig("tiny");
  EXPECT_TRUE(config.ok());
  auto weights = model::RandomWeights(*config, 1, pool);
  EXPECT_TRUE(weights.ok());
  auto m = model::Model::Create(*config, std::move(*weights), pool);
  EXPECT_TRUE(m.ok());
  return std::move(*m);
}

TEST(PrefillBackendTest, CpuDeviceIsTheCpuModel) {
  ThreadPool pool(1);
  auto m = TinyModel(&pool);
  PrefillConfig config;
  auto backend = MakePrefillBackend(config, m.get());
  ASSERT_TRUE(backend.ok()) << backend.status();
  EXPECT_EQ((*backend)->name(), "cpu");
  EXPECT_EQ((*backend)->config().hidden, m->config().hidden);
}

TEST(PrefillBackendTest, CudaDeviceWithoutAGpuFailsNamingTheSetting) {
  ThreadPool pool(1);
  auto m = TinyModel(&pool);
  PrefillConfig config;
  config.device = "cuda";
  auto backend = MakePrefillBackend(config, m.get());
  if (model::CudaModelAvailable()) {
    // The tiny shape's head_dim (16) is not compiled for the GPU: still an error naming it.
    if (backend.ok()) {
      EXPECT_EQ((*backend)->name(), "cuda:0");
    } else {
      EXPECT_THAT(backend.status().message(), HasSubstr("--device cuda"));
    }
    GTEST_SKIP() << "a GPU is usable here: the no-GPU error cannot be seen";
  }
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(backend.status().message(), HasSubstr("--device cuda"));
  EXPECT_THAT(backend.status().message(), HasSubstr("--device cpu"));
}

TEST(PrefillBackendTest, DeviceSettingParsesAndNamesBadValues) {
  auto env = [](const std::string& n) -> std::optional<std::string> {
    if (n == "KVR_PREFILL_DEVICE") return "cuda";
    if (n == "KVR_PREFILL_CUDA_DEVICE") return "1";
    return std::nullopt;
  };
  auto c = node::ResolveConfig(PrefillSettings(), {}, std::nullopt, env);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->device, "cuda");
  EXPECT_EQ(c->cuda_device, 1u);
  EXPECT_THAT(node::FormatConfig(PrefillSettings(), *c), HasSubstr("device: cuda\n"));
  EXPECT_THAT(node::FormatConfig(PrefillSettings(), *c), HasSubstr("cuda_device: 1\n"));
  c = node::ResolveConfig(PrefillSettings(), {{"device", "cpu"}}, std::nullopt,
                          env);  // flag over env
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->device, "cpu");
  EXPECT_EQ(node::ResolveConfig(PrefillSettings(), {}, std::nullopt,
                                [](const std::string&) { return std::optional<std::string>(); })
                ->device,
            "cpu");  // default
  c = node::ResolveConfig(PrefillSettings(), {{"device", "gpu"}}, std::nullopt, env);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("device (flag --device)"));
  EXPECT_THAT(c.status().message(), HasSubstr("one of cpu, cuda"));
  c = node::ResolveConfig(PrefillSettings(), {{"cuda_device", "-1"}}, std::nullopt, env);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("cuda_device"));
}

TEST(PrefillBackendTest, GpuSummariesSettingParses) {
  auto none = [](const std::string&) { return std::optional<std::string>(); };
  auto c = node::ResolveConfig(PrefillSettings(), {}, std::nullopt, none);
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(c->gpu_summaries);  // default: quest / clusterkv summaries on the GPU
  c = node::ResolveConfig(PrefillSettings(), {{"gpu_summaries", "false"}}, std::nullopt, none);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->gpu_summaries);
  EXPECT_THAT(node::FormatConfig(PrefillSettings(), *c), HasSubstr("gpu_summaries: false\n"));
  c = node::ResolveConfig(PrefillSettings(), {{"gpu_summaries", "perhaps"}}, std::nullopt, none);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("gpu_summaries"));
  EXPECT_THAT(c.status().message(), HasSubstr("true or false"));
}

}  // namespace
}  // namespace kvr::prefill_node
