#pragma once
// The certificate, key and client CA of the HTTPS API, read again from their files without a
// restart (private to http_server.cc).
//
// OpenSSL reads a server's certificate into its SSL_CTX once; cpp-httplib makes every
// connection's SSL from that one SSL_CTX. So the files are kept here, parsed, and a
// certificate callback on the SSL_CTX (Install) gives each new handshake what was read last:
// its certificate chain and key, and with a client CA, the store that verifies client
// certificates and the CA names sent in the CertificateRequest. Reload reads the files again
// and swaps them in only when they changed and form a valid set (the key is the certificate's);
// anything else (a half-written renewal, a key of another certificate) keeps the set in use.
// Whether client certificates are asked for at all is fixed at start (SSL_CTX verify mode).
//
// Thread safety: Reload and the callback (on cpp-httplib's worker threads) may run at once;
// a handshake uses one whole set, the old or the new.

#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kvr/controller/http_server.h"

typedef struct ssl_ctx_st SSL_CTX;
typedef struct ssl_st SSL;

namespace kvr::controller {

class HttpsCertificates {
 public:
  // Reads the files of `tls` (enabled). INVALID_ARGUMENT names the setting whose file cannot
  // be used.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<HttpsCertificates>> Load(
      const HttpTlsOptions& tls);
  ~HttpsCertificates();
  HttpsCertificates(const HttpsCertificates&) = delete;
  HttpsCertificates& operator=(const HttpsCertificates&) = delete;

  // Makes every new handshake of `ctx` take the current set. `this` must outlive `ctx`'s
  // handshakes.
  void Install(SSL_CTX& ctx);

  // Reads the files again: true when they changed and are now in use, false when unchanged;
  // an error (naming the file) when they changed but cannot be used, the set in use kept.
  [[nodiscard]] absl::StatusOr<bool> Reload();

  // The one-line subject and serial of the certificate in use, for logs.
  [[nodiscard]] std::string Describe() const;

  struct Set;

 private:
  HttpsCertificates(HttpTlsOptions tls, std::shared_ptr<const Set> current);
  static int OnCertificate(SSL* ssl, void* self);
  std::shared_ptr<const Set> Current() const;

  const HttpTlsOptions tls_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const Set> current_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvr::controller
