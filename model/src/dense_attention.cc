#include "kvr/model/dense_attention.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvr/common/status.h"
#include "kvr/common/thread_pool.h"
#include "kvr/model/cpu_kernels.h"
#include "kvr/model/kv_cache.h"

namespace kvr::model {

absl::Status ValidateAttentionRequest(const AttentionShape& shape,
                                      const AttentionRequest& request) {
  auto bad = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("attention request (sequence ", request.sequence,
                                                   ", layer ", request.layer, "): ", what));
  };
  if (shape.n_heads <= 0 || shape.n_kv_heads <= 0 || shape.head_dim <= 0 ||
      shape.n_heads % shape.n_kv_heads != 0) {
    return bad(absl::StrCat("bad shape: ", shape.n_heads, " heads, ", shape.n_kv_heads,
                            " kv heads, head_dim ", shape.head_dim));
  }
  if (request.n_queries < 0 || request.first_position < 0) {
    return bad("negative query count or position");
  }
  if (request.n_queries > 0 && (request.q == nullptr || request.out == nullptr)) {
    return bad("q or out is null");
  }
  const KvView& kv = request.kv;
  if (kv.n_rows < 0) return bad("negative n_rows");
  if (kv.n_rows > 0) {
    if ((kv.k == nullptr || kv.v == nullptr) && (kv.k_f16 == nullptr || kv.v_f16 == nullptr)) {
      return bad("k or v is null");
    }
    if (kv.row_stride < int64_t{shape.n_kv_heads} * shape.head_dim) {
      return bad(absl::StrCat("row_stride ", kv.row_stride, " < n_kv_heads * head_dim = ",
                              int64_t{shape.n_kv_heads} * shape.head_dim));
    }
  }
  if (!kv.positions.empty() && static_cast<int64_t>(kv.positions.size()) != kv.n_rows) {
    return bad(
        absl::StrCat("positions has ", kv.positions.size(), " entries for ", kv.n_rows, " rows"));
  }
  return absl::OkStatus();
}

DenseAttention::DenseAttention(ThreadPool* pool, int query_block)
    : pool_(pool), query_block_(std::max(1, query_block)) {
  // The pool's threads each issue their own small SGEMMs; OpenBLAS threads on top of them
  // would oversubscribe the cores (process-wide setting, the same one Model::Create makes).
  if (pool_ != nullptr && pool_->size() > 1) openblas_set_num_threads(1);
}

