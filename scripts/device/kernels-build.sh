#!/usr/bin/env bash
# GPU summary-building kernels (issue 6, kernels-build): build here, check and time on the device.
#
#   bash scripts/device/kernels-build.sh bundle   # here: build retrieval_cuda_build_test and
#                                                 # build_cuda_bench, copy them + non-system
#                                                 # shared libraries to .device/kernels-build/
#   bash scripts/device/kernels-build.sh run [quick]  # there (device tool, carry
#                                                 # .device/kernels-build): parity tests,
#                                                 # compute-sanitizer memcheck on them, the bench,
#                                                 # torch SDPA causal prefill attention anchor
#
# `run` builds nothing. Logs go to $OUT (the device tool's output folder) or ./out.
# Optional environment for a partial run: KB_TESTS (gtest filter of the parity and memcheck runs),
# KB_BENCH_ARGS (extra build_cuda_bench flags, e.g. "--builders ctkvr"), KB_SDPA_ARGS.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
DEV=.device/kernels-build
BUILD=${KVR_BUILD_DIR:-build-kbuild}

bundle() {
  export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/kvr/ccache}
  [[ -f $BUILD/build.ninja ]] ||
    cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  local targets=(retrieval_cuda_build_test build_cuda_bench)
  cmake --build "$BUILD" --target "${targets[@]}" -j2
  rm -rf "$DEV" && mkdir -p "$DEV/lib"
  local bins=()
  for t in "${targets[@]}"; do
    local b
    b=$(find "$BUILD" -type f -name "$t" -perm -u+x | head -1)
    cp "$b" "$DEV/" && strip -g "$DEV/$t" && bins+=("$DEV/$t")
  done
  # Every shared library but glibc's and the driver's (the device is Ubuntu 24.04 without
  # Debian's absl / openblas builds).
  ldd "${bins[@]}" | awk '/=> \//{print $3}' | sort -u |
    grep -Ev '/(libc|libm|libdl|librt|libpthread|ld-linux-x86-64|libcuda)\.so' |
    while read -r lib; do cp -L "$lib" "$DEV/lib/"; done
  strip -g "$DEV"/lib/*.so* 2>/dev/null || true
  cp retrieval/cuda/build/bench/prefill_sdpa.py "$DEV/"
  du -sh "$DEV"
}

run() {
  local quick=${1:-}
  local out=${OUT:-$ROOT/out/kernels-build}
  mkdir -p "$out"
  export LD_LIBRARY_PATH=$ROOT/$DEV/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  local san
  san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  local status=0
  local filter=()
  [[ -n ${KB_TESTS:-} ]] && filter=("--gtest_filter=$KB_TESTS")
  echo "== parity ${KB_TESTS:-}"
  timeout 120 "$DEV/retrieval_cuda_build_test" "${filter[@]}" >"$out/parity.log" 2>&1 || status=1
  grep -E "^\[ (a2ats|clusterkv|ctkvr)|^\[  (PASSED|FAILED)|FAILED  \]|tests ran" "$out/parity.log" |
    head -60
  echo "== compute-sanitizer memcheck (every parity test${KB_TESTS:+ of $KB_TESTS})"
  timeout 240 "$san" --tool memcheck --error-exitcode 3 "$DEV/retrieval_cuda_build_test" \
    "${filter[@]}" >"$out/memcheck.log" 2>&1 || status=1
  grep -E "ERROR SUMMARY|^\[  (PASSED|FAILED)" "$out/memcheck.log" | tail -3
  echo "== bench"
  local args=()
  [[ $quick == quick ]] && args=(--contexts 8192,131072 --iters 2)
  # shellcheck disable=SC2206
  args+=(${KB_BENCH_ARGS:-})
  timeout 200 "$DEV/build_cuda_bench" "${args[@]}" | tee "$out/bench.txt" || status=1
  echo "== torch SDPA causal prefill attention (same run)"
  # shellcheck disable=SC2086
  timeout 120 python3 "$DEV/prefill_sdpa.py" ${KB_SDPA_ARGS:-} | tee "$out/sdpa.txt" || status=1
  echo "status $status"
  return $status
}

case ${1:-run} in
  bundle) bundle ;;
  run) shift || true; run "$@" ;;
  *) echo "usage: $0 bundle|run [quick]" >&2; exit 2 ;;
esac
