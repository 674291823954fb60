#!/usr/bin/env bash
# Install (first time only), lint, type-check and run the test suite. Extra arguments go to pytest;
# without any, the whole suite runs in two lanes at once (scripts/run_lanes.py: one per core).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(bash "$root/scripts/bootstrap.sh")
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
cd "$root"
echo "[sglang-oasis] ruff and mypy" >&2
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
"$venv/bin/mypy"
# The default model is a test fixture too: prepare it here so its one-time conversion shows progress.
"$venv/bin/python" -m sglang_oasis.models.default_model >/dev/null
if [ $# -eq 0 ]; then
  exec "$venv/bin/python" scripts/run_lanes.py
fi
exec "$venv/bin/python" -m pytest "$@"
