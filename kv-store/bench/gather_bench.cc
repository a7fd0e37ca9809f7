// kv_store_gather_bench: gather throughput and latency (p50/p99) against a real kvr-store
// process, for k rows per KV head of 128 B .. 1 KiB, over UCX shared memory and over TCP,
// against the ceiling measured in the same run (memcpy at the reply size for shared memory;
// `ucx_perftest -t ucp_am_bw` over TCP loopback for TCP).
//
// One request gathers k rows from each of `--heads` KV heads of one layer (as a decode step
// does per layer), with random distinct sorted indices out of `--context` rows; the reply is
// one contiguous buffer of heads * k rows. Requests run back to back from one client thread,
// so bandwidth = reply bytes / mean latency.
//
// Usage: kv_store_gather_bench [--tls "sm,self" --tls tcp] [--k 1024 --k 32768]
//          [--row-bytes 128 --row-bytes 512 --row-bytes 1024] [--heads 8] [--context 32768]
//          [--store path/to/kvr-store]

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "ceilings.h"
#include "kvr/kv_store/client.h"

namespace ks = kvr::kv_store;

namespace {

// A kvr-store child process (fork + exec) with UCX_TLS set; stopped with SIGTERM.
class StoreProcess {
 public:
  static absl::StatusOr<StoreProcess> Start(const std::string& binary, const std::string& tls,
                                            uint64_t capacity_bytes) {
    int out[2];
    if (pipe2(out, O_CLOEXEC) != 0) return absl::InternalError("pipe");
    pid_t pid = fork();
    if (pid < 0) return absl::InternalError("fork");
    if (pid == 0) {
      setenv("UCX_TLS", tls.c_str(), 1);
      dup2(out[1], 1);
      std::string capacity = std::to_string(capacity_bytes);
      execl(binary.c_str(), binary.c_str(), "--listen", "127.0.0.1:0", "--capacity-bytes",
            capacity.c_str(), "--name", "bench-store", static_cast<char*>(nullptr));
      _exit(127);
    }
    close(out[1]);
    StoreProcess p;
    p.pid_ = pid;
    FILE* f = fdopen(out[0], "r");
    char line[1024];
    while (fgets(line, sizeof(line), f) != nullptr) {
      if (std::sscanf(line, "kvr-store listening port=%d", &p.port_) == 1) break;
    }
    fclose(f);  // the store's later output goes to a closed pipe: it only prints at exit
    if (p.port_ <= 0) return absl::InternalError(absl::StrCat(binary, " printed no port"));
    return p;
  }
  StoreProcess(StoreProcess&& o) noexcept : pid_(std::exchange(o.pid_, -1)), port_(o.port_) {}
  ~StoreProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);  // SIGTERM would print to the closed pipe; nothing to flush here
      waitpid(pid_, nullptr, 0);
    }
  }
  int port() const { return port_; }

 private:
  StoreProcess() = default;
  pid_t pid_ = -1;
  int port_ = 0;
};

double Percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5))];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kv-store gather benchmark"};
  std::vector<std::string> tls_list = {"sm,self", "tcp"};
  std::vector<uint32_t> ks_list = {1024, 32768};
  std::vector<uint32_t> row_bytes_list = {128, 512, 1024};
  uint32_t heads = 8;
  uint32_t context = 32768;
  size_t bytes_per_point = size_t{512} << 20;
  std::string store_binary = KVR_STORE_BINARY;
  std::string perftest = "ucx_perftest";
  app.add_option("--tls", tls_list, "UCX_TLS value per run");
  app.add_option("--k", ks_list, "rows gathered per KV head per request");
  app.add_option("--row-bytes", row_bytes_list, "bytes of one [k|v] row (fp16: 4*head_dim)");
  app.add_option("--heads", heads, "KV heads per request");
  app.add_option("--context", context, "rows stored per KV head");
  app.add_option("--bytes-per-point", bytes_per_point, "reply bytes moved per measurement");
  app.add_option("--store", store_binary);
  app.add_option("--perftest", perftest);
  CLI11_PARSE(app, argc, argv);

  uint32_t max_row = *std::max_element(row_bytes_list.begin(), row_bytes_list.end());
  // One sequence lives at a time (each is released after its points), plus page slack.
  uint64_t capacity = uint64_t{context} * heads * max_row + (uint64_t{256} << 20);
  std::mt19937_64 rng(42);
  int port = 14500 + getpid() % 1000;

  for (const std::string& tls : tls_list) {
    const bool is_tcp = tls.find("tcp") != std::string::npos;
    auto store = StoreProcess::Start(store_binary, tls, capacity);
    if (!store.ok()) {
      std::fprintf(stderr, "%s\n", store.status().ToString().c_str());
      return 1;
    }
    ks::UcxClientOptions options;
    options.ucx_config = {{"TLS", tls}};
    options.timeout = absl::Seconds(60);
    options.name = "gather-bench";
    auto client = ks::UcxKvStoreClient::Connect(absl::StrCat("127.0.0.1:", store->port()), options);
    if (!client.ok()) {
      std::fprintf(stderr, "connect: %s\n", client.status().ToString().c_str());
      return 1;
    }
    std::printf("\n== UCX_TLS=%s\n", tls.c_str());
    std::printf("%9s %7s %6s %12s %10s %10s %9s %9s %9s  %s\n", "row_bytes", "k/head", "heads",
                "reply_bytes", "p50_us", "p99_us", "GB/s", "ceiling", "fraction", "ceiling source");

    ks::SequenceId next_id = 1;
    for (uint32_t row_bytes : row_bytes_list) {
      ks::SequenceShape shape{
          .n_layers = 1, .n_kv_heads = heads, .head_dim = row_bytes / 4, .dtype = ks::DType::kF16};
      const ks::SequenceRef seq{next_id++, ks::Capability::Generate()};
      auto created = (*client)->CreateSequence(seq, shape, context, absl::ZeroDuration());
      if (!created.ok()) {
        std::fprintf(stderr, "create: %s\n", created.status().ToString().c_str());
        return 1;
      }
      // Fill the layer in chunks: K and V are [n_rows, n_kv_heads, head_dim].
      const uint32_t chunk = 2048;
      std::vector<uint8_t> k(size_t{chunk} * shape.TokenHalfBytes());
      std::vector<uint8_t> v(k.size());
      for (size_t i = 0; i < k.size(); ++i) {
        k[i] = static_cast<uint8_t>(i * 31 + row_bytes);
        v[i] = static_cast<uint8_t>(i * 17 + 3);
      }
      for (uint32_t start = 0; start < context; start += chunk) {
        ks::LayerRows rows{.sequence = seq,
                           .layer = 0,
                           .start_row = start,
                           .n_rows = std::min(chunk, context - start)};
        rows.k = std::span<const uint8_t>(k.data(), size_t{rows.n_rows} * shape.TokenHalfBytes());
        rows.v = std::span<const uint8_t>(v.data(), rows.k.size());
        auto put = (*client)->PutLayer(rows);
        if (!put.ok()) {
          std::fprintf(stderr, "put: %s\n", put.status().ToString().c_str());
          return 1;
        }
      }
      for (uint32_t k_rows : ks_list) {
        k_rows = std::min(k_rows, context);
        // Random distinct sorted indices per head.
        std::vector<std::vector<uint32_t>> indices(heads);
        std::vector<uint32_t> all(context);
        std::iota(all.begin(), all.end(), 0);
        for (auto& idx : indices) {
          std::shuffle(all.begin(), all.end(), rng);
          idx.assign(all.begin(), all.begin() + k_rows);
          std::sort(idx.begin(), idx.end());
        }
        std::vector<ks::GatherEntry> entries;
        for (uint32_t h = 0; h < heads; ++h) {
          entries.push_back({.sequence = seq, .layer = 0, .head = h, .indices = indices[h]});
        }
        const size_t reply = ks::GatherBytes(entries, shape.RowBytes());
        kvr::transport::Bytes out = kvr::transport::Bytes::Uninitialized(reply);
        std::memset(out.data(), 0, out.size());
        const int iters = static_cast<int>(std::clamp<size_t>(bytes_per_point / reply, 20, 2000));
        std::vector<double> lat;
        for (int i = -3; i < iters; ++i) {
          auto t0 = std::chrono::steady_clock::now();
          absl::Status s = (*client)->Gather(entries, out.span());
          auto t1 = std::chrono::steady_clock::now();
          if (!s.ok()) {
            std::fprintf(stderr, "gather: %s\n", s.ToString().c_str());
            return 1;
          }
          if (i >= 0) lat.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
        }
        // Spot-check: head 0's first gathered row is row indices[0][0] of the pattern.
        const size_t half = shape.RowBytes() / 2;
        const size_t src = (size_t{indices[0][0]} % chunk) * shape.TokenHalfBytes();
        if (std::memcmp(out.data(), k.data() + src, half) != 0 ||
            std::memcmp(out.data() + half, v.data() + src, half) != 0) {
          std::fprintf(stderr, "gathered row does not match what was written\n");
          return 1;
        }
        const double mean_us = std::accumulate(lat.begin(), lat.end(), 0.0) / lat.size();
        const double gbps = reply / (mean_us * 1e-6) / 1e9;
        // Ceiling at the reply size (memcpy is DRAM-bound beyond a few MiB: cap the probe).
        const size_t probe = std::min<size_t>(reply, size_t{8} << 20);
        const double ceiling =
            is_tcp ? kvr::transport::bench::PerftestAmBwGbps(perftest, probe, port++)
                   : kvr::transport::bench::MemcpyGbps(probe);
        std::printf("%9u %7u %6u %12zu %10.1f %10.1f %9.2f %9.2f %9.2f  %s\n", row_bytes, k_rows,
                    heads, reply, Percentile(lat, 0.5), Percentile(lat, 0.99), gbps, ceiling,
                    ceiling > 0 ? gbps / ceiling : 0.0,
                    is_tcp ? "ucx_perftest ucp_am_bw tcp" : "memcpy");
        std::fflush(stdout);
      }
      if (absl::Status s = (*client)->Release(seq, absl::ZeroDuration()); !s.ok()) {
        std::fprintf(stderr, "release: %s\n", s.ToString().c_str());
        return 1;
      }
    }
  }
  return 0;
}
