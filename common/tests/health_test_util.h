#pragma once
// grpc.health.v1 from a test's side (CMake target kvr::health_test_util): a channel to a port
// on loopback and a Check of one service.

#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "kvr/common/tls.h"

namespace kvr {

// What HealthStatus adds to the gRPC code of a failed call: no serving status is that large.
inline constexpr int kHealthCallFailed = 100;

// The serving status of `service` ("" the overall one) that a grpc.health.v1 Check on `channel`
// answers within `timeout`, or kHealthCallFailed + the gRPC code of a failed call.
inline int HealthStatus(const std::shared_ptr<grpc::Channel>& channel,
                        const std::string& service = "",
                        absl::Duration timeout = absl::Seconds(5)) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status s =
      grpc::health::v1::Health::NewStub(channel)->Check(&ctx, request, &response);
  return s.ok() ? static_cast<int>(response.status()) : kHealthCallFailed + s.error_code();
}

// A channel to 127.0.0.1:`port` with the security of `tls` (plaintext when it names no files).
inline std::shared_ptr<grpc::Channel> LoopbackChannel(int port, const TlsConfig& tls) {
  absl::StatusOr<GrpcSecurity> security = GrpcSecurity::Load(tls);
  EXPECT_TRUE(security.ok()) << security.status();
  return security->CreateChannel(absl::StrCat("127.0.0.1:", port));
}

}  // namespace kvr
