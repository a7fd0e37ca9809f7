#pragma once
// --tls-ca / --tls-cert / --tls-key of the kvr subcommands that call a cluster's gRPC API
// (kvr generate --endpoint, kvr bench --backend kvr-grpc) or its HTTPS API (kvr bench
// --backend openai-*), the same names and environment variables as the nodes' settings
// (kvr/common/tls.h).

#include <CLI/CLI.hpp>

#include "kvr/common/tls.h"

namespace kvr::tools {

// `tls` must outlive the parse.
inline void AddTlsOptions(CLI::App* cmd, TlsConfig* tls) {
  cmd->add_option("--tls-ca", tls->ca_file,
                  "PEM CA that the controller's certificate chains to: the cluster's gRPC port "
                  "is TLS (kvr up: <log dir>/tls/ca.pem); empty: plaintext (an https:// "
                  "--base-url: the system's CAs)")
      ->envname("KVR_TLS_CA");
  cmd->add_option("--tls-cert", tls->cert_file,
                  "PEM client certificate to present (with --tls-ca; the public API needs none)")
      ->envname("KVR_TLS_CERT");
  cmd->add_option("--tls-key", tls->key_file, "PEM private key of --tls-cert")
      ->envname("KVR_TLS_KEY");
}

}  // namespace kvr::tools
