#pragma once
// What the sparse decode tests (sparse_decode_test.cc, sparse_decode_load_test.cc) set up alike:
// a CUDA model with random weights of a dummy shape, and the sparse decode attention over it.
// Tests only.

#include <cstdint>
#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "kvr/model/cuda_model.h"
#include "kvr/model/dummy.h"
#include "kvr/retrieval/cuda/sparse_decode.h"

namespace kvr::model::cuda_test {

struct SparseModel {
  ModelConfig config;
  std::unique_ptr<CudaModel> gpu;  // outlives `sp`, which hooks into it
  std::unique_ptr<retrieval::cuda::SparseDecodeAttention> sp;
};

// The dummy shape `shape` with `n_layers` layers (0: the shape's own), random weights from `seed`,
// room for max_batch_tokens tokens and max_sequences sequences (and as many logits rows).
inline void MakeSparseModel(const std::string& shape, int n_layers, uint64_t seed,
                            int max_batch_tokens, int max_sequences, SparseModel* out) {
  auto config = DummyConfig(shape, n_layers);
  ASSERT_TRUE(config.ok()) << config.status();
  out->config = *config;
  CudaModelOptions mo;
  mo.max_batch_tokens = max_batch_tokens;
  mo.max_sequences = max_sequences;
  mo.max_logits_rows = max_sequences;
  auto gpu = CreateCudaModelWithRandomWeights(out->config, seed, mo);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  out->gpu = std::move(*gpu);
  auto sp = retrieval::cuda::CreateSparseDecodeAttention(*out->gpu);
  ASSERT_TRUE(sp.ok()) << sp.status();
  out->sp = std::move(*sp);
}

}  // namespace kvr::model::cuda_test
