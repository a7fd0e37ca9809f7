#!/usr/bin/env bash
# Installs what the build needs (Debian packages, the test model) and builds kvr.
# Used by demo.sh and test.sh. Prints nothing but build progress.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bash scripts/install-deps.sh
bash scripts/fetch-model.sh >/dev/null
build="${KVR_BUILD_DIR:-$root/build}"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" -j "${KVR_JOBS:-$(nproc)}" ${KVR_BUILD_TARGETS:+--target $KVR_BUILD_TARGETS}
