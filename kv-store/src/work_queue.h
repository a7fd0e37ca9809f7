#pragma once
// A fixed set of threads draining a FIFO of tasks. Private to kv-store: the data plane hands
// requests from the UCX progress thread to these threads. (kvr::ThreadPool offers only a
// blocking ParallelFor, not fire-and-forget submission.)

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvr::kv_store {

class WorkQueue {
 public:
  explicit WorkQueue(size_t threads) {
    for (size_t i = 0; i < std::max<size_t>(threads, 1); ++i) {
      threads_.emplace_back([this] { Loop(); });
    }
  }
  ~WorkQueue() { Stop(); }
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  // Returns false (and drops `task`) once stopped.
  bool Push(std::function<void()> task) {
    absl::MutexLock lock(&mu_);
    if (stop_) return false;
    tasks_.push_back(std::move(task));
    return true;
  }

  // Runs what is queued, then joins the threads. Idempotent.
  void Stop() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    for (std::thread& t : threads_) {
      if (t.joinable()) t.join();
    }
  }

 private:
  void Loop() {
    for (;;) {
      std::function<void()> task;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](WorkQueue* q) ABSL_EXCLUSIVE_LOCKS_REQUIRED(q->mu_) {
              return q->stop_ || !q->tasks_.empty();
            },
            this));
        if (tasks_.empty()) return;  // stopped and drained
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace kvr::kv_store
