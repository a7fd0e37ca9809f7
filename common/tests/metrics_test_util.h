#pragma once
// Test helpers for metrics: a registry without an HTTP server, a minimal HTTP GET (tests must
// not depend on curl being present) and `promtool check metrics` on a text exposition. Shared
// by the metric-set tests of every role (CMake target kvr::metrics_test_util).

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <initializer_list>
#include <memory>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kvr/common/metrics.h"

#ifndef KVR_PROMTOOL
#define KVR_PROMTOOL "promtool"
#endif

namespace kvr::metrics::testing {

// GET http://127.0.0.1:<port><path>; returns the body of a 200 response.
inline absl::StatusOr<std::string> HttpGet(int port, const std::string& path = "/metrics") {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError("socket failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("cannot connect to 127.0.0.1:", port));
  }
  const std::string request =
      absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  if (write(fd, request.data(), request.size()) != static_cast<ssize_t>(request.size())) {
    close(fd);
    return absl::InternalError("short write");
  }
  std::string response;
  char buf[8192];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) response.append(buf, static_cast<size_t>(n));
  close(fd);
  const size_t header_end = response.find("\r\n\r\n");
  if (header_end == std::string::npos || response.find(" 200 ") > response.find("\r\n")) {
    return absl::InternalError(absl::StrCat("bad HTTP response: ", response.substr(0, 200)));
  }
  return response.substr(header_end + 4);
}

// Runs `promtool check metrics` on `text`. Returns promtool's output (empty when clean) and
// sets *exit_code. promtool path: KVR_PROMTOOL compile definition or "promtool".
inline std::string PromtoolCheck(const std::string& text, int* exit_code,
                                 const std::string& promtool = "promtool") {
  char name[] = "/tmp/kvr_metrics_XXXXXX";
  const int fd = mkstemp(name);
  if (fd < 0) {
    *exit_code = -1;
    return "mkstemp failed";
  }
  close(fd);
  std::ofstream(name) << text;
  const std::string cmd = absl::StrCat(promtool, " check metrics < ", name, " 2>&1");
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  *exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  unlink(name);
  return out;
}

// A MetricsServer without HTTP (ScrapeText() renders it) for role `role`, named role-0.
inline std::unique_ptr<MetricsServer> Offline(const std::string& role) {
  auto server = MetricsServer::Start({.port = -1, .role = role, .node_name = role + "-0"});
  EXPECT_TRUE(server.ok()) << server.status();
  return std::move(*server);
}

// Expects each of `lines` (exposition lines, or parts of one) to appear in the exposition `text`:
// one EXPECT_THAT(text, HasSubstr(line)) a line.
inline void ExpectExposes(const std::string& text, std::initializer_list<std::string> lines) {
  for (const std::string& line : lines) EXPECT_THAT(text, ::testing::HasSubstr(line));
}

// Fails the test when promtool finds anything to say about `text`; skips it without promtool.
inline void ExpectPromtoolClean(const std::string& text) {
  if (std::string(KVR_PROMTOOL).empty()) GTEST_SKIP() << "promtool not found at configure time";
  int code = 0;
  const std::string out = PromtoolCheck(text, &code, KVR_PROMTOOL);
  EXPECT_EQ(code, 0) << out << "\n--- exposition ---\n" << text;
  EXPECT_EQ(out, "") << text;
}

}  // namespace kvr::metrics::testing
