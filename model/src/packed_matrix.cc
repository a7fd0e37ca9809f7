#include "kvr/model/packed_matrix.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvr/common/half.h"
#include "kvr/common/status.h"
#include "kvr/common/thread_pool.h"
#include "kvr/model/dequant.h"

namespace kvr::model {
namespace {

void PutHalf(uint8_t* p, float v) {
  const uint16_t h = FloatToFp16(v);
  std::memcpy(p, &h, sizeof(h));
}

// ggml-quants.c quantize_row_q8_0_ref.
void QuantizeRowQ8_0(const float* x, int64_t n, uint8_t* y) {
  for (int64_t b = 0; b < n / 32; ++b, x += 32, y += 34) {
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    PutHalf(y, d);
    for (int j = 0; j < 32; ++j) y[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(std::round(x[j] * id)));
  }
}

// ggml-quants.c quantize_row_q4_0_ref: the scale carries the sign of the largest magnitude.
void QuantizeRowQ4_0(const float* x, int64_t n, uint8_t* y) {
  for (int64_t b = 0; b < n / 32; ++b, x += 32, y += 18) {
    float amax = 0.f, max = 0.f;
    for (int j = 0; j < 32; ++j) {
      if (amax < std::fabs(x[j])) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    }
    const float d = max / -8.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    PutHalf(y, d);
    for (int j = 0; j < 16; ++j) {
      const uint8_t x0 = std::min<uint8_t>(15, static_cast<int8_t>(x[j] * id + 8.5f));
      const uint8_t x1 = std::min<uint8_t>(15, static_cast<int8_t>(x[16 + j] * id + 8.5f));
      y[2 + j] = static_cast<uint8_t>(x0 | (x1 << 4));
    }
  }
}

// ggml-quants.c quantize_row_q4_1_ref.
void QuantizeRowQ4_1(const float* x, int64_t n, uint8_t* y) {
  for (int64_t b = 0; b < n / 32; ++b, x += 32, y += 20) {
    float min = x[0], max = x[0];
    for (int j = 1; j < 32; ++j) {
      min = std::min(min, x[j]);
      max = std::max(max, x[j]);
    }
    const float d = (max - min) / 15.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    PutHalf(y, d);
    PutHalf(y + 2, min);
    for (int j = 0; j < 16; ++j) {
      const uint8_t x0 = std::min<uint8_t>(15, static_cast<int8_t>((x[j] - min) * id + 0.5f));
      const uint8_t x1 = std::min<uint8_t>(15, static_cast<int8_t>((x[16 + j] - min) * id + 0.5f));
      y[4 + j] = static_cast<uint8_t>(x0 | (x1 << 4));
    }
  }
}

// Rows [n0, n1) of C = A W^T through dequantised tiles of W and SGEMM. `tile` is this
// thread's scratch.
void TiledSgemm(const CpuKernels& kernels, const float* a, int64_t m, int64_t k,
                const PackedMatrix& w, int64_t n0, int64_t n1, float* c, std::vector<float>& tile) {
  // 64 rows x k floats (<= 400 KiB for k <= 1536): stays in L2 while SGEMM streams A past it.
  constexpr int64_t kTileRows = 64;
  tile.resize(static_cast<size_t>(kTileRows * k));
  for (int64_t t0 = n0; t0 < n1; t0 += kTileRows) {
    const int64_t rows = std::min(kTileRows, n1 - t0);
    if (IsBlockKernelType(w.type) || IsFloatKernelType(w.type)) {
      kernels.dequantize_rows(w.type, w.row(t0), w.row_bytes, rows, k, tile.data());
    } else {
      for (int64_t r = 0; r < rows; ++r) w.DequantizeRowInto(t0 + r, tile.data() + r * k);
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m),
                static_cast<int>(rows), static_cast<int>(k), 1.f, a, static_cast<int>(k),
                tile.data(), static_cast<int>(k), 0.f, c + t0, static_cast<int>(w.rows));
  }
}

}  // namespace

void PackedMatrix::DequantizeRowInto(int64_t r, float* out) const {
  // Types are checked when the matrix is made, so this cannot fail.
  (void)DequantizeRow(type, row(r), cols, out);
}

