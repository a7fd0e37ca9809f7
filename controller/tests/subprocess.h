#pragma once
// A child process whose stdout lines the test can wait for (test helper).

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

extern char** environ;

namespace kvr::controller::testing {

class Subprocess {
 public:
  explicit Subprocess(std::vector<std::string> argv) {
    int fds[2];
    if (pipe(fds) != 0) return;
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
    posix_spawn_file_actions_addclose(&actions, fds[0]);
    std::vector<char*> args;
    for (std::string& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    if (posix_spawn(&pid_, args[0], &actions, nullptr, args.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&actions);
    close(fds[1]);
    reader_ = std::thread([this, fd = fds[0]] { ReadLines(fd); });
  }
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;
  ~Subprocess() {
    Stop(SIGTERM);
    reader_.join();
  }

  bool started() const { return pid_ > 0; }

  // Waits for a stdout line starting with `prefix` and returns it ("" on timeout or exit).
  std::string WaitForLine(const std::string& prefix, absl::Duration timeout = absl::Seconds(10)) {
    absl::MutexLock lock(&mu_);
    auto found = [&]() -> const std::string* {
      for (const std::string& l : lines_) {
        if (absl::StartsWith(l, prefix)) return &l;
      }
      return nullptr;
    };
    auto ready = [&] { return found() != nullptr || eof_; };
    mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
    const std::string* l = found();
    return l == nullptr ? "" : *l;
  }

  std::vector<std::string> Lines() {
    absl::MutexLock lock(&mu_);
    return lines_;
  }

  // Kills the process (SIGKILL: no cleanup, like a crashed node) and reaps it.
  void Kill() { Stop(SIGKILL); }

  // Sends `signal`, waits up to 2 s for the exit (then SIGKILL) and returns the wait status.
  int Stop(int signal) {
    if (pid_ <= 0) return -1;
    kill(pid_, signal);
    int status = -1;
    for (int i = 0; i < 300 && waitpid(pid_, &status, WNOHANG) == 0; ++i) {
      usleep(10'000);
      if (i == 200) kill(pid_, SIGKILL);
    }
    pid_ = -1;
    return status;
  }

 private:
  void ReadLines(int fd) {
    std::string partial;
    char buf[4096];
    ssize_t n;
    while ((n = read(fd, buf, sizeof(buf))) > 0) {
      partial.append(buf, static_cast<size_t>(n));
      size_t pos;
      while ((pos = partial.find('\n')) != std::string::npos) {
        absl::MutexLock lock(&mu_);
        lines_.push_back(partial.substr(0, pos));
        partial.erase(0, pos + 1);
      }
    }
    close(fd);
    absl::MutexLock lock(&mu_);
    eof_ = true;
  }

  pid_t pid_ = -1;
  std::thread reader_;
  absl::Mutex mu_;
  std::vector<std::string> lines_;
  bool eof_ = false;
};

}  // namespace kvr::controller::testing
