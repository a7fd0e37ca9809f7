#pragma once
// A child process whose stdout lines the test can wait for (test helper).

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/time.h"
#include "kvr/common/line_reader.h"

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
    stdout_ = std::make_unique<LineReader>(fds[0]);
  }
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;
  ~Subprocess() { Stop(SIGTERM); }  // then stdout_ reads to EOF

  bool started() const { return pid_ > 0; }

  // Waits for a stdout line starting with `prefix` and returns it ("" on timeout or exit).
  std::string WaitForLine(const std::string& prefix, absl::Duration timeout = absl::Seconds(10)) {
    if (stdout_ == nullptr) return "";
    return stdout_
        ->Await([&](const std::string& l) { return absl::StartsWith(l, prefix); }, timeout)
        .value_or("");
  }

  std::vector<std::string> Lines() {
    return stdout_ == nullptr ? std::vector<std::string>() : stdout_->Lines();
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
  pid_t pid_ = -1;
  std::unique_ptr<LineReader> stdout_;  // null when the pipe could not be made
};

}  // namespace kvr::controller::testing
