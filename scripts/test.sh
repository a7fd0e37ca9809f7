#!/usr/bin/env bash
# Builds kvr and runs every test. On a fresh Debian 12 machine this installs what it needs
# (Debian packages, the test model, the Python reference environment) first.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

bash scripts/build.sh
export KVR_TEST_MODEL="$(bash scripts/fetch-model.sh)"
export KVR_TEST_PYTHON="$(bash scripts/python-env.sh)"
build="${KVR_BUILD_DIR:-$root/build}"
cd "$build"
ctest --output-on-failure -j "${KVR_JOBS:-$(nproc)}" --timeout 900 -LE gpu

# Fuzzing (every run, short) and ASan/UBSan (weekly, Sundays UTC): docs/fuzzing-and-sanitizers.md.
if [ "${KVR_FUZZ_SECONDS:-20}" != 0 ] && command -v clang++ >/dev/null; then
  bash "$root/scripts/fuzz.sh" "${KVR_FUZZ_SECONDS:-20}"
fi
sanitizers="${KVR_SANITIZERS:-auto}"
if [ "$sanitizers" = auto ]; then
  sanitizers=$([ "$(date -u +%u)" = 7 ] && echo 1 || echo 0)
fi
# ASan + UBSan only: TSan needs an abseil built with TSan (docs/fuzzing-and-sanitizers.md).
if [ "$sanitizers" = 1 ]; then
  bash "$root/scripts/sanitizers.sh" asan
fi
