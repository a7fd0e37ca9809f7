#include "kvr/model/safetensors.h"

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

namespace kvr::model {

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  return absl::UnimplementedError(
      absl::StrCat("SafetensorsFile::Open('", path, "'): not implemented yet"));
}

}  // namespace kvr::model
