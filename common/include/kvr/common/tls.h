#pragma once
// Transport security of kvr's gRPC channels, one mechanism for every server and client.
//
// A process is given three PEM files: the cluster's CA, its own certificate and that
// certificate's private key (TlsConfig; flags --tls-ca/--tls-cert/--tls-key, YAML keys
// tls_ca/tls_cert/tls_key, env KVR_<ROLE>_TLS_CA/_CERT/_KEY in every binary: the node settings
// of kvr/node/settings.h; kvr generate and kvr bench read KVR_TLS_CA). With
// them, GrpcSecurity makes
//   - server credentials: TLS with this certificate; a client must present a certificate
//     that chains to the CA (ClientCertificates::kRequired: the store, prefill and decode
//     nodes), or may present none (kOptional: the controller, whose port also serves public
//     clients; its internal services then ask PeerHasClusterCertificate);
//   - channel credentials: TLS that verifies the server against the CA (and its name against
//     the address dialled, so certificates carry the hosts nodes advertise as SANs) and
//     presents this process's certificate.
// Both sides take the three files from one gRPC file watcher, which reads them again every
// TlsConfig::reload_interval: a renewed certificate, key or CA is what the next handshake of a
// server or of a client channel uses, without a restart. Connections already open keep what
// they were made with; a channel's next connection (after a reconnect) takes the new files.
// With no file given everything is plaintext, as before TLS existed; a partial configuration
// (a certificate without its key, a key without the CA ...) is an error, never a silent
// downgrade.
//
// A node's certificate also says which node it is: a URI subjectAltName
// `kvr://node/<name>` (NodeIdentityUri), where <name> is the name the node registers with
// (RegisterRequest.name: kvr-store/kvr-decode --name, kvr-prefill --node-name). The
// controller's Membership service reads it with PeerNodeIdentity and admits a registration
// only under that name, and heartbeats and deregistrations of a node id only from the
// certificate that registered it (controller/README.md, "Membership and node identity").
//
// Thread safety: a GrpcSecurity is immutable after Load and may be shared across threads;
// its copies share one file watcher (one thread), which lives until the last copy and the last
// credentials made from it are gone.

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace grpc {
namespace experimental {
class CertificateProviderInterface;
}  // namespace experimental
class Channel;
class ChannelArguments;
class ChannelCredentials;
class ServerBuilder;
class ServerContext;
class ServerCredentials;
}  // namespace grpc

namespace kvr {

// How often a process reads its TLS files again unless told otherwise (TlsConfig and the HTTPS
// front door's options): a certificate renewed on disk (a Kubernetes Secret update, a
// cert-manager renewal) is in use within this long.
inline constexpr absl::Duration kTlsReloadInterval = absl::Seconds(60);

struct TlsConfig {
  std::string ca_file;    // PEM: the CA that peers' certificates must chain to
  std::string cert_file;  // PEM: the certificate (chain) this process presents
  std::string key_file;   // PEM: the private key of cert_file
  // How often the servers and client channels of this process read the three files again: a
  // renewed certificate (or CA) is used from the next handshake on, without a restart.
  // Connections already open keep the certificate they were made with. Rounded to whole
  // seconds, at least one (gRPC's file watcher counts seconds).
  absl::Duration reload_interval = kTlsReloadInterval;
  // The DNS name the certificates of the servers this process dials must carry, checked instead
  // of the host it dials (empty: that host). For clusters whose nodes are dialled at addresses
  // no shared certificate can name (Kubernetes pod IPs): every node certificate carries this
  // one name, and the CA still decides who belongs to the cluster.
  std::string server_name;
  [[nodiscard]] bool empty() const {
    return ca_file.empty() && cert_file.empty() && key_file.empty();
  }
};

// Help texts of the three settings, the same in every binary (kvr::node::TlsSettings).
inline constexpr char kTlsCaHelp[] =
    "PEM file of the cluster CA: peers' certificates must chain to it (with tls_cert and "
    "tls_key: every internal gRPC channel is mutual TLS; all three empty: plaintext)";
inline constexpr char kTlsCertHelp[] = "PEM certificate this process presents (see tls_ca)";
inline constexpr char kTlsKeyHelp[] = "PEM private key of tls_cert";
inline constexpr char kTlsServerNameHelp[] =
    "DNS name that the certificates of the kvr servers this process dials must carry, checked "
    "instead of the address dialled (empty: the address; for nodes reached at pod IPs)";

enum class ClientCertificates {
  // The handshake fails unless the client presents a certificate that chains to the CA.
  kRequired,
  // A client may connect without a certificate (public clients of the controller); one that
  // presents a certificate must chain to the CA. Handlers of internal services call
  // PeerHasClusterCertificate.
  kOptional,
};

class GrpcSecurity {
 public:
  // Plaintext.
  GrpcSecurity() = default;
  // Reads the files of `config`. All empty: plaintext. A client-only configuration is the CA
  // alone (kvr generate, kvr bench); a certificate needs its key and the CA.
  [[nodiscard]] static absl::StatusOr<GrpcSecurity> Load(const TlsConfig& config);

