#include "kvr/controller/ids.h"

#include <algorithm>
#include <span>

#include "kvr/common/secure_random.h"

namespace kvr::controller {

std::string NewRequestId() { return SecureRandomHex(kRequestIdBytes); }

uint64_t NewSequenceId() {
  uint64_t id = 0;
  while (id == 0) id = SecureRandomU64();
  return id;
}

std::string NewSequenceCapability() {
  std::string cap(kSequenceCapabilityBytes, '\0');
  const std::span<uint8_t> bytes(reinterpret_cast<uint8_t*>(cap.data()), cap.size());
  do {
    SecureRandomBytes(bytes);
  } while (std::all_of(cap.begin(), cap.end(), [](char c) { return c == '\0'; }));
  return cap;
}

}  // namespace kvr::controller
