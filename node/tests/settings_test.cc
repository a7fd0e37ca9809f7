#include "kvr/node/settings.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>

#include "CLI/CLI.hpp"

namespace kvr::node {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

struct Nested {
  int32_t depth = 2;
};

// One setting of every type.
struct TestConfig {
  std::string listen = "127.0.0.1:0";
  std::string note;
  bool huge_pages = true;
  uint32_t slots = 8;
  int32_t metrics_port = 0;
  double lease_seconds = 5;
  double cache_seconds = 300;
  uint64_t pool_bytes = uint64_t{1} << 30;
  std::string device = "cpu";
  std::vector<std::string> extra_args;
  std::string api_key;
  Nested nested;
  TlsConfig tls;
};

const SettingTable<TestConfig>& Table() {
  static const SettingTable<TestConfig>* const table = [] {
    auto* t = new SettingTable<TestConfig>{
        .program = "kvr-test",
        .description = "kvr-test: a table of every setting type",
        .env_prefix = "KVR_TEST_",
        .legacy_env_prefixes = {"KVR_"},
        .settings =
            {
                StringSetting<TestConfig>("listen", "listen address", &TestConfig::listen),
                StringSetting<TestConfig>("note", "free text", &TestConfig::note, true),
                BoolSetting<TestConfig>("huge_pages", "try huge pages", &TestConfig::huge_pages),
                IntegerSetting<TestConfig>("slots", "batch slots", &TestConfig::slots, 1),
                MetricsPortSetting<TestConfig>(&TestConfig::metrics_port),
                SecondsSetting<TestConfig>("lease_seconds", "lease", &TestConfig::lease_seconds),
                SecondsSetting<TestConfig>("cache_seconds", "cache, 0 off",
                                           &TestConfig::cache_seconds, true),
                ByteSizeSetting<TestConfig>("pool_bytes", "pool size", &TestConfig::pool_bytes),
                EnumSetting<TestConfig>("device", "where to run", &TestConfig::device,
                                        {"cpu", "cuda"}),
                ListSetting<TestConfig>("extra_arg", "extra arguments", &TestConfig::extra_args),
                IntegerSetting<TestConfig>(
                    "depth", "a nested member",
                    [](TestConfig& c) -> int32_t& { return c.nested.depth; }, 0, 10),
            },
    };
    Setting<TestConfig> key =
        StringSetting<TestConfig>("api_key", "secret key", &TestConfig::api_key, true);
    key.spec.secret = true;
    t->settings.push_back(std::move(key));
    for (Setting<TestConfig>& s :
         TlsSettings<TestConfig>([](TestConfig& c) -> TlsConfig& { return c.tls; })) {
      t->settings.push_back(std::move(s));
    }
    return t;
  }();
  return *table;
}

class SettingsTest : public ::testing::Test {
 protected:
  // A file of its own per test process: CTest runs this binary's tests in parallel processes.
  std::string WriteFile(const std::string& text) {
    std::string path = ::testing::TempDir() + "/node_settings_test." +
                       ::testing::UnitTest::GetInstance()->current_test_info()->name() + "." +
                       std::to_string(::getpid()) + ".yaml";
    std::ofstream(path) << text;
    return path;
  }
  EnvLookup Env() {
    return [this](const std::string& name) -> std::optional<std::string> {
      auto it = env_.find(name);
      if (it == env_.end()) return std::nullopt;
      return it->second;
    };
  }
  absl::StatusOr<ResolvedConfig<TestConfig>> Resolve(
      const std::map<std::string, std::string>& flags,
      std::optional<std::string> file = std::nullopt) {
    return node::Resolve(Table(), flags, file, Env());
  }
  absl::StatusOr<ResolvedConfig<TestConfig>> Parse(std::vector<std::string> args,
                                                   bool* print_config = nullptr) {
    args.insert(args.begin(), "kvr-test");
    std::vector<const char*> argv;
    for (const std::string& a : args) argv.push_back(a.c_str());
    return ParseCommandLine(Table(), static_cast<int>(argv.size()), argv.data(), Env(),
                            print_config);
  }
  std::map<std::string, std::string> env_;
};

TEST_F(SettingsTest, DefaultsAreTheConfigStructs) {
  auto r = Resolve({});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->config.slots, 8u);
  EXPECT_EQ(r->config.pool_bytes, uint64_t{1} << 30);
  EXPECT_EQ(r->sources.front(), "default");
  EXPECT_EQ(r->sources.size(), Table().settings.size());
}

