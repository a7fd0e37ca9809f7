#pragma once
// A throw-away certificate authority for a local cluster (`kvr up`) and tests: an ECDSA P-256
// CA and certificates it signs for servers and clients, in PEM, made with OpenSSL's C API.
// Not a PKI: no revocation, no rotation; production certificates come from the operator's own
// CA (docs/design.md, security).

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvr/common/tls.h"

namespace kvr {

struct PemCertificate {
  std::string cert_pem;
  std::string key_pem;
};

// A self-signed CA certificate (basicConstraints CA:TRUE, keyCertSign) valid for `validity`.
[[nodiscard]] absl::StatusOr<PemCertificate> GenerateCertificateAuthority(
    const std::string& common_name, absl::Duration validity);

// A certificate signed by `ca` for both TLS server and client use, with subject alternative
// names `hosts` (each an IPv4/IPv6 address or a DNS name) and `uris` (URI names, e.g. a
// node's identity NodeIdentityUri(name), kvr/common/tls.h).
[[nodiscard]] absl::StatusOr<PemCertificate> IssueCertificate(
    const PemCertificate& ca, const std::string& common_name, const std::vector<std::string>& hosts,
    absl::Duration validity, const std::vector<std::string>& uris = {});

// Writes `<dir>/<name>.pem` and `<dir>/<name>-key.pem` (the key 0600) and returns the
// TlsConfig of those files with `ca_file`.
[[nodiscard]] absl::StatusOr<TlsConfig> WriteCertificate(const std::string& dir,
                                                         const std::string& name,
                                                         const PemCertificate& certificate,
                                                         const std::string& ca_file);

}  // namespace kvr