  [[nodiscard]] bool enabled() const { return !ca_pem_.empty(); }
  // Whether this process has a certificate to present (servers need one).
  [[nodiscard]] bool has_certificate() const { return !cert_pem_.empty(); }

  // Server credentials for a listening port: plaintext when disabled; an error when enabled
  // without a certificate. The certificate, key and CA are those of the file watcher.
  [[nodiscard]] absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
      ClientCertificates client_certificates) const;
  // Channel credentials: plaintext when disabled, else TLS verifying the server against the
  // watched CA (and its name against the target dialled) and presenting the watched
  // certificate, when there is one. tls_server_name is a channel argument: it applies only to
  // channels made by CreateChannel.
  [[nodiscard]] std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials() const;
  // grpc::CreateCustomChannel with ChannelCredentials().
  [[nodiscard]] std::shared_ptr<grpc::Channel> CreateChannel(
      const std::string& target, const grpc::ChannelArguments& args) const;
  [[nodiscard]] std::shared_ptr<grpc::Channel> CreateChannel(const std::string& target) const;

  // "mutual TLS" / "plaintext", for the effective-config line of each node.
  [[nodiscard]] std::string Describe() const;

 private:
  std::string ca_pem_;
  std::string cert_pem_;
  std::string key_pem_;
  TlsConfig files_;
  // Reads files_ every files_.reload_interval; null when disabled.
  std::shared_ptr<grpc::experimental::CertificateProviderInterface> provider_;
};

// The URI subjectAltName that names a node in its certificate: "kvr://node/" + name.
inline constexpr char kNodeIdentityUriPrefix[] = "kvr://node/";
[[nodiscard]] std::string NodeIdentityUri(absl::string_view node_name);

// The node names of the kvr://node/ URI subjectAltNames of a PEM certificate (empty: none).
// INVALID_ARGUMENT when `pem` is not a certificate.
[[nodiscard]] absl::StatusOr<std::vector<std::string>> NodeIdentitiesOfCertificate(
    absl::string_view pem);

// The node name that the peer of `context` proved: the one kvr://node/ URI subjectAltName of
// the certificate gRPC verified in the handshake. UNAUTHENTICATED without a verified
// certificate; NOT_FOUND when it carries no such name; INVALID_ARGUMENT when it carries
// several (one certificate is one node). The messages say what the certificate lacks.
[[nodiscard]] absl::StatusOr<std::string> PeerNodeIdentity(const grpc::ServerContext& context);

// True when the peer of `context` presented a certificate that chained to the CA of a server
// whose credentials came from an enabled GrpcSecurity (gRPC verified it in the handshake).
// False on a plaintext port and for a TLS client without a certificate.
[[nodiscard]] bool PeerHasClusterCertificate(const grpc::ServerContext& context);

}  // namespace kvr
