#!/usr/bin/env bash
# CTest entry of validate_manifests.py: runs it with the test venv's Python (KVR_TEST_PYTHON,
# set by scripts/test.sh; else the default venv of scripts/python-env.sh; else python3), which
# has kubernetes-validate from scripts/requirements-test.txt.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python="${KVR_TEST_PYTHON:-}"
if [ -z "$python" ]; then
  venv="${KVR_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvr}/venv/bin/python"
  if [ -x "$venv" ]; then python="$venv"; else python=python3; fi
fi
exec "$python" "$here/validate_manifests.py" "$@"
