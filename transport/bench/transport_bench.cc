// transport_bench: active-message round-trip latency (p50/p99) and reply bandwidth for range
// reads of 4 KiB..8 MiB from a peer process, over each UCX transport set given, against the
// ceiling measured in the same run:
//   - shared memory: single-thread memcpy bandwidth at the same size (a shared-memory reply
//     is at least one copy), over a working set larger than the last-level cache;
//   - TCP: `ucx_perftest -t ucp_am_bw` between a server and a client on localhost.
// Also reports RMA get bandwidth at each size (UCX emulates RMA over TCP; native over cma).
//
// Usage: transport_bench [--tls "sm,self" --tls tcp] [--min-size 4096] [--max-size 8388608]
//                        [--window 8] [--bytes-per-point 268435456]
// The peer is transport_test_server (built beside this binary).

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "../tests/server_process.h"
#include "../tests/test_protocol.h"
#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "ceilings.h"
#include "kvr/transport/ucx.h"

namespace kt = kvr::transport;
namespace tp = kvr::transport::testing;

namespace {

double Percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(q * (v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

struct Point {
  size_t size;
  double p50_us, p99_us, gbps, rma_gbps, ceiling_gbps;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"UCX transport benchmark"};
  std::vector<std::string> tls_list = {"sm,self", "tcp"};
  size_t min_size = 4096, max_size = size_t{8} << 20;
  int window = 8;
  size_t bytes_per_point = size_t{256} << 20;
  std::string server_binary = KVR_TRANSPORT_TEST_SERVER;
  std::string perftest = "ucx_perftest";
  int spin_us = 50;
  app.add_option("--tls", tls_list, "UCX_TLS value per run");
  app.add_option("--min-size", min_size);
  app.add_option("--max-size", max_size);
  app.add_option("--window", window, "calls in flight in the bandwidth test");
  app.add_option("--bytes-per-point", bytes_per_point);
  app.add_option("--server", server_binary);
  app.add_option("--perftest", perftest);
  app.add_option("--spin-us", spin_us, "progress-thread spin before sleeping, both sides");
  CLI11_PARSE(app, argc, argv);
  if (max_size > tp::kRegionBytes) max_size = tp::kRegionBytes;

  int port = 13500 + getpid() % 1000;
  for (const std::string& tls : tls_list) {
    const bool is_tcp = tls.find("tcp") != std::string::npos;
    auto server = tp::ServerProcess::Start(server_binary, tls, std::to_string(spin_us));
    if (!server.ok()) {
      std::fprintf(stderr, "%s\n", server.status().ToString().c_str());
      return 1;
    }
    auto context = kt::Context::Create({.ucx_config = {{"TLS", tls}}});
    if (!context.ok()) return 1;
    auto worker =
        kt::Worker::Create(*context, {.name = "bench", .spin = absl::Microseconds(spin_us)});
    if (!worker.ok()) return 1;
    auto ep = worker->Connect(server->address(), "bench-server");
    if (!ep.ok()) return 1;
    auto info = ep->CallSync(tp::kRegionInfo, {}, {}, {});
    if (!info.ok()) return 1;
    tp::RegionInfo region;
    std::memcpy(&region, info->header.data(), sizeof(region));
    auto rkey = ep->UnpackRkey(std::string_view(info->header).substr(sizeof(region)));
    if (!rkey.ok()) return 1;
    auto transports = ep->Transports();
    std::printf("\n== UCX_TLS=%s  lanes: %s\n", tls.c_str(),
                transports.ok() ? absl::StrJoin(*transports, ",").c_str() : "?");
    std::printf("%10s %10s %10s %10s %10s %12s %10s  %s\n", "size", "p50_us", "p99_us", "am_GB/s",
                "rma_GB/s", "ceiling", "fraction", "ceiling source");

    std::vector<kt::Bytes> buffers;
    for (int w = 0; w < window; ++w) buffers.push_back(kt::Bytes::Uninitialized(max_size));
    for (auto& b : buffers) std::memset(b.data(), 0, b.size());

    for (size_t size = min_size; size <= max_size; size *= 2) {
      Point pt{size};
      tp::ReadRequest read{0, size};
      kt::ByteView header(reinterpret_cast<const uint8_t*>(&read), sizeof(read));
      // Latency: one call at a time.
      const int lat_iters = static_cast<int>(std::clamp<size_t>((64u << 20) / size, 50, 2000));
      std::vector<double> lat;
      for (int i = -10; i < lat_iters; ++i) {
        auto t0 = std::chrono::steady_clock::now();
        auto r = ep->CallSync(tp::kRead, header, {}, {.reply_buffer = buffers[0].span()});
        auto t1 = std::chrono::steady_clock::now();
        if (!r.ok()) {
          std::fprintf(stderr, "call failed: %s\n", r.status().ToString().c_str());
          return 1;
        }
        if (i >= 0) lat.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      }
      pt.p50_us = Percentile(lat, 0.5);
      pt.p99_us = Percentile(lat, 0.99);
      // Bandwidth: `window` calls in flight, each into its own reply buffer.
      const size_t calls = std::max<size_t>(bytes_per_point / size, 4 * window);
      std::vector<kt::PendingCall> inflight(window);
      auto t0 = std::chrono::steady_clock::now();
      for (size_t i = 0; i < calls + window; ++i) {
        size_t slot = i % window;
        if (i >= static_cast<size_t>(window)) {
          auto r = inflight[slot].Wait();
          if (!r.ok()) return 1;
        }
        if (i < calls) {
          inflight[slot] = ep->Call(tp::kRead, header, {}, {.reply_buffer = buffers[slot].span()});
        }
      }
      double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      pt.gbps = static_cast<double>(calls * size) / secs / 1e9;
      // RMA get bandwidth, same window.
      std::vector<kt::PendingTransfer> gets(window);
      const size_t get_calls =
          std::max<size_t>((is_tcp ? bytes_per_point / 8 : bytes_per_point) / size, 4 * window);
      t0 = std::chrono::steady_clock::now();
      for (size_t i = 0; i < get_calls + window; ++i) {
        size_t slot = i % window;
        if (i >= static_cast<size_t>(window) && !gets[slot].Wait().ok()) return 1;
        if (i < get_calls) {
          gets[slot] = ep->Get(region.address, *rkey, buffers[slot].span().subspan(0, size));
        }
      }
      secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      pt.rma_gbps = static_cast<double>(get_calls * size) / secs / 1e9;
      const char* source = is_tcp ? "ucx_perftest ucp_am_bw tcp" : "memcpy";
      pt.ceiling_gbps = is_tcp ? kvr::transport::bench::PerftestAmBwGbps(perftest, size, port++)
                               : kvr::transport::bench::MemcpyGbps(size);
      std::printf("%10zu %10.1f %10.1f %10.2f %10.2f %12.2f %10.2f  %s\n", pt.size, pt.p50_us,
                  pt.p99_us, pt.gbps, pt.rma_gbps, pt.ceiling_gbps,
                  pt.ceiling_gbps > 0 ? pt.gbps / pt.ceiling_gbps : 0.0, source);
      std::fflush(stdout);
    }
  }
  return 0;
}
