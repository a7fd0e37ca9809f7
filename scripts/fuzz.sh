#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (AddressSanitizer + UndefinedBehaviorSanitizer, coverage
# for libFuzzer) in their own build directory and fuzzes each for a while, one process each:
#   gguf_fuzz, tokenizer_fuzz (model/fuzz), store_wire_fuzz, store_service_fuzz (kv-store/fuzz),
#   generate_request_fuzz (controller/fuzz).
# Usage: scripts/fuzz.sh [SECONDS_PER_TARGET (default 20)] [ctest -R pattern]
# CI (scripts/test.sh) runs it with 20 s per target. New inputs go to the build tree's
# corpus (build-asan/fuzz/<target>/corpus), crashes to build-asan/fuzz/<target>/crashes;
# the seeds in the repository are only read. A crash fails the run: add its input to the
# target's corpus/ folder with the fix, and every build replays it (fuzz_replay_<target>).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
seconds="${1:-20}"
pattern="${2:-}"
# The same directory and flags as scripts/sanitizers.sh asan: the two share one build.
build="${KVR_ASAN_BUILD_DIR:-$root/build-asan}"
if ! command -v clang++ >/dev/null; then
  echo "fuzz.sh: clang++ not found (scripts/install-deps.sh installs it)" >&2
  exit 1
fi
flags="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"

cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVR_ENABLE_CUDA=OFF \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
  -DKVR_ENABLE_FUZZ=ON -DKVR_FUZZ_SECONDS="$seconds" >/dev/null
targets=(gguf_fuzz tokenizer_fuzz store_wire_fuzz store_service_fuzz generate_request_fuzz)
cmake --build "$build" -j "${KVR_JOBS:-$(nproc)}" --target "${targets[@]}"
cd "$build"
# One fuzzer at a time (-j1): each is a single process, and CI has 2 cores.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
ctest --output-on-failure -j1 -L fuzz ${pattern:+-R "$pattern"}
