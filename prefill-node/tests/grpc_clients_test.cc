// GrpcHandoffOpener against an in-process gRPC DecodeService on 127.0.0.1.

#include "kvr/prefill_node/grpc_clients.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kvr/cluster/v1/cluster.grpc.pb.h"

namespace kvr::prefill_node {
namespace {

namespace cv1 = ::kvr::cluster::v1;

// Accepts every handoff.
class AcceptingDecode final : public cv1::DecodeService::Service {
  grpc::Status Handoff(grpc::ServerContext*, grpc::ServerReader<cv1::HandoffChunk>* reader,
                       cv1::HandoffResponse*) override {
    cv1::HandoffChunk chunk;
    while (reader->Read(&chunk)) {
    }
    return grpc::Status::OK;
  }
};

std::unique_ptr<grpc::Server> Serve(grpc::Service* service, const std::string& address,
                                    int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), port);
  builder.RegisterService(service);
  return builder.BuildAndStart();
}

cv1::NodeRef Decode(const std::string& address, const std::string& instance) {
  cv1::NodeRef ref;
  ref.set_node_id("decode-1");
  ref.mutable_endpoints()->set_grpc_address(address);
  ref.set_instance_id(instance);
  return ref;
}

// A decode node that died and came back on the same address (another instance) is reached at
// once: the opener does not reuse the channel that the dead process refused, which sits in
// gRPC's reconnect backoff (1 s at first, growing to minutes) and fails every call meanwhile.
TEST(GrpcHandoffOpenerTest, ADecodeNodeRestartedOnTheSameAddressIsReachedAtOnce) {
  AcceptingDecode service;
  int port = 0;
  std::unique_ptr<grpc::Server> first = Serve(&service, "127.0.0.1:0", &port);
  ASSERT_NE(first, nullptr);
  ASSERT_GT(port, 0);
  const std::string address = "127.0.0.1:" + std::to_string(port);
  GrpcHandoffOpener opener;
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  {
    auto sink = opener.Open(Decode(address, "instance-a"), deadline);
    ASSERT_TRUE(sink.ok()) << sink.status();
    EXPECT_TRUE((*sink)->Finish().ok());
  }
  // The node dies: a handoff to it fails (connection refused) and the channel backs off.
  first->Shutdown();
  first.reset();
  {
    auto sink = opener.Open(Decode(address, "instance-a"), absl::Now() + absl::Seconds(2));
    ASSERT_TRUE(sink.ok()) << sink.status();
    auto finished = (*sink)->Finish();
    EXPECT_FALSE(finished.ok());
  }
  // Another instance on the same port, at once.
  int again = 0;
  std::unique_ptr<grpc::Server> second = Serve(&service, address, &again);
  ASSERT_NE(second, nullptr) << "port " << port << " was taken meanwhile";
  ASSERT_EQ(again, port);
  auto sink = opener.Open(Decode(address, "instance-b"), absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(sink.ok()) << sink.status();
  auto finished = (*sink)->Finish();
  EXPECT_TRUE(finished.ok()) << finished.status();
  second->Shutdown();
}

}  // namespace
}  // namespace kvr::prefill_node
