# Small helpers so that component CMakeLists stay short.

# kvr_warnings(<target>): the warning set every kvr target builds with.
function(kvr_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers>)
endfunction()

# kvr_add_library(<name> [INTERFACE] [CUDA] [SOURCES ...] [INCLUDES ...] [PRIVATE_INCLUDES ...]
#                 [PUBLIC ...] [PRIVATE ...])
# The library kvr_<name> with its alias kvr::<name> (what other targets link), the warning set,
# include directories (INCLUDES public, PRIVATE_INCLUDES for its own sources) and links.
# INTERFACE: a header-only library; its INCLUDES and PUBLIC links become INTERFACE ones.
# CUDA: its .cu sources build with the nvcc options of every kvr kernel library.
function(kvr_add_library name)
  cmake_parse_arguments(ARG "INTERFACE;CUDA" "" "SOURCES;INCLUDES;PRIVATE_INCLUDES;PUBLIC;PRIVATE"
                        ${ARGN})
  set(target kvr_${name})
  if(ARG_INTERFACE)
    add_library(${target} INTERFACE)
    set(public INTERFACE)
  else()
    add_library(${target} ${ARG_SOURCES})
    kvr_warnings(${target})
    set(public PUBLIC)
  endif()
  add_library(kvr::${name} ALIAS ${target})
  # Empty lists are no-ops.
  target_include_directories(${target} ${public} ${ARG_INCLUDES} PRIVATE ${ARG_PRIVATE_INCLUDES})
  target_link_libraries(${target} ${public} ${ARG_PUBLIC} PRIVATE ${ARG_PRIVATE})
  if(ARG_CUDA)
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo>)
  endif()
endfunction()

# kvr_add_metric_set(<name> [DIR <folder>] [INCLUDES ...] [PUBLIC ...])
# A role's Prometheus metric set (its metrics.h) with the observer adapter that feeds it: the
# library kvr_<name> of DIR/src/metrics.cc and DIR/src/metrics_observer.cc (DIR: the calling
# folder unless given), linking PUBLIC and kvr::metrics (kvr/common/metrics.h).
function(kvr_add_metric_set name)
  cmake_parse_arguments(ARG "" "DIR" "INCLUDES;PUBLIC" ${ARGN})
  if(NOT ARG_DIR)
    set(ARG_DIR ${CMAKE_CURRENT_SOURCE_DIR})
  endif()
  kvr_add_library(${name}
    SOURCES ${ARG_DIR}/src/metrics.cc ${ARG_DIR}/src/metrics_observer.cc
    INCLUDES ${ARG_INCLUDES}
    PUBLIC ${ARG_PUBLIC} kvr::metrics
    PRIVATE prometheus-cpp::core absl::strings absl::synchronization absl::flat_hash_map)
endfunction()

