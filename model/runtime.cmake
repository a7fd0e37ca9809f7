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
