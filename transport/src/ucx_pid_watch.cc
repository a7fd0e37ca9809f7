// Same-host peers of the UCX data plane are connected in error mode NONE (shared memory), so
// UCX does not report their death: a pidfd per peer process, watched in the progress loop's
// epoll set, does (AddressPrefix in ucx_internal.h says why).

#include <sys/epoll.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "ucx_internal.h"

namespace kvr::transport {
namespace internal {

absl::Status WorkerCore::OpenPidWatch(EndpointState* state, uint32_t pid) {
  state->peer_pid = static_cast<int>(pid);
  // glibc 2.36 declares pidfd_open but does not export it; use the system call.
  state->pid_fd = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0));
  if (state->pid_fd < 0) {
    return absl::UnavailableError(absl::StrCat("peer '", state->peer_name, "' (pid ", pid,
                                               ") is not running: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

void WorkerCore::ArmPidWatch(EndpointState* state) {
  if (state->pid_fd < 0) return;
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = state->pid_fd;
  epoll_ctl(epoll_fd, EPOLL_CTL_ADD, state->pid_fd, &ev);
  pid_watches[state->pid_fd] = state;
}

void WorkerCore::ClosePidWatch(EndpointState* state) {
  if (state->pid_fd < 0) return;
  epoll_ctl(epoll_fd, EPOLL_CTL_DEL, state->pid_fd, nullptr);
  pid_watches.erase(state->pid_fd);
  close(state->pid_fd);
  state->pid_fd = -1;
}

void WorkerCore::CheckPidWatches(int timeout_ms, bool* woke_for_events) {
  epoll_event events[16];
  int n = epoll_wait(epoll_fd, events, 16, timeout_ms);
  for (int i = 0; i < n; ++i) {
    int fd = events[i].data.fd;
    if (fd == event_fd) {
      uint64_t count;
      ssize_t r = read(event_fd, &count, sizeof(count));
      (void)r;
      continue;
    }
    auto it = pid_watches.find(fd);
    if (it == pid_watches.end()) continue;
    EndpointState* state = it->second;
    FailEndpoint(state, absl::UnavailableError(absl::StrCat("peer '", state->peer_name, "' (pid ",
                                                            state->peer_pid, ") exited")));
  }
  if (woke_for_events != nullptr) *woke_for_events = n > 0;
}

}  // namespace internal

}  // namespace kvr::transport
