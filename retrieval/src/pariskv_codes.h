#pragma once
// ParisKV per-key summaries (paper section 4.1): the math, without any index bookkeeping.
// Internal to kvr::retrieval_quant; tests include it directly.
//
// A key k (head_dim d) becomes, after k_hat = k / |k| and x = R k_hat (R: the shared SRHT, P
// output coordinates), B = P / m subspaces x_b = r_b u_b (radius r_b, unit direction u_b). Per
// subspace we keep
//   * the 4-bit direction code: per coordinate 1 sign bit + 3 magnitude bits (an index into 8
//     magnitude levels). The sign bits are exactly the id of the nearest sign-pattern centroid
//     {+-1/sqrt(m)}^m (eq. 6: argmax_w <u, w> picks w_j = sign(u_j)/sqrt(m)), so the centroid id is
//     not stored separately: it is read off the code.
//   * one scale weight w_b = |k| r_b / <v_b, u_b>, v_b the dequantised (unnormalised) direction.
// Eq. (9) writes w_b = |k| r_b / alpha_b with alpha_b = <v_hat_b, u_b> for a unit-norm v_hat_b;
// folding 1/|v_b| into the weight gives the same estimate with one fewer normalisation online:
//   <k, q> ~= |q| sum_b w_b <v_b, R q_hat_b>                                     (eq. 10)
// which is exact whenever the query direction inside a subspace equals the key's.

#include <array>
#include <cstdint>
#include <span>

#include "absl/status/statusor.h"

namespace kvr::retrieval::internal {

inline constexpr int kMagnitudeLevels = 8;  // 3 magnitude bits
inline constexpr int kMaxSubspaceDim = 8;   // centroid id must fit one byte
inline constexpr uint8_t kSignBit = 0x8;    // in a 4-bit code; set = negative coordinate

// Lloyd-Max magnitude levels for one coordinate of a uniformly random unit vector in R^m.
// By Prop. 4.1 (eq. 12) u_j^2 ~ Beta(1/2, (m-1)/2), so t = |u_j| has density proportional to
// (1 - t^2)^((m-3)/2) on [0, 1]; the 8 levels minimise E[(t - level(t))^2] under that density.
// Deterministic (fixed grid, fixed iteration count) so both ends of the wire agree; the index
// still serialises the levels it used.
[[nodiscard]] absl::StatusOr<std::array<float, kMagnitudeLevels>> DirectionLevels(int m);

// Encodes one unit direction u ([m], m <= kMaxSubspaceDim) into m 4-bit codes (one per byte of
// `codes`, low nibble) and returns <v, u>, v the dequantised direction (always > 0 for u != 0,
// because every dequantised coordinate has the right sign and a positive magnitude).
float EncodeDirection(std::span<const float> u, const std::array<float, kMagnitudeLevels>& levels,
                      std::span<uint8_t> codes);

// Value of one 4-bit code.
inline float DecodeCoordinate(uint8_t code, const std::array<float, kMagnitudeLevels>& levels) {
  const float mag = levels[code & 0x7];
  return (code & kSignBit) ? -mag : mag;
}

// Centroid id (bit j set = coordinate j negative) of one subspace whose m codes are stored as
// nibbles, two per byte (coordinate 2i in the low nibble of byte i, 2i+1 in the high nibble).
inline uint32_t CentroidIdFromPacked(const uint8_t* packed, int m) {
  // Byte i holds the sign bits of coordinates 2i (bit 3) and 2i+1 (bit 7); m is even.
  uint32_t id = 0;
  for (int i = 0; i < m / 2; ++i) {
    const uint32_t b = packed[i];
    id |= (((b >> 3) & 1u) | ((b >> 6) & 2u)) << (2 * i);
  }
  return id;
}

// <x, w_id> for the sign-pattern centroid w_id = (+-1/sqrt(m))^m; x: [m].
float CentroidDot(std::span<const float> x, uint32_t id);

// scores[c] = CentroidDot(x, c) for all 2^m centroids, in O(2^m): flipping the sign of
// coordinate j subtracts 2 x_j / sqrt(m), so each score extends one with its top bit cleared.
void AllCentroidDots(std::span<const float> x, std::span<float> scores);

// Multi-tier collision bonus table for one subspace (section 4.2.2 (1), section 5.4).
// `centroid_scores`: [2^m] = <q_b, w_c>; `centroid_counts`: [2^m] = number of indexed keys whose
// direction in this subspace is assigned to centroid c. Centroids are visited from the best score
// down; the keys they hold fill the top `rho_keys` (= rho * n) slots of the subspace, which are cut
// into `n_tiers` equal slices: a centroid whose first key lands in slice t (0 = best) gives every
// key it holds bonus n_tiers - t, and centroids past the top-rho slots give 0. With n_tiers = 1
// this is plain collision counting (bonus 1 for the top-rho keys); the paper's 6 tiers widen the
// per-token score range from [0, B] to [0, 6B] and so break most ties before the top-beta cut.
// The best centroid always scores, even if it alone holds more than rho * n keys.
void CollisionBonus(std::span<const float> centroid_scores,
                    std::span<const uint32_t> centroid_counts, double rho_keys, int n_tiers,
                    std::span<uint8_t> bonus);

}  // namespace kvr::retrieval::internal
