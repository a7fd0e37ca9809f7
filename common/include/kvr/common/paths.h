#pragma once
// Where kvr keeps fetched models and other caches.

#include <string>

namespace kvr {

// $KVR_CACHE_DIR, else $XDG_CACHE_HOME/kvr, else $HOME/.cache/kvr.
std::string CacheDir();

// The folder scripts/fetch-model.sh puts models in: CacheDir() + "/models".
std::string ModelCacheDir();

}  // namespace kvr

namespace kvr {

// The SmolLM2-135M-Instruct GGUF that tests and the demo use: $KVR_TEST_MODEL, else its place
// in ModelCacheDir() (scripts/fetch-model.sh puts it there).
std::string TestModelPath();

}  // namespace kvr
