#!/usr/bin/env bash
# The GPU decode data path's per-method per-layer table in ONE device call: select (all six GPU selectors) +
# gather from host memory / hot cache + attend, beside torch SDPA dense decode, same run.
#
#   bash scripts/device/issue6-table.sh bundle   # here: build select_cuda_bench and
#                                                # decode_attention_bench (build-i6), copy them +
#                                                # non-system shared libraries + the Python parts
#                                                # to .device/i6table/
#   bash scripts/device/issue6-table.sh run      # there (device tool, carry .device/i6table):
#                                                # runs the benches, prints ONE table
#
# `run` builds nothing. Stages (each under `timeout`, all under one deadline of I6_DEADLINE s,
# default 235, so the call stays under ~4 minutes; a stage that would start past the deadline is
# skipped and the table says which rows are missing):
#   1. decode_attention_bench at 128K (ceilings, gather host / hot / attend, batch 1,4,16,
#      budget 256,1024)            -> da_128k.log
#   2. select_cuda_bench, six methods, 128K                 -> sel_128k.csv
#   3. sdpa_dense.py, 8K/32K/128K x 1/4/16                  -> sdpa.log / sdpa.csv
#   4. decode_attention_bench at 32K, 8K                    -> da_rest.log
#   5. select_cuda_bench, six methods, 32K, 8K              -> sel_rest.csv
#   6. decode_attention_bench at 128K, overlap 0.9 (hot)    -> da_ov90.log
#   7. issue6_table.py: the composed table                  -> table.md
# Logs are packed into $OUT/raw.tar.gz, and table.md is copied to $OUT (the device tool returns
# at most 8 files).
# The 128K points run first so that the issue's target rows survive a timeout. The benches'
# stdout is kept (rows are flushed per point) and parsed, not their --csv files (written at exit).
set -euo pipefail
. "$(dirname "$0")/lib.sh"  # build_targets, stage_targets, compute_sanitizer
cd "$(dirname "$0")/../.."
ROOT=$PWD
DEV=.device/i6table
BUILD=${KVR_BUILD_DIR:-build-i6}

bundle() {
  local targets=(select_cuda_bench decode_attention_bench)
  build_targets "$BUILD" "${targets[@]}"
  stage_targets "$BUILD" "$DEV" "${targets[@]}"
  cp retrieval/bench/sdpa_dense.py retrieval/bench/issue6_table.py "$DEV/"
  du -sh "$DEV"
}

run() {
  # The device tool returns at most 8 files from $OUT (the first call lost the select CSVs and
  # table.md that way): every log goes to a scratch folder, packed into $OUT/raw.tar.gz at exit,
  # and table.md is copied beside it.
  local dest=${OUT:-$ROOT/out/i6table}
  mkdir -p "$dest"
  local out
  out=$(mktemp -d)
  # shellcheck disable=SC2064  # expand now: the locals are gone when the trap runs
  trap "cp '$out/table.md' '$dest/' 2>/dev/null; tar czf '$dest/raw.tar.gz' -C '$out' .; rm -rf '$out'" EXIT
  export LD_LIBRARY_PATH=$ROOT/$DEV/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PYTHONUNBUFFERED=1
  local deadline=${I6_DEADLINE:-235}
  local status=0
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader |
    tee "$out/gpu.txt" || true
  local methods=exact,quest,clusterkv,pariskv,ctkvr,a2ats
  # stage NAME CAP LOG CMD...: runs CMD under min(CAP, time left), stdout+stderr to LOG.
  stage() {
    local name=$1 cap=$2 log=$3
    shift 3
    local left=$((deadline - SECONDS))
    if ((left < 10)); then
      echo "== $name: SKIPPED (deadline, ${SECONDS}s elapsed)" | tee -a "$out/stages.txt"
      return 0
    fi
    local t=$((cap < left ? cap : left))
    local t0=$SECONDS rc=0
    timeout "$t" "$@" >"$log" 2>&1 || rc=$?
    echo "== $name: rc $rc, $((SECONDS - t0)) s (limit $t s), ${SECONDS}s elapsed" |
      tee -a "$out/stages.txt"
    ((rc == 0)) || { status=1; tail -3 "$log"; }
  }
  stage "decode 128K" 75 "$out/da_128k.log" "$DEV/decode_attention_bench" --contexts 131072 \
    --batches 1,4,16 --budgets 256,1024 --iters 20 --csv "$out/da_128k.csv"
  stage "select 128K" 45 "$out/sel_128k.csv" "$DEV/select_cuda_bench" --methods "$methods" \
    --contexts 131072 --batches 1,4,16 --budgets 256,1024 --iters 20 --csv
  stage "sdpa" 45 "$out/sdpa.log" python3 "$DEV/sdpa_dense.py" --contexts 131072,32768,8192 \
    --batches 1,4,16 --iters 30 --out "$out/sdpa.csv"
  stage "decode 32K,8K" 50 "$out/da_rest.log" "$DEV/decode_attention_bench" --contexts 32768,8192 \
    --batches 1,4,16 --budgets 256,1024 --iters 20 --csv "$out/da_rest.csv"
  stage "select 32K,8K" 40 "$out/sel_rest.csv" "$DEV/select_cuda_bench" --methods "$methods" \
    --contexts 32768,8192 --batches 1,4,16 --budgets 256,1024 --iters 20 --csv
  stage "decode 128K overlap 0.9" 35 "$out/da_ov90.log" "$DEV/decode_attention_bench" \
    --contexts 131072 --batches 1,4,16 --budgets 256,1024 --iters 20 --overlap 0.9 \
    --csv "$out/da_ov90.csv"
  python3 "$DEV/issue6_table.py" --dir "$out" | tee "$out/table.md" || status=1
  echo "status $status, ${SECONDS}s"
  return $status
}

case ${1:-run} in
  bundle) bundle ;;
  run) run ;;
  *) echo "usage: $0 bundle|run" >&2; exit 2 ;;
esac
