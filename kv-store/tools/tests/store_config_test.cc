#include "store_config.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <map>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvr::kv_store {
namespace {

using ::testing::HasSubstr;

using node::EnvLookup;

EnvLookup FakeEnv(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

// The store's resolved config and its effective-config text.
struct Parsed : StoreConfig {
  std::string text;
};

absl::StatusOr<Parsed> Parse(std::vector<std::string> args, const EnvLookup& env) {
  args.insert(args.begin(), "kvr-store");
  std::vector<const char*> argv;
  for (const std::string& a : args) argv.push_back(a.c_str());
  auto r = node::ParseCommandLine(StoreSettings(), static_cast<int>(argv.size()), argv.data(), env);
  if (!r.ok()) return r.status();
  Parsed parsed{r->config, node::FormatConfig(StoreSettings(), *r)};
  return parsed;
}

// A file of its own per test process: CTest runs this binary's tests in parallel processes.
std::string WriteYaml(const std::string& text) {
  std::string path = ::testing::TempDir() + "/kvr_store_config_test." +
                     ::testing::UnitTest::GetInstance()->current_test_info()->name() + "." +
                     std::to_string(::getpid()) + ".yaml";
  std::ofstream(path) << text;
  return path;
}

TEST(ConfigTest, PrecedenceIsFlagThenFileThenEnvThenDefault) {
  const std::string path = WriteYaml("capacity_bytes: 2GiB\nevict_expired: true\n");
  auto env = FakeEnv({{"KVR_STORE_CAPACITY_BYTES", "3GiB"},
                      {"KVR_STORE_EVICT_EXPIRED", "false"},
                      {"KVR_STORE_PAGE_BYTES", "128KiB"},
                      {"KVR_STORE_LISTEN", "1.2.3.4:5"}});
  auto config = Parse({"--config", path, "--listen", "127.0.0.1:0"}, env);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->listen, "127.0.0.1:0");       // flag beats env
  EXPECT_EQ(config->capacity_bytes, 2ull << 30);  // file beats env
  EXPECT_TRUE(config->evict_expired);             // file beats env
  EXPECT_EQ(config->page_bytes, 128u << 10);      // env beats default
  EXPECT_EQ(config->data_plane_threads, 2u);      // default
  const std::string described = config->text;
  EXPECT_THAT(described, HasSubstr("listen: 127.0.0.1:0  # flag"));
  EXPECT_THAT(described, HasSubstr("capacity_bytes: 2GiB  # file"));
  EXPECT_THAT(described, HasSubstr("page_bytes: 128KiB  # env KVR_STORE_PAGE_BYTES"));
  EXPECT_THAT(described, HasSubstr("data_plane_threads: 2  # default"));
  auto options = config->ToServerOptions();
  EXPECT_EQ(options.store.pool.capacity_bytes, 2ull << 30);
  EXPECT_TRUE(options.store.evict_expired);
}

TEST(ConfigTest, EvictCachedIsOnByDefaultAndCanBeTurnedOff) {
  auto config = Parse({}, FakeEnv({}));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(config->evict_cached);
  EXPECT_TRUE(config->ToServerOptions().store.evict_cached);
  EXPECT_THAT(config->text, HasSubstr("evict_cached: true  # default"));
  config = Parse({"--config", WriteYaml("evict_cached: false\n")},
                 FakeEnv({{"KVR_STORE_EVICT_CACHED", "true"}}));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_FALSE(config->evict_cached);  // file beats env
  EXPECT_FALSE(config->ToServerOptions().store.evict_cached);
  config = Parse({"--evict-cached", "off"}, FakeEnv({}));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_FALSE(config->evict_cached);
  EXPECT_THAT(config->text, HasSubstr("evict_cached: false  # flag"));
}

TEST(ConfigTest, CachedEvictionIsLruUnlessThinIsAsked) {
  auto config = Parse({}, FakeEnv({}));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->ToServerOptions().store.cached_eviction, CachedEviction::kLru);
  EXPECT_THAT(config->text, HasSubstr("cached_eviction: lru  # default"));
  config = Parse({"--cached-eviction", "thin", "--thin-keep-fraction", "0.25"}, FakeEnv({}));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->ToServerOptions().store.cached_eviction, CachedEviction::kThin);
  EXPECT_EQ(config->ToServerOptions().store.thin_keep_fraction, 0.25);
  auto st = Parse({"--cached-eviction", "random"}, FakeEnv({})).status();
  EXPECT_THAT(st.message(), HasSubstr("cached_eviction"));
  st = Parse({"--thin-keep-fraction", "1.5"}, FakeEnv({})).status();
  EXPECT_THAT(st.message(), HasSubstr("thin_keep_fraction"));
}

