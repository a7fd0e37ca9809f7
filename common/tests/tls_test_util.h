#pragma once
// Certificate files for the TLS tests of every component (CMake target kvr::tls_test_util): CAs
// and the certificates they sign (kvr/common/cert_authority.h), written under a directory of the
// test's own that is removed at the end. A failure to make or write one is a test failure
// (EXPECT), after which the test fails on what it checks.

#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "kvr/common/cert_authority.h"
#include "kvr/common/tls.h"

namespace kvr {

// What a certificate is issued for, beside its CA and file name.
struct LeafOptions {
  std::string common_name;  // empty: the file name
  std::vector<std::string> hosts = {"127.0.0.1", "localhost"};
  std::vector<std::string> uris;  // e.g. NodeIdentityUri(name)
};

// Owns <TempDir>/<prefix>-<pid>-<test name>; every certificate is valid for an hour.
class TestCertificates {
 public:
  explicit TestCertificates(const std::string& prefix)
      : dir_(absl::StrCat(::testing::TempDir(), "/", prefix, "-", getpid(), "-",
                          ::testing::UnitTest::GetInstance()->current_test_info()->name())) {
    std::filesystem::create_directories(dir_);
  }
  ~TestCertificates() { std::filesystem::remove_all(dir_); }
  TestCertificates(const TestCertificates&) = delete;
  TestCertificates& operator=(const TestCertificates&) = delete;

  const std::string& dir() const { return dir_; }

  // A self-signed CA named `common_name` (not written).
  PemCertificate Ca(const std::string& common_name) {
    absl::StatusOr<PemCertificate> ca = GenerateCertificateAuthority(common_name, absl::Hours(1));
    EXPECT_TRUE(ca.ok()) << ca.status();
    return ca.ok() ? *ca : PemCertificate{};
  }

  // Writes `ca` to <dir>/<file>.pem (and its key beside it); returns the certificate's path.
  std::string WriteCa(const PemCertificate& ca, const std::string& file) {
    const std::string path = absl::StrCat(dir_, "/", file, ".pem");
    const absl::StatusOr<TlsConfig> files = WriteCertificate(dir_, file, ca, path);
    EXPECT_TRUE(files.ok()) << files.status();
    return path;
  }

  // A certificate signed by `by`, written to <dir>/<file>.pem and <dir>/<file>-key.pem; returns
  // the TlsConfig of those files with `ca_file` as the CA it trusts.
  TlsConfig Issue(const PemCertificate& by, const std::string& file, const std::string& ca_file,
                  const LeafOptions& options = {}) {
    const std::string& common_name = options.common_name.empty() ? file : options.common_name;
    absl::StatusOr<PemCertificate> cert =
        IssueCertificate(by, common_name, options.hosts, absl::Hours(1), options.uris);
    EXPECT_TRUE(cert.ok()) << cert.status();
    if (!cert.ok()) return TlsConfig{};
    absl::StatusOr<TlsConfig> files = WriteCertificate(dir_, file, *cert, ca_file);
    EXPECT_TRUE(files.ok()) << files.status();
    return files.ok() ? *files : TlsConfig{};
  }

 private:
  std::string dir_;
};

}  // namespace kvr
