#include "kvr/decode/config.h"

#include <cstdio>
#include <fstream>

#include "gtest/gtest.h"

namespace kvr::decode {
namespace {

TEST(DecodeConfigTest, FlagBeatsFileBeatsEnvBeatsDefault) {
  const std::string path = ::testing::TempDir() + "/decode_config_test.yaml";
  std::ofstream(path) << "batch_slots: 5\nhot_cache_bytes: 1000\n";
  auto env = [](const std::string& name) -> std::optional<std::string> {
    if (name == "KVR_DECODE_BATCH_SLOTS") return "3";
    if (name == "KVR_DECODE_MEMORY_BYTES") return "4096";
    if (name == "KVR_DECODE_HOT_CACHE_BYTES") return "7";
    return std::nullopt;
  };
  auto config = node::ResolveConfig(DecodeSettings(), {{"hot_cache_bytes", "42"}}, path, env);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->hot_cache_bytes, 42);  // flag
  EXPECT_EQ(config->batch_slots, 5u);      // file over env
  EXPECT_EQ(config->memory_bytes, 4096);   // env
  EXPECT_EQ(config->log_level, "info");    // default
  EXPECT_NE(node::FormatConfig(DecodeSettings(), *config).find("batch_slots: 5"),
            std::string::npos);

  auto bad = node::ResolveConfig(DecodeSettings(), {{"batch_slots", "0"}}, std::nullopt, env);
  EXPECT_TRUE(absl::IsInvalidArgument(bad.status()));
  EXPECT_NE(bad.status().message().find("batch_slots (flag --batch-slots)"), std::string::npos);
  std::ofstream(path) << "bogus: 1\n";
  EXPECT_TRUE(
      absl::IsInvalidArgument(node::ResolveConfig(DecodeSettings(), {}, path, env).status()));
  std::remove(path.c_str());
}

TEST(DecodeConfigTest, ByteSizesAreDecimalOrBinaryAsWritten) {
  auto no_env = [](const std::string&) -> std::optional<std::string> { return std::nullopt; };
  auto config = node::ResolveConfig(DecodeSettings(),
                                    {{"memory_bytes", "8GiB"}, {"hot_cache_bytes", "256MB"}},
                                    std::nullopt, no_env);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->memory_bytes, 8ll << 30);
  EXPECT_EQ(config->hot_cache_bytes, 256'000'000);
  EXPECT_TRUE(absl::IsInvalidArgument(
      node::ResolveConfig(DecodeSettings(), {{"memory_bytes", "0GiB"}}, std::nullopt, no_env)
          .status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      node::ResolveConfig(DecodeSettings(), {{"memory_bytes", "8 parsecs"}}, std::nullopt, no_env)
          .status()));
}

TEST(DecodeConfigTest, QualitySampleRateIsAFractionFromFlagFileOrEnv) {
  auto no_env = [](const std::string&) -> std::optional<std::string> { return std::nullopt; };
  auto config = node::ResolveConfig(DecodeSettings(), {}, std::nullopt, no_env);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->quality_sample_rate, 0.0);  // off by default

  config = node::ResolveConfig(DecodeSettings(), {{"quality_sample_rate", "0.25"}}, std::nullopt,
                               no_env);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->quality_sample_rate, 0.25);
  auto env = [](const std::string& name) -> std::optional<std::string> {
    if (name == "KVR_DECODE_QUALITY_SAMPLE_RATE") return "1";
    return std::nullopt;
  };
  config = node::ResolveConfig(DecodeSettings(), {}, std::nullopt, env);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->quality_sample_rate, 1.0);

  for (const char* bad : {"1.5", "-0.1", "nan", "often"}) {
    auto refused =
        node::ResolveConfig(DecodeSettings(), {{"quality_sample_rate", bad}}, std::nullopt, no_env);
    EXPECT_TRUE(absl::IsInvalidArgument(refused.status())) << bad;
    EXPECT_NE(refused.status().message().find("--quality-sample-rate"), std::string::npos)
        << refused.status();
  }
  const std::string path = ::testing::TempDir() + "/decode_quality_config_test.yaml";
  std::ofstream(path) << "quality_sample_rate: 2\n";
  auto from_file = node::ResolveConfig(DecodeSettings(), {}, path, no_env);
  EXPECT_TRUE(absl::IsInvalidArgument(from_file.status()));
  EXPECT_NE(from_file.status().message().find("quality_sample_rate"), std::string::npos);
  std::remove(path.c_str());
}

