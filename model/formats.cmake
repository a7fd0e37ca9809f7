# kvr::model_formats: GGUF and Hugging Face (safetensors) readers and ggml dequantisation.
kvr_add_library(model_formats
  SOURCES src/gguf_types.cc src/dequant.cc src/gguf.cc src/safetensors.cc
  INCLUDES include
  PUBLIC kvr::common absl::status absl::statusor absl::strings absl::flat_hash_map
         nlohmann_json::nlohmann_json
  PRIVATE absl::int128)
# Bit-exactness with ggml's reference dequantisation needs unfused multiply-adds.
set_source_files_properties(src/dequant.cc PROPERTIES COMPILE_OPTIONS "-ffp-contract=off")

# ---- tests -------------------------------------------------------------------------------
find_package(OpenSSL REQUIRED COMPONENTS Crypto)
kvr_add_executable(gguf_dequant_digest
  SOURCES tests/tools/gguf_dequant_digest.cc
  LIBS kvr::model_formats CLI11::CLI11 OpenSSL::Crypto)

# Bit-exact comparison with the gguf Python package. The interpreter comes from
# $KVR_TEST_PYTHON (scripts/python-env.sh makes it), falling back to the default venv.
set(_kvr_test_python "$ENV{KVR_TEST_PYTHON}")
if(NOT _kvr_test_python)
  set(_kvr_test_python "$ENV{HOME}/.cache/kvr/venv/bin/python")
endif()
set(_kvr_compare ${CMAKE_CURRENT_SOURCE_DIR}/tests/scripts/gguf_dequant_compare.py)
add_test(NAME gguf_dequant_vs_gguf_py_all_types
  COMMAND sh -c "exec \"\${KVR_TEST_PYTHON:-${_kvr_test_python}}\" ${_kvr_compare} --tool $<TARGET_FILE:gguf_dequant_digest> --synthetic")
add_test(NAME gguf_dequant_vs_gguf_py_smollm2
  COMMAND sh -c "exec \"\${KVR_TEST_PYTHON:-${_kvr_test_python}}\" ${_kvr_compare} --tool $<TARGET_FILE:gguf_dequant_digest> --model \"\${KVR_TEST_MODEL:-$HOME/.cache/kvr/models/SmolLM2-135M-Instruct.Q4_1.gguf}\"")
set_tests_properties(gguf_dequant_vs_gguf_py_all_types gguf_dequant_vs_gguf_py_smollm2
  PROPERTIES LABELS "unit;python" SKIP_RETURN_CODE 77)

kvr_add_test(model_formats_test
  SOURCES tests/gguf_test.cc tests/dequant_test.cc tests/safetensors_test.cc
  LIBS kvr::model_formats nlohmann_json::nlohmann_json)
