#include "https_certificates.h"

#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>

#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvr::controller {
namespace {

struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct ChainFree {
  void operator()(STACK_OF(X509) * s) const { sk_X509_pop_free(s, X509_free); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
struct StoreFree {
  void operator()(X509_STORE* s) const { X509_STORE_free(s); }
};
struct NamesFree {
  void operator()(STACK_OF(X509_NAME) * s) const { sk_X509_NAME_pop_free(s, X509_NAME_free); }
};
struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};

absl::StatusOr<std::string> ReadFile(const std::string& path, const char* setting) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(setting, " '", path, "': unreadable"));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::unique_ptr<BIO, BioFree> MemoryBio(const std::string& text) {
  return std::unique_ptr<BIO, BioFree>(BIO_new_mem_buf(text.data(), static_cast<int>(text.size())));
}

// Every PEM certificate of `text`, in order.
std::vector<std::unique_ptr<X509, X509Free>> Certificates(const std::string& text) {
  std::vector<std::unique_ptr<X509, X509Free>> out;
  std::unique_ptr<BIO, BioFree> bio = MemoryBio(text);
  while (bio != nullptr) {
    X509* x = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr);
    if (x == nullptr) break;
    out.emplace_back(x);
  }
  ERR_clear_error();  // the end of the input reads as an error
  return out;
}

}  // namespace

struct HttpsCertificates::Set {
  // The files' bytes as read, to tell a change.
  std::string cert_text, key_text, client_ca_text;
  std::unique_ptr<X509, X509Free> leaf;
  std::unique_ptr<STACK_OF(X509), ChainFree> chain;  // the certificates after the leaf
  std::unique_ptr<EVP_PKEY, KeyFree> key;
  // With a client CA: the store that verifies client certificates, and its subjects (sent to
  // clients so that they pick a matching certificate). Null without.
  std::unique_ptr<X509_STORE, StoreFree> client_store;
  std::unique_ptr<STACK_OF(X509_NAME), NamesFree> client_names;
  std::string description;
};

namespace {

absl::StatusOr<std::shared_ptr<HttpsCertificates::Set>> Parse(const HttpTlsOptions& tls,
                                                              std::string cert_text,
                                                              std::string key_text,
                                                              std::string client_ca_text) {
  auto set = std::make_shared<HttpsCertificates::Set>();
  std::vector<std::unique_ptr<X509, X509Free>> certs = Certificates(cert_text);
  if (certs.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("http_tls_cert '", tls.cert_file, "': no PEM certificate"));
  }
  set->leaf = std::move(certs[0]);
  set->chain.reset(sk_X509_new_null());
  if (set->chain == nullptr) return absl::ResourceExhaustedError("sk_X509_new_null");
  for (size_t i = 1; i < certs.size(); ++i) {
    if (sk_X509_push(set->chain.get(), certs[i].get()) == 0) {
      return absl::ResourceExhaustedError("sk_X509_push");
    }
    certs[i].release();  // owned by the chain now
  }
  std::unique_ptr<BIO, BioFree> key_bio = MemoryBio(key_text);
  if (key_bio != nullptr) {
    set->key.reset(PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr));
  }
  ERR_clear_error();
  if (set->key == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("http_tls_key '", tls.key_file, "': no PEM private key"));
  }
  if (X509_check_private_key(set->leaf.get(), set->key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat(
        "http_tls_key '", tls.key_file, "' is not the key of http_tls_cert '", tls.cert_file, "'"));
  }
  if (!tls.client_ca_file.empty()) {
    std::vector<std::unique_ptr<X509, X509Free>> cas = Certificates(client_ca_text);
    if (cas.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("http_tls_client_ca '", tls.client_ca_file, "': no PEM certificate"));
    }
    set->client_store.reset(X509_STORE_new());
    set->client_names.reset(sk_X509_NAME_new_null());
    if (set->client_store == nullptr || set->client_names == nullptr) {
      return absl::ResourceExhaustedError("X509_STORE_new");
    }
    for (const auto& ca : cas) {
      // Both take references of their own.
      X509_NAME* name = X509_NAME_dup(X509_get_subject_name(ca.get()));
      if (X509_STORE_add_cert(set->client_store.get(), ca.get()) != 1 || name == nullptr ||
          sk_X509_NAME_push(set->client_names.get(), name) == 0) {
        X509_NAME_free(name);
        ERR_clear_error();
        return absl::InvalidArgumentError(absl::StrCat("http_tls_client_ca '", tls.client_ca_file,
                                                       "': a certificate cannot be used"));
      }
    }
  }
  char subject[256];
  X509_NAME_oneline(X509_get_subject_name(set->leaf.get()), subject, sizeof(subject));
  std::string serial = "?";
  if (BIGNUM* bn = ASN1_INTEGER_to_BN(X509_get0_serialNumber(set->leaf.get()), nullptr)) {
    if (char* hex = BN_bn2hex(bn)) {
      serial = hex;
      OPENSSL_free(hex);
    }
    BN_free(bn);
  }
  set->description = absl::StrCat(subject, " serial ", serial);
  set->cert_text = std::move(cert_text);
  set->key_text = std::move(key_text);
  set->client_ca_text = std::move(client_ca_text);
  return set;
}

