# kvr::retrieval: every method this build has (core + quant when built), through AllMethods().
# Lives here because eval.cmake is included after core.cmake and quant.cmake.
add_library(kvr_retrieval src/all_methods.cc)
add_library(kvr::retrieval ALIAS kvr_retrieval)
target_link_libraries(kvr_retrieval PUBLIC kvr::retrieval_core)
if(TARGET kvr_retrieval_quant)
  target_link_libraries(kvr_retrieval PUBLIC kvr_retrieval_quant)
  target_compile_definitions(kvr_retrieval PRIVATE KVR_RETRIEVAL_HAVE_QUANT)
endif()
kvr_warnings(kvr_retrieval)

# kvr::retrieval_eval: `kvr eval retrieval` (needs the model runtime).
if(TARGET kvr_model)
  add_library(kvr_retrieval_eval eval/retrieval_eval.cc)
  add_library(kvr::retrieval_eval ALIAS kvr_retrieval_eval)
  target_include_directories(kvr_retrieval_eval PUBLIC eval)
  target_link_libraries(kvr_retrieval_eval
    PUBLIC kvr::retrieval kvr::model kvr::common
    PRIVATE nlohmann_json::nlohmann_json absl::strings absl::str_format)
  if(TARGET kvr_retrieval_calibrate)
    target_link_libraries(kvr_retrieval_eval PRIVATE kvr_retrieval_calibrate)
    target_compile_definitions(kvr_retrieval_eval PRIVATE KVR_RETRIEVAL_HAVE_QUANT)
  endif()
  kvr_warnings(kvr_retrieval_eval)
  kvr_add_test(retrieval_eval_test
    SOURCES tests/eval_test.cc
    LIBS kvr::retrieval_eval kvr::model kvr::common)
endif()

if(TARGET kvr_model)
  kvr_add_test(retrieval_model_test
    SOURCES tests/model_greedy_test.cc
    LIBS kvr::retrieval_core kvr::model kvr::common)
endif()
