#include "kvr/common/line_reader.h"

#include <fcntl.h>
#include <unistd.h>

#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace kvr {
namespace {

void Write(int fd, const std::string& s) {
  ASSERT_EQ(write(fd, s.data(), s.size()), static_cast<ssize_t>(s.size()));
}

TEST(LineReaderTest, AwaitsALineThatArrivesInPiecesAndStopsAtEof) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  LineReader reader(fds[0]);
  Write(fds[1], "starting\nkvr-x listen");
  EXPECT_EQ(reader.Await([](const std::string& l) { return absl::StartsWith(l, "kvr-x"); },
                         absl::Milliseconds(50)),
            std::nullopt)
      << "half a line is no line";
  std::thread writer([fd = fds[1]] {
    absl::SleepFor(absl::Milliseconds(20));
    Write(fd, "ing on 127.0.0.1:5\nlast");
    close(fd);
  });
  EXPECT_EQ(reader.Await([](const std::string& l) { return absl::StartsWith(l, "kvr-x"); },
                         absl::Seconds(10)),
            "kvr-x listening on 127.0.0.1:5");
  writer.join();
  // EOF ends a wait for a line that never came at once, and drops an unterminated tail.
  const absl::Time start = absl::Now();
  EXPECT_EQ(reader.Await([](const std::string& l) { return l == "never"; }, absl::Seconds(10)),
            std::nullopt);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_TRUE(reader.eof());
  EXPECT_EQ(reader.Lines(),
            (std::vector<std::string>{"starting", "kvr-x listening on 127.0.0.1:5"}));
}

TEST(LineReaderTest, CopiesEveryByteToTheCopyFd) {
  int fds[2], copy[2];
  ASSERT_EQ(pipe(fds), 0);
  ASSERT_EQ(pipe(copy), 0);
  {
    LineReader reader(fds[0], copy[1]);
    Write(fds[1], "a\nb\npartial");
    close(fds[1]);
  }  // joined: both ends it owned are closed
  std::string copied;
  char buf[64];
  ssize_t n;
  while ((n = read(copy[0], buf, sizeof(buf))) > 0) copied.append(buf, static_cast<size_t>(n));
  close(copy[0]);
  EXPECT_EQ(copied, "a\nb\npartial");
}

}  // namespace
}  // namespace kvr
