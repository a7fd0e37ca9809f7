#include "kvr/common/secure_random.h"

#include <sys/random.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/string_view.h"

namespace kvr {

void SecureRandomBytes(std::span<uint8_t> out) {
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = getrandom(out.data() + done, out.size() - done, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      // A guessable id would defeat the isolation these bytes provide: fail closed.
      std::fprintf(stderr, "kvr: getrandom failed: %s\n", std::strerror(errno));
      std::abort();
    }
    done += static_cast<size_t>(n);
  }
}

uint64_t SecureRandomU64() {
  uint64_t value = 0;
  SecureRandomBytes({reinterpret_cast<uint8_t*>(&value), sizeof(value)});
  return value;
}

std::string SecureRandomHex(size_t n_bytes) {
  std::vector<uint8_t> bytes(n_bytes);
  SecureRandomBytes(bytes);
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
}

}  // namespace kvr
