// QuestPageBounds: per (sequence, page, KV head, channel) the min and max key over the page's
// tokens, in the CPU QuestIndex payload layout (build.cuh). The comparisons are std::min /
// std::max's (`b < a ? b : a`, `a < b ? b : a`) in token order, so the result is the CPU's bit
// for bit, NaN keys included.

#include "build_common.cuh"
#include "kvr/common/status.h"

namespace kvr::retrieval::cuda {
namespace {

using build_internal::Invalid;
using build_internal::KeyBase;
using build_internal::LoadKey;

// Grid (pages, batch); threads loop over (head, channel) pairs, consecutive threads reading
// consecutive channels of one token.
template <typename T>
__global__ void __launch_bounds__(512) QuestBoundsKernel(QuestBoundsParams p) {
  const int page = blockIdx.x, b = blockIdx.y;
  const int len = p.seq_len[b];
  const int t0 = page * p.page_size;
  if (t0 >= len) return;
  const int t1 = min(len, t0 + p.page_size);
  const int hd = p.head_dim;
  float* out =
      p.bounds + b * p.bounds_batch_stride + static_cast<int64_t>(page) * p.n_kv_heads * 2 * hd;
  for (int e = threadIdx.x; e < p.n_kv_heads * hd; e += blockDim.x) {
    const int h = e / hd, d = e % hd;
    const int64_t base = KeyBase(p.keys, b, h, p.n_kv_heads) + d;
    float mn = LoadKey<T>(p.keys.data, base + static_cast<int64_t>(t0) * p.keys.token_stride);
    float mx = mn;
    for (int t = t0 + 1; t < t1; ++t) {
      const float k = LoadKey<T>(p.keys.data, base + static_cast<int64_t>(t) * p.keys.token_stride);
      mn = k < mn ? k : mn;
      mx = mx < k ? k : mx;
    }
    out[h * 2 * hd + d] = mn;
    out[h * 2 * hd + hd + d] = mx;
  }
}

absl::Status Validate(const QuestBoundsParams& p) {
  constexpr const char* op = "QuestPageBounds";
  if (p.batch < 1 || p.n_kv_heads < 1) return Invalid(op, "batch and n_kv_heads must be >= 1");
  if (p.head_dim < 1 || p.head_dim > 256) return Invalid(op, "head_dim must be in [1, 256]");
  if (p.page_size < 1) return Invalid(op, "page_size must be >= 1");
  if (p.max_tokens < 0) return Invalid(op, "max_tokens must be >= 0");
  if (p.batch > 65535) return Invalid(op, "batch must be <= 65535");
  KVR_RETURN_IF_ERROR(build_internal::CheckKeys(op, p.keys, p.head_dim));
  if (p.seq_len == nullptr || p.bounds == nullptr)
    return Invalid(op, "seq_len and bounds are required");
  const int64_t pages = (static_cast<int64_t>(p.max_tokens) + p.page_size - 1) / p.page_size;
  if (p.batch > 1 && p.bounds_batch_stride < pages * p.n_kv_heads * 2 * p.head_dim) {
    return Invalid(op, "bounds_batch_stride smaller than ceil(max_tokens / page_size) pages");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status QuestPageBounds(const QuestBoundsParams& p, cudaStream_t stream) {
  KVR_RETURN_IF_ERROR(Validate(p));
  const int pages = (p.max_tokens + p.page_size - 1) / p.page_size;
  if (pages == 0) return absl::OkStatus();
  return build_internal::DispatchKeyType(p.keys.dtype, [&]<typename T>() {
    const int threads = std::min(512, (p.n_kv_heads * p.head_dim + 31) / 32 * 32);
    QuestBoundsKernel<T><<<dim3(pages, p.batch), threads, 0, stream>>>(p);
    return build_internal::LaunchStatus("QuestPageBounds");
  });
}

}  // namespace kvr::retrieval::cuda