TEST_F(SettingsTest, FlagBeatsFileBeatsEnvBeatsLegacyEnvBeatsDefault) {
  env_ = {{"KVR_TEST_LISTEN", "env:1"},
          {"KVR_TEST_SLOTS", "5"},
          {"KVR_TEST_LEASE_SECONDS", "9"},
          {"KVR_LEASE_SECONDS", "11"},  // the older spelling loses to the new one
          {"KVR_POOL_BYTES", "2GiB"}};  // and is read when the new one is unset
  const std::string file = WriteFile("listen: file:2\nslots: 4\n");
  auto r = Resolve({{"listen", "flag:3"}}, file);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->config.listen, "flag:3");  // flag over file and env
  EXPECT_EQ(r->config.slots, 4u);         // file over env
  EXPECT_EQ(r->config.lease_seconds, 9);  // env over legacy env and default
  EXPECT_EQ(r->config.pool_bytes, uint64_t{2} << 30);
  EXPECT_EQ(r->config.metrics_port, 0);  // default
  const std::string text = FormatConfig(Table(), *r);
  EXPECT_THAT(text, HasSubstr("listen: flag:3  # flag\n"));
  EXPECT_THAT(text, HasSubstr("slots: 4  # file\n"));
  EXPECT_THAT(text, HasSubstr("lease_seconds: 9  # env KVR_TEST_LEASE_SECONDS\n"));
  EXPECT_THAT(text, HasSubstr("pool_bytes: 2GiB  # env KVR_POOL_BYTES\n"));
  EXPECT_THAT(text, HasSubstr("metrics_port: 0  # default\n"));
}

TEST_F(SettingsTest, BadValuesNameTheSettingAndTheirSource) {
  auto flag = Resolve({{"slots", "0"}});
  EXPECT_TRUE(absl::IsInvalidArgument(flag.status()));
  EXPECT_THAT(flag.status().message(), HasSubstr("slots (flag --slots): '0' is not a positive"));

  env_ = {{"KVR_TEST_LEASE_SECONDS", "-1"}};
  auto env = Resolve({});
  EXPECT_THAT(env.status().message(),
              HasSubstr("lease_seconds (environment KVR_TEST_LEASE_SECONDS): '-1'"));
  env_ = {{"KVR_LEASE_SECONDS", "soon"}};
  EXPECT_THAT(Resolve({}).status().message(),
              HasSubstr("lease_seconds (environment KVR_LEASE_SECONDS): 'soon'"));
  env_.clear();

  const std::string file = WriteFile("pool_bytes: 4 parsecs\n");
  auto from_file = Resolve({}, file);
  EXPECT_THAT(from_file.status().message(),
              HasSubstr("pool_bytes (config file " + file + "): '4 parsecs'"));

  EXPECT_THAT(Resolve({{"device", "tpu"}}).status().message(),
              HasSubstr("device (flag --device): 'tpu' is not one of cpu, cuda"));
  EXPECT_THAT(Resolve({{"huge_pages", "maybe"}}).status().message(),
              HasSubstr("huge_pages (flag --huge-pages): 'maybe' is not a boolean"));
  EXPECT_THAT(Resolve({{"metrics_port", "70000"}}).status().message(),
              HasSubstr("'70000' is not an integer from -1 to 65535"));
  EXPECT_THAT(Resolve({{"depth", "11"}}).status().message(), HasSubstr("depth (flag --depth)"));
  EXPECT_THAT(Resolve({{"listen", ""}}).status().message(),
              HasSubstr("listen (flag --listen): must not be empty"));
  EXPECT_TRUE(Resolve({{"note", ""}}).ok());
  EXPECT_TRUE(Resolve({{"cache_seconds", "0"}}).ok());
  EXPECT_FALSE(Resolve({{"lease_seconds", "0"}}).ok());
  EXPECT_FALSE(Resolve({{"lease_seconds", "nan"}}).ok());
}

TEST_F(SettingsTest, UnknownOrMalformedFileKeysNameTheKeyAndTheFile) {
  const std::string typo = WriteFile("listen: a:1\nlistne: b:2\n");
  auto unknown = Resolve({}, typo);
  EXPECT_TRUE(absl::IsInvalidArgument(unknown.status()));
  EXPECT_THAT(unknown.status().message(),
              HasSubstr("config file " + typo + ": unknown setting 'listne'"));

  const std::string nested = WriteFile("listen:\n  host: a\n");
  EXPECT_THAT(Resolve({}, nested).status().message(), HasSubstr("listen: expected a single value"));
  const std::string not_a_map = WriteFile("- listen\n");
  EXPECT_THAT(Resolve({}, not_a_map).status().message(), HasSubstr("expected a map"));
  EXPECT_THAT(Resolve({}, std::string("/nonexistent/kvr.yaml")).status().message(),
              HasSubstr("/nonexistent/kvr.yaml"));
  EXPECT_TRUE(Resolve({}, WriteFile("")).ok());  // an empty file sets nothing
}

