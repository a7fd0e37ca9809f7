#include "kvr/prefill_node/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>

namespace kvr::prefill_node {
namespace {

using ::testing::HasSubstr;

absl::StatusOr<PrefillConfig> Resolve(const std::map<std::string, std::string>& flags,
                                      std::optional<std::string> file,
                                      const std::map<std::string, std::string>& env) {
  return node::ResolveConfig(PrefillSettings(), flags, file,
                             [&](const std::string& n) -> std::optional<std::string> {
                               auto it = env.find(n);
                               if (it == env.end()) return std::nullopt;
                               return it->second;
                             });
}

TEST(PrefillConfigTest, PrecedenceFlagOverFileOverEnvOverDefault) {
  const std::string path = ::testing::TempDir() + "/prefill_config_test.yaml";
  std::ofstream(path) << "chunk_tokens: 128\nthreads: 3\n";
  auto c = Resolve({{"chunk_tokens", "64"}}, path,
                   {{"KVR_PREFILL_CHUNK_TOKENS", "32"},
                    {"KVR_PREFILL_THREADS", "5"},
                    {"KVR_PREFILL_CONTROLLER", "host:1"}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->chunk_tokens, 64u);          // flag
  EXPECT_EQ(c->threads, 3u);                // file
  EXPECT_EQ(c->controller, "host:1");       // env
  EXPECT_EQ(c->max_prefill_queries, 512u);  // default
  EXPECT_THAT(node::FormatConfig(PrefillSettings(), *c), HasSubstr("chunk_tokens: 64\n"));
}

TEST(PrefillConfigTest, BadValuesNameTheSettingAndSource) {
  auto c = Resolve({}, std::nullopt, {{"KVR_PREFILL_CHUNK_TOKENS", "zero"}});
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("chunk_tokens"));
  EXPECT_THAT(c.status().message(), HasSubstr("KVR_PREFILL_CHUNK_TOKENS"));
  const std::string path = ::testing::TempDir() + "/prefill_config_bad.yaml";
  std::ofstream(path) << "no_such_setting: 1\n";
  c = Resolve({}, path, {});
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("no_such_setting"));
}

TEST(PrefillConfigTest, StoreDtypeFollowsTheDeviceUnlessSet) {
  auto c = Resolve({}, std::nullopt, {});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->store_dtype, "f32");  // the CPU model runs in f32
  EXPECT_EQ(StoreDType(*c), kv_store::DType::kF32);
  EXPECT_THAT(node::FormatConfig(PrefillSettings(), *c), HasSubstr("store_dtype: f32\n"));
  c = Resolve({{"device", "cuda"}}, std::nullopt, {});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->store_dtype, "bf16");  // the GPU model's KV is bf16
  EXPECT_EQ(StoreDType(*c), kv_store::DType::kBf16);
  EXPECT_THAT(node::FormatConfig(PrefillSettings(), *c), HasSubstr("store_dtype: bf16\n"));
  c = Resolve({{"device", "cuda"}}, std::nullopt, {{"KVR_PREFILL_STORE_DTYPE", "f32"}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(StoreDType(*c), kv_store::DType::kF32);
  c = Resolve({{"store_dtype", "bf16"}}, std::nullopt, {});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->device, "cpu");
  EXPECT_EQ(StoreDType(*c), kv_store::DType::kBf16);

  c = Resolve({}, std::nullopt, {{"KVR_PREFILL_STORE_DTYPE", "fp16"}});
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("store_dtype"));
  EXPECT_THAT(c.status().message(), HasSubstr("KVR_PREFILL_STORE_DTYPE"));
  EXPECT_THAT(c.status().message(), HasSubstr("one of f32, bf16"));
}

TEST(PrefillConfigTest, StoreDtypeFp8IsTheFp8RowDtype) {
  auto c = Resolve({{"store_dtype", "fp8"}}, std::nullopt, {});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(StoreDType(*c), kv_store::DType::kFp8E4m3);
  EXPECT_THAT(node::FormatConfig(PrefillSettings(), *c), HasSubstr("store_dtype: fp8\n"));
  c = Resolve({{"device", "cuda"}}, std::nullopt, {{"KVR_PREFILL_STORE_DTYPE", "fp8"}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(StoreDType(*c), kv_store::DType::kFp8E4m3);

  c = Resolve({{"store_dtype", "fp9"}}, std::nullopt, {});
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("store_dtype"));
  EXPECT_THAT(c.status().message(), HasSubstr("fp9"));
  EXPECT_THAT(c.status().message(), HasSubstr("one of f32, bf16, fp8"));
}

TEST(PrefillConfigTest, ServedModelName) {
  PrefillConfig c;
  c.model = "smollm2-135m-instruct";
  EXPECT_EQ(ServedModelName(c), "smollm2-135m-instruct");
  c.model = "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  EXPECT_EQ(ServedModelName(c), "SmolLM2-135M-Instruct.Q4_1");
  c.model_name = "smol";
  EXPECT_EQ(ServedModelName(c), "smol");
}

}  // namespace
}  // namespace kvr::prefill_node
