# kvr::tokenizer: byte-level BPE (GGUF metadata and tokenizer.json), PCRE2 pre-tokenizers and
# chat templates. Included from model/CMakeLists.txt.
add_library(kvr_tokenizer
  src/tokenizer.cc
  src/chat_template.cc
)
add_library(kvr::tokenizer ALIAS kvr_tokenizer)
kvr_warnings(kvr_tokenizer)
target_include_directories(kvr_tokenizer PUBLIC include)
target_link_libraries(kvr_tokenizer
  PUBLIC absl::status absl::statusor
  PRIVATE kvr::common PkgConfig::PCRE2 nlohmann_json::nlohmann_json absl::strings
          absl::str_format absl::flat_hash_map absl::synchronization)
