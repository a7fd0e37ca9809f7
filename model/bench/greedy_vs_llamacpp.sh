#!/usr/bin/env bash
# Greedy-token agreement of kvr's CPU path with llama.cpp's own quantised path on the same GGUF:
# llama.cpp decodes the logits fixture's prompts greedily (f16 KV, its defaults), kvr is
# teacher-forced on those tokens and reports agreement and both top-2 gaps where it differs.
#
#   model/bench/greedy_vs_llamacpp.sh BUILD_DIR LLAMA_CPP_DIR [STEPS] [-- kvr flags...]
#     BUILD_DIR      kvr build directory (has model/model_greedy_agreement)
#     LLAMA_CPP_DIR  llama.cpp source tree with a CMake build in build/ (include/, build/bin/)
#   Environment: MODEL (default: scripts/fetch-model.sh), THREADS (2).
set -euo pipefail
build=$1 llama=$2 steps=${3:-24}
shift $(( $# >= 3 ? 3 : $# ))
[ "${1:-}" = "--" ] && shift
here=$(cd "$(dirname "$0")/../.." && pwd)
model=${MODEL:-$(bash "$here/scripts/fetch-model.sh")}
threads=${THREADS:-2}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -c '
import json, sys
for p in json.load(open(sys.argv[1]))["prompts"]:
    print(" ".join(map(str, p["input_ids"])))' \
  "$here/model/tests/fixtures/logits/reference.json" > "$work/prompts"
g++ -O2 -std=c++17 -I "$llama/include" -I "$llama/ggml/include" \
  "$here/model/bench/llamacpp_greedy.cc" -o "$work/llamacpp_greedy" \
  -L "$llama/build/bin" -lllama -Wl,-rpath,"$llama/build/bin"
"$work/llamacpp_greedy" "$model" "$work/prompts" "$steps" "$threads" > "$work/reference" 2>/dev/null
"$build/model/model_greedy_agreement" --model "$model" --prompts "$work/prompts" \
  --reference "$work/reference" --threads "$threads" "$@"
