#include "kvr/model/gguf.h"

#include "absl/strings/str_cat.h"

namespace kvr::model {

absl::StatusOr<GgufFile> GgufFile::Open(const std::string& path) {
  return absl::UnimplementedError(absl::StrCat("GgufFile::Open('", path, "'): not implemented yet"));
}

}  // namespace kvr::model
