// transport_test_server: a peer process for the transport tests and benchmarks.
//
// Usage: transport_test_server <ucx-tls> [spin-us]   (tls e.g. "tcp" or "sm,self")
// Prints its worker address as one hex line on stdout, then serves the requests of
// test_protocol.h until stdin reaches EOF (the parent exits or closes the pipe) or it is killed.

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "kvr/transport/ucx.h"
#include "test_protocol.h"

namespace kt = kvr::transport;
namespace tp = kvr::transport::testing;

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: transport_test_server <ucx-tls> [spin-us]\n"
                 "       transport_test_server <ucx-tls> --client <hex-address>\n";
    return 2;
  }
  if (argc == 4 && std::string(argv[2]) == "--client") {
    // Client mode: send one request (am 1, header "park") to the given worker, print
    // "sent" once it is out, then wait to be killed.
    kt::ContextOptions client_options;
    client_options.ucx_config = {{"TLS", argv[1]}};
    auto ctx = kt::Context::Create(client_options);
    if (!ctx.ok()) return 1;
    auto w = kt::Worker::Create(*ctx, {.name = "test-client-process"});
    if (!w.ok()) return 1;
    auto ep = w->Connect(absl::HexStringToBytes(argv[3]), "test-parent");
    if (!ep.ok()) return 1;
    kt::PendingCall call = ep->Call(1, kt::AsBytes("park"), {}, {});
    // Flush the request out with a second, answered call (am 2 echoes at once).
    auto r = ep->CallSync(2, kt::AsBytes("ping"), {}, {});
    std::cout << (r.ok() ? "sent" : "failed") << std::endl;
    std::string line;
    while (std::getline(std::cin, line)) {
    }
    return 0;
  }
  kt::ContextOptions options;
  options.ucx_config = {{"TLS", argv[1]}};
  auto context = kt::Context::Create(options);
  if (!context.ok()) {
    std::cerr << context.status() << "\n";
    return 1;
  }
  // Optional second argument: the progress thread's spin before sleeping, in microseconds.
  kt::WorkerOptions worker_options{.name = "test-server"};
  if (argc > 2) worker_options.spin = absl::Microseconds(std::atoi(argv[2]));
  auto worker = kt::Worker::Create(*context, worker_options);
  if (!worker.ok()) {
    std::cerr << worker.status() << "\n";
    return 1;
  }
  auto region = context->Allocate(tp::kRegionBytes);
  if (!region.ok()) {
    std::cerr << region.status() << "\n";
    return 1;
  }
  tp::FillPattern(region->span(), tp::kRegionSeed);
  auto rkey = region->PackRkey();
  if (!rkey.ok()) {
    std::cerr << rkey.status() << "\n";
    return 1;
  }

  std::mutex hung_mu;
  std::vector<kt::IncomingRequest> hung;  // kHang requests, kept until exit

  auto check = [](absl::Status s) {
    if (!s.ok()) std::cerr << "test-server: " << s << "\n";
  };
  check(worker->RegisterHandler(tp::kEcho, [&](kt::IncomingRequest req) {
    // Replying with views into the request is safe: Reply keeps the request alive until sent.
    kt::ByteView header = req.header();
    kt::ByteView payload = req.payload();
    check(req.Reply(header, {payload}, nullptr));
  }));
  check(worker->RegisterHandler(tp::kDelayEcho, [&](kt::IncomingRequest req) {
    uint32_t delay_ms = 0;
    if (req.header().size() >= sizeof(delay_ms)) {
      std::memcpy(&delay_ms, req.header().data(), sizeof(delay_ms));
    }
    // Reply from another thread, as a store would after handing work to a pool.
    std::thread([r = std::move(req), delay_ms, &check]() mutable {
      std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
      kt::ByteView payload = r.payload();
      check(r.Reply(r.header(), {payload}, nullptr));
    }).detach();
  }));
  check(worker->RegisterHandler(tp::kHang, [&](kt::IncomingRequest req) {
    std::lock_guard<std::mutex> lock(hung_mu);
    hung.push_back(std::move(req));
  }));
  check(worker->RegisterHandler(tp::kFail, [&](kt::IncomingRequest req) {
    check(req.ReplyError(absl::NotFoundError("no such sequence 42")));
  }));
  check(worker->RegisterHandler(tp::kRegionInfo, [&](kt::IncomingRequest req) {
    tp::RegionInfo info{region->address(), region->size()};
    std::string header(reinterpret_cast<const char*>(&info), sizeof(info));
    header += *rkey;
    check(req.Reply(kt::AsBytes(header)));
  }));

  check(worker->RegisterHandler(tp::kRead, [&](kt::IncomingRequest req) {
    // A range read answered zero-copy from the registered region, like a store read.
    tp::ReadRequest read{};
    if (req.header().size() != sizeof(read)) {
      check(req.ReplyError(absl::InvalidArgumentError("read header must be 16 bytes")));
      return;
    }
    std::memcpy(&read, req.header().data(), sizeof(read));
    if (read.offset > region->size() || read.length > region->size() - read.offset) {
      check(req.ReplyError(absl::OutOfRangeError("read outside the region")));
      return;
    }
    check(req.Reply({}, {kt::ByteView(region->data() + read.offset, read.length)}, nullptr));
  }));

  check(worker->RegisterHandler(tp::kReplyThenDie, [&](kt::IncomingRequest req) {
    uint32_t delay_us = 0;
    if (req.header().size() >= sizeof(delay_us)) {
      std::memcpy(&delay_us, req.header().data(), sizeof(delay_us));
    }
    check(req.Reply({}, {region->span()}, nullptr));
    // Die while the rendezvous reply is (most likely) still streaming to the client.
    std::thread([delay_us] {
      std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
      kill(getpid(), SIGKILL);
    }).detach();
  }));

  std::cout << absl::BytesToHexString(worker->address()) << std::endl;
  // Serve until the parent goes away.
  std::string line;
  while (std::getline(std::cin, line)) {
  }
  {
    std::lock_guard<std::mutex> lock(hung_mu);
    hung.clear();
  }
  worker->Shutdown();
  return 0;
}
