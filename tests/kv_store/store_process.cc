#include "store_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

extern char** environ;

namespace kvr::kv_store::testing {
namespace {

// Spawns argv with stdout+stderr on a pipe; returns {pid, read fd}. The child gets SIGKILL
// when the spawning thread dies, so a test killed by its ctest timeout leaves no store behind.
absl::StatusOr<std::pair<pid_t, int>> Spawn(const std::vector<std::string>& argv,
                                            const std::vector<std::string>& env) {
  // Everything the child needs is built before fork: after it, only async-signal-safe calls.
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
  for (const std::string& e : env) env_strings.push_back(e);
  std::vector<char*> envp;
  for (std::string& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return absl::InternalError("pipe failed");
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return absl::InternalError(absl::StrFormat("fork: %s", strerror(errno)));
  }
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(126);  // the parent died before prctl took effect
    // The child must not inherit a blocked SIGTERM from a test thread's mask.
    sigset_t none;
    sigemptyset(&none);
    pthread_sigmask(SIG_SETMASK, &none, nullptr);
    dup2(fds[1], 1);
    dup2(fds[1], 2);
    execve(args[0], args.data(), envp.data());
    _exit(127);
  }
  close(fds[1]);
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

std::vector<std::string> LoopbackUcxEnv() { return {"UCX_TLS=tcp", "UCX_NET_DEVICES=lo"}; }

absl::StatusOr<StoreProcess> StartLoopbackStore(const std::string& binary,
                                                std::vector<std::string> flags) {
  std::vector<std::string> argv = {binary,  "--listen",     "127.0.0.1:0", "--capacity-bytes",
                                   "64MiB", "--page-bytes", "64KiB",       "--metrics-port",
                                   "-1"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  return StoreProcess::Start(std::move(argv), LoopbackUcxEnv(), absl::Seconds(20));
}

}  // namespace kvr::kv_store::testing
