#!/usr/bin/env bash
# GPU decode data path (select, gather, attend): build here, measure on the device machine.
#
#   bash scripts/device/retrieval-bench.sh bundle     # here: build the CUDA targets, copy the
#                                                     # binaries + non-system shared libraries
#                                                     # into .device/kernels-attend/
#   bash scripts/device/retrieval-bench.sh run [quick] # there (device tool, carry
#                                                     # .device/kernels-attend): parity tests,
#                                                     # compute-sanitizer memcheck, the bench,
#                                                     # torch SDPA dense, ONE ratio table
#
# `run` builds nothing. Logs and CSVs go to $OUT (the device tool's output folder) or ./out.
set -euo pipefail
. "$(dirname "$0")/lib.sh"  # build_targets, stage_targets, compute_sanitizer
cd "$(dirname "$0")/../.."
ROOT=$PWD
DEV=.device/kernels-attend
BUILD=${KVR_BUILD_DIR:-build-kattend}

bundle() {
  local targets=(gpu_parity_test decode_attention_bench)
  # kernels-select's bench rides along when that part is in the tree.
  if ninja -C "$BUILD" -t targets all 2>/dev/null | grep -q '^select_cuda_bench:'; then
    targets+=(select_cuda_bench)
  fi
  build_targets "$BUILD" "${targets[@]}"
  stage_targets "$BUILD" "$DEV" "${targets[@]}"
  cp retrieval/bench/sdpa_dense.py "$DEV/"
  du -sh "$DEV"
}

run() {
  local quick=${1:-}
  local out=${OUT:-$ROOT/out/kernels-attend}
  mkdir -p "$out"
  export LD_LIBRARY_PATH=$ROOT/$DEV/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader || true
  local san
  san=$(compute_sanitizer)
  local status=0
  # The decode data path's and the selectors' rows of gpu_parity_test (tests/gpu_parity).
  local attend='Attend/*:AttendContract.*'
  echo "== parity (gpu_parity_test: attend and select rows)"
  "$DEV/gpu_parity_test" --gtest_brief=1 --gtest_filter="$attend:Select/*:SelectContract.*" \
    >"$out/parity.log" 2>&1 || status=1
  sed -n '/^=== GPU parity table/,/^=== end of GPU parity table/p' "$out/parity.log"
  echo "== compute-sanitizer memcheck"
  if [[ -x $san ]]; then
    "$san" --tool memcheck --leak-check full --error-exitcode 3 \
      "$DEV/gpu_parity_test" --gtest_brief=1 --gtest_filter="$attend" >"$out/memcheck.log" 2>&1 ||
      status=1
    grep -E "ERROR SUMMARY|PASSED|FAILED" "$out/memcheck.log" | tail -3
  else
    echo "compute-sanitizer not found"
  fi
  echo "== bench"
  local args=()
  [[ $quick == quick ]] && args=(--contexts 8192,131072 --batches 1,4 --budgets 256,1024)
  "$DEV/decode_attention_bench" "${args[@]}" --csv "$out/bench.csv" >"$out/bench.log" 2>&1 ||
    { status=1; tail -5 "$out/bench.log"; }
  # Hot-cache hit rate at a higher step-to-step overlap (128K, batch 1 and 4).
  "$DEV/decode_attention_bench" --contexts 131072 --batches 1,4 --budgets 1024 --overlap 0.9 \
    --csv "$out/bench_overlap90.csv" >>"$out/bench.log" 2>&1 || status=1
  local sargs=()
  [[ $quick == quick ]] && sargs=(--contexts 8192,131072 --batches 1,4)
  python3 "$DEV/sdpa_dense.py" "${sargs[@]}" --out "$out/sdpa.csv" >"$out/sdpa.log" 2>&1 ||
    { status=1; tail -5 "$out/sdpa.log"; }
  { python3 "$DEV/sdpa_dense.py" --join "$out/bench.csv" --sdpa "$out/sdpa.csv"
    echo "overlap 0.9:"
    python3 "$DEV/sdpa_dense.py" --join "$out/bench_overlap90.csv" --sdpa "$out/sdpa.csv" |
      tail -n +2; } | tee "$out/table.md"
  return $status
}

case "${1:-}" in
  bundle) bundle ;;
  run) run "${2:-}" ;;
  *) echo "usage: $0 bundle | run [quick]" >&2; exit 2 ;;
esac
