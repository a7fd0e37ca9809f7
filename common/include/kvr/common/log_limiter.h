#pragma once
// Rate limit for a log line that a peer can trigger at will (a refused call, a malformed
// message): the first occurrence is logged, then at most one per `interval`, each saying how
// many occurrences it stands for, so that a hostile or broken peer cannot fill the log.
//
// Thread safety: Allow may be called from any thread.

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvr {

class LogLimiter {
 public:
  explicit LogLimiter(absl::Duration interval) : interval_(interval) {}

  // True when this occurrence should be logged; then *count is the number of occurrences the
  // line stands for (this one and those suppressed since the last line logged).
  [[nodiscard]] bool Allow(absl::Time now, int64_t* count) {
    absl::MutexLock lock(&mu_);
    ++pending_;
    if (logged_once_ && now - last_ < interval_) return false;
    logged_once_ = true;
    last_ = now;
    *count = pending_;
    pending_ = 0;
    return true;
  }

 private:
  const absl::Duration interval_;
  absl::Mutex mu_;
  bool logged_once_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time last_ ABSL_GUARDED_BY(mu_);
  int64_t pending_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvr
