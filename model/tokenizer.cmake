# kvr::tokenizer: byte-level BPE (GGUF metadata and tokenizer.json), PCRE2 pre-tokenizers and
# chat templates. Included from model/CMakeLists.txt.
# ICU provides NFC normalisation (Qwen2's tokenizer.json); Debian package libicu-dev.
pkg_check_modules(KVR_ICU_UC REQUIRED IMPORTED_TARGET icu-uc)

kvr_add_library(tokenizer
  SOURCES src/bpe.cc src/chat_template.cc src/pretokenizer.cc src/tokenizer.cc
          src/tokenizer_json.cc src/tokenizer_normalize.cc src/tokenizer_utf8.cc
  INCLUDES include
  PUBLIC absl::status absl::statusor
  PRIVATE kvr::common PkgConfig::PCRE2 PkgConfig::KVR_ICU_UC nlohmann_json::nlohmann_json
          absl::strings absl::str_format absl::flat_hash_map absl::synchronization)

# kvr::tokenizer_gguf: TokenizerSpecFromGguf (tokenizer_gguf.h), the GGUF reader's side of the
# tokenizer, apart so that the tokenizer itself needs no GGUF reader.
kvr_add_library(tokenizer_gguf
  SOURCES src/tokenizer_gguf.cc
  INCLUDES include
  PUBLIC kvr::tokenizer absl::status absl::statusor
  PRIVATE kvr::model_formats kvr::common)

# ---- tests -------------------------------------------------------------------------------
set(_kvr_tokenizer_fixtures ${CMAKE_CURRENT_SOURCE_DIR}/tests/fixtures/tokenizer)

# Hand-made vocabularies; also reaches the internal pieces (pre-tokenizer splits, UTF-8).
kvr_add_test(tokenizer_test
  SOURCES tests/tokenizer_test.cc
  LIBS kvr::tokenizer absl::strings
  INCLUDES src)

# The SmolLM2 GGUF against the Hugging Face reference fixture (>= 2,000 strings).
kvr_add_test(tokenizer_reference_test
  SOURCES tests/tokenizer_reference_test.cc tests/tokenizer_test_util.cc
  LIBS kvr::tokenizer kvr::tokenizer_gguf kvr::model_formats kvr::common nlohmann_json::nlohmann_json
       Threads::Threads)
target_compile_definitions(tokenizer_reference_test PRIVATE
  KVR_TOKENIZER_FIXTURES="${_kvr_tokenizer_fixtures}")

kvr_add_test(chat_template_test
  SOURCES tests/chat_template_test.cc tests/tokenizer_test_util.cc
  LIBS kvr::tokenizer kvr::tokenizer_gguf kvr::model_formats kvr::common
       nlohmann_json::nlohmann_json)
target_compile_definitions(chat_template_test PRIVATE
  KVR_TOKENIZER_FIXTURES="${_kvr_tokenizer_fixtures}")

# Encode throughput on the SmolLM2 vocabulary (prints tokens/s; not a test).
add_executable(tokenizer_bench tests/tokenizer_bench.cc tests/tokenizer_test_util.cc)
target_link_libraries(tokenizer_bench PRIVATE kvr::tokenizer kvr::tokenizer_gguf kvr::model_formats
                      kvr::common nlohmann_json::nlohmann_json)
target_compile_definitions(tokenizer_bench PRIVATE
  KVR_TOKENIZER_FIXTURES="${_kvr_tokenizer_fixtures}")
kvr_warnings(tokenizer_bench)
