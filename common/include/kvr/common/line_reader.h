#pragma once
// LineReader: the lines written to a pipe (a child process's stdout), read on a thread of its
// own until EOF, for callers that wait for a particular line ("... listening on HOST:PORT").
//
// Thread safety: every method may be called from any thread. Lifetime: the destructor joins the
// reading thread, which ends at EOF, so the pipe's writer (the child) must have closed it or
// exited by then: owners stop their child first.

#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvr {

class LineReader {
 public:
  // Reads `fd` (owned: closed at EOF). With `copy_fd` >= 0 (owned as well) every byte read is
  // also written there, as it arrives: a log file of the child's output.
  explicit LineReader(int fd, int copy_fd = -1);
  ~LineReader();
  LineReader(const LineReader&) = delete;
  LineReader& operator=(const LineReader&) = delete;

  // The first line (without its newline) for which `match` is true, waiting up to `timeout` for
  // it; nullopt when none came by then or the pipe reached EOF without one.
  [[nodiscard]] std::optional<std::string> Await(
      const std::function<bool(const std::string&)>& match, absl::Duration timeout);
  [[nodiscard]] std::vector<std::string> Lines() const;
  // True once the pipe reached EOF (the child closed its end or exited).
  [[nodiscard]] bool eof() const;

 private:
  void Read(int fd, int copy_fd);

  mutable absl::Mutex mu_;
  std::vector<std::string> lines_ ABSL_GUARDED_BY(mu_);
  bool eof_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: started once the members above exist
};

}  // namespace kvr
