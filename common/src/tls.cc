#include "kvr/common/tls.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <limits>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

namespace kvr {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* setting) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat(setting, ": cannot read '", path, "'"));
  }
  std::ostringstream text;
  text << in.rdbuf();
  std::string pem = text.str();
  if (pem.find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(setting, ": '", path, "' is not a PEM file (no -----BEGIN line)"));
  }
  return pem;
}

// gRPC's file watcher counts whole seconds.
unsigned int ReloadSeconds(absl::Duration interval) {
  return static_cast<unsigned int>(std::clamp<int64_t>(absl::ToInt64Seconds(interval), 1,
                                                       std::numeric_limits<unsigned int>::max()));
}

}  // namespace

absl::StatusOr<GrpcSecurity> GrpcSecurity::Load(const TlsConfig& config) {
  GrpcSecurity security;
  if (config.empty()) return security;
  if (config.ca_file.empty()) {
    return absl::InvalidArgumentError(
        "tls_ca: empty, but tls_cert or tls_key is set (TLS needs the CA that peers chain to)");
  }
  if (config.cert_file.empty() != config.key_file.empty()) {
    return absl::InvalidArgumentError(config.cert_file.empty()
                                          ? "tls_cert: empty, but tls_key is set"
                                          : "tls_key: empty, but tls_cert is set");
  }
  absl::StatusOr<std::string> ca = ReadPem(config.ca_file, "tls_ca");
  if (!ca.ok()) return ca.status();
  security.files_ = config;
  security.ca_pem_ = std::move(*ca);
  if (!config.cert_file.empty()) {
    absl::StatusOr<std::string> cert = ReadPem(config.cert_file, "tls_cert");
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadPem(config.key_file, "tls_key");
    if (!key.ok()) return key.status();
    security.cert_pem_ = std::move(*cert);
    security.key_pem_ = std::move(*key);
  }
  // The files were read (and checked) above; the watcher reads them again now and every
  // reload_interval, keeping what it has when a read fails (a half-written renewal).
  const unsigned int seconds = ReloadSeconds(config.reload_interval);
  if (security.has_certificate()) {
    security.provider_ = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        config.key_file, config.cert_file, config.ca_file, seconds);
  } else {
    security.provider_ = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        config.ca_file, seconds);
  }
  return security;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> GrpcSecurity::ServerCredentials(
    ClientCertificates client_certificates) const {
  if (!enabled()) return grpc::InsecureServerCredentials();
  if (!has_certificate()) {
    return absl::InvalidArgumentError(
        "tls_cert, tls_key: a TLS server needs its own certificate and key (only tls_ca is set)");
  }
  grpc::experimental::TlsServerCredentialsOptions options(provider_);
  options.watch_root_certs();
  options.watch_identity_key_cert_pairs();
  options.set_cert_request_type(client_certificates == ClientCertificates::kRequired
                                    ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                    : GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  return grpc::experimental::TlsServerCredentials(options);
}

std::shared_ptr<grpc::ChannelCredentials> GrpcSecurity::ChannelCredentials() const {
  if (!enabled()) return grpc::InsecureChannelCredentials();
  // The server's certificate must chain to the watched CA; gRPC's default verifier of TLS
  // channel credentials then checks its name against the target's host, as SslCredentials
  // does.
  grpc::experimental::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(provider_);
  options.watch_root_certs();
  if (has_certificate()) options.watch_identity_key_cert_pairs();
  return grpc::experimental::TlsCredentials(options);
}

std::shared_ptr<grpc::Channel> GrpcSecurity::CreateChannel(
    const std::string& target, const grpc::ChannelArguments& args) const {
  return grpc::CreateCustomChannel(target, ChannelCredentials(), args);
}

std::shared_ptr<grpc::Channel> GrpcSecurity::CreateChannel(const std::string& target) const {
  return CreateChannel(target, grpc::ChannelArguments());
}

std::string GrpcSecurity::Describe() const {
  if (!enabled()) return "plaintext";
  return has_certificate() ? "TLS with a client certificate (mutual TLS)"
                           : "TLS, server verified, no client certificate";
}

std::string NodeIdentityUri(absl::string_view node_name) {
  return absl::StrCat(kNodeIdentityUriPrefix, node_name);
}

absl::StatusOr<std::vector<std::string>> NodeIdentitiesOfCertificate(absl::string_view pem) {
  BIO* bio = BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size()));
  if (bio == nullptr) return absl::ResourceExhaustedError("BIO_new_mem_buf");
  X509* cert = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr);
  BIO_free(bio);
  if (cert == nullptr) return absl::InvalidArgumentError("not a PEM certificate");
  std::vector<std::string> names;
  auto* sans =
      static_cast<GENERAL_NAMES*>(X509_get_ext_d2i(cert, NID_subject_alt_name, nullptr, nullptr));
  for (int i = 0; sans != nullptr && i < sk_GENERAL_NAME_num(sans); ++i) {
    const GENERAL_NAME* name = sk_GENERAL_NAME_value(sans, i);
    if (name->type != GEN_URI) continue;
    const ASN1_IA5STRING* uri = name->d.uniformResourceIdentifier;
    absl::string_view value(reinterpret_cast<const char*>(ASN1_STRING_get0_data(uri)),
                            static_cast<size_t>(ASN1_STRING_length(uri)));
    if (absl::ConsumePrefix(&value, kNodeIdentityUriPrefix)) names.emplace_back(value);
  }
  GENERAL_NAMES_free(sans);
  X509_free(cert);
  return names;
}

absl::StatusOr<std::string> PeerNodeIdentity(const grpc::ServerContext& context) {
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) {
    return absl::UnauthenticatedError("the peer presented no certificate of the cluster CA");
  }
  // gRPC's SSL security puts the verified peer certificate's PEM in this property.
  const std::vector<grpc::string_ref> pems = auth->FindPropertyValues("x509_pem_cert");
  if (pems.empty()) {
    return absl::UnauthenticatedError("the TLS peer's certificate is not available");
  }
  absl::StatusOr<std::vector<std::string>> names =
      NodeIdentitiesOfCertificate(absl::string_view(pems[0].data(), pems[0].size()));
  if (!names.ok()) return names.status();
  if (names->empty()) {
    return absl::NotFoundError(
        absl::StrCat("the peer's certificate names no node (it needs the "
                     "URI subjectAltName ",
                     kNodeIdentityUriPrefix, "<node name>)"));
  }
  if (names->size() > 1) {
    return absl::InvalidArgumentError(absl::StrCat("the peer's certificate names ", names->size(),
                                                   " nodes (", absl::StrJoin(*names, ", "),
                                                   "); a node's certificate names one"));
  }
  return std::move((*names)[0]);
}

bool PeerHasClusterCertificate(const grpc::ServerContext& context) {
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  // gRPC's SSL security sets a peer identity only from a certificate it verified against the
  // server's root certificates; plaintext and certificate-less TLS peers have none.
  return auth != nullptr && auth->IsPeerAuthenticated();
}

}  // namespace kvr
