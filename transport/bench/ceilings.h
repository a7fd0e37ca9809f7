#pragma once
// Same-run bandwidth ceilings for data-plane benchmarks:
//   MemcpyGbps: single-thread memcpy at a given copy size over a working set larger than the
//     last-level cache (the ceiling of a shared-memory transfer, which is at least one copy);
//   PerftestAmBwGbps: `ucx_perftest -t ucp_am_bw` between a server and a client process on
//     localhost over UCX_TLS=tcp (the ceiling of UCX active messages over TCP loopback).

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kvr/transport/bytes.h"

namespace kvr::transport::bench {

// memcpy GB/s at `size` bytes per copy, cycling through buffers larger than the LLC.
inline double MemcpyGbps(size_t size) {
  const size_t working_set = std::max<size_t>(size * 4, size_t{256} << 20);
  const size_t slots = working_set / size;
  kvr::transport::Bytes src = kvr::transport::Bytes::Uninitialized(slots * size);
  kvr::transport::Bytes dst = kvr::transport::Bytes::Uninitialized(slots * size);
  std::memset(src.data(), 1, src.size());
  std::memset(dst.data(), 2, dst.size());
  const size_t copies = std::max<size_t>(slots * 2, 64);
  auto start = std::chrono::steady_clock::now();
  for (size_t i = 0; i < copies; ++i) {
    size_t s = i % slots;
    std::memcpy(dst.data() + s * size, src.data() + s * size, size);
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return static_cast<double>(copies * size) / secs / 1e9;
}

// ucx_perftest am_bw over TCP loopback at `size` bytes: overall bandwidth in GB/s, or < 0.
inline double PerftestAmBwGbps(const std::string& perftest, size_t size, int port) {
  size_t iters = std::clamp<size_t>((size_t{512} << 20) / size, 200, 20000);
  pid_t server = fork();
  if (server == 0) {
    setenv("UCX_TLS", "tcp", 1);
    int devnull = open("/dev/null", O_WRONLY);
    dup2(devnull, 1);
    dup2(devnull, 2);
    execlp(perftest.c_str(), perftest.c_str(), "-p", std::to_string(port).c_str(),
           static_cast<char*>(nullptr));
    _exit(127);
  }
  usleep(300'000);  // let the server listen
  std::string cmd =
      absl::StrCat("UCX_TLS=tcp ", perftest, " localhost -p ", port, " -t ucp_am_bw -s ", size,
                   " -n ", iters, " -w ", std::max<size_t>(iters / 10, 10), " -f 2>/dev/null");
  double gbps = -1;
  if (FILE* p = popen(cmd.c_str(), "r")) {
    char line[1024];
    while (fgets(line, sizeof(line), p) != nullptr) {
      // With -f: "<iters> <p50 lat> <avg lat> <overall lat> <avg MB/s> <overall MB/s> ..."
      // (some versions prefix "Final:"). MB here is 2^20 bytes.
      std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipWhitespace());
      if (!f.empty() && f[0] == "Final:") f.erase(f.begin());
      if (f.size() >= 6 && std::isdigit(static_cast<unsigned char>(f[0][0]))) {
        gbps = std::stod(f[5]) * 1048576.0 / 1e9;
      }
    }
    pclose(p);
  }
  kill(server, SIGTERM);
  waitpid(server, nullptr, 0);
  return gbps;
}

}  // namespace kvr::transport::bench
