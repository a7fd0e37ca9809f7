#!/usr/bin/env bash
# The main job: builds kvr (installing what it needs) and serves SmolLM2-135M-Instruct on the CPU,
# streaming an answer and ending with a throughput summary.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
KVR_BUILD_TARGETS=kvr bash scripts/build.sh
build="${KVR_BUILD_DIR:-$root/build}"
model="$(bash scripts/fetch-model.sh)"
"$build/tools/kvr" generate --model "$model" --chat --max-tokens 96 \
  --prompt "${KVR_DEMO_PROMPT:-Explain in three sentences why long-context LLM serving keeps the KV cache off the GPU.}"
