#include "local_pool_socket.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "kvr/common/instance_id.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

namespace kvr::kv_store {
namespace {

absl::StatusOr<sockaddr_un> SocketAddress(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "local socket path '%s' must be 1 to %d bytes long", path, sizeof(addr.sun_path) - 1));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  return addr;
}

std::string Errno() { return strerror(errno); }

// An owned fd closed on scope exit unless released.
class ScopedFd {
 public:
  explicit ScopedFd(int fd) : fd_(fd) {}
  ~ScopedFd() {
    if (fd_ >= 0) close(fd_);
  }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

}  // namespace

absl::StatusOr<std::string> ReadHostId() {
  std::string id = HostId();
  if (id.empty()) {
    return absl::UnavailableError("cannot read /proc/sys/kernel/random/boot_id");
  }
  return id;
}

absl::StatusOr<std::unique_ptr<LocalPoolServer>> LocalPoolServer::Start(const std::string& path,
                                                                        const PagePool& pool) {
  auto addr = SocketAddress(path);
  if (!addr.ok()) return addr.status();
  // The pool makes its id from 16 random bytes as 32 hex digits.
  const std::string raw_id = absl::HexStringToBytes(pool.pool_id());
  if (raw_id.size() != 16) {
    return absl::InternalError(absl::StrCat("malformed pool id ", pool.pool_id()));
  }
  std::unique_ptr<LocalPoolServer> server(new LocalPoolServer());
  server->path_ = path;
  server->hello_.pool_bytes = pool.mapped_bytes();
  server->hello_.page_bytes = pool.page_bytes();
  std::memcpy(server->hello_.pool_id, raw_id.data(), 16);

  // A leftover socket file of a store that died is replaced; one where a store still answers
  // is not taken over.
  struct stat st {};
  if (lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrFormat("local socket path %s exists and is not a socket", path));
    }
    ScopedFd probe(socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (probe.get() >= 0 &&
        (connect(probe.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr)) == 0 ||
         errno == EAGAIN)) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "local socket %s is served by another live process (another kvr-store?)", path));
    }
    if (unlink(path.c_str()) != 0) {
      return absl::FailedPreconditionError(
          absl::StrFormat("cannot remove the stale local socket %s: %s", path, Errno()));
    }
  }

  server->listen_fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (server->listen_fd_ < 0) {
    return absl::UnavailableError(absl::StrFormat("local socket: socket(): %s", Errno()));
  }
  if (bind(server->listen_fd_, reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr)) != 0) {
    return absl::UnavailableError(
        absl::StrFormat("cannot bind the local socket %s: %s", path, Errno()));
  }
  server->bound_ = true;  // from here on the socket file is ours to remove
  // Connections only succeed after listen(), so the mode is 0600 before anyone can connect,
  // whatever the umask made of the file at bind().
  if (chmod(path.c_str(), 0600) != 0 || listen(server->listen_fd_, 64) != 0) {
    return absl::UnavailableError(
        absl::StrFormat("cannot set up the local socket %s: %s", path, Errno()));
  }
  // Readers get a read-only reopening of the memfd, never the store's read-write fd.
  server->pool_fd_ = open(absl::StrCat("/proc/self/fd/", pool.fd()).c_str(), O_RDONLY | O_CLOEXEC);
  server->stop_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (server->pool_fd_ < 0 || server->stop_fd_ < 0) {
    return absl::UnavailableError(
        absl::StrFormat("local socket %s: cannot reopen the pool read-only: %s", path, Errno()));
  }
  server->thread_ = std::thread([raw = server.get()] { raw->Run(); });
  return server;
}

LocalPoolServer::~LocalPoolServer() {
  Stop();
  for (int fd : {listen_fd_, pool_fd_, stop_fd_}) {
    if (fd >= 0) close(fd);
  }
  if (bound_) unlink(path_.c_str());
}

void LocalPoolServer::Stop() {
  if (!thread_.joinable()) return;
  const uint64_t one = 1;
  (void)!write(stop_fd_, &one, sizeof(one));
  thread_.join();
}

void LocalPoolServer::Run() {
  for (;;) {
    pollfd fds[2] = {{.fd = listen_fd_, .events = POLLIN, .revents = 0},
                     {.fd = stop_fd_, .events = POLLIN, .revents = 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      std::fprintf(stderr, "kvr-store local socket %s: poll: %s; no longer serving\n",
                   path_.c_str(), Errno().c_str());
      return;
    }
    if (fds[1].revents != 0) return;
    for (;;) {
      const int conn = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (conn < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
        // Out of fds or similar: log, back off a little instead of spinning on a readable
        // socket, and try again.
        std::fprintf(stderr, "kvr-store local socket %s: accept: %s\n", path_.c_str(),
                     Errno().c_str());
        pollfd stop = {.fd = stop_fd_, .events = POLLIN, .revents = 0};
        if (poll(&stop, 1, 100) > 0) return;
        break;
      }
      Serve(conn);
      close(conn);
    }
  }
}

void LocalPoolServer::Serve(int conn) {
  ucred peer{};
  socklen_t peer_len = sizeof(peer);
  const bool have_peer = getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &peer, &peer_len) == 0;
  iovec iov{.iov_base = &hello_, .iov_len = sizeof(hello_)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
  cmsg->cmsg_level = SOL_SOCKET;
  cmsg->cmsg_type = SCM_RIGHTS;
  cmsg->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(cmsg), &pool_fd_, sizeof(int));
  // A fresh connection's send buffer takes 48 bytes at once; anything else (EAGAIN included)
  // is the peer's problem, not a reason to wait.
  const ssize_t sent = sendmsg(conn, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (sent != static_cast<ssize_t>(sizeof(hello_))) {
    std::fprintf(stderr, "kvr-store local socket %s: handing the pool to pid %d failed: %s\n",
                 path_.c_str(), have_peer ? peer.pid : -1,
                 sent < 0 ? Errno().c_str() : "short send");
    return;
  }
  handed_out_.fetch_add(1, std::memory_order_relaxed);
  std::fprintf(stderr, "kvr-store local socket %s: handed the pool to pid %d uid %d\n",
               path_.c_str(), have_peer ? peer.pid : -1,
               have_peer ? static_cast<int>(peer.uid) : -1);
}

absl::StatusOr<ReceivedPool> ReceivePoolFd(const std::string& path, absl::Time deadline) {
  auto addr = SocketAddress(path);
  if (!addr.ok()) return addr.status();
  ScopedFd sock(socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (sock.get() < 0) {
    return absl::UnavailableError(absl::StrFormat("local socket %s: socket(): %s", path, Errno()));
  }
  // A Unix-socket connect completes at once; EAGAIN means the listener's backlog is full.
  while (connect(sock.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr)) != 0) {
    if ((errno != EAGAIN && errno != EINTR) || absl::Now() >= deadline) {
      return absl::UnavailableError(
          absl::StrFormat("cannot connect to the local socket %s: %s", path, Errno()));
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  ReceivedPool received;
  alignas(cmsghdr) char control[CMSG_SPACE(4 * sizeof(int))] = {};
  iovec iov{.iov_base = &received.hello, .iov_len = sizeof(received.hello)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n = -1;
  for (;;) {
    const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left_ms <= 0) {
      return absl::UnavailableError(
          absl::StrFormat("local socket %s: no pool handed over before the deadline", path));
    }
    pollfd p{.fd = sock.get(), .events = POLLIN, .revents = 0};
    if (poll(&p, 1, static_cast<int>(std::min<int64_t>(left_ms, 1000))) <= 0) continue;
    n = recvmsg(sock.get(), &msg, MSG_CMSG_CLOEXEC);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    break;
  }
  // Take every fd that came, so none leaks whatever else is wrong.
  int first_fd = -1;
  for (cmsghdr* c = n < 0 ? nullptr : CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int got = -1;
      std::memcpy(&got, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      if (first_fd < 0) {
        first_fd = got;
      } else {
        close(got);
      }
    }
  }
  ScopedFd fd(first_fd);
  if (n < 0) {
    return absl::UnavailableError(absl::StrFormat("local socket %s: recvmsg: %s", path, Errno()));
  }
  if (n == 0) {
    return absl::UnavailableError(
        absl::StrFormat("local socket %s closed without handing over the pool", path));
  }
  const LocalPoolHello& hello = received.hello;
  if (static_cast<size_t>(n) != sizeof(hello) || hello.magic != LocalPoolHello::kMagic ||
      hello.version != LocalPoolHello::kVersion) {
    return absl::FailedPreconditionError(
        absl::StrFormat("local socket %s sent %d bytes that are not a version %d pool hello", path,
                        n, LocalPoolHello::kVersion));
  }
  if (fd.get() < 0 || (msg.msg_flags & MSG_CTRUNC) != 0) {
    return absl::FailedPreconditionError(
        absl::StrFormat("local socket %s sent its hello without the pool's fd", path));
  }
  received.fd = fd.release();
  return received;
}

}  // namespace kvr::kv_store
