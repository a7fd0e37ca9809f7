#include "kvr/common/cert_authority.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvr/common/secure_random.h"

namespace kvr {
namespace {

// RAII owners of OpenSSL objects.
struct PkeyFree {
  void operator()(EVP_PKEY* p) const { EVP_PKEY_free(p); }
};
struct X509Free {
  void operator()(X509* p) const { X509_free(p); }
};
struct BioFree {
  void operator()(BIO* p) const { BIO_free(p); }
};
using Pkey = std::unique_ptr<EVP_PKEY, PkeyFree>;
using Cert = std::unique_ptr<X509, X509Free>;
using Bio = std::unique_ptr<BIO, BioFree>;

// The OpenSSL error queue as text, prefixed by what failed.
absl::Status OpenSslError(absl::string_view what) {
  std::string detail;
  while (unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof(buf));
    absl::StrAppend(&detail, detail.empty() ? "" : "; ", buf);
  }
  return absl::InternalError(absl::StrCat("OpenSSL: ", what, detail.empty() ? "" : ": ", detail));
}

std::string BioText(BIO* bio) {
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio, &data);
  return std::string(data, static_cast<size_t>(n));
}

absl::StatusOr<Pkey> NewKey() {
  Pkey key(EVP_EC_gen("P-256"));
  if (key == nullptr) return OpenSslError("EC P-256 key generation");
  return key;
}

// A certificate with a random 127-bit serial, `subject` as its CN, valid from an hour ago
// (clock skew) for `validity`, carrying `key`'s public key.
absl::StatusOr<Cert> NewCertificate(const std::string& common_name, EVP_PKEY* key,
                                    absl::Duration validity) {
  Cert cert(X509_new());
  if (cert == nullptr) return OpenSslError("X509_new");
  uint8_t serial[16];
  SecureRandomBytes(serial);
  serial[0] &= 0x7f;  // positive
  BIGNUM* bn = BN_bin2bn(serial, sizeof(serial), nullptr);
  const bool ok =
      bn != nullptr && X509_set_version(cert.get(), 2) == 1 &&
      BN_to_ASN1_INTEGER(bn, X509_get_serialNumber(cert.get())) != nullptr &&
      X509_gmtime_adj(X509_getm_notBefore(cert.get()), -3600) != nullptr &&
      X509_gmtime_adj(X509_getm_notAfter(cert.get()), absl::ToInt64Seconds(validity)) != nullptr &&
      X509_set_pubkey(cert.get(), key) == 1 &&
      X509_NAME_add_entry_by_txt(X509_get_subject_name(cert.get()), "CN", MBSTRING_UTF8,
                                 reinterpret_cast<const unsigned char*>(common_name.c_str()), -1,
                                 -1, 0) == 1;
  BN_free(bn);
  if (!ok) return OpenSslError("building the certificate");
  return cert;
}

absl::Status AddExtension(X509* cert, X509V3_CTX* ctx, int nid, const std::string& value) {
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, ctx, nid, value.c_str());
  if (ext == nullptr) return OpenSslError(absl::StrCat("extension ", OBJ_nid2sn(nid), "=", value));
  const int added = X509_add_ext(cert, ext, -1);
  X509_EXTENSION_free(ext);
  if (added != 1) return OpenSslError(absl::StrCat("adding extension ", OBJ_nid2sn(nid)));
  return absl::OkStatus();
}

absl::StatusOr<PemCertificate> ToPem(X509* cert, EVP_PKEY* key) {
  Bio cert_bio(BIO_new(BIO_s_mem()));
  Bio key_bio(BIO_new(BIO_s_mem()));
  if (cert_bio == nullptr || key_bio == nullptr || PEM_write_bio_X509(cert_bio.get(), cert) != 1 ||
      PEM_write_bio_PrivateKey(key_bio.get(), key, nullptr, nullptr, 0, nullptr, nullptr) != 1) {
    return OpenSslError("PEM encoding");
  }
  return PemCertificate{.cert_pem = BioText(cert_bio.get()), .key_pem = BioText(key_bio.get())};
}

bool IsIpAddress(const std::string& host) {
  in6_addr v6;
  in_addr v4;
  return inet_pton(AF_INET, host.c_str(), &v4) == 1 || inet_pton(AF_INET6, host.c_str(), &v6) == 1;
}

}  // namespace

