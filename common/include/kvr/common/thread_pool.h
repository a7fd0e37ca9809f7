#pragma once
// A fixed-size pool of worker threads with a blocking ParallelFor. Passed into whatever needs
// it through constructors; never a global.
//
// Thread safety: ParallelFor may be called from one thread at a time per pool (callers that
// share a pool serialise on an internal mutex).
//
// Latency: a decode step of a small model issues ~150 short ParallelFor calls (tens of
// microseconds each). Waking a sleeping worker through the condition variable costs about as
// much, and a caller that does not see the worker arrive in time runs every chunk itself. So
// idle workers first spin for up to kSpin (checking an atomic generation counter) before they
// sleep, and the caller spins as long for the workers to finish before it waits.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvr {

class ThreadPool {
 public:
  // `num_threads` == 0 picks std::thread::hardware_concurrency().
  explicit ThreadPool(size_t num_threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  size_t size() const { return workers_.size() + 1; }  // workers plus the calling thread

  // Calls fn(begin, end) over contiguous chunks of [0, n), spread over the pool and the calling
  // thread; returns when all chunks are done. `min_chunk` bounds the smallest chunk.
  void ParallelFor(size_t n, const std::function<void(size_t, size_t)>& fn, size_t min_chunk = 1);

 private:
  void WorkerLoop();

  std::vector<std::thread> workers_;
  std::mutex call_mutex_;  // one ParallelFor at a time
  std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  const std::function<void(size_t, size_t)>* fn_ = nullptr;
  size_t n_ = 0;
  size_t chunk_ = 0;
  size_t next_ = 0;
  std::atomic<size_t> pending_ = 0;     // written under mutex_; read by the spinning caller
  std::atomic<uint64_t> generation_ = 0;  // written under mutex_; read by spinning workers
  static constexpr std::chrono::microseconds kSpin{50};
  bool stop_ = false;
};

}  // namespace kvr
