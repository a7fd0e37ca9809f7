#pragma once
// The store's UCX data-plane handlers: parse wire.h messages, run them against the
// PagedKvStore on a WorkQueue, reply with rows or with an error naming what was wrong. A
// malformed request only ever costs its sender an error reply. Private to kv-store.

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "kvr/kv_store/store.h"
#include "kvr/transport/ucx.h"
#include "work_queue.h"

namespace kvr::kv_store {

// What ReplyBufferPool lends at most (StoreServerOptions::max_reply_bytes, ...).
struct ReplyLimits {
  size_t max_reply_bytes = size_t{512} << 20;
  size_t max_outstanding_bytes = size_t{2} << 30;
};

// Reply buffers reused across requests. A fresh multi-MiB buffer per gather costs a page fault
// per 4 KiB on first touch (and an munmap after), which at decode's reply sizes is as much
// work as the copy itself; reused buffers stay mapped. It also bounds the store's memory
// outside its page pool: one reply may be at most `max_reply_bytes`, and the replies on loan
// (being filled or sent) at most `max_outstanding_bytes` together, so a request that names
// millions of rows (or many such requests) cannot make the store allocate without limit.
// Thread-safe.
class ReplyBufferPool {
 public:
  // A buffer on loan; returns itself to the pool when the last reference drops (after UCX
  // sent it, or when a reply could not be sent at all).
  class Buffer {
   public:
    Buffer(ReplyBufferPool* pool, std::unique_ptr<uint8_t[]> data, size_t capacity, size_t size)
        : pool_(pool), data_(std::move(data)), capacity_(capacity), size_(size) {}
    ~Buffer() { pool_->Return(std::move(data_), capacity_, size_); }
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    std::span<uint8_t> span() { return {data_.get(), size_}; }

   private:
    ReplyBufferPool* pool_;
    std::unique_ptr<uint8_t[]> data_;
    size_t capacity_;
    size_t size_;
  };

  using Limits = ReplyLimits;
  // Keeps at most `max_buffers` idle buffers, none larger than `max_kept_bytes`.
  ReplyBufferPool(size_t max_buffers, size_t max_kept_bytes, Limits limits = {})
      : max_buffers_(max_buffers), max_kept_bytes_(max_kept_bytes), limits_(limits) {}
  // A buffer of `size` bytes, or RESOURCE_EXHAUSTED naming the limit: a reply above
  // max_reply_bytes (the request should be split), or one that would take the buffers on loan
  // past max_outstanding_bytes (the store is busy; retry).
  [[nodiscard]] absl::StatusOr<std::shared_ptr<Buffer>> Acquire(size_t size);
  size_t idle_buffers() {
    absl::MutexLock lock(&mu_);
    return idle_.size();
  }
  size_t outstanding_bytes() {
    absl::MutexLock lock(&mu_);
    return outstanding_;
  }

 private:
  // Takes back a buffer of `capacity` that was on loan for `size` bytes.
  void Return(std::unique_ptr<uint8_t[]> data, size_t capacity, size_t size);
  struct Idle {
    std::unique_ptr<uint8_t[]> data;
    size_t capacity = 0;
  };
  const size_t max_buffers_;
  const size_t max_kept_bytes_;
  const Limits limits_;
  absl::Mutex mu_;
  std::vector<Idle> idle_ ABSL_GUARDED_BY(mu_);
  size_t outstanding_ ABSL_GUARDED_BY(mu_) = 0;  // bytes of the buffers on loan
};

// Installs the handlers for every wire::MessageType on `worker`. `store`, `queue` and
// `buffers` must outlive the worker (shut it down and destroy it first). Without
// `rma_reads` a locate-range message (pool offsets for RMA) is answered FAILED_PRECONDITION:
// the store then hands out no rkey, so the offsets would be of no use.
[[nodiscard]] absl::Status RegisterDataPlaneHandlers(transport::Worker& worker, PagedKvStore& store,
                                                     WorkQueue& queue, ReplyBufferPool& buffers,
                                                     bool rma_reads);

}  // namespace kvr::kv_store
