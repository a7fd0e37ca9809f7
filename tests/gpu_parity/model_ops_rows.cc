// Rows of the CUDA model's kernels (model/cuda/ops.cuh, attention.cuh) with the CPU building
// blocks: RmsNorm and ApplyRope (model.h), SiLU-gated product as model.cc computes it, ArgMax
// (sampler.h) and DenseAttention (dense_attention.h). Outputs are poisoned with NaN before each
// kernel; every output is checked finite and within a tolerance per output dtype:
//   float32: 1e-5 relative (the CPU sums in double, the GPU in float).
//   bf16:    2^-8 relative (twice bf16's rounding of 2^-9) plus a small absolute term.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "attention.cuh"
#include "gtest/gtest.h"
#include "kvr/common/cuda/cuda_util.h"
#include "kvr/common/gpu_testing.h"
#include "kvr/model/config.h"
#include "kvr/model/dense_attention.h"
#include "kvr/model/dummy.h"
#include "kvr/model/model.h"
#include "kvr/model/sampler.h"
#include "ops.cuh"
#include "parity.h"

namespace kvr::model::cuda {
namespace {

using kvr::cuda::DeviceBuffer;
using kvr::cuda::testing::Download;
using kvr::cuda::testing::Poisoned;
using kvr::cuda::testing::RecordMeasure;
using kvr::cuda::testing::Upload;
using kvr::gpu_parity::ParityRow;

float RoundBf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

std::vector<float> Random(size_t n, float lo, float hi, uint32_t seed) {
  return kvr::cuda::testing::RandomUniform(n, lo, hi, seed);
}

std::vector<bf16> ToBf16(const std::vector<float>& v) {
  std::vector<bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __float2bfloat16(v[i]);
  return out;
}

// A device buffer filled with 0xFF bytes: NaN as float32 and as bf16.
template <typename T>
DeviceBuffer<T> Poisoned(size_t n) {
  return Poisoned<T>(n, kvr::cuda::testing::kNanByte);
}

// n bf16 elements from element `offset` on, widened to float.
std::vector<float> Download(const DeviceBuffer<bf16>& b, size_t n, size_t offset = 0) {
  const std::vector<bf16> raw = Download<bf16>(b, n, offset);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = __bfloat162float(raw[i]);
  return out;
}

// Every element finite and |got - want| <= rtol |want| + atol; recorded as the row's measure.
void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, float rtol,
                 float atol, const std::string& what) {
  const kvr::cuda::testing::CloseResult r =
      kvr::cuda::testing::ExpectClose(got, want, rtol, atol, what);
  char bound[64];
  std::snprintf(bound, sizeof(bound), "%g + %g |ref|", atol, rtol);
  RecordMeasure(what + ": max |err|", r.worst, bound, r.bad == 0);
}

constexpr float kBf16Rtol = 1.f / 256;

void RmsNormMatchesCpu(int dim) {
  {
    for (int64_t rows : {1, 5, 33}) {
      const std::vector<float> x = Random(rows * dim, -3.f, 3.f, dim + rows);
      const std::vector<float> weight = Random(dim, 0.5f, 1.5f, dim);
      std::vector<float> want(rows * dim);
      RmsNorm(x.data(), weight.data(), rows, dim, 1e-5f, want.data());
      auto d_x = Upload(x);
      auto d_w = Upload(weight);
      for (bool bf16_out : {false, true}) {
        auto y32 = Poisoned<float>(rows * dim);
        auto y16 = Poisoned<bf16>(rows * dim);
        RmsNormParams p;
        p.x = d_x.data();
        p.weight = d_w.data();
        p.n_rows = rows;
        p.dim = dim;
        p.eps = 1e-5f;
        if (bf16_out) {
          p.y_bf16 = y16.data();
        } else {
          p.y_f32 = y32.data();
        }
        ASSERT_TRUE(LaunchRmsNorm(p, nullptr).ok());
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const std::string what = "rmsnorm dim " + std::to_string(dim) + " rows " +
                                 std::to_string(rows) + (bf16_out ? " bf16" : " f32");
        if (bf16_out) {
          ExpectClose(Download(y16, rows * dim), want, kBf16Rtol, 1e-6f, what);
        } else {
          ExpectClose(Download(y32, rows * dim), want, 1e-5f, 1e-6f, what);
        }
      }
    }
  }
}

void RmsNormGathersRows() {
  const int dim = 576, rows = 9;
  const std::vector<float> x = Random(rows * dim, -2.f, 2.f, 3);
  const std::vector<float> weight(dim, 1.f);
  const std::vector<int32_t> pick = {8, 0, 4};
  std::vector<float> want(pick.size() * dim);
  for (size_t i = 0; i < pick.size(); ++i) {
    RmsNorm(x.data() + pick[i] * dim, weight.data(), 1, dim, 1e-6f, want.data() + i * dim);
  }
  auto d_x = Upload(x);
  auto d_w = Upload(weight);
  auto d_rows = Upload(pick);
  auto y = Poisoned<float>(pick.size() * dim);
  RmsNormParams p;
  p.x = d_x.data();
  p.rows = d_rows.data();
  p.weight = d_w.data();
  p.y_f32 = y.data();
  p.n_rows = static_cast<int64_t>(pick.size());
  p.dim = dim;
  p.eps = 1e-6f;
  ASSERT_TRUE(LaunchRmsNorm(p, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ExpectClose(Download(y, pick.size() * dim), want, 1e-5f, 1e-6f, "rmsnorm gather");
}

// Q/K/V of one layer for two sequences (one at position 0, one deep into its context).
void QkvRopeMatchesCpu(const char* shape) {
  {
    auto config = DummyConfig(shape);
    ASSERT_TRUE(config.ok()) << config.status();
    const ModelConfig& c = *config;
    const std::vector<float> inv_freq = RopeInverseFrequencies(c);
    const int q_dim = c.q_dim(), kv_dim = c.kv_dim(), qkv_dim = q_dim + 2 * kv_dim;
    const int n_layers = 2, layer = 1;
    const int64_t capacity = 40000;
    // Sequence 0: 3 tokens at 0..2; sequence 1: 4 tokens at 31000..31003 (llama3 scaling range).
    const std::vector<int64_t> first = {0, 31000};
    const std::vector<int> count = {3, 4};
    const int n_tokens = 7;
    const std::vector<float> qkv = Random(int64_t{n_tokens} * qkv_dim, -2.f, 2.f, 11);
    std::vector<float> bias;
    if (c.qkv_bias) bias = Random(qkv_dim, -0.5f, 0.5f, 12);

    // CPU reference, as model.cc: bias, then ApplyRope on the Q and K parts.
    std::vector<float> ref = qkv;
    if (!bias.empty()) {
      for (int t = 0; t < n_tokens; ++t) {
        for (int i = 0; i < qkv_dim; ++i) ref[t * qkv_dim + i] += bias[i];
      }
    }
    std::vector<int64_t> positions;
    for (size_t s = 0; s < first.size(); ++s) {
      for (int i = 0; i < count[s]; ++i) positions.push_back(first[s] + i);
    }
    ApplyRope(ref.data(), n_tokens, c.n_heads, c.head_dim, qkv_dim, positions, inv_freq);
    ApplyRope(ref.data() + q_dim, n_tokens, c.n_kv_heads, c.head_dim, qkv_dim, positions, inv_freq);

    std::vector<DeviceBuffer<bf16>> caches;
    std::vector<SeqKv> seqs(2);
    std::vector<int32_t> token_seq;
    int row = 0;
    for (int s = 0; s < 2; ++s) {
      caches.push_back(Poisoned<bf16>(int64_t{n_layers} * 2 * capacity * kv_dim));
      seqs[s] = {caches[s].data(), capacity, first[s], first[s] + count[s], row, count[s]};
      for (int i = 0; i < count[s]; ++i) token_seq.push_back(s);
      row += count[s];
    }
    auto d_qkv = Upload(qkv);
    auto d_bias = Upload(bias.empty() ? std::vector<float>(1) : bias);
    auto d_freq = Upload(inv_freq);
    auto d_seq = Upload(token_seq);
    auto d_seqs = Upload(seqs);
    auto d_q = Poisoned<bf16>(int64_t{n_tokens} * q_dim);
    QkvRopeParams p;
    p.qkv = d_qkv.data();
    p.bias = bias.empty() ? nullptr : d_bias.data();
    p.inv_freq = d_freq.data();
    p.token_seq = d_seq.data();
    p.seqs = d_seqs.data();
    p.q = d_q.data();
    p.n_tokens = n_tokens;
    p.n_heads = c.n_heads;
    p.n_kv_heads = c.n_kv_heads;
    p.head_dim = c.head_dim;
    p.layer = layer;
    ASSERT_TRUE(LaunchQkvRope(p, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

    std::vector<float> want_q, want_k, want_v, got_k, got_v;
    for (int t = 0; t < n_tokens; ++t) {
      const float* r = ref.data() + int64_t{t} * qkv_dim;
      want_q.insert(want_q.end(), r, r + q_dim);
      want_k.insert(want_k.end(), r + q_dim, r + q_dim + kv_dim);
      want_v.insert(want_v.end(), r + q_dim + kv_dim, r + qkv_dim);
    }
    for (int s = 0; s < 2; ++s) {
      const size_t k_off = (2 * size_t{layer} * capacity + first[s]) * kv_dim;
      const size_t v_off = ((2 * size_t{layer} + 1) * capacity + first[s]) * kv_dim;
      const std::vector<float> k = Download(caches[s], count[s] * kv_dim, k_off);
      const std::vector<float> v = Download(caches[s], count[s] * kv_dim, v_off);
      got_k.insert(got_k.end(), k.begin(), k.end());
      got_v.insert(got_v.end(), v.begin(), v.end());
    }
    const std::string what = std::string(shape) + " rope";
    ExpectClose(Download(d_q, int64_t{n_tokens} * q_dim), want_q, kBf16Rtol, 1e-5f, what + " q");
    ExpectClose(got_k, want_k, kBf16Rtol, 1e-5f, what + " k");
    ExpectClose(got_v, want_v, kBf16Rtol, 1e-5f, what + " v");
  }
}

void SwiGluMatchesCpu(int ffn) {
  {
    for (int64_t n : {1, 7}) {
      const std::vector<float> gu = Random(n * 2 * ffn, -6.f, 6.f, ffn + n);
      std::vector<float> want(n * ffn);
      for (int64_t t = 0; t < n; ++t) {
        for (int i = 0; i < ffn; ++i) {
          const float g = gu[t * 2 * ffn + i], u = gu[t * 2 * ffn + ffn + i];
          want[t * ffn + i] = g / (1.f + std::exp(-g)) * u;
        }
      }
      auto d_gu = Upload(gu);
      auto act = Poisoned<bf16>(n * ffn);
      ASSERT_TRUE(LaunchSwiGlu({d_gu.data(), act.data(), n, ffn}, nullptr).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      ExpectClose(Download(act, n * ffn), want, kBf16Rtol, 1e-6f,
                  "swiglu ffn " + std::to_string(ffn));
    }
  }
}

void ArgMaxMatchesCpuIncludingTies() {
  const int vocab = 49152, rows = 4;
  std::vector<float> x = Random(int64_t{rows} * vocab, -5.f, 5.f, 5);
  x[0 * vocab + 100] = 9.f;  // a clear maximum
  x[1 * vocab + 7] = 9.f;    // a tie: the lower id wins
  x[1 * vocab + 40000] = 9.f;
  x[2 * vocab + vocab - 1] = 9.f;  // at the end
  auto d_x = Upload(x);
  auto out = Poisoned<int32_t>(rows);
  ASSERT_TRUE(LaunchArgMax({d_x.data(), out.data(), rows, vocab}, nullptr).ok());
  std::vector<int32_t> got(rows);
  ASSERT_EQ(cudaMemcpy(got.data(), out.data(), rows * sizeof(int32_t), cudaMemcpyDeviceToHost),
            cudaSuccess);
  int differ = 0;
  for (int r = 0; r < rows; ++r) {
    const int32_t want = ArgMax(std::span<const float>(x.data() + int64_t{r} * vocab, vocab));
    EXPECT_EQ(got[r], want) << "row " << r;
    differ += got[r] != want;
  }
  EXPECT_EQ(got[1], 7);
  RecordMeasure("rows != ArgMax", differ, "0", differ == 0 && got[1] == 7);
}

struct AttentionCase {
  int n_heads, n_kv_heads, head_dim;
};

// Sequences given as (cached tokens, new tokens); K/V random bf16 in the caches at layer 1 of 2.
void CheckAttention(const AttentionCase& ac, const std::vector<std::pair<int64_t, int>>& seq_shape,
                    bool decode) {
  const int kv_dim = ac.n_kv_heads * ac.head_dim, q_dim = ac.n_heads * ac.head_dim;
  const int n_layers = 2, layer = 1;
  std::vector<DeviceBuffer<bf16>> caches;
  std::vector<std::vector<float>> k_host, v_host;  // [length, kv_dim], bf16-rounded
  std::vector<SeqKv> seqs;
  int n_tokens = 0, max_q = 0;
  int64_t max_length = 0;
  uint32_t seed = 100;
  for (const auto& [cached, n_new] : seq_shape) {
    const int64_t length = cached + n_new, capacity = length + 5;
    std::vector<float> k = Random(length * kv_dim, -1.f, 1.f, ++seed);
    std::vector<float> v = Random(length * kv_dim, -1.f, 1.f, ++seed);
    for (float& x : k) x = RoundBf16(x);
    for (float& x : v) x = RoundBf16(x);
    std::vector<bf16> buf(int64_t{n_layers} * 2 * capacity * kv_dim, __float2bfloat16(NAN));
    for (int64_t i = 0; i < length * kv_dim; ++i) {
      buf[2 * layer * capacity * kv_dim + i] = __float2bfloat16(k[i]);
      buf[(2 * layer + 1) * capacity * kv_dim + i] = __float2bfloat16(v[i]);
    }
    caches.push_back(Upload(buf));
    k_host.push_back(std::move(k));
    v_host.push_back(std::move(v));
    seqs.push_back({caches.back().data(), capacity, cached, length, n_tokens, n_new});
    n_tokens += n_new;
    max_q = std::max(max_q, n_new);
    max_length = std::max(max_length, length);
  }
  std::vector<float> q = Random(int64_t{n_tokens} * q_dim, -2.f, 2.f, 7);
  for (float& x : q) x = RoundBf16(x);

  // CPU reference.
  std::vector<float> want(int64_t{n_tokens} * q_dim);
  std::vector<AttentionRequest> requests;
  for (size_t s = 0; s < seqs.size(); ++s) {
    AttentionRequest r;
    r.sequence = s;
    r.layer = layer;
    r.first_position = seqs[s].first_position;
    r.n_queries = seqs[s].n_q;
    r.q = q.data() + int64_t{seqs[s].q_begin} * q_dim;
    r.kv.k = k_host[s].data();
    r.kv.v = v_host[s].data();
    r.kv.n_rows = seqs[s].length;
    r.kv.row_stride = kv_dim;
    r.kv.total_tokens = seqs[s].length;
    r.out = want.data() + int64_t{seqs[s].q_begin} * q_dim;
    requests.push_back(r);
  }
  const float scale = 1.f / std::sqrt(static_cast<float>(ac.head_dim));
  DenseAttention dense(nullptr);
  ASSERT_TRUE(dense.Attend({ac.n_heads, ac.n_kv_heads, ac.head_dim, scale}, requests).ok());

  auto d_q = Upload(ToBf16(q));
  auto d_seqs = Upload(seqs);
  auto out = Poisoned<bf16>(int64_t{n_tokens} * q_dim);
  constexpr int kSplits = 32;
  auto po = Poisoned<float>(seqs.size() * ac.n_heads * kSplits * ac.head_dim);
  auto pml = Poisoned<float>(seqs.size() * ac.n_heads * kSplits * 2);
  AttentionParams p;
  p.q = d_q.data();
  p.out = out.data();
  p.seqs = d_seqs.data();
  p.n_seqs = static_cast<int>(seqs.size());
  p.max_q = max_q;
  p.max_length = max_length;
  p.n_heads = ac.n_heads;
  p.n_kv_heads = ac.n_kv_heads;
  p.head_dim = ac.head_dim;
  p.layer = layer;
  p.scale = scale;
  p.partial_o = po.data();
  p.partial_ml = pml.data();
  p.max_splits = kSplits;
  const absl::Status st =
      decode ? LaunchDecodeAttention(p, nullptr) : LaunchPrefillAttention(p, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  // P is rounded to bf16 before P V in the prefill kernel (2^-9 relative per weight: at most
  // ~2e-3 absolute on values in [-1, 1]); the output is bf16.
  ExpectClose(Download(out, int64_t{n_tokens} * q_dim), want, kBf16Rtol, 5e-3f,
              std::string(decode ? "decode" : "prefill") + " heads " + std::to_string(ac.n_heads) +
                  "/" + std::to_string(ac.n_kv_heads) + " dim " + std::to_string(ac.head_dim));
}

const AttentionCase kAttentionCases[] = {{9, 3, 64}, {14, 2, 64}, {32, 8, 128}};

}  // namespace
}  // namespace kvr::model::cuda

namespace kvr::gpu_parity {

std::vector<ParityRow> ModelOpsRows() {
  using namespace kvr::model::cuda;
  std::vector<ParityRow> rows;
  for (int dim : {64, 576, 896, 4096}) {
    rows.push_back({"LaunchRmsNorm", "dim " + std::to_string(dim) + " rows 1,5,33 f32+bf16 out",
                    "RmsNorm", "f32 1e-5 rel, bf16 2^-8 rel", [dim] { RmsNormMatchesCpu(dim); }});
  }
  rows.push_back({"LaunchRmsNorm", "gather rows 8,0,4 of 9 dim 576", "RmsNorm", "1e-5 rel",
                  [] { RmsNormGathersRows(); }});
  for (const char* shape : {"smollm2-135m", "qwen2-0.5b", "llama3-8b"}) {
    rows.push_back({"LaunchQkvRope", std::string(shape) + " 2 seqs at 0 and 31000",
                    "bias + ApplyRope", "bf16 2^-8 rel + 1e-5",
                    [shape] { QkvRopeMatchesCpu(shape); }});
  }
  for (int ffn : {64, 1536, 14336, 1001}) {  // 1001: the scalar path
    rows.push_back({"LaunchSwiGlu", "ffn " + std::to_string(ffn) + " tokens 1,7",
                    "silu(g) * u as model.cc", "bf16 2^-8 rel + 1e-6",
                    [ffn] { SwiGluMatchesCpu(ffn); }});
  }
  rows.push_back({"LaunchArgMax", "vocab 49152 rows 4, ties", "ArgMax (sampler.h)",
                  "equal, ties to the lower id", [] { ArgMaxMatchesCpuIncludingTies(); }});
  for (const AttentionCase& ac : kAttentionCases) {
    const std::string heads = "heads " + std::to_string(ac.n_heads) + "/" +
                              std::to_string(ac.n_kv_heads) + " d" + std::to_string(ac.head_dim);
    // One query alone, a chunk over a cached prefix, a fresh prompt over several tiles.
    rows.push_back({"LaunchPrefillAttention", heads + " (cached,new) 0+1 100+37 0+130 5+64",
                    "DenseAttention", "bf16 2^-8 rel + 5e-3", [ac] {
                      CheckAttention(ac, {{0, 1}, {100, 37}, {0, 130}, {5, 64}},
                                     /*decode=*/false);
                    }});
  }
  for (const AttentionCase& ac : kAttentionCases) {
    const std::string heads = "heads " + std::to_string(ac.n_heads) + "/" +
                              std::to_string(ac.n_kv_heads) + " d" + std::to_string(ac.head_dim);
    rows.push_back({"LaunchDecodeAttention", heads + " cached 0,62,63,64,999,3000",
                    "DenseAttention", "bf16 2^-8 rel + 5e-3", [ac] {
                      CheckAttention(ac, {{0, 1}, {62, 1}, {63, 1}, {64, 1}, {999, 1}, {3000, 1}},
                                     /*decode=*/true);
                    }});
  }
  // One long sequence alone: many splits.
  rows.push_back({"LaunchDecodeAttention", "heads 32/8 d128 cached 8191 alone", "DenseAttention",
                  "bf16 2^-8 rel + 5e-3", [] {
                    CheckAttention(kAttentionCases[2], {{8191, 1}}, /*decode=*/true);
                  }});
  return rows;
}

}  // namespace kvr::gpu_parity
