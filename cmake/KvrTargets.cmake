# Small helpers so that component CMakeLists stay short.

# kvr_warnings(<target>): the warning set every kvr target builds with.
function(kvr_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers>)
endfunction()

# kvr_add_test(<name> SOURCES ... LIBS ... [LABELS ...])
# A GoogleTest binary whose cases are discovered when ctest runs (not at build time, which
# would cost a run of every test binary on each build).
function(kvr_add_test name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  kvr_warnings(${name})
  target_link_libraries(${name} PRIVATE ${ARG_LIBS} GTest::gtest GTest::gmock GTest::gtest_main)
  set(labels unit)
  if(ARG_LABELS)
    set(labels ${ARG_LABELS})
  endif()
  gtest_discover_tests(${name} DISCOVERY_MODE PRE_TEST
    PROPERTIES LABELS "${labels}" ENVIRONMENT "KVR_SOURCE_DIR=${PROJECT_SOURCE_DIR}")
endfunction()
