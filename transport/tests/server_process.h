#pragma once
// Runs transport_test_server as a child process (fork + exec) and reads its worker address.

#include <fcntl.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace kvr::transport::testing {

class ServerProcess {
 public:
  // Starts `binary <tls> <spin_us>` and waits for the address line.
  static absl::StatusOr<ServerProcess> Start(const std::string& binary, const std::string& tls,
                                             const std::string& spin_us = "50") {
    return StartWithArgs(binary, {tls, spin_us});
  }

  // Starts `binary args...` and returns once it printed its first line (kept as address()).
  static absl::StatusOr<ServerProcess> StartWithArgs(const std::string& binary,
                                                     const std::vector<std::string>& args) {
    int to_child[2], from_child[2];
    if (pipe2(to_child, O_CLOEXEC) != 0 || pipe2(from_child, O_CLOEXEC) != 0)
      return absl::InternalError("pipe");
    pid_t pid = fork();
    if (pid < 0) return absl::InternalError("fork");
    if (pid == 0) {
      dup2(to_child[0], 0);
      dup2(from_child[1], 1);
      close(to_child[0]);
      close(to_child[1]);
      close(from_child[0]);
      close(from_child[1]);
      std::vector<char*> argv = {const_cast<char*>(binary.c_str())};
      for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execv(binary.c_str(), argv.data());
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
    std::string first(line);
    while (!first.empty() && (first.back() == '\n' || first.back() == '\r')) first.pop_back();
    p.first_line_ = first;
    p.address_ = absl::HexStringToBytes(first);
    return p;
  }

  ServerProcess(ServerProcess&& o) noexcept
      : pid_(std::exchange(o.pid_, -1)),
        stdin_fd_(std::exchange(o.stdin_fd_, -1)),
        address_(std::move(o.address_)),
        first_line_(std::move(o.first_line_)) {}
  ServerProcess& operator=(ServerProcess&&) = delete;
  ~ServerProcess() {
    if (stdin_fd_ >= 0) close(stdin_fd_);  // EOF: the server shuts down cleanly
    if (pid_ > 0) waitpid(pid_, nullptr, 0);
  }

  const std::string& address() const { return address_; }
  const std::string& first_line() const { return first_line_; }
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
  std::string first_line_;
};

}  // namespace kvr::transport::testing