namespace {

// One unit of work: `n_rows_q` query rows of one sequence that share a KV head, rows `lda`
// floats apart, the first at position `first_position` (+ `position_step` per row).
struct Task {
  const AttentionRequest* request;
  int kv_head;
  const float* q;
  float* out;
  int64_t n_rows_q;
  int64_t lda;             // floats between consecutive query (and output) rows
  int64_t first_position;  // position of query row 0
  int64_t position_step;   // 1: rows are consecutive tokens; 0: rows are heads of one token
};

// softmax(scale q k^T) v for one task, with `scores` scratch of n_rows_q * n_keys floats.
void RunTask(const CpuKernels& kernels, const AttentionShape& shape, const Task& t,
             std::vector<float>& scores) {
  const KvView& kv = t.request->kv;
  const int d = shape.head_dim;
  const int64_t last_position = t.first_position + (t.n_rows_q - 1) * t.position_step;
  // Dense rows are positions 0..n_rows-1: rows past the last query's position are never used.
  const int64_t n_keys = kv.positions.empty() ? std::min(kv.n_rows, last_position + 1) : kv.n_rows;
  if (n_keys <= 0) {
    for (int64_t i = 0; i < t.n_rows_q; ++i) std::fill_n(t.out + i * t.lda, d, 0.f);
    return;
  }
  scores.resize(static_cast<size_t>(t.n_rows_q * n_keys));
  const float* k = kv.k + int64_t{t.kv_head} * d;
  const float* v = kv.v + int64_t{t.kv_head} * d;

  // [n_rows_q, n_keys] = scale * q [n_rows_q, d] . k[n_keys, d]^T
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(t.n_rows_q),
              static_cast<int>(n_keys), d, shape.scale, t.q, static_cast<int>(t.lda), k,
              static_cast<int>(kv.row_stride), 0.f, scores.data(), static_cast<int>(n_keys));
  for (int64_t i = 0; i < t.n_rows_q; ++i) {
    float* s = scores.data() + i * n_keys;
    const int64_t position = t.first_position + i * t.position_step;
    if (kv.positions.empty()) {
      // Dense rows: the visible keys are exactly rows [0, position]; no per-row test.
      const int64_t visible = std::min(n_keys, position + 1);
      if (visible <= 0) {
        std::fill_n(s, n_keys, 0.f);  // nothing visible: the output row becomes zero
      } else {
        kernels.softmax_prefix(s, visible, n_keys);
      }
      continue;
    }
    // Rows at arbitrary positions: only those at or before the query's position are visible.
    float max_score = -std::numeric_limits<float>::infinity();
    for (int64_t r = 0; r < n_keys; ++r) {
      if (kv.positions[r] <= position) max_score = std::max(max_score, s[r]);
    }
    if (max_score == -std::numeric_limits<float>::infinity()) {
      std::fill_n(s, n_keys, 0.f);  // nothing visible: the output row becomes zero
      continue;
    }
    float sum = 0.f;
    for (int64_t r = 0; r < n_keys; ++r) {
      const float e = kv.positions[r] <= position ? std::exp(s[r] - max_score) : 0.f;
      s[r] = e;
      sum += e;
    }
    const float inv = 1.f / sum;
    for (int64_t r = 0; r < n_keys; ++r) s[r] *= inv;
  }
  // out [n_rows_q, d] = p [n_rows_q, n_keys] . v [n_keys, d]
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(t.n_rows_q), d,
              static_cast<int>(n_keys), 1.f, scores.data(), static_cast<int>(n_keys), v,
              static_cast<int>(kv.row_stride), 0.f, t.out, static_cast<int>(t.lda));
}

// A decode query (one token) of `n_heads` query heads that share KV head `kv_head`, over every
// row: one pass through attend_rows.
struct DecodeTask {
  const AttentionRequest* request;
  int kv_head;
  int first_head;  // query head
  int n_heads;
};

void RunDecodeTask(const CpuKernels& kernels, const AttentionShape& shape, const DecodeTask& t,
                   std::vector<float>& state) {
  const KvView& kv = t.request->kv;
  const int d = shape.head_dim;
  // Dense rows are positions 0..n_rows-1: rows past the query's position are never used.
  const int64_t n_keys =
      kv.positions.empty() ? std::min(kv.n_rows, t.request->first_position + 1) : kv.n_rows;
  state.assign(static_cast<size_t>(t.n_heads) * (d + 2), 0.f);
  float* m = state.data();
  float* l = m + t.n_heads;
  float* acc = l + t.n_heads;
  std::fill_n(m, t.n_heads, -std::numeric_limits<float>::infinity());
  const int64_t offset = int64_t{t.first_head} * d;
  kernels.attend_rows(t.request->q + offset, t.n_heads, d, shape.scale,
                      KvRowsForHead(kv, t.kv_head, d, 0, n_keys), m, l, acc);
  FinishAttention(t.n_heads, d, l, acc, t.request->out + offset);
}

// True when every row is visible to a decode query at `position` (the one-pass kernel has no
// mask).
bool AllRowsVisible(const KvView& kv, int64_t position) {
  for (int64_t p : kv.positions) {
    if (p > position) return false;
  }
  return true;
}

}  // namespace

AttentionRows KvRowsForHead(const KvView& kv, int kv_head, int head_dim, int64_t first_row,
                            int64_t n_rows) {
  const int64_t at = first_row * kv.row_stride + int64_t{kv_head} * head_dim;
  if (kv.k == nullptr && kv.k_f16 != nullptr) {
    return {kv.k_f16 + at, kv.v_f16 + at, n_rows, kv.row_stride, true};
  }
  return {kv.k + at, kv.v + at, n_rows, kv.row_stride, false};
}

