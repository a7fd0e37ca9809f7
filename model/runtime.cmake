# kvr::model: architectures (config), weights, KV cache, dense attention, the CPU forward pass,
# sampling and dummy shapes. Included from model/CMakeLists.txt.
kvr_add_library(model
  SOURCES src/config.cc src/weights.cc src/kv_cache.cc src/dense_attention.cc src/model.cc
          src/sampler.cc src/dummy.cc src/loader.cc src/packed_matrix.cc src/cpu_kernels.cc
          src/cpu_kernels_generic.cc
  INCLUDES include
  PUBLIC kvr::model_api kvr::model_formats kvr::tokenizer kvr::tokenizer_gguf kvr::common
         absl::status absl::statusor nlohmann_json::nlohmann_json
  PRIVATE PkgConfig::OPENBLAS absl::strings)
# The CPU kernels are built at -O3 whatever CMAKE_BUILD_TYPE is (the rest of the project stays
# at its build type, so CI's cached objects are untouched), each ISA's file with its own target
# flags; cpu_kernels.cc picks one at run time from cpuid, so the binary still runs on any x86-64.
set_source_files_properties(src/cpu_kernels_generic.cc PROPERTIES COMPILE_OPTIONS "-O3")
if(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64|amd64")
  target_sources(kvr_model PRIVATE src/cpu_kernels_avx2.cc src/cpu_kernels_avx512.cc)
  target_compile_definitions(kvr_model PRIVATE KVR_X86_KERNELS=1)
  set_source_files_properties(src/cpu_kernels_avx2.cc PROPERTIES COMPILE_OPTIONS
    "-O3;-mavx2;-mfma;-mf16c")
  set_source_files_properties(src/cpu_kernels_avx512.cc PROPERTIES COMPILE_OPTIONS
    "-O3;-mavx2;-mfma;-mf16c;-mavx512f;-mavx512bw;-mavx512vl;-mavx512vnni")
endif()

kvr_add_test(model_runtime_test
  SOURCES tests/runtime_ops_test.cc tests/model_test.cc tests/weights_format_test.cc
  LIBS kvr::model kvr::model_formats kvr::common absl::strings nlohmann_json::nlohmann_json)

kvr_add_test(model_cpu_kernels_test
  SOURCES tests/cpu_kernels_test.cc
  LIBS kvr::model kvr::model_formats kvr::common)

# Needs the SmolLM2 GGUF (scripts/fetch-model.sh; CI's scripts/test.sh fetches it).
kvr_add_test(model_logits_parity_test
  SOURCES tests/logits_parity_test.cc tests/packed_decode_test.cc
  LIBS kvr::model kvr::common absl::strings absl::str_format nlohmann_json::nlohmann_json)
target_compile_definitions(model_logits_parity_test PRIVATE
  KVR_LOGITS_FIXTURE_DIR="${CMAKE_CURRENT_SOURCE_DIR}/tests/fixtures/logits")

kvr_add_executable(model_runtime_bench
  SOURCES bench/runtime_bench.cc
  LIBS kvr::model kvr::common PkgConfig::OPENBLAS CLI11::CLI11 absl::str_format)

# One thread's decode attention (attend_rows) over a cache larger or smaller than the caches.
kvr_add_executable(model_attend_rows_bench
  SOURCES bench/attend_rows_bench.cc
  LIBS kvr::model)

kvr_add_executable(model_greedy_agreement
  SOURCES bench/greedy_agreement.cc
  LIBS kvr::model kvr::common CLI11::CLI11)