absl::StatusOr<PemCertificate> GenerateCertificateAuthority(const std::string& common_name,
                                                            absl::Duration validity) {
  absl::StatusOr<Pkey> key = NewKey();
  if (!key.ok()) return key.status();
  absl::StatusOr<Cert> cert = NewCertificate(common_name, key->get(), validity);
  if (!cert.ok()) return cert.status();
  X509* x = cert->get();
  if (X509_set_issuer_name(x, X509_get_subject_name(x)) != 1) return OpenSslError("issuer name");
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, x, x, nullptr, nullptr, 0);
  for (const auto& [nid, value] : std::initializer_list<std::pair<int, std::string>>{
           {NID_basic_constraints, "critical,CA:TRUE,pathlen:0"},
           {NID_key_usage, "critical,keyCertSign,cRLSign"},
           {NID_subject_key_identifier, "hash"}}) {
    if (absl::Status s = AddExtension(x, &ctx, nid, value); !s.ok()) return s;
  }
  if (X509_sign(x, key->get(), EVP_sha256()) == 0) return OpenSslError("signing the CA");
  return ToPem(x, key->get());
}

absl::StatusOr<PemCertificate> IssueCertificate(const PemCertificate& ca,
                                                const std::string& common_name,
                                                const std::vector<std::string>& hosts,
                                                absl::Duration validity,
                                                const std::vector<std::string>& uris) {
  Bio ca_cert_bio(BIO_new_mem_buf(ca.cert_pem.data(), static_cast<int>(ca.cert_pem.size())));
  Bio ca_key_bio(BIO_new_mem_buf(ca.key_pem.data(), static_cast<int>(ca.key_pem.size())));
  Cert ca_cert(PEM_read_bio_X509(ca_cert_bio.get(), nullptr, nullptr, nullptr));
  Pkey ca_key(PEM_read_bio_PrivateKey(ca_key_bio.get(), nullptr, nullptr, nullptr));
  if (ca_cert == nullptr || ca_key == nullptr) return OpenSslError("reading the CA's PEM");
  absl::StatusOr<Pkey> key = NewKey();
  if (!key.ok()) return key.status();
  absl::StatusOr<Cert> cert = NewCertificate(common_name, key->get(), validity);
  if (!cert.ok()) return cert.status();
  X509* x = cert->get();
  if (X509_set_issuer_name(x, X509_get_subject_name(ca_cert.get())) != 1) {
    return OpenSslError("issuer name");
  }
  std::vector<std::string> names;
  for (const std::string& host : hosts) {
    names.push_back(absl::StrCat(IsIpAddress(host) ? "IP:" : "DNS:", host));
  }
  for (const std::string& uri : uris) names.push_back(absl::StrCat("URI:", uri));
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, ca_cert.get(), x, nullptr, nullptr, 0);
  std::vector<std::pair<int, std::string>> extensions = {
      {NID_basic_constraints, "critical,CA:FALSE"},
      {NID_key_usage, "critical,digitalSignature,keyEncipherment"},
      {NID_ext_key_usage, "serverAuth,clientAuth"},
      {NID_subject_key_identifier, "hash"},
      {NID_authority_key_identifier, "keyid"}};
  if (!names.empty()) extensions.push_back({NID_subject_alt_name, absl::StrJoin(names, ",")});
  for (const auto& [nid, value] : extensions) {
    if (absl::Status s = AddExtension(x, &ctx, nid, value); !s.ok()) return s;
  }
  if (X509_sign(x, ca_key.get(), EVP_sha256()) == 0) return OpenSslError("signing");
  return ToPem(x, key->get());
}

absl::StatusOr<TlsConfig> WriteCertificate(const std::string& dir, const std::string& name,
                                           const PemCertificate& certificate,
                                           const std::string& ca_file) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  TlsConfig config{.ca_file = ca_file,
                   .cert_file = absl::StrCat(dir, "/", name, ".pem"),
                   .key_file = absl::StrCat(dir, "/", name, "-key.pem")};
  for (const auto& [path, text, mode] : {std::tuple<std::string, const std::string*, mode_t>{
                                             config.cert_file, &certificate.cert_pem, 0644},
                                         {config.key_file, &certificate.key_pem, 0600}}) {
    // Created with its final mode (a private key is never readable by others, not even for a
    // moment); an existing file is replaced rather than rewritten in place.
    std::filesystem::remove(path, ec);
    const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
    bool ok = fd >= 0;
    size_t done = 0;
    while (ok && done < text->size()) {
      const ssize_t n = write(fd, text->data() + done, text->size() - done);
      ok = n > 0;
      if (ok) done += static_cast<size_t>(n);
    }
    if (fd >= 0) ok = close(fd) == 0 && ok;
    if (!ok) return absl::InternalError(absl::StrCat("cannot write ", path));
  }
  return config;
}

}  // namespace kvr
