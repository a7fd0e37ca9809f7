#include "kvr/common/byte_size.h"

#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvr {

absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text) {
  const absl::string_view s = absl::StripAsciiWhitespace(text);
  size_t digits = 0;
  while (digits < s.size() && absl::ascii_isdigit(static_cast<unsigned char>(s[digits]))) {
    ++digits;
  }
  uint64_t value = 0;
  if (digits == 0 || !absl::SimpleAtoi(s.substr(0, digits), &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", text, "' is not a byte size (e.g. 512MiB, 4GB, 4096)"));
  }
  std::string unit = absl::AsciiStrToLower(absl::StripAsciiWhitespace(s.substr(digits)));
  if (unit.size() > 1 && unit.back() == 'b') unit.pop_back();  // kB -> k, KiB -> Ki
  const bool binary = unit.size() == 2 && unit[1] == 'i';
  if (binary) unit.pop_back();
  int power = -1;
  if (unit.empty() || (unit == "b" && !binary)) {
    power = 0;
  } else if (unit.size() == 1) {
    static constexpr absl::string_view kPrefixes = "kmgtp";
    const size_t at = kPrefixes.find(unit[0]);
    if (at != absl::string_view::npos) power = static_cast<int>(at) + 1;
  }
  if (power < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", text, "': unknown size unit (use B, kB, MB, GB, TB, PB or KiB, MiB, ",
                     "GiB, TiB, PiB)"));
  }
  const uint64_t base = binary ? 1024 : 1000;
  for (int i = 0; i < power; ++i) {
    if (value > UINT64_MAX / base) {
      return absl::InvalidArgumentError(absl::StrCat("'", text, "' overflows 64 bits"));
    }
    value *= base;
  }
  return value;
}

}  // namespace kvr
