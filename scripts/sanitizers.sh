#!/usr/bin/env bash
# Sanitizer runs of the unit tests of the store, the controller and the decode node, with clang,
# each in its own build directory and building only those tests:
#   scripts/sanitizers.sh asan   AddressSanitizer + UndefinedBehaviorSanitizer (build-asan; the
#                                same flags and directory as scripts/fuzz.sh, whose libFuzzer
#                                coverage instrumentation costs the tests little)
#   scripts/sanitizers.sh tsan   ThreadSanitizer (build-tsan). Debian's abseil and gRPC are not
#                                built with TSan, so absl::Mutex / absl::Notification
#                                synchronisation is invisible to it and code they guard is
#                                reported as racing: meaningful only with an abseil built with
#                                -fsanitize=thread (docs/fuzzing-and-sanitizers.md)
#   scripts/sanitizers.sh all    both (default)
# Tests: kv_store_core_test, kv_store_service_test, kv_store_data_plane_test (the store: page
# pool, leases, the gRPC service and the UCX data plane on loopback), controller_test,
# membership_client_test (membership, placement, request runner), decode_node_test (the decode
# engine, its batching threads and service). Why this subset: these are the processes that
# take requests from other processes, and the threads of their engines; a sanitizer build of
# everything (model, retrieval and their parity sweeps, the e2e clusters) takes well over an
# hour on CI's 2 cores. See docs/sanitizers.md for the schedule.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
what="${1:-all}"
tests=(kv_store_core_test kv_store_service_test kv_store_data_plane_test controller_test
       membership_client_test decode_node_test)
if ! command -v clang++ >/dev/null; then
  echo "sanitizers.sh: clang++ not found (scripts/install-deps.sh installs it)" >&2
  exit 1
fi
export KVR_TEST_MODEL="${KVR_TEST_MODEL:-$(bash "$root/scripts/fetch-model.sh")}"

run() {  # run <build dir> <flags>
  local build="$1" flags="$2"
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVR_ENABLE_CUDA=OFF \
    -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
    -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" >/dev/null
  cmake --build "$build" -j "${KVR_JOBS:-$(nproc)}" --target "${tests[@]}"
  # The test binaries directly (one at a time: sanitizer builds are memory-hungry), with the
  # environment ctest gives them.
  local failed=0
  for t in "${tests[@]}"; do
    local bin
    bin="$(find "$build" -name "$t" -type f -perm -u+x | head -1)"
    echo "== $(basename "$build") $t"
    if ! (cd "$(dirname "$bin")" && KVR_SOURCE_DIR="$root" "$bin" --gtest_brief=1); then
      echo "== FAILED: $(basename "$build") $t"
      failed=1
    fi
  done
  return "$failed"
}

status=0
if [ "$what" = asan ] || [ "$what" = all ]; then
  export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}"
  export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
  run "${KVR_ASAN_BUILD_DIR:-$root/build-asan}" \
    "-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer" ||
    status=1
fi
if [ "$what" = tsan ] || [ "$what" = all ]; then
  # Races inside the uninstrumented gRPC libraries (its pollers' epoll fds) are not kvr's.
  export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:suppressions=$root/scripts/tsan.supp}"
  run "${KVR_TSAN_BUILD_DIR:-$root/build-tsan}" "-fsanitize=thread -fno-omit-frame-pointer" ||
    status=1
fi
exit "$status"
