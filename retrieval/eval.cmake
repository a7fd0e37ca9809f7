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
