# kvr::retrieval_core: the retrieval index interface, registry and byte format, the baselines,
# ClusterKV, CTKVR, KeyDiff, and CPU sparse attention.
add_library(kvr_retrieval_core
  src/index.cc
  src/registry.cc
  src/rope.cc
  src/ops.cc
  src/partial_attention.cc
  src/keydiff.cc
  src/method_util.cc
  src/baselines.cc
  src/clusterkv.cc
  src/ctkvr.cc
  src/keydiff_index.cc
  src/core_methods.cc
  src/sparse_attention.cc)
add_library(kvr::retrieval_core ALIAS kvr_retrieval_core)
target_include_directories(kvr_retrieval_core PUBLIC include)
target_link_libraries(kvr_retrieval_core
  PUBLIC kvr::model_api kvr::common absl::status absl::statusor absl::strings
         absl::flat_hash_map
  PRIVATE PkgConfig::OPENBLAS)
kvr_warnings(kvr_retrieval_core)

kvr_add_test(retrieval_core_test
  SOURCES tests/core_test.cc
  LIBS kvr::retrieval_core)

kvr_add_test(retrieval_methods_test
  SOURCES tests/methods_test.cc
  LIBS kvr::retrieval_core)

kvr_add_test(retrieval_sparse_attention_test
  SOURCES tests/sparse_attention_test.cc
  LIBS kvr::retrieval_core)

add_executable(retrieval_select_bench bench/select_bench.cc)
target_link_libraries(retrieval_select_bench PRIVATE kvr::retrieval_core)
kvr_warnings(retrieval_select_bench)
