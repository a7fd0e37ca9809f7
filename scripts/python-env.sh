#!/usr/bin/env bash
# Creates (once) the Python virtual environment that reference checks in the tests use: the
# `gguf` package is the format authors' reader that our dequantisation is compared against.
# Prints the venv's python on stdout. Safe to run twice.
set -euo pipefail
cache="${KVR_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvr}"
venv="$cache/venv"
requirements="$(cd "$(dirname "$0")" && pwd)/requirements-test.txt"
stamp="$venv/.requirements.sha256"
want=$(sha256sum "$requirements" | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "python-env: creating $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$requirements" >&2
  echo "$want" > "$stamp"
fi
echo "$venv/bin/python"
