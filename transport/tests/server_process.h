#pragma once
// Runs transport_test_server as a child process (fork + exec) and reads its worker address.

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace kvr::transport::testing {

class ServerProcess {
 public:
  // Starts `binary <tls> <spin_us>` and waits for the address line.
  static absl::StatusOr<ServerProcess> Start(const std::string& binary, const std::string& tls,
                                             const std::string& spin_us = "50") {
    int to_child[2], from_child[2];
    if (pipe2(to_child, O_CLOEXEC) != 0 || pipe2(from_child, O_CLOEXEC) != 0) return absl::InternalError("pipe");
    pid_t pid = fork();
    if (pid < 0) return absl::InternalError("fork");
    if (pid == 0) {
      dup2(to_child[0], 0);
      dup2(from_child[1], 1);
      close(to_child[0]);
      close(to_child[1]);
      close(from_child[0]);
      close(from_child[1]);
      execl(binary.c_str(), binary.c_str(), tls.c_str(), spin_us.c_str(),
            static_cast<char*>(nullptr));
      _exit(127);
    }
    close(to_child[0]);
    close(from_child[1]);
    ServerProcess p;
    p.pid_ = pid;
    p.stdin_fd_ = to_child[1];
    FILE* out = fdopen(from_child[0], "r");
    char line[4096];
    bool got = fgets(line, sizeof(line), out) != nullptr;
    fclose(out);
    if (!got) return absl::InternalError(absl::StrCat(binary, " printed no address"));
    std::string hex(line);
    while (!hex.empty() && (hex.back() == '\n' || hex.back() == '\r')) hex.pop_back();
    p.address_ = absl::HexStringToBytes(hex);
    return p;
  }

  ServerProcess(ServerProcess&& o) noexcept
      : pid_(std::exchange(o.pid_, -1)),
        stdin_fd_(std::exchange(o.stdin_fd_, -1)),
        address_(std::move(o.address_)) {}
  ServerProcess& operator=(ServerProcess&&) = delete;
  ~ServerProcess() {
    if (stdin_fd_ >= 0) close(stdin_fd_);  // EOF: the server shuts down cleanly
    if (pid_ > 0) waitpid(pid_, nullptr, 0);
  }

  const std::string& address() const { return address_; }
  void Kill() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }

 private:
  ServerProcess() = default;
  pid_t pid_ = -1;
  int stdin_fd_ = -1;
  std::string address_;
};

}  // namespace kvr::transport::testing
