#pragma once
// A raw unary gRPC call for tests (CMake target kvr::grpc_test_util): any method, any request
// bytes (also ones that are not the method's message), through a generic stub.

#include <functional>
#include <future>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvr {

// Calls `method` ("/package.Service/Method") on `channel` with `bytes` as the request message,
// under `timeout`. On success the reply's bytes go to `*reply` when given; `inspect`, when
// given, sees the call's context after it ended (the peer's certificate, say).
inline grpc::Status RawUnaryCall(
    const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
    const std::string& bytes, absl::Duration timeout, std::string* reply = nullptr,
    const std::function<void(const grpc::ClientContext&)>& inspect = nullptr) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  grpc::Slice slice(bytes);
  grpc::ByteBuffer request(&slice, 1), response;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, method, grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) { done.set_value(std::move(s)); });
  const grpc::Status status = done.get_future().get();
  if (inspect) inspect(ctx);
  if (status.ok() && reply != nullptr) {
    std::vector<grpc::Slice> slices;
    if (!response.Dump(&slices).ok()) {
      return grpc::Status(grpc::StatusCode::INTERNAL, "reply bytes could not be read");
    }
    reply->clear();
    for (const grpc::Slice& s : slices) {
      reply->append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
  }
  return status;
}

}  // namespace kvr
