#include "kvr/common/version.h"

#ifndef KVR_VERSION
#define KVR_VERSION "unknown"
#endif
#ifndef KVR_GIT_DESCRIBE
#define KVR_GIT_DESCRIBE ""
#endif

namespace kvr {

const std::string& Version() {
  static const std::string* const version = new std::string(
      std::string_view(KVR_GIT_DESCRIBE).empty()
          ? std::string(KVR_VERSION)
          : std::string(KVR_VERSION) + " (git " + KVR_GIT_DESCRIBE + ")");
  return *version;
}

std::string VersionLine(std::string_view binary) {
  return std::string(binary) + " " + Version();
}

}  // namespace kvr
