#include "kvr/common/paths.h"

#include <cstdlib>

namespace kvr {

std::string CacheDir() {
  if (const char* dir = std::getenv("KVR_CACHE_DIR"); dir != nullptr && *dir != '\0') return dir;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg != '\0') {
    return std::string(xdg) + "/kvr";
  }
  const char* home = std::getenv("HOME");
  return std::string(home != nullptr ? home : ".") + "/.cache/kvr";
}

std::string ModelCacheDir() { return CacheDir() + "/models"; }

}  // namespace kvr

namespace kvr {

std::string TestModelPath() {
  if (const char* p = std::getenv("KVR_TEST_MODEL"); p != nullptr && *p != '\0') return p;
  return ModelCacheDir() + "/SmolLM2-135M-Instruct.Q4_1.gguf";
}

}  // namespace kvr
