#include "kvr/common/thread_pool.h"

#include <algorithm>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVR_CPU_RELAX() _mm_pause()
#else
#define KVR_CPU_RELAX() std::this_thread::yield()
#endif

namespace kvr {
namespace {

// Spins until done() or `limit` has passed; returns done().
template <typename Done>
bool SpinUntil(Done done, std::chrono::microseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    for (int i = 0; i < 64; ++i) KVR_CPU_RELAX();
    if (std::chrono::steady_clock::now() > deadline) return done();
  }
  return true;
}

}  // namespace

ThreadPool::ThreadPool(size_t num_threads) {
  if (num_threads == 0) num_threads = std::max(1u, std::thread::hardware_concurrency());
  for (size_t i = 1; i < num_threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::ParallelFor(size_t n, const std::function<void(size_t, size_t)>& fn,
                             size_t min_chunk) {
  if (n == 0) return;
  const size_t threads = size();
  if (threads == 1 || n <= min_chunk) {
    fn(0, n);
    return;
  }
  std::lock_guard<std::mutex> call_lock(call_mutex_);
  // About four chunks per thread balances uneven work without much scheduling cost.
  const size_t chunk = std::max(min_chunk, (n + threads * 4 - 1) / (threads * 4));
  std::unique_lock<std::mutex> lock(mutex_);
  fn_ = &fn;
  n_ = n;
  chunk_ = chunk;
  next_ = 0;
  pending_ = (n + chunk - 1) / chunk;
  ++generation_;
  work_cv_.notify_all();
  // The calling thread works too.
  while (next_ < n_) {
    const size_t begin = next_;
    next_ = std::min(n_, begin + chunk_);
    const size_t end = next_;
    lock.unlock();
    fn(begin, end);
    lock.lock();
    --pending_;
  }
  if (pending_ != 0) {
    lock.unlock();
    SpinUntil([this] { return pending_.load(std::memory_order_acquire) == 0; }, kSpin);
    lock.lock();
  }
  done_cv_.wait(lock, [this] { return pending_ == 0; });
  fn_ = nullptr;
}

void ThreadPool::WorkerLoop() {
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    if (!stop_ && generation_ == seen) {
      lock.unlock();
      SpinUntil([&] { return generation_.load(std::memory_order_acquire) != seen; }, kSpin);
      lock.lock();
    }
    work_cv_.wait(lock, [&] { return stop_ || (generation_ != seen && next_ < n_); });
    if (stop_) return;
    seen = generation_;
    while (fn_ != nullptr && next_ < n_) {
      const size_t begin = next_;
      next_ = std::min(n_, begin + chunk_);
      const size_t end = next_;
      const auto* fn = fn_;
      lock.unlock();
      (*fn)(begin, end);
      lock.lock();
      if (--pending_ == 0) done_cv_.notify_all();
    }
  }
}

}  // namespace kvr
