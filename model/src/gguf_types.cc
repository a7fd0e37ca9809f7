#include <array>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kvr/model/tensor_types.h"

namespace kvr::model {
namespace {

struct TypeEntry {
  uint32_t id;
  GgmlTypeTraits traits;
};

// Block geometry from ggml.c's type_traits table (QK_K = 256).
constexpr std::array<TypeEntry, 33> kTypes = {{
    {0, {"f32", 1, 4, true}},
    {1, {"f16", 1, 2, true}},
    {2, {"q4_0", 32, 18, true}},
    {3, {"q4_1", 32, 20, true}},
    {6, {"q5_0", 32, 22, true}},
    {7, {"q5_1", 32, 24, true}},
    {8, {"q8_0", 32, 34, true}},
    {9, {"q8_1", 32, 36, false}},
    {10, {"q2_K", 256, 84, true}},
    {11, {"q3_K", 256, 110, true}},
    {12, {"q4_K", 256, 144, true}},
    {13, {"q5_K", 256, 176, true}},
    {14, {"q6_K", 256, 210, true}},
    {15, {"q8_K", 256, 292, false}},
    {16, {"iq2_xxs", 256, 66, false}},
    {17, {"iq2_xs", 256, 74, false}},
    {18, {"iq3_xxs", 256, 98, false}},
    {19, {"iq1_s", 256, 50, false}},
    {20, {"iq4_nl", 32, 18, false}},
    {21, {"iq3_s", 256, 110, false}},
    {22, {"iq2_s", 256, 82, false}},
    {23, {"iq4_xs", 256, 136, false}},
    {24, {"i8", 1, 1, false}},
    {25, {"i16", 1, 2, false}},
    {26, {"i32", 1, 4, false}},
    {27, {"i64", 1, 8, false}},
    {28, {"f64", 1, 8, false}},
    {29, {"iq1_m", 256, 56, false}},
    {30, {"bf16", 1, 2, true}},
    {34, {"tq1_0", 256, 54, false}},
    {35, {"tq2_0", 256, 66, false}},
    // Sentinels keep the array size simple to maintain; never matched (ids are unique above).
    {0xffffffffu, {"", 0, 0, false}},
    {0xffffffffu, {"", 0, 0, false}},
}};

const GgmlTypeTraits* Find(uint32_t id) {
  for (const TypeEntry& e : kTypes) {
    if (e.id == id && e.traits.block_size > 0) return &e.traits;
  }
  return nullptr;
}

}  // namespace

absl::StatusOr<GgmlTypeTraits> GetGgmlTypeTraits(uint32_t type_id) {
  const GgmlTypeTraits* t = Find(type_id);
  if (t == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("unknown ggml tensor type id ", type_id));
  }
  return *t;
}

absl::StatusOr<GgmlTypeTraits> GetGgmlTypeTraits(GgmlType type) {
  return GetGgmlTypeTraits(static_cast<uint32_t>(type));
}

std::string GgmlTypeName(GgmlType type) {
  const GgmlTypeTraits* t = Find(static_cast<uint32_t>(type));
  if (t == nullptr) return absl::StrCat("unknown(", static_cast<uint32_t>(type), ")");
  return std::string(t->name);
}

absl::StatusOr<GgmlType> GgmlTypeFromName(absl::string_view name) {
  for (const TypeEntry& e : kTypes) {
    if (e.traits.block_size > 0 && absl::EqualsIgnoreCase(e.traits.name, name)) {
      return static_cast<GgmlType>(e.id);
    }
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown ggml type name '", name, "'"));
}

absl::StatusOr<uint64_t> GgmlRowBytes(GgmlType type, int64_t n_elements) {
  const GgmlTypeTraits* t = Find(static_cast<uint32_t>(type));
  if (t == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown ggml tensor type id ", static_cast<uint32_t>(type)));
  }
  if (n_elements < 0 || n_elements % t->block_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(n_elements, " elements of type ", t->name,
                                                   " are not a whole number of ", t->block_size,
                                                   "-element blocks"));
  }
  return static_cast<uint64_t>(n_elements / t->block_size) * static_cast<uint64_t>(t->type_size);
}

}  // namespace kvr::model
