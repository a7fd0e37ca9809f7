#!/usr/bin/env bash
# GPU summary-building kernels: build here, check and time on the device.
#
#   bash scripts/device/kernels-build.sh bundle   # here: build gpu_parity_test and
#                                                 # build_cuda_bench and assign_bench, copy
#                                                 # them + non-system shared libraries to
#                                                 # .device/kernels-build/bundle.tar.xz (xz)
#   bash scripts/device/kernels-build.sh run [quick]  # there (device tool, carry
#                                                 # .device/kernels-build): the builders'
#                                                 # rows of the parity table,
#                                                 # compute-sanitizer memcheck on them, the bench,
#                                                 # torch SDPA causal prefill attention anchor
#
# `run` builds nothing. Logs go to $OUT (the device tool's output folder) or ./out.
# Optional environment for a partial run: KB_TESTS (gtest filter of the parity and memcheck runs
# over gpu_parity_test's names, e.g. 'Build/*Ctkvr*:BuildValidation*'; default: every build row),
# KB_BENCH_ARGS (extra build_cuda_bench flags, e.g. "--builders ctkvr"), KB_ASSIGN_ARGS
# (assign_bench flags: ClusterKV's assignment kernel, in-loop vs pre-split), KB_SDPA_ARGS, KB_SDPA=0
# (skip the torch SDPA anchor, e.g. when only a builder's own before/after matters).
set -euo pipefail
. "$(dirname "$0")/lib.sh"  # build_targets, stage_targets, compute_sanitizer, dispatch_bundle_run
cd "$(dirname "$0")/../.."
ROOT=$PWD
DEV=.device/kernels-build
BUILD=${KVR_BUILD_DIR:-build-kbuild}

bundle() {
  local targets=(gpu_parity_test build_cuda_bench assign_bench)
  build_targets "$BUILD" "${targets[@]}"
  stage_targets "$BUILD" "$DEV" "${targets[@]}"
  cp retrieval/cuda/summaries/bench/prefill_sdpa.py "$DEV/"
  # OpenBLAS alone is ~37 MB: the bundle travels xz-compressed (run unpacks it).
  tar -C "$DEV" -cf - . | xz -T2 -6 >/tmp/kernels-build-bundle.tar.xz
  rm -rf "$DEV" && mkdir -p "$DEV" && mv /tmp/kernels-build-bundle.tar.xz "$DEV/bundle.tar.xz"
  du -sh "$DEV"
}

run() {
  local quick=${1:-}
  local out=${OUT:-$ROOT/out/kernels-build}
  mkdir -p "$out"
  if [[ -f $DEV/bundle.tar.xz ]]; then
    local stage=/tmp/kernels-build-stage
    rm -rf "$stage" && mkdir -p "$stage" && tar -C "$stage" -xJf "$DEV/bundle.tar.xz"
    DEV=$stage
  else
    DEV=$ROOT/$DEV
  fi
  export LD_LIBRARY_PATH=$DEV/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  local san
  san=$(compute_sanitizer)
  local status=0
  # The builders' rows of gpu_parity_test (tests/gpu_parity), the assignment kernel's and the
  # launchers' validation.
  local filter=("--gtest_filter=${KB_TESTS:-Build/*:ArgmaxSplit/*:BuildValidation.*}")
  echo "== parity ${KB_TESTS:-}"
  timeout 120 "$DEV/gpu_parity_test" "${filter[@]}" >"$out/parity.log" 2>&1 || status=1
  grep -E "^\[ (a2ats|clusterkv|ctkvr)|^\[  (PASSED|FAILED)|FAILED  \]|tests ran" "$out/parity.log" |
    head -60 || true
  sed -n '/^=== GPU parity table/,/^=== end of GPU parity table/p' "$out/parity.log"
  echo "== compute-sanitizer memcheck (every parity test${KB_TESTS:+ of $KB_TESTS})"
  timeout 240 "$san" --tool memcheck --error-exitcode 3 "$DEV/gpu_parity_test" \
    "${filter[@]}" >"$out/memcheck.log" 2>&1 || status=1
  grep -E "ERROR SUMMARY|^\[  (PASSED|FAILED)" "$out/memcheck.log" | tail -3 || true
  echo "== bench"
  local args=()
  [[ $quick == quick ]] && args=(--contexts 8192,131072 --iters 2)
  # shellcheck disable=SC2206
  args+=(${KB_BENCH_ARGS:-})
  timeout 200 "$DEV/build_cuda_bench" "${args[@]}" | tee "$out/bench.txt" || status=1
  if [[ -x $DEV/assign_bench ]]; then
    echo "== ClusterKV assignment kernel: in-loop vs pre-split 3xTF32 (same run)"
    # shellcheck disable=SC2086
    timeout 120 "$DEV/assign_bench" ${KB_ASSIGN_ARGS:-} | tee "$out/assign.txt" || status=1
  fi
  if [[ ${KB_SDPA:-1} != 0 ]]; then
    echo "== torch SDPA causal prefill attention (same run)"
    # shellcheck disable=SC2086
    timeout 120 python3 "$DEV/prefill_sdpa.py" ${KB_SDPA_ARGS:-} | tee "$out/sdpa.txt" || status=1
  fi
  echo "status $status"
  return $status
}

dispatch_bundle_run "bundle|run [quick]" "$@"