# kvr_add_executable(<name> SOURCES ... [LIBS ...] [INCLUDES ...])
# A program (a tool, a benchmark, a test's helper process) with the warning set, linking LIBS;
# INCLUDES: include directories of its own sources.
function(kvr_add_executable name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBS;INCLUDES" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  kvr_warnings(${name})
  target_link_libraries(${name} PRIVATE ${ARG_LIBS})
  target_include_directories(${name} PRIVATE ${ARG_INCLUDES})
endfunction()

# kvr_add_test(<name> SOURCES ... LIBS ... [INCLUDES ...] [LABELS ...] [OWN_MAIN] [RUN_SERIAL]
#              [PROGRAMS <MACRO>=<target> ...])
# A GoogleTest binary whose cases are discovered when ctest runs (not at build time, which
# would cost a run of every test binary on each build). INCLUDES: include directories of its
# own sources (another folder's test helpers). OWN_MAIN: the sources define main() (e.g. to
# install a test event listener), so gtest_main is not linked. PROGRAMS: executables the test
# runs, built before it, each one's path in the compile definition <MACRO>. RUN_SERIAL: its
# cases never share the machine with another test (ones that time a recovery).
function(kvr_add_test name)
  cmake_parse_arguments(ARG "OWN_MAIN;RUN_SERIAL" "" "SOURCES;LIBS;INCLUDES;LABELS;PROGRAMS"
                        ${ARGN})
  kvr_add_executable(${name} SOURCES ${ARG_SOURCES} INCLUDES ${ARG_INCLUDES}
                     LIBS ${ARG_LIBS} GTest::gtest GTest::gmock)
  foreach(program ${ARG_PROGRAMS})
    string(REPLACE "=" ";" macro_target ${program})
    list(GET macro_target 0 macro)
    list(GET macro_target 1 target)
    add_dependencies(${name} ${target})
    target_compile_definitions(${name} PRIVATE ${macro}="$<TARGET_FILE:${target}>")
  endforeach()
  if(NOT ARG_OWN_MAIN)
    target_link_libraries(${name} PRIVATE GTest::gtest_main)
  endif()
  set(labels unit)
  if(ARG_LABELS)
    # gtest_discover_tests writes a list property unquoted, so a second label became a property
    # name (and swallowed the next property): one label per test binary.
    list(LENGTH ARG_LABELS n_labels)
    if(n_labels GREATER 1)
      message(FATAL_ERROR "kvr_add_test(${name}): one label, not ${ARG_LABELS}")
    endif()
    set(labels ${ARG_LABELS})
  endif()
  set(serial)
  if(ARG_RUN_SERIAL)
    set(serial RUN_SERIAL TRUE)
  endif()
  gtest_discover_tests(${name} DISCOVERY_MODE PRE_TEST
    PROPERTIES LABELS "${labels}" ENVIRONMENT "KVR_SOURCE_DIR=${PROJECT_SOURCE_DIR}" ${serial})
endfunction()

# kvr_add_fuzzer(<name> SOURCES ... LIBS ... CORPUS <seed dir>)
# A libFuzzer target (LLVMFuzzerTestOneInput). With KVR_ENABLE_FUZZ (clang, scripts/fuzz.sh)
# it links libFuzzer and CTest `fuzz_<name>` (label fuzz) runs it for KVR_FUZZ_SECONDS, one
# process, over a working corpus in the build tree seeded from CORPUS (the repository's seeds
# are read, never written). Otherwise it links a replay main (cmake/fuzz_replay_main.cc) and
# CTest `fuzz_replay_<name>` (label unit) runs every seed once.
option(KVR_ENABLE_FUZZ "build libFuzzer targets (clang; see scripts/fuzz.sh)" OFF)
set(KVR_FUZZ_SECONDS 20 CACHE STRING "seconds each fuzz_<name> test fuzzes")
function(kvr_add_fuzzer name)
  cmake_parse_arguments(ARG "" "CORPUS" "SOURCES;LIBS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  kvr_warnings(${name})
  target_link_libraries(${name} PRIVATE ${ARG_LIBS})
  if(KVR_ENABLE_FUZZ)
    target_link_options(${name} PRIVATE -fsanitize=fuzzer)
    set(work ${CMAKE_BINARY_DIR}/fuzz/${name})
    add_test(NAME fuzz_${name}
      COMMAND sh -c "mkdir -p ${work}/corpus ${work}/crashes && exec $<TARGET_FILE:${name}> -max_total_time=${KVR_FUZZ_SECONDS} -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 -artifact_prefix=${work}/crashes/ ${work}/corpus ${ARG_CORPUS}")
    set_tests_properties(fuzz_${name} PROPERTIES LABELS fuzz)
  else()
    target_sources(${name} PRIVATE ${PROJECT_SOURCE_DIR}/cmake/fuzz_replay_main.cc)
    add_test(NAME fuzz_replay_${name} COMMAND ${name} ${ARG_CORPUS})
    set_tests_properties(fuzz_replay_${name} PROPERTIES LABELS unit)
  endif()
endfunction()
