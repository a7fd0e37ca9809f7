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

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kvr/common/tls.h"

namespace grpc {
class ServerBuilder;
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

}  // namespace kvr