TEST_F(SettingsTest, ByteSizesAreDecimalOrBinaryAsWrittenAndPrintExactly) {
  auto r = Resolve({{"pool_bytes", "4GB"}});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->config.pool_bytes, 4'000'000'000u);
  EXPECT_THAT(FormatConfig(Table(), r->config), HasSubstr("pool_bytes: 4GB\n"));
  r = Resolve({{"pool_bytes", "4GiB"}});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->config.pool_bytes, uint64_t{4} << 30);
  EXPECT_THAT(FormatConfig(Table(), r->config), HasSubstr("pool_bytes: 4GiB\n"));
  r = Resolve({{"pool_bytes", "4097"}});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(FormatConfig(Table(), r->config), HasSubstr("pool_bytes: 4097\n"));
  EXPECT_FALSE(Resolve({{"pool_bytes", "0"}}).ok());
}

TEST_F(SettingsTest, EffectiveConfigReadsBackAsTheSameConfig) {
  env_ = {{"KVR_TEST_EXTRA_ARG", "--a=1 --b"}};
  auto r = Resolve({{"note", "a: b # c"},
                    {"device", "cuda"},
                    {"pool_bytes", "1000001"},
                    {"lease_seconds", "0.25"},
                    {"huge_pages", "off"}});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->config.extra_args, (std::vector<std::string>{"--a=1", "--b"}));
  const std::string text = FormatConfig(Table(), *r);
  env_.clear();
  auto again = Resolve({}, WriteFile(text));
  ASSERT_TRUE(again.ok()) << again.status() << "\n" << text;
  EXPECT_EQ(FormatConfig(Table(), again->config), FormatConfig(Table(), r->config));
  EXPECT_EQ(again->config.note, "a: b # c");
}

TEST_F(SettingsTest, SecretsArePrintedRedacted) {
  auto r = Resolve({{"api_key", "s3cret"}});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->config.api_key, "s3cret");
  EXPECT_THAT(FormatConfig(Table(), *r), Not(HasSubstr("s3cret")));
  EXPECT_THAT(FormatConfig(Table(), *r), HasSubstr("api_key: <redacted>"));
}

TEST_F(SettingsTest, CommandLineIsTypedAndShowsDefaults) {
  auto help = Parse({"--help"});
  ASSERT_TRUE(absl::IsCancelled(help.status()));
  const std::string text(help.status().message());
  EXPECT_THAT(text, HasSubstr("--slots INT=8"));
  EXPECT_THAT(text, HasSubstr("--pool-bytes BYTES=1GiB"));
  EXPECT_THAT(text, HasSubstr("--lease-seconds SECONDS=5"));
  EXPECT_THAT(text, HasSubstr("--device cpu|cuda=cpu"));
  EXPECT_THAT(text, HasSubstr("--huge-pages BOOL=true"));
  EXPECT_THAT(text, HasSubstr("--config FILE"));
  EXPECT_THAT(text, HasSubstr("--print-config"));
  EXPECT_THAT(text, HasSubstr("4GB (x 1000^3)"));

  bool print = false;
  env_ = {{"KVR_TEST_HUGE_PAGES", "false"}};  // a bare flag means true, over the environment
  auto r = Parse({"--huge-pages", "--slots=3", "--slots", "6", "--extra-arg=--x=1", "--extra-arg",
                  "--y", "--print-config"},
                 &print);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(print);
  EXPECT_TRUE(r->config.huge_pages);
  EXPECT_EQ(r->config.slots, 6u);  // the last one given
  EXPECT_EQ(r->config.extra_args, (std::vector<std::string>{"--x=1", "--y"}));
  env_.clear();
  r = Parse({"--slots=3", "--huge-pages"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->config.huge_pages);
  r = Parse({"--huge-pages=false"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->config.huge_pages);
  r = Parse({"--huge-pages", "no", "--slots", "2"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->config.huge_pages);
  EXPECT_EQ(r->config.slots, 2u);

  auto unknown = Parse({"--slotz", "3"});
  EXPECT_TRUE(absl::IsInvalidArgument(unknown.status()));
  EXPECT_THAT(Parse({"--slots", "many"}).status().message(), HasSubstr("slots (flag --slots)"));
}

}  // namespace
}  // namespace kvr::node
