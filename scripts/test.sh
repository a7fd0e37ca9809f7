#!/usr/bin/env bash
# Builds kvr and runs every test. On a fresh Debian 12 machine this installs what it needs
# (Debian packages, the test model, the Python reference environment) first.
#   scripts/test.sh            # configure, build, run all tests
#   KVR_BUILD_DIR=... scripts/test.sh
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

bash scripts/install-deps.sh
export KVR_TEST_MODEL="$(bash scripts/fetch-model.sh)"
export KVR_TEST_PYTHON="$(bash scripts/python-env.sh)"

build="${KVR_BUILD_DIR:-$root/build}"
jobs="${KVR_JOBS:-$(nproc)}"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build "$build" -j "$jobs"
cd "$build"
ctest --output-on-failure -j "$jobs" --timeout 900 -LE gpu
