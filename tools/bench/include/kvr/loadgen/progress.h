#pragma once
// A one-line progress bar on a terminal stream ("[=====>    ] 45/100  2 failed  12.3 s").
// Debian packages no C++ progress-bar library (indicators is not packaged), so this is the
// minimal one. Thread-safe: Update may be called from any thread.

#include <chrono>
#include <cstdint>
#include <cstdio>

#include "absl/synchronization/mutex.h"

namespace kvr::loadgen {

class ProgressBar {
 public:
  // `total` 0 = unknown (a duration-bounded run): shows counts only. Redraws at most every
  // `min_interval`; `out` is not owned.
  ProgressBar(uint64_t total, std::FILE* out,
              std::chrono::milliseconds min_interval = std::chrono::milliseconds(100));
  void Update(uint64_t done, uint64_t failed);
  // Draws the final state and ends the line.
  void Finish();

 private:
  void Draw(uint64_t done, uint64_t failed);

  const uint64_t total_;
  std::FILE* const out_;
  const std::chrono::milliseconds min_interval_;
  const std::chrono::steady_clock::time_point start_;
  absl::Mutex mu_;
  std::chrono::steady_clock::time_point last_draw_ ABSL_GUARDED_BY(mu_);
  uint64_t done_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t failed_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvr::loadgen
