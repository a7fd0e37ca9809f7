#pragma once
// Same-host handover of the store's page pool (local_pool.h), both ends. Private to kv-store.
//
// Protocol: a Unix stream socket at a path (file mode 0600). Per connection the store sends one
// message, a fixed LocalPoolHello with the pool's fd attached (SCM_RIGHTS), and closes; the
// client sends nothing. The fd is a read-only reopening of the pool's memfd, and the memfd is
// sealed (PagePool), so a reader can neither write the pool nor resize it.

#include <atomic>
#include <bit>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvr/kv_store/page_pool.h"

namespace kvr::kv_store {

static_assert(std::endian::native == std::endian::little,
              "the local pool hello is little-endian, sent as a raw struct");

// The fixed header sent with the fd. 48 bytes, little-endian.
struct LocalPoolHello {
  static constexpr uint32_t kMagic = 0x5052564B;  // "KVRP"
  static constexpr uint32_t kVersion = 1;
  uint32_t magic = kMagic;
  uint32_t version = kVersion;
  uint64_t pool_bytes = 0;  // bytes of the fd to map from offset 0 (PagePool::mapped_bytes)
  uint64_t page_bytes = 0;
  uint8_t pool_id[16] = {};  // PagePool::pool_id() as raw bytes
  uint64_t reserved = 0;
};
static_assert(sizeof(LocalPoolHello) == 48);

// This machine's identity for "same host": the content of /proc/sys/kernel/random/boot_id (a
// random UUID per boot, shared by every process, container and network namespace of one
// kernel), trimmed.
[[nodiscard]] absl::StatusOr<std::string> ReadHostId();

// The store side: a thread that accepts on the socket and hands each connection the pool.
// Never blocks the store: the socket is non-blocking, each connection gets one non-blocking
// send and is closed; errors are logged to stderr and the next connection is served.
class LocalPoolServer {
 public:
  // Binds `path` (refusing one where a live store answers; a stale socket file is replaced),
  // chmods it 0600 before listening, and starts the thread. `pool` must outlive the server.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<LocalPoolServer>> Start(
      const std::string& path, const PagePool& pool);
  // Stops the thread, closes the socket and removes the socket file.
  ~LocalPoolServer();
  LocalPoolServer(const LocalPoolServer&) = delete;
  LocalPoolServer& operator=(const LocalPoolServer&) = delete;

  void Stop();
  // Connections that were handed the pool.
  uint64_t handed_out() const { return handed_out_.load(std::memory_order_relaxed); }

 private:
  LocalPoolServer() = default;
  void Run();
  void Serve(int conn);

  std::string path_;
  LocalPoolHello hello_;
  int listen_fd_ = -1;
  bool bound_ = false;  // listen_fd_ is bound to path_, so the file is removed on destruction
  int pool_fd_ = -1;    // read-only reopening of the memfd; owned
  int stop_fd_ = -1;    // eventfd that wakes the thread to stop; owned
  std::thread thread_;
  std::atomic<uint64_t> handed_out_{0};
};

// The client side: the fd (owned by the caller) and the hello from the socket at `path`.
struct ReceivedPool {
  int fd = -1;
  LocalPoolHello hello;
};
// UNAVAILABLE when the socket cannot be reached or says nothing before `deadline`;
// FAILED_PRECONDITION when what comes is not a pool hello of this version.
[[nodiscard]] absl::StatusOr<ReceivedPool> ReceivePoolFd(const std::string& path,
                                                         absl::Time deadline);

}  // namespace kvr::kv_store
