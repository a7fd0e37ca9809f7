#pragma once
// When `kvr bench` sends its requests (open loop): a constant rate, or a Poisson process
// (gamma-distributed gaps when burstiness != 1, as `vllm bench serve --burstiness`). Closed-loop
// runs (`--concurrency N` without a rate) send whenever a slot frees up and need no schedule.

#include <cstdint>
#include <limits>
#include <random>

#include "absl/status/status.h"

namespace kvr::loadgen {

struct ArrivalOptions {
  // Requests per second; infinity sends every request at once (or as slots free up).
  double rate = std::numeric_limits<double>::infinity();
  // Random gaps (Poisson process when burstiness == 1) instead of a fixed 1/rate.
  bool poisson = false;
  // Shape of the gamma distribution of gaps (mean stays 1/rate); < 1 is burstier, > 1 more
  // regular. Only with `poisson`.
  double burstiness = 1.0;
  // Seed of the gap generator: the same seed gives the same schedule.
  uint64_t seed = 0;
};

// InvalidArgument naming the field when the options make no schedule (rate <= 0 or NaN,
// burstiness <= 0).
[[nodiscard]] absl::Status ValidateArrivalOptions(const ArrivalOptions& options);

// The arrival times of successive requests, in seconds since the start of the run.
// Not thread-safe: one dispatcher owns it.
class ArrivalSchedule {
 public:
  // `options` must pass ValidateArrivalOptions.
  explicit ArrivalSchedule(const ArrivalOptions& options);

  // Offset of the next request: 0 for the first, then the previous plus one gap (0 gaps when
  // the rate is infinite).
  double Next();

 private:
  ArrivalOptions options_;
  std::mt19937_64 rng_;
  std::gamma_distribution<double> gap_;
  double next_ = 0.0;
  bool first_ = true;
};

}  // namespace kvr::loadgen
