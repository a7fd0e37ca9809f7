#pragma once
// A kvr-store child process for integration tests: started with posix_spawn (optionally
// under `ip netns exec`), its port read from its "listening port=" line, killed on
// destruction.

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvr::kv_store::testing {

class StoreProcess {
 public:
  // Runs `argv` (argv[0] a path) with extra environment entries ("NAME=value"), waits up to
  // `startup` for the port line.
  [[nodiscard]] static absl::StatusOr<StoreProcess> Start(std::vector<std::string> argv,
                                                          std::vector<std::string> env,
                                                          absl::Duration startup);
  StoreProcess(StoreProcess&& other) noexcept;
  StoreProcess& operator=(StoreProcess&& other) noexcept;
  StoreProcess(const StoreProcess&) = delete;
  StoreProcess& operator=(const StoreProcess&) = delete;
  ~StoreProcess();

  pid_t pid() const { return pid_; }
  int port() const { return port_; }
  const std::string& output() const { return output_; }
  // Sends `sig` and reaps the process; returns its wait status.
  int Kill(int sig);

 private:
  StoreProcess() = default;
  pid_t pid_ = -1;
  int port_ = 0;
  int stdout_fd_ = -1;
  std::string output_;
};

// Runs `argv` to completion with extra environment entries; returns {exit status, output}.
struct RunResult {
  int exit_code = -1;
  std::string output;
};
[[nodiscard]] absl::StatusOr<RunResult> RunProcess(std::vector<std::string> argv,
                                                   std::vector<std::string> env,
                                                   absl::Duration timeout);

// Environment entries that make UCX use TCP on the loopback device: a store and its clients on
// 127.0.0.1, whatever else the machine has.
[[nodiscard]] std::vector<std::string> LoopbackUcxEnv();

// The kvr-store at `binary` on 127.0.0.1 (a free port) with a 64 MiB pool of 64 KiB pages, no
// metrics port and LoopbackUcxEnv(), given `flags` besides; waits up to 20 s for its port line.
[[nodiscard]] absl::StatusOr<StoreProcess> StartLoopbackStore(const std::string& binary,
                                                              std::vector<std::string> flags);

}  // namespace kvr::kv_store::testing
