# kvr::retrieval: every method this build has (core + quant when built), through AllMethods().
# Lives here because eval.cmake is included after core.cmake and quant.cmake.
kvr_add_library(retrieval SOURCES src/all_methods.cc PUBLIC kvr::retrieval_core)
if(TARGET kvr_retrieval_quant)
  target_link_libraries(kvr_retrieval PUBLIC kvr_retrieval_quant)
  target_compile_definitions(kvr_retrieval PRIVATE KVR_RETRIEVAL_HAVE_QUANT)
endif()

# kvr::retrieval_eval: `kvr eval retrieval` (needs the model runtime).
if(TARGET kvr_model)
  kvr_add_library(retrieval_eval
    SOURCES eval/retrieval_eval.cc eval/selection_trace.cc eval/thinned_prefix.cc eval/head_quality.cc
    INCLUDES eval
    PUBLIC kvr::retrieval kvr::model kvr::common
    PRIVATE nlohmann_json::nlohmann_json absl::strings absl::str_format)
  if(TARGET kvr_retrieval_calibrate)
    target_link_libraries(kvr_retrieval_eval PRIVATE kvr_retrieval_calibrate)
    target_compile_definitions(kvr_retrieval_eval PRIVATE KVR_RETRIEVAL_HAVE_QUANT)
  endif()
  kvr_add_test(retrieval_eval_test
    SOURCES tests/eval_test.cc
    LIBS kvr::retrieval_eval kvr::model kvr::common
    INCLUDES ${PROJECT_SOURCE_DIR}/retrieval/cuda/decode/include)
endif()

if(TARGET kvr_model)
  kvr_add_test(retrieval_model_test
    SOURCES tests/model_greedy_test.cc
    LIBS kvr::retrieval_core kvr::model kvr::common)
endif()
