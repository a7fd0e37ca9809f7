# kvr::model: architectures (config), weights, KV cache, dense attention, the CPU forward pass,
# sampling and dummy shapes. Included from model/CMakeLists.txt.
add_library(kvr_model
  src/config.cc
  src/weights.cc
  src/kv_cache.cc
  src/dense_attention.cc
  src/model.cc
  src/sampler.cc
  src/dummy.cc
  src/loader.cc)
add_library(kvr::model ALIAS kvr_model)
kvr_warnings(kvr_model)
target_include_directories(kvr_model PUBLIC include)
target_link_libraries(kvr_model
  PUBLIC kvr::model_api kvr::model_formats kvr::tokenizer kvr::common absl::status
         absl::statusor nlohmann_json::nlohmann_json
  PRIVATE PkgConfig::OPENBLAS absl::strings)

kvr_add_test(model_runtime_test
  SOURCES tests/runtime_ops_test.cc tests/model_test.cc tests/weights_format_test.cc
  LIBS kvr::model kvr::model_formats kvr::common absl::strings nlohmann_json::nlohmann_json)

# Needs the SmolLM2 GGUF (scripts/fetch-model.sh; CI's scripts/test.sh fetches it).
kvr_add_test(model_logits_parity_test
  SOURCES tests/logits_parity_test.cc
  LIBS kvr::model kvr::common absl::strings absl::str_format nlohmann_json::nlohmann_json)
target_compile_definitions(model_logits_parity_test PRIVATE
  KVR_LOGITS_FIXTURE_DIR="${CMAKE_CURRENT_SOURCE_DIR}/tests/fixtures/logits")

add_executable(model_runtime_bench bench/runtime_bench.cc)
kvr_warnings(model_runtime_bench)
target_link_libraries(model_runtime_bench PRIVATE kvr::model kvr::common PkgConfig::OPENBLAS
                                                  CLI11::CLI11 absl::str_format)
