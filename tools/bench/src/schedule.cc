#include "kvr/loadgen/schedule.h"

#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"

namespace kvr::loadgen {

absl::Status ValidateArrivalOptions(const ArrivalOptions& options) {
  if (std::isnan(options.rate) || options.rate <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("request rate must be > 0 (or inf), got ", options.rate));
  }
  if (std::isnan(options.burstiness) || options.burstiness <= 0 || std::isinf(options.burstiness)) {
    return absl::InvalidArgumentError(
        absl::StrCat("burstiness must be a finite number > 0, got ", options.burstiness));
  }
  return absl::OkStatus();
}

ArrivalSchedule::ArrivalSchedule(const ArrivalOptions& options)
    : options_(options),
      rng_(options.seed),
      // Gamma(shape k, scale 1 / (k * rate)) has mean 1 / rate; k = 1 is the exponential gap
      // of a Poisson process.
      gap_(options.burstiness,
           std::isinf(options.rate) ? 1.0 : 1.0 / (options.burstiness * options.rate)) {}

double ArrivalSchedule::Next() {
  if (first_) {
    first_ = false;
    return next_;
  }
  if (std::isinf(options_.rate)) return next_;
  next_ += options_.poisson ? gap_(rng_) : 1.0 / options_.rate;
  return next_;
}

}  // namespace kvr::loadgen
