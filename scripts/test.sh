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
