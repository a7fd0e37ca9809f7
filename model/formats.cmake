# kvr::model_formats: GGUF and Hugging Face (safetensors) readers and ggml dequantisation.
add_library(kvr_model_formats
  src/gguf_types.cc
  src/dequant.cc
  src/gguf.cc
  src/safetensors.cc)
add_library(kvr::model_formats ALIAS kvr_model_formats)
target_include_directories(kvr_model_formats PUBLIC include)
target_link_libraries(kvr_model_formats
  PUBLIC kvr::common absl::status absl::statusor absl::strings absl::flat_hash_map
         nlohmann_json::nlohmann_json)
kvr_warnings(kvr_model_formats)