TEST(DecodeConfigTest, GpuLanesAreACommaSeparatedListOfKnownLanes) {
  auto no_env = [](const std::string&) -> std::optional<std::string> { return std::nullopt; };
  auto config = node::ResolveConfig(DecodeSettings(), {}, std::nullopt, no_env);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(config->gpu_lanes.empty());  // none by default: a lane holds codes per slot
  config = node::ResolveConfig(DecodeSettings(), {{"gpu_lanes", "pariskv"}}, std::nullopt, no_env);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->gpu_lanes, std::vector<std::string>{"pariskv"});
  config =
      node::ResolveConfig(DecodeSettings(), {{"gpu_lanes", "pariskv,ctkvr"}}, std::nullopt, no_env);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->gpu_lanes, (std::vector<std::string>{"pariskv", "ctkvr"}));
  // quest and clusterkv are GPU methods (gpu_method), not lanes.
  auto refused =
      node::ResolveConfig(DecodeSettings(), {{"gpu_lanes", "pariskv,quest"}}, std::nullopt, no_env);
  EXPECT_TRUE(absl::IsInvalidArgument(refused.status()));
  EXPECT_NE(refused.status().message().find("quest"), std::string::npos) << refused.status();
}

TEST(DecodeConfigTest, GpuRowSourceIsInPlaceFetchOrAuto) {
  auto no_env = [](const std::string&) -> std::optional<std::string> { return std::nullopt; };
  auto config = node::ResolveConfig(DecodeSettings(), {}, std::nullopt, no_env);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->gpu_row_source, "in-place");
  EXPECT_FALSE(config->store_rma_reads);
  config =
      node::ResolveConfig(DecodeSettings(), {{"store_rma_reads", "true"}}, std::nullopt, no_env);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(config->store_rma_reads);
  for (const std::string v : {"fetch", "auto"}) {
    config = node::ResolveConfig(DecodeSettings(), {{"gpu_row_source", v}}, std::nullopt, no_env);
    ASSERT_TRUE(config.ok()) << config.status();
    EXPECT_EQ(config->gpu_row_source, v);
  }
  auto refused =
      node::ResolveConfig(DecodeSettings(), {{"gpu_row_source", "rdma"}}, std::nullopt, no_env);
  EXPECT_TRUE(absl::IsInvalidArgument(refused.status()));
  EXPECT_NE(refused.status().message().find("one of in-place, fetch, auto"), std::string::npos)
      << refused.status();
}

TEST(DecodeConfigTest, GpuRowFormatIsBf16OrFp8) {
  auto no_env = [](const std::string&) -> std::optional<std::string> { return std::nullopt; };
  auto config = node::ResolveConfig(DecodeSettings(), {}, std::nullopt, no_env);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->gpu_row_format, "bf16");
  config = node::ResolveConfig(DecodeSettings(), {{"gpu_row_format", "fp8"}}, std::nullopt, no_env);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->gpu_row_format, "fp8");
  auto refused =
      node::ResolveConfig(DecodeSettings(), {{"gpu_row_format", "fp4"}}, std::nullopt, no_env);
  EXPECT_TRUE(absl::IsInvalidArgument(refused.status()));
  EXPECT_NE(refused.status().message().find("one of bf16, fp8"), std::string::npos)
      << refused.status();
}

}  // namespace
}  // namespace kvr::decode
