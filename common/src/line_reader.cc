#include "kvr/common/line_reader.h"

#include <unistd.h>

namespace kvr {

LineReader::LineReader(int fd, int copy_fd) : thread_([this, fd, copy_fd] { Read(fd, copy_fd); }) {}

LineReader::~LineReader() { thread_.join(); }

std::optional<std::string> LineReader::Await(const std::function<bool(const std::string&)>& match,
                                             absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  std::optional<std::string> found;
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const std::string& l : lines_) {
      if (match(l)) {
        found = l;
        return true;
      }
    }
    return eof_;
  };
  mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
  return found;
}

std::vector<std::string> LineReader::Lines() const {
  absl::MutexLock lock(&mu_);
  return lines_;
}

bool LineReader::eof() const {
  absl::MutexLock lock(&mu_);
  return eof_;
}

void LineReader::Read(int fd, int copy_fd) {
  std::string partial;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) {
    if (copy_fd >= 0) (void)!write(copy_fd, buf, static_cast<size_t>(n));
    partial.append(buf, static_cast<size_t>(n));
    size_t pos;
    while ((pos = partial.find('\n')) != std::string::npos) {
      absl::MutexLock lock(&mu_);
      lines_.push_back(partial.substr(0, pos));
      partial.erase(0, pos + 1);
    }
  }
  close(fd);
  if (copy_fd >= 0) close(copy_fd);
  absl::MutexLock lock(&mu_);
  eof_ = true;
}

}  // namespace kvr
