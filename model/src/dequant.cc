#include "kvr/model/dequant.h"

#include "absl/strings/str_cat.h"

namespace kvr::model {

absl::Status DequantizeRow(GgmlType type, const void* src, int64_t n, float* dst) {
  return absl::UnimplementedError(
      absl::StrCat("DequantizeRow: ", GgmlTypeName(type), " not implemented yet"));
}

}  // namespace kvr::model
