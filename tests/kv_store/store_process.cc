#include "store_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

extern char** environ;

namespace kvr::kv_store::testing {
namespace {

// Spawns argv with stdout+stderr on a pipe; returns {pid, read fd}.
absl::StatusOr<std::pair<pid_t, int>> Spawn(const std::vector<std::string>& argv,
                                            const std::vector<std::string>& env) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return absl::InternalError("pipe failed");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 1);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 2);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
  for (const std::string& e : env) env_strings.push_back(e);
  std::vector<char*> envp;
  for (std::string& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  // The child must not inherit a blocked SIGTERM from a test thread's mask.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, args[0], &actions, &attr, args.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  close(fds[1]);
  if (rc != 0) {
    close(fds[0]);
    return absl::InternalError(absl::StrFormat("posix_spawn %s: %s", argv[0], strerror(rc)));
  }
  return std::make_pair(pid, fds[0]);
}

// Appends what `fd` has within `timeout`; false on EOF.
bool ReadSome(int fd, std::string& out, absl::Duration timeout) {
  pollfd p{.fd = fd, .events = POLLIN, .revents = 0};
  const int ready = poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout)));
  if (ready <= 0) return true;
  char buf[4096];
  const ssize_t n = read(fd, buf, sizeof(buf));
  if (n <= 0) return false;
  out.append(buf, static_cast<size_t>(n));
  return true;
}

}  // namespace

absl::StatusOr<StoreProcess> StoreProcess::Start(std::vector<std::string> argv,
                                                 std::vector<std::string> env,
                                                 absl::Duration startup) {
  auto spawned = Spawn(argv, env);
  if (!spawned.ok()) return spawned.status();
  StoreProcess proc;
  proc.pid_ = spawned->first;
  proc.stdout_fd_ = spawned->second;
  const absl::Time deadline = absl::Now() + startup;
  constexpr std::string_view kMarker = "listening port=";
  while (absl::Now() < deadline) {
    if (!ReadSome(proc.stdout_fd_, proc.output_, absl::Milliseconds(100))) break;
    const size_t at = proc.output_.find(kMarker);
    if (at == std::string::npos) continue;
    const size_t end = proc.output_.find(' ', at + kMarker.size());
    if (end == std::string::npos) continue;
    int port = 0;
    if (absl::SimpleAtoi(proc.output_.substr(at + kMarker.size(), end - at - kMarker.size()),
                         &port) &&
        port > 0) {
      proc.port_ = port;
      return proc;
    }
  }
  const std::string out = proc.output_;
  proc.Kill(SIGKILL);
  return absl::UnavailableError(
      absl::StrCat("kvr-store did not report its port; output:\n", out));
}

StoreProcess::StoreProcess(StoreProcess&& other) noexcept { *this = std::move(other); }

StoreProcess& StoreProcess::operator=(StoreProcess&& other) noexcept {
  if (this != &other) {
    if (pid_ > 0) Kill(SIGKILL);
    pid_ = std::exchange(other.pid_, -1);
    port_ = std::exchange(other.port_, 0);
    stdout_fd_ = std::exchange(other.stdout_fd_, -1);
    output_ = std::move(other.output_);
  }
  return *this;
}

StoreProcess::~StoreProcess() {
  if (pid_ > 0) Kill(SIGKILL);
}

int StoreProcess::Kill(int sig) {
  int status = -1;
  if (pid_ > 0) {
    kill(pid_, sig);
    if (stdout_fd_ >= 0) {
      while (ReadSome(stdout_fd_, output_, absl::Milliseconds(2000))) {
        if (waitpid(pid_, &status, WNOHANG) == pid_) {
          pid_ = -1;
          break;
        }
      }
    }
    if (pid_ > 0) waitpid(pid_, &status, 0);
    pid_ = -1;
  }
  if (stdout_fd_ >= 0) close(stdout_fd_);
  stdout_fd_ = -1;
  return status;
}

absl::StatusOr<RunResult> RunProcess(std::vector<std::string> argv,
                                     std::vector<std::string> env, absl::Duration timeout) {
  auto spawned = Spawn(argv, env);
  if (!spawned.ok()) return spawned.status();
  const auto [pid, fd] = *spawned;
  RunResult result;
  const absl::Time deadline = absl::Now() + timeout;
  bool open = true;
  while (open && absl::Now() < deadline) open = ReadSome(fd, result.output, absl::Milliseconds(200));
  if (open) kill(pid, SIGKILL);
  close(fd);
  int status = 0;
  waitpid(pid, &status, 0);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  if (open) {
    return absl::DeadlineExceededError(
        absl::StrCat(argv[0], " ran past ", absl::FormatDuration(timeout), "; output:\n",
                     result.output));
  }
  return result;
}

}  // namespace kvr::kv_store::testing
