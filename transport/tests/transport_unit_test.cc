// In-process tests: two workers of one process talking to each other. They cover argument
// errors, reply-buffer handling, handler misuse, payload destinations and destruction order.

#include <atomic>
#include <cstring>
#include <thread>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "kvr/transport/ucx.h"

namespace kvr::transport {
namespace {

constexpr AmId kEcho = 1;
constexpr AmId kDrop = 2;
constexpr AmId kHold = 3;
constexpr AmId kSink = 4;

class TransportUnitTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto context = Context::Create({.ucx_config = {{"TLS", "sm,self"}}});
    ASSERT_TRUE(context.ok()) << context.status();
    context_.emplace(std::move(*context));
    auto server = Worker::Create(*context_, {.name = "server"});
    ASSERT_TRUE(server.ok()) << server.status();
    server_.emplace(std::move(*server));
    auto client = Worker::Create(*context_, {.name = "client"});
    ASSERT_TRUE(client.ok()) << client.status();
    client_.emplace(std::move(*client));
    ASSERT_TRUE(server_
                    ->RegisterHandler(kEcho,
                                      [](IncomingRequest r) {
                                        ByteView p = r.payload();
                                        ASSERT_TRUE(r.Reply(r.header(), {p}, nullptr).ok());
                                      })
                    .ok());
    ASSERT_TRUE(server_->RegisterHandler(kDrop, [](IncomingRequest) {}).ok());
    ASSERT_TRUE(server_
                    ->RegisterHandler(kHold,
                                      [this](IncomingRequest r) {
                                        absl::MutexLock lock(&held_mu_);
                                        held_.push_back(std::move(r));
                                      })
                    .ok());
    auto ep = client_->Connect(server_->address(), "server");
    ASSERT_TRUE(ep.ok()) << ep.status();
    ep_.emplace(std::move(*ep));
  }

  void TearDown() override {
    absl::MutexLock lock(&held_mu_);
    held_.clear();
  }

  CallOptions Deadline(absl::Duration d = absl::Seconds(10)) {
    return {.deadline = absl::Now() + d};
  }

  absl::Mutex held_mu_;
  std::vector<IncomingRequest> held_;
  std::optional<Context> context_;
  std::optional<Worker> server_;
  std::optional<Worker> client_;
  std::optional<Endpoint> ep_;
};