absl::Status DenseAttention::Attend(const AttentionShape& shape,
                                    std::span<const AttentionRequest> batch) {
  for (const AttentionRequest& request : batch) {
    KVR_RETURN_IF_ERROR(ValidateAttentionRequest(shape, request));
  }
  const int group = shape.n_heads / shape.n_kv_heads;
  const int64_t head_stride = int64_t{shape.n_heads} * shape.head_dim;  // floats per token
  // Decode queries: one pass over the rows per (KV head, share of its query heads). A group
  // is split into shares when there are fewer KV heads than threads have work for; the result
  // does not depend on the split (attend_rows).
  std::vector<DecodeTask> decode_tasks;
  const size_t threads = pool_ != nullptr ? pool_->size() : 1;
  size_t decode_requests = 0;
  for (const AttentionRequest& r : batch) {
    decode_requests += r.n_queries == 1 && AllRowsVisible(r.kv, r.first_position) ? 1 : 0;
  }
  const int shares =
      decode_requests == 0
          ? 1
          : std::clamp<int>(static_cast<int>((2 * threads + decode_requests * shape.n_kv_heads - 1) /
                                             (decode_requests * shape.n_kv_heads)),
                            1, group);
  const int share_heads = (group + shares - 1) / shares;
  // The SGEMM path reads float rows: requests on it over half rows get a widened copy (once
  // per call, in the cache's layout, so that the GEMMs see what a float32 cache of the same
  // values would give them).
  std::vector<AttentionRequest> widened;
  widened.reserve(batch.size());
  std::vector<std::vector<float>> widened_rows;
  widened_rows.reserve(batch.size());
  std::vector<Task> tasks;
  for (const AttentionRequest& original : batch) {
    if (original.n_queries == 1 && AllRowsVisible(original.kv, original.first_position)) {
      const AttentionRequest& r = original;
      for (int h = 0; h < shape.n_kv_heads; ++h) {
        for (int g0 = 0; g0 < group; g0 += share_heads) {
          decode_tasks.push_back({&r, h, h * group + g0, std::min(share_heads, group - g0)});
        }
      }
      continue;
    }
    const AttentionRequest* rp = &original;
    if (original.kv.k == nullptr && original.kv.k_f16 != nullptr) {
      AttentionRequest& w = widened.emplace_back(original);
      w.kv.n_rows = original.kv.positions.empty()
                        ? std::min(original.kv.n_rows, original.first_position + original.n_queries)
                        : original.kv.n_rows;
      w.kv = AsFloatView(w.kv, &widened_rows.emplace_back());
      rp = &w;
    }
    const AttentionRequest& r = *rp;
    if (r.n_queries == 1) {
      // Decode: the `group` query heads of one KV head are contiguous rows of one GEMM.
      for (int h = 0; h < shape.n_kv_heads; ++h) {
        const int64_t offset = int64_t{h} * group * shape.head_dim;
        tasks.push_back(
            {&r, h, r.q + offset, r.out + offset, group, shape.head_dim, r.first_position, 0});
      }
      continue;
    }
    for (int head = 0; head < shape.n_heads; ++head) {
      for (int64_t q0 = 0; q0 < r.n_queries; q0 += query_block_) {
        const int64_t offset = q0 * head_stride + int64_t{head} * shape.head_dim;
        tasks.push_back({&r, head / group, r.q + offset, r.out + offset,
                         std::min<int64_t>(query_block_, r.n_queries - q0), head_stride,
                         r.first_position + q0, 1});
      }
    }
  }
  // Later query blocks see more keys; hand them out first so the pool ends evenly.
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) {
    return a.first_position > b.first_position;
  });
  const CpuKernels& kernels = BestCpuKernels();
  auto run = [&](size_t begin, size_t end) {
    std::vector<float> scratch;
    for (size_t i = begin; i < end; ++i) {
      if (i < decode_tasks.size()) {
        RunDecodeTask(kernels, shape, decode_tasks[i], scratch);
      } else {
        RunTask(kernels, shape, tasks[i - decode_tasks.size()], scratch);
      }
    }
  };
  const size_t n_tasks = decode_tasks.size() + tasks.size();
  if (pool_ != nullptr) {
    pool_->ParallelFor(n_tasks, run);
  } else {
    run(0, n_tasks);
  }
  return absl::OkStatus();
}

}  // namespace kvr::model