absl::StatusOr<PackedMatrix> NewPackedMatrix(GgmlType type, int64_t rows, int64_t cols) {
  KVR_ASSIGN_OR_RETURN(const GgmlTypeTraits traits, GetGgmlTypeTraits(type));
  if (!traits.dequantizable) {
    return absl::InvalidArgumentError(
        absl::StrCat("PackedMatrix: ggml type ", traits.name, " cannot be dequantised"));
  }
  if (rows < 0) return absl::InvalidArgumentError("PackedMatrix: negative row count");
  KVR_ASSIGN_OR_RETURN(const uint64_t row_bytes, GgmlRowBytes(type, cols));
  PackedMatrix w;
  w.type = type;
  w.rows = rows;
  w.cols = cols;
  w.row_bytes = static_cast<int64_t>(row_bytes);
  w.bytes.resize(static_cast<size_t>(rows * w.row_bytes));
  return w;
}

absl::StatusOr<PackedMatrix> QuantizeMatrix(GgmlType type, const float* w, int64_t rows,
                                            int64_t cols) {
  KVR_ASSIGN_OR_RETURN(PackedMatrix p, NewPackedMatrix(type, rows, cols));
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = w + r * cols;
    uint8_t* y = p.bytes.data() + r * p.row_bytes;
    switch (type) {
      case GgmlType::kQ8_0:
        QuantizeRowQ8_0(x, cols, y);
        break;
      case GgmlType::kQ4_0:
        QuantizeRowQ4_0(x, cols, y);
        break;
      case GgmlType::kQ4_1:
        QuantizeRowQ4_1(x, cols, y);
        break;
      case GgmlType::kF32:
        std::memcpy(y, x, static_cast<size_t>(cols) * sizeof(float));
        break;
      case GgmlType::kF16:
        for (int64_t i = 0; i < cols; ++i) PutHalf(y + 2 * i, x[i]);
        break;
      case GgmlType::kBF16:
        FloatsToBf16Bytes(x, static_cast<size_t>(cols), y);
        break;
      default:
        return absl::UnimplementedError(
            absl::StrCat("QuantizeMatrix: no quantiser for ", GgmlTypeName(type)));
    }
  }
  return p;
}

void PackedMatMul(ThreadPool* pool, const CpuKernels& kernels, const float* a, int64_t m,
                  int64_t k, const PackedMatrix& w, float* c, ActivationPrecision precision,
                  int64_t max_gemv_rows) {
  const int64_t n = w.rows;
  const bool gemv = m <= max_gemv_rows && (IsBlockKernelType(w.type) || IsFloatKernelType(w.type));
  const bool int8 = precision == ActivationPrecision::kInt8;
  // Decode: A's rows are quantised once here, then every thread streams its slice of W.
  thread_local std::vector<ActivationBlock> quantized;
  if (gemv && int8 && IsBlockKernelType(w.type)) {
    quantized.resize(static_cast<size_t>(m * (k / kActivationBlockSize)));
    for (int64_t j = 0; j < m; ++j) {
      kernels.quantize_activations(a + j * k, k, quantized.data() + j * (k / kActivationBlockSize));
    }
  }
  const ActivationBlock* a_blocks = quantized.data();
  // Several parts per thread, handed out dynamically: a worker that wakes late (or a core
  // shared with another process) takes fewer parts instead of leaving the caller to run all.
  // Parts of whole SGEMM tiles (TiledSgemm's 64 rows of W) on the tiled path, so that no
  // part ends in a narrower tile; 16-row parts for the gemv kernels.
  const int64_t align = gemv ? 16 : 64;
  const int64_t threads = pool == nullptr ? 1 : static_cast<int64_t>(pool->size());
  const int64_t parts = std::max<int64_t>(1, std::min(threads == 1 ? 1 : threads * 4, n / align));
  const int64_t per_part = ((n + parts - 1) / parts + align - 1) / align * align;
  auto run = [&](size_t begin, size_t end) {
    thread_local std::vector<float> tile;
    for (size_t p = begin; p < end; ++p) {
      const int64_t n0 = static_cast<int64_t>(p) * per_part;
      const int64_t n1 = std::min(n, n0 + per_part);
      if (n1 <= n0) continue;
      if (!gemv) {
        TiledSgemm(kernels, a, m, k, w, n0, n1, c, tile);
      } else if (IsBlockKernelType(w.type) && !int8) {
        kernels.gemv_blocks_f32(w.type, w.row(n0), w.row_bytes, n1 - n0, k, a, m, c + n0, n);
      } else if (IsBlockKernelType(w.type)) {
        kernels.gemv_blocks(w.type, w.row(n0), w.row_bytes, n1 - n0, k, a_blocks, m, c + n0, n);
      } else {
        kernels.gemv_floats(w.type, w.row(n0), w.row_bytes, n1 - n0, k, a, m, c + n0, n);
      }
    }
  };
  if (parts == 1) {
    run(0, 1);
  } else {
    pool->ParallelFor(static_cast<size_t>(parts), run, 1);
  }
}

}  // namespace kvr::model
