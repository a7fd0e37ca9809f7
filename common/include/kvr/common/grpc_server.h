#pragma once
// What every kvr gRPC server sets on its builder, in one place: the listening port with the
// process's transport security (tls.h) and the interceptor that turns an undecodable request
// into INVALID_ARGUMENT with a message.
//
// Why an interceptor: gRPC's synchronous handlers never see a request that failed to parse;
// gRPC answers it INTERNAL with an empty message, which reads as a server fault and says
// nothing of what the client sent. The interceptor notices the failed parse (the received
// message is missing) and rewrites that status, for every method of every service on the
// server, so no handler has to read its request itself.

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvr/common/tls.h"

namespace grpc {
class Server;
class ServerBuilder;
class Service;
class Status;
}  // namespace grpc

namespace kvr {

// Adds a listening port on `address` with `security`'s server credentials to `builder`
// (`*port` is set by BuildAndStart, as for grpc::ServerBuilder::AddListeningPort) and installs
// the undecodable-request interceptor. Call once per builder.
[[nodiscard]] absl::Status ConfigureServer(grpc::ServerBuilder* builder, const std::string& address,
                                           const GrpcSecurity& security,
                                           ClientCertificates client_certificates, int* port);

// The status a request that did not decode gets: INVALID_ARGUMENT naming `what` (a method or
// a message type) and the likely causes.
[[nodiscard]] grpc::Status UndecodableRequestStatus(absl::string_view what);

// What a kvr gRPC server is made of: the address and security of its port, its services, and
// the limit on a received message.
struct GrpcServerOptions {
  std::string listen;  // host:port; port 0: any free port
  GrpcSecurity security;
  ClientCertificates client_certificates = ClientCertificates::kRequired;
  // Services to serve besides health and reflection; not owned, must outlive the server.
  std::vector<grpc::Service*> services;
  // Largest request message in bytes: 0 keeps gRPC's default (4 MiB), -1 is unlimited.
  int max_receive_message_bytes = 0;
};

struct StartedGrpcServer {
  std::unique_ptr<grpc::Server> server;
  int port = 0;  // the port bound (listen's port, or the free one chosen for port 0)
};

// Builds and starts a server of `options` the way every kvr server is: the default
// grpc.health.v1 service (overall status "" SERVING) and server reflection on, the port and
// interceptor of ConfigureServer. INVALID_ARGUMENT when the security cannot serve (no
// certificate); UNAVAILABLE "cannot listen on <listen>" when the port cannot be bound.
[[nodiscard]] absl::StatusOr<StartedGrpcServer> StartGrpcServer(const GrpcServerOptions& options);

}  // namespace kvr
