#include "kvr/common/grpc_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/support/server_interceptor.h>

#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvr {
namespace {

using grpc::experimental::InterceptionHookPoints;

// Per call: remembers that the request message did not arrive as a message (gRPC's parse
// failed, or the client sent none) and rewrites gRPC's bare INTERNAL for it.
class UndecodableRequestInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit UndecodableRequestInterceptor(grpc::experimental::ServerRpcInfo* info)
      : method_(info->method() == nullptr ? "" : info->method()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE) &&
        methods->GetRecvMessage() == nullptr) {
      missing_message_ = true;
    }
    if (missing_message_ &&
        methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status status = methods->GetSendStatus();
      // Only gRPC's own answer (INTERNAL, no message): a handler's INTERNAL has a message,
      // and the end of a client stream (also no message) ends in the handler's status.
      if (status.error_code() == grpc::StatusCode::INTERNAL && status.error_message().empty()) {
        methods->ModifySendStatus(
            UndecodableRequestStatus(absl::StrCat("request message for ", method_)));
      }
    }
    methods->Proceed();
  }

 private:
  const std::string method_;
  bool missing_message_ = false;
};

class UndecodableRequestInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new UndecodableRequestInterceptor(info);
  }
};

}  // namespace

grpc::Status UndecodableRequestStatus(absl::string_view what) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                      absl::StrCat("request: not a valid ", what,
                                   " (undecodable protobuf, a string field that is not UTF-8, "
                                   "or no request message)"));
}

absl::Status ConfigureServer(grpc::ServerBuilder* builder, const std::string& address,
                             const GrpcSecurity& security, ClientCertificates client_certificates,
                             int* port) {
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      security.ServerCredentials(client_certificates);
  if (!credentials.ok()) return credentials.status();
  builder->AddListeningPort(address, *credentials, port);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
  creators.push_back(std::make_unique<UndecodableRequestInterceptorFactory>());
  builder->experimental().SetInterceptorCreators(std::move(creators));
  return absl::OkStatus();
}

absl::StatusOr<StartedGrpcServer> StartGrpcServer(const GrpcServerOptions& options) {
  // Both are process-wide switches read by every builder made after them; setting them again
  // is harmless.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  StartedGrpcServer started;
  if (absl::Status s = ConfigureServer(&builder, options.listen, options.security,
                                       options.client_certificates, &started.port);
      !s.ok()) {
    return absl::InvalidArgumentError(s.message());
  }
  if (options.max_receive_message_bytes != 0) {
    builder.SetMaxReceiveMessageSize(options.max_receive_message_bytes);
  }
  for (grpc::Service* service : options.services) builder.RegisterService(service);
  started.server = builder.BuildAndStart();
  if (started.server == nullptr || started.port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen));
  }
  return started;
}

}  // namespace kvr
