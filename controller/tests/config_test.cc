#include "kvr/controller/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>

namespace kvr::controller {
namespace {

using ::testing::HasSubstr;

class ConfigTest : public ::testing::Test {
 protected:
  // A file of its own per test process: CTest runs this binary's tests in parallel processes.
  std::string WriteFile(const std::string& text) {
    std::string path = ::testing::TempDir() + "/controller_config_test." +
                       ::testing::UnitTest::GetInstance()->current_test_info()->name() + "." +
                       std::to_string(::getpid()) + ".yaml";
    std::ofstream(path) << text;
    return path;
  }
  std::optional<std::string> Env(const std::string& name) {
    auto it = env_.find(name);
    if (it == env_.end()) return std::nullopt;
    return it->second;
  }
  absl::StatusOr<ControllerConfig> Resolve(const std::map<std::string, std::string>& flags,
                                           std::optional<std::string> file = std::nullopt) {
    return node::ResolveConfig(ControllerSettings(), flags, file,
                               [this](const std::string& n) { return Env(n); });
  }
  std::string Format(const ControllerConfig& c) {
    return node::FormatConfig(ControllerSettings(), c);
  }
  std::map<std::string, std::string> env_;
};

TEST_F(ConfigTest, DefaultsWhenNothingIsSet) {
  auto c = Resolve({});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->listen, "0.0.0.0:50051");
  EXPECT_EQ(c->max_attempts, 3u);
  EXPECT_EQ(c->defaults.method, "full");
}

TEST_F(ConfigTest, TlsFilesFromFlagsFileAndEnvironment) {
  env_["KVR_CONTROLLER_TLS_CA"] = "/etc/kvr/ca.pem";
  auto c = Resolve({{"tls_cert", "/etc/kvr/controller.pem"}},
                   WriteFile("tls_key: /etc/kvr/controller-key.pem\n"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->tls.ca_file, "/etc/kvr/ca.pem");
  EXPECT_EQ(c->tls.cert_file, "/etc/kvr/controller.pem");
  EXPECT_EQ(c->tls.key_file, "/etc/kvr/controller-key.pem");
  EXPECT_THAT(Format(*c), HasSubstr("tls_ca: /etc/kvr/ca.pem"));
}

TEST_F(ConfigTest, FlagBeatsFileBeatsEnvBeatsDefault) {
  env_ = {{"KVR_CONTROLLER_LISTEN", "env:1"},
          {"KVR_CONTROLLER_MAX_ATTEMPTS", "5"},
          {"KVR_CONTROLLER_DEFAULT_BUDGET", "7"},
          {"KVR_CONTROLLER_LEASE_SECONDS", "9"}};
  const std::string file = WriteFile("listen: file:2\nmax_attempts: 4\ndefault_budget: 8\n");
  auto c = Resolve({{"listen", "flag:3"}}, file);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen, "flag:3");      // flag over file and env
  EXPECT_EQ(c->max_attempts, 4u);      // file over env
  EXPECT_EQ(c->defaults.budget, 8u);   // file over env
  EXPECT_EQ(c->lease_seconds, 9.0);    // env over default
  EXPECT_EQ(c->max_in_flight, 1024u);  // default
}

TEST_F(ConfigTest, OlderEnvironmentNamesStillWorkBelowTheNewOnes) {
  env_ = {{"KVR_API_KEY", "old-key"},
          {"KVR_LEASE_SECONDS", "9"},
          {"KVR_CONTROLLER_LEASE_SECONDS", "7"}};
  auto c = Resolve({});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->api_key, "old-key");
  EXPECT_EQ(c->lease_seconds, 7.0);
}

TEST_F(ConfigTest, BadValuesNameTheSettingAndSource) {
  auto flag = Resolve({{"max_attempts", "zero"}});
  EXPECT_TRUE(absl::IsInvalidArgument(flag.status()));
  EXPECT_THAT(std::string(flag.status().message()),
              HasSubstr("max_attempts (flag --max-attempts)"));
  env_ = {{"KVR_CONTROLLER_LEASE_SECONDS", "-1"}};
  auto env = Resolve({});
  EXPECT_THAT(std::string(env.status().message()),
              HasSubstr("lease_seconds (environment KVR_CONTROLLER_LEASE_SECONDS)"));
  env_.clear();
  auto unknown = Resolve({}, WriteFile("listen: a:1\nlistne: b:2\n"));
  EXPECT_THAT(std::string(unknown.status().message()), HasSubstr("unknown setting 'listne'"));
  auto level = Resolve({{"log_level", "loud"}});
  EXPECT_THAT(std::string(level.status().message()), HasSubstr("log_level"));
  auto missing = Resolve({}, std::string("/nonexistent/kvr.yaml"));
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("/nonexistent/kvr.yaml"));
}

TEST_F(ConfigTest, FormattedConfigReadsBackAsTheSameConfig) {
  auto c = Resolve({{"listen", "127.0.0.1:0"}, {"default_method", "clusterkv"}});
  ASSERT_TRUE(c.ok());
  const std::string text = Format(*c);
  EXPECT_THAT(text, HasSubstr("default_method: clusterkv\n"));
  auto again = Resolve({}, WriteFile(text));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(Format(*again), text);
}

}  // namespace
}  // namespace kvr::controller
