#include "kvr/loadgen/progress.h"

#include <algorithm>
#include <string>

namespace kvr::loadgen {

ProgressBar::ProgressBar(uint64_t total, std::FILE* out, std::chrono::milliseconds min_interval)
    : total_(total),
      out_(out),
      min_interval_(min_interval),
      start_(std::chrono::steady_clock::now()) {}

void ProgressBar::Update(uint64_t done, uint64_t failed) {
  absl::MutexLock lock(&mu_);
  done_ = done;
  failed_ = failed;
  const auto now = std::chrono::steady_clock::now();
  if (now - last_draw_ < min_interval_ && done != total_) return;
  last_draw_ = now;
  Draw(done, failed);
}

void ProgressBar::Finish() {
  absl::MutexLock lock(&mu_);
  Draw(done_, failed_);
  std::fputc('\n', out_);
  std::fflush(out_);
}

void ProgressBar::Draw(uint64_t done, uint64_t failed) {
  constexpr int kWidth = 30;
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  std::string bar;
  if (total_ > 0) {
    const int filled = static_cast<int>(kWidth * std::min<double>(1.0, double(done) / total_));
    bar = "[" + std::string(filled, '=') + (filled < kWidth ? ">" : "") +
          std::string(std::max(0, kWidth - filled - 1), ' ') + "] ";
    std::fprintf(out_, "\r%s%llu/%llu  %llu failed  %.1f s", bar.c_str(),
                 static_cast<unsigned long long>(done), static_cast<unsigned long long>(total_),
                 static_cast<unsigned long long>(failed), elapsed);
  } else {
    std::fprintf(out_, "\r%llu done  %llu failed  %.1f s", static_cast<unsigned long long>(done),
                 static_cast<unsigned long long>(failed), elapsed);
  }
  std::fflush(out_);
}

}  // namespace kvr::loadgen
