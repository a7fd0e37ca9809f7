#pragma once
// Host-side pieces the selectors (cuda/select) and the summary builders (cuda/summaries) share:
// workspace alignment and the dispatch of a key dtype and a head_dim to template constants.
// Not part of the selection or build contract (namespace internal).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kvr/retrieval/cuda/selection.cuh"

namespace kvr::retrieval::cuda::internal {

// Workspace pieces start 256-byte aligned (what *WorkspaceBytes promise their callers).
inline constexpr size_t kAlign = 256;
inline size_t AlignUp(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Carves 256-byte aligned pieces out of a caller-owned workspace, from byte `used` on (or only
// counts the bytes when base is null: what *WorkspaceBytes return).
class Carver {
 public:
  explicit Carver(void* base, size_t used = 0) : base_(static_cast<char*>(base)), used_(used) {}
  // Room for `n` values of T.
  template <typename T>
  T* Take(size_t n) {
    T* p = base_ == nullptr ? nullptr : reinterpret_cast<T*>(base_ + used_);
    used_ += AlignUp(n * sizeof(T));
    return p;
  }
  void* TakeBytes(size_t n) { return Take<char>(n); }
  size_t used() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
};

// Calls fn.template operator()<T>() with T the element type of `dtype`.
template <typename Fn>
absl::Status DispatchKeyType(KeyDType dtype, Fn&& fn) {
  switch (dtype) {
    case KeyDType::kF32:
      return fn.template operator()<float>();
    case KeyDType::kF16:
      return fn.template operator()<__half>();
    case KeyDType::kBf16:
      return fn.template operator()<__nv_bfloat16>();
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown key dtype ", static_cast<int>(dtype)));
}

// Calls fn.template operator()<D>() for head_dim D in {64, 128}.
template <typename Fn>
absl::Status DispatchHeadDim(int head_dim, Fn&& fn) {
  switch (head_dim) {
    case 64:
      return fn.template operator()<64>();
    case 128:
      return fn.template operator()<128>();
  }
  return absl::InvalidArgumentError(absl::StrCat("head_dim ", head_dim, " (64 or 128)"));
}

}  // namespace kvr::retrieval::cuda::internal
