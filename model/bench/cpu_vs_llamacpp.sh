#!/usr/bin/env bash
# kvr's CPU runtime beside llama.cpp's llama-bench on the same GGUF and threads, runs
# interleaved (kvr, llama.cpp, kvr, ...) so that both see the same machine load; prints one
# line per run, the load average before it, and each llama-bench process's CPU share over its
# threads (GNU time; kvr prints its own "cpu use"): well under 100% means other processes
# took the cores. Take medians over the repetitions.
#
#   model/bench/cpu_vs_llamacpp.sh BUILD_DIR LLAMA_BENCH [REPS] [CONTEXTS...]
#     BUILD_DIR    kvr build directory (has model/model_runtime_bench)
#     LLAMA_BENCH  path to llama.cpp's llama-bench
#     REPS         repetitions of each (default 3); CONTEXTS default 512 2048 4096
#   Environment: MODEL (default: scripts/fetch-model.sh), THREADS (2), STEPS (64 decode steps).
set -euo pipefail
build=$1 llama_bench=$2 reps=${3:-3}
shift $(( $# >= 3 ? 3 : $# ))
contexts=("$@")
[ ${#contexts[@]} -eq 0 ] && contexts=(512 2048 4096)
here=$(cd "$(dirname "$0")/../.." && pwd)
model=${MODEL:-$(bash "$here/scripts/fetch-model.sh")}
threads=${THREADS:-2} steps=${STEPS:-64}
share=$(mktemp)
trap 'rm -f "$share"' EXIT
# Runs llama-bench, printing its CSV row and its CPU share (percent of $threads cores).
llama() {
  local label=$1
  shift
  /usr/bin/time -f '%P' -o "$share" "$llama_bench" "$@" 2>/dev/null | tail -n 1 |
    sed "s/^/llama.cpp $label /"
  local pct
  pct=$(tr -dc '0-9' < "$share")
  echo "llama.cpp $label cpu use $(( ${pct:-0} / threads ))%"
}
echo "# $(date -u +%FT%TZ) $(uname -n) threads=$threads steps=$steps model=$model"
for rep in $(seq "$reps"); do
  for ctx in "${contexts[@]}"; do
    echo "## rep $rep ctx $ctx load $(cut -d' ' -f1-3 /proc/loadavg)"
    "$build/model/model_runtime_bench" --model "$model" --threads "$threads" \
      --prompt-tokens "$ctx" --decode-steps "$steps" --no-ceilings | sed 's/^/kvr /'
    echo "## load $(cut -d' ' -f1-3 /proc/loadavg)"
    llama pp -m "$model" -t "$threads" -r 1 -o csv -p "$ctx" -n 0
    llama tg -m "$model" -t "$threads" -r 1 -o csv -p 0 -n "$steps" -d "$ctx"
  done
done
