// Unicode normalisation through ICU (the maintained implementation; the composition tables
// are not something to hand-write).

#include <unicode/normalizer2.h>
#include <unicode/unistr.h>

#include "absl/strings/str_cat.h"
#include "tokenizer_utf8.h"

namespace kvr::model::internal {

absl::Status NormalizeNfc(std::string_view text, std::string& out) {
  out.clear();
  // ASCII is always in NFC; most text takes this path without touching ICU.
  bool ascii = true;
  for (char c : text) {
    if (static_cast<uint8_t>(c) >= 0x80) {
      ascii = false;
      break;
    }
  }
  if (ascii) {
    out.assign(text);
    return absl::OkStatus();
  }
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* nfc = icu::Normalizer2::getNFCInstance(status);
  if (U_FAILURE(status)) {
    return absl::InternalError(
        absl::StrCat("ICU NFC normaliser unavailable: ", u_errorName(status)));
  }
  const icu::UnicodeString source = icu::UnicodeString::fromUTF8(
      icu::StringPiece(text.data(), static_cast<int32_t>(text.size())));
  const icu::UnicodeString normalized = nfc->normalize(source, status);
  if (U_FAILURE(status)) {
    return absl::InternalError(absl::StrCat("ICU NFC normalisation failed: ", u_errorName(status)));
  }
  normalized.toUTF8String(out);
  return absl::OkStatus();
}

}  // namespace kvr::model::internal
