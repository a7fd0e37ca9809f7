# kvr::retrieval_core: the retrieval index interface, registry and byte format, the baselines,
# ClusterKV, CTKVR, KeyDiff, and CPU sparse attention.
kvr_add_library(retrieval_core
  SOURCES src/index.cc src/registry.cc src/rope.cc src/ops.cc src/partial_attention.cc
          src/keydiff.cc src/method_util.cc src/baselines.cc src/clusterkv.cc src/ctkvr.cc
          src/keydiff_index.cc src/core_methods.cc src/sparse_attention.cc
  INCLUDES include
  PUBLIC kvr::model_api kvr::common absl::status absl::statusor absl::strings absl::flat_hash_map
  PRIVATE PkgConfig::OPENBLAS)

kvr_add_test(retrieval_core_test
  SOURCES tests/core_test.cc
  LIBS kvr::retrieval_core)

kvr_add_test(retrieval_methods_test
  SOURCES tests/methods_test.cc
  LIBS kvr::retrieval_core)

kvr_add_test(retrieval_sparse_attention_test
  SOURCES tests/sparse_attention_test.cc
  LIBS kvr::retrieval_core)

kvr_add_executable(retrieval_select_bench
  SOURCES bench/select_bench.cc
  LIBS kvr::retrieval_core)