TEST_F(TransportUnitTest, RejectsReservedAndOutOfRangeAmIds) {
  auto r0 = ep_->CallSync(0, {}, {}, Deadline());
  EXPECT_EQ(r0.status().code(), absl::StatusCode::kInvalidArgument) << r0.status();
  auto r1 = ep_->CallSync(kMaxUserAmId + 1, {}, {}, Deadline());
  EXPECT_EQ(r1.status().code(), absl::StatusCode::kInvalidArgument) << r1.status();
  EXPECT_EQ(server_->RegisterHandler(0, [](IncomingRequest) {}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(server_->RegisterHandler(5, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(TransportUnitTest, ConnectRejectsMalformedAddresses) {
  EXPECT_EQ(client_->Connect("", "x").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->Connect("short", "x").status().code(), absl::StatusCode::kInvalidArgument);
  std::string bad = server_->address();
  bad[0] ^= 0x5a;  // breaks the magic
  auto r = client_->Connect(bad, "x");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("not a kvr worker address"), absl::string_view::npos);
}

TEST_F(TransportUnitTest, ReplyLargerThanReplyBufferIsOutOfRange) {
  for (size_t size : {size_t{100}, size_t{4} << 20}) {  // eager and rendezvous
    Bytes payload = Bytes::Uninitialized(size);
    std::memset(payload.data(), 1, size);
    Bytes small = Bytes::Uninitialized(size / 2);
    auto r =
        ep_->CallSync(kEcho, {}, {payload.view()},
                      {.deadline = absl::Now() + absl::Seconds(10), .reply_buffer = small.span()});
    ASSERT_EQ(r.status().code(), absl::StatusCode::kOutOfRange) << r.status();
    EXPECT_NE(r.status().message().find(absl::StrCat(size, " bytes")), absl::string_view::npos)
        << r.status();
    // The endpoint still works afterwards.
    auto ok = ep_->CallSync(kEcho, AsBytes("h"), {}, Deadline());
    ASSERT_TRUE(ok.ok()) << ok.status();
    EXPECT_EQ(ok->header, "h");
  }
}

TEST_F(TransportUnitTest, RequestDroppedByHandlerAnswersInternal) {
  auto r = ep_->CallSync(kDrop, {}, {}, Deadline());
  ASSERT_EQ(r.status().code(), absl::StatusCode::kInternal) << r.status();
  EXPECT_NE(r.status().message().find("dropped"), absl::string_view::npos);
}

TEST_F(TransportUnitTest, AsyncReplyFromAnotherThreadRunsOnDone) {
  absl::Notification done;
  PendingCall call =
      ep_->Call(kHold, AsBytes("later"), {},
                {.deadline = absl::Now() + absl::Seconds(10), .on_done = [&] { done.Notify(); }});
  // Wait until the server holds the request; the call must still be in progress.
  for (;;) {
    absl::MutexLock lock(&held_mu_);
    if (!held_.empty()) break;
    held_mu_.Unlock();
    absl::SleepFor(absl::Milliseconds(1));
    held_mu_.Lock();
  }
  EXPECT_EQ(call.state(), OpState::kInProgress);
  EXPECT_FALSE(done.HasBeenNotified());
  IncomingRequest request = [&] {
    absl::MutexLock lock(&held_mu_);
    IncomingRequest r = std::move(held_.back());
    held_.pop_back();
    return r;
  }();
  std::thread replier([r = std::move(request)]() mutable {
    ASSERT_TRUE(r.Reply(AsBytes("answer"), Bytes::Copy(AsBytes("payload"))).ok());
    // A second reply is refused, not sent.
    EXPECT_EQ(r.ReplyError(absl::InternalError("x")).code(), absl::StatusCode::kFailedPrecondition);
  });
  replier.join();
  done.WaitForNotification();
  EXPECT_EQ(call.state(), OpState::kDone);
  auto r = call.Wait();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->header, "answer");
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(r->payload.data()), r->payload_size),
            "payload");
  EXPECT_EQ(call.Wait().status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(TransportUnitTest, PayloadDestinationReceivesIntoPoolMemory) {
  auto pool = context_->Allocate(size_t{8} << 20);
  ASSERT_TRUE(pool.ok()) << pool.status();
  std::atomic<const uint8_t*> seen{nullptr};
  HandlerOptions options;
  options.payload_destination = [&](ByteView header,
                                    size_t length) -> absl::StatusOr<std::span<uint8_t>> {
    // Header = offset into the pool as text; refuse writes that do not fit.
    size_t offset =
        std::stoul(std::string(reinterpret_cast<const char*>(header.data()), header.size()));
    if (offset + length > pool->size()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("write of ", length, " bytes at ", offset, " overflows the pool"));
    }
    return pool->span().subspan(offset, length);
  };
  ASSERT_TRUE(server_
                  ->RegisterHandler(
                      kSink,
                      [&](IncomingRequest r) {
                        seen = r.payload().data();
                        ASSERT_TRUE(r.Reply({}).ok());
                      },
                      options)
                  .ok());
  for (size_t size : {size_t{300}, size_t{3} << 20}) {
    Bytes payload = Bytes::Uninitialized(size);
    for (size_t i = 0; i < size; ++i) payload.data()[i] = static_cast<uint8_t>(i * 7 + size);
    const size_t offset = 4096;
    auto r = ep_->CallSync(kSink, AsBytes(std::to_string(offset)), {payload.view()}, Deadline());
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(seen.load(), pool->data() + offset);
    EXPECT_EQ(std::memcmp(pool->data() + offset, payload.data(), size), 0);
  }
  Bytes big = Bytes::Uninitialized(size_t{2} << 20);
  auto refused = ep_->CallSync(kSink, AsBytes(std::to_string(7u << 20)), {big.view()}, Deadline());
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("overflows the pool"), absl::string_view::npos);
}

TEST_F(TransportUnitTest, RmaRejectsKeyOfAnotherEndpoint) {
  auto region = context_->Allocate(1 << 16);
  ASSERT_TRUE(region.ok());
  auto packed = region->PackRkey();
  ASSERT_TRUE(packed.ok()) << packed.status();
  auto other = client_->Connect(server_->address(), "server-2");
  ASSERT_TRUE(other.ok());
  auto key = other->UnpackRkey(*packed);
  ASSERT_TRUE(key.ok()) << key.status();
  Bytes local = Bytes::Uninitialized(64);
  EXPECT_EQ(ep_->GetSync(region->address(), *key, local.span()).code(),
            absl::StatusCode::kInvalidArgument);
  // With the right endpoint the same get works and is exact.
  std::memset(region->data(), 0x3c, 64);
  ASSERT_TRUE(other->GetSync(region->address(), *key, local.span()).ok());
  EXPECT_EQ(local.data()[63], 0x3c);
  EXPECT_EQ(ep_->UnpackRkey("").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(TransportUnitTest, ClosingEndpointCancelsItsCalls) {
  PendingCall call = ep_->Call(kHold, {}, {}, Deadline(absl::Seconds(60)));
  // Make sure the request is out before closing.
  ASSERT_TRUE(ep_->CallSync(kEcho, {}, {}, Deadline()).ok());
  ep_.reset();
  auto r = call.Wait();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kCancelled) << r.status();
}

TEST_F(TransportUnitTest, ShutdownCancelsPendingCallsAndLeavesHandlesSafe) {
  PendingCall call = ep_->Call(kHold, {}, {}, Deadline(absl::Seconds(60)));
  ASSERT_TRUE(ep_->CallSync(kEcho, {}, {}, Deadline()).ok());
  client_->Shutdown();
  auto r = call.Wait();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kCancelled) << r.status();
  // The endpoint outlives its worker's shutdown: calls fail cleanly instead of crashing.
  auto after = ep_->CallSync(kEcho, {}, {}, Deadline());
  EXPECT_FALSE(after.ok());
  EXPECT_FALSE(ep_->Transports().ok());
}

TEST_F(TransportUnitTest, ContextMayBeDroppedBeforeItsWorkers) {
  // Owners share the context, so dropping the handle first is safe.
  context_.reset();
  auto r = ep_->CallSync(kEcho, AsBytes("still"), {}, Deadline());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->header, "still");
}

}  // namespace
}  // namespace kvr::transport