// The three files' bytes (the client CA's: "" when not set).
struct Texts {
  std::string cert, key, client_ca;
};

absl::StatusOr<Texts> ReadTexts(const HttpTlsOptions& tls) {
  Texts t;
  absl::StatusOr<std::string> cert = ReadFile(tls.cert_file, "http_tls_cert");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadFile(tls.key_file, "http_tls_key");
  if (!key.ok()) return key.status();
  t.cert = std::move(*cert);
  t.key = std::move(*key);
  if (!tls.client_ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadFile(tls.client_ca_file, "http_tls_client_ca");
    if (!ca.ok()) return ca.status();
    t.client_ca = std::move(*ca);
  }
  return t;
}

}  // namespace

HttpsCertificates::HttpsCertificates(HttpTlsOptions tls, std::shared_ptr<const Set> current)
    : tls_(std::move(tls)), current_(std::move(current)) {}

HttpsCertificates::~HttpsCertificates() = default;

absl::StatusOr<std::unique_ptr<HttpsCertificates>> HttpsCertificates::Load(
    const HttpTlsOptions& tls) {
  absl::StatusOr<Texts> texts = ReadTexts(tls);
  if (!texts.ok()) return texts.status();
  absl::StatusOr<std::shared_ptr<Set>> set =
      Parse(tls, std::move(texts->cert), std::move(texts->key), std::move(texts->client_ca));
  if (!set.ok()) return set.status();
  return std::unique_ptr<HttpsCertificates>(new HttpsCertificates(tls, std::move(*set)));
}

void HttpsCertificates::Install(SSL_CTX& ctx) { SSL_CTX_set_cert_cb(&ctx, &OnCertificate, this); }

absl::StatusOr<bool> HttpsCertificates::Reload() {
  absl::StatusOr<Texts> texts = ReadTexts(tls_);
  if (!texts.ok()) return texts.status();
  const std::shared_ptr<const Set> current = Current();
  if (texts->cert == current->cert_text && texts->key == current->key_text &&
      texts->client_ca == current->client_ca_text) {
    return false;
  }
  absl::StatusOr<std::shared_ptr<Set>> set =
      Parse(tls_, std::move(texts->cert), std::move(texts->key), std::move(texts->client_ca));
  if (!set.ok()) return set.status();
  absl::MutexLock lock(&mu_);
  current_ = std::move(*set);
  return true;
}

std::string HttpsCertificates::Describe() const { return Current()->description; }

std::shared_ptr<const HttpsCertificates::Set> HttpsCertificates::Current() const {
  absl::MutexLock lock(&mu_);
  return current_;
}

// OpenSSL calls this in every server handshake, after the ClientHello and before it picks the
// certificate and asks for the client's; returning 0 aborts the handshake.
int HttpsCertificates::OnCertificate(SSL* ssl, void* self) {
  const std::shared_ptr<const Set> set = static_cast<HttpsCertificates*>(self)->Current();
  // The SSL takes references of its own: the set may be replaced during the handshake.
  if (SSL_use_cert_and_key(ssl, set->leaf.get(), set->key.get(), set->chain.get(),
                           /*override=*/1) != 1) {
    return 0;
  }
  if (set->client_store != nullptr) {
    if (SSL_set1_verify_cert_store(ssl, set->client_store.get()) != 1) return 0;
    STACK_OF(X509_NAME)* names = SSL_dup_CA_list(set->client_names.get());
    if (names == nullptr) return 0;
    SSL_set_client_CA_list(ssl, names);  // takes `names`
  }
  return 1;
}

}  // namespace kvr::controller
