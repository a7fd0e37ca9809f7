#pragma once
// The server that kvr bench and kvr eval endpoint send their requests to: the flag values that
// name it (--backend, --target or --base-url, --api-key, --tls-*) and the loadgen backend
// options they make.

#include <string>

#include "absl/status/statusor.h"
#include "kvr/common/status.h"
#include "kvr/common/tls.h"
#include "kvr/loadgen/backend.h"

namespace kvr::tools {

struct EndpointFlags {
  std::string backend = "kvr-grpc";  // kvr-grpc | openai-chat | openai-completions
  std::string target = "127.0.0.1:50051";
  TlsConfig tls;  // kvr-grpc: the channel's TLS; openai-*: HTTPS's CA and client certificate
  std::string base_url;
  std::string api_key;

  // What the requests go to: --target for kvr-grpc, --base-url for openai-*.
  [[nodiscard]] const std::string& address() const {
    return backend == "kvr-grpc" ? target : base_url;
  }
};

// The loadgen backend options of `flags`; INVALID_ARGUMENT for an unknown --backend.
[[nodiscard]] inline absl::StatusOr<loadgen::BackendOptions> BackendOptionsOf(
    const EndpointFlags& flags) {
  loadgen::BackendOptions options;
  KVR_ASSIGN_OR_RETURN(options.kind, loadgen::ParseBackendKind(flags.backend));
  options.target = flags.target;
  options.tls = flags.tls;
  options.base_url = flags.base_url;
  options.api_key = flags.api_key;
  return options;
}

}  // namespace kvr::tools
