#pragma once
// Where kvr keeps fetched models and other caches.

#include <string>

namespace kvr {

// $KVR_CACHE_DIR, else $XDG_CACHE_HOME/kvr, else $HOME/.cache/kvr.
std::string CacheDir();

// The folder scripts/fetch-model.sh puts models in: CacheDir() + "/models".
std::string ModelCacheDir();

}  // namespace kvr