TEST(ConfigTest, BadValuesNameTheOptionAndSource) {
  auto st = Parse({"--capacity-bytes", "12 parsecs"}, FakeEnv({})).status();
  EXPECT_TRUE(absl::IsInvalidArgument(st));
  EXPECT_THAT(st.message(), HasSubstr("capacity_bytes"));
  EXPECT_THAT(st.message(), HasSubstr("flag"));
  st = Parse({}, FakeEnv({{"KVR_STORE_EVICT_EXPIRED", "maybe"}})).status();
  EXPECT_THAT(
      st.message(),
      HasSubstr("evict_expired (environment KVR_STORE_EVICT_EXPIRED): 'maybe' is not a boolean"));
  st = Parse({"--config", WriteYaml("capacity: 1\n")}, FakeEnv({})).status();
  EXPECT_THAT(st.message(), HasSubstr("unknown setting 'capacity'"));
  st = Parse({"--no-such-flag"}, FakeEnv({})).status();
  EXPECT_TRUE(absl::IsInvalidArgument(st));
  EXPECT_TRUE(absl::IsCancelled(Parse({"--help"}, FakeEnv({})).status()));
}

TEST(ConfigTest, LocalSocketFromEachSourceReachesTheServerOptions) {
  auto config = Parse({}, FakeEnv({}));
  ASSERT_TRUE(config.ok());
  EXPECT_EQ(config->local_socket, "");  // off by default
  EXPECT_THAT(config->text, HasSubstr("local_socket: \"\"  # default"));
  config = Parse({}, FakeEnv({{"KVR_STORE_LOCAL_SOCKET", "/run/kvr/env.sock"}}));
  ASSERT_TRUE(config.ok());
  EXPECT_EQ(config->local_socket, "/run/kvr/env.sock");
  config = Parse({"--config", WriteYaml("local_socket: /run/kvr/file.sock\n")},
                 FakeEnv({{"KVR_STORE_LOCAL_SOCKET", "/run/kvr/env.sock"}}));
  ASSERT_TRUE(config.ok());
  EXPECT_EQ(config->local_socket, "/run/kvr/file.sock");
  config = Parse({"--local-socket", "/run/kvr/flag.sock"},
                 FakeEnv({{"KVR_STORE_LOCAL_SOCKET", "/run/kvr/env.sock"}}));
  ASSERT_TRUE(config.ok());
  EXPECT_THAT(config->text, HasSubstr("local_socket: /run/kvr/flag.sock  # flag"));
  EXPECT_EQ(config->ToServerOptions().local_socket, "/run/kvr/flag.sock");
}

TEST(ConfigTest, ByteSizesAreDecimalOrBinaryAsWritten) {
  // kvr::ParseByteSize (common): GB is 1000^3 bytes, GiB 1024^3, from every source.
  auto config = Parse({"--capacity-bytes", "4GB"}, FakeEnv({{"KVR_STORE_PAGE_BYTES", "64KiB"}}));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->capacity_bytes, 4'000'000'000u);
  EXPECT_EQ(config->page_bytes, 64u << 10);
  config = Parse({"--capacity-bytes", "4GiB"}, FakeEnv({}));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->capacity_bytes, 4ull << 30);
}

TEST(ConfigTest, TlsFilesFromEachSourceReachTheServerOptions) {
  auto config = Parse({"--tls-ca", "/etc/kvr/ca.pem", "--tls-cert", "/etc/kvr/store.pem"},
                      FakeEnv({{"KVR_STORE_TLS_KEY", "/etc/kvr/store-key.pem"}}));
  ASSERT_TRUE(config.ok()) << config.status();
  const StoreServerOptions options = config->ToServerOptions();
  EXPECT_EQ(options.tls.ca_file, "/etc/kvr/ca.pem");
  EXPECT_EQ(options.tls.cert_file, "/etc/kvr/store.pem");
  EXPECT_EQ(options.tls.key_file, "/etc/kvr/store-key.pem");
  EXPECT_THAT(config->text, HasSubstr("tls_key: /etc/kvr/store-key.pem  # env KVR_STORE_TLS_KEY"));
  config = Parse({"--config", WriteYaml("tls_ca: /etc/kvr/file-ca.pem\n")}, FakeEnv({}));
  ASSERT_TRUE(config.ok());
  EXPECT_EQ(config->tls.ca_file, "/etc/kvr/file-ca.pem");
  // A partial configuration is refused when the server starts, naming the missing setting.
  StoreServerOptions partial;
  partial.store.pool = {.capacity_bytes = 1 << 20, .page_bytes = 64 << 10};
  partial.tls.ca_file = "/etc/kvr/ca.pem";
  partial.tls.cert_file = "/etc/kvr/store.pem";
  auto server = StoreServer::Start(partial);
  ASSERT_FALSE(server.ok());
  EXPECT_THAT(std::string(server.status().message()), HasSubstr("tls_key"));
}

}  // namespace
}  // namespace kvr::kv_store
