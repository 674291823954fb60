#!/usr/bin/env bash
# Install (first time only) and start prefill/decode disaggregation on this machine: a prefill server,
# a decode server (KV over the Mooncake transfer engine) and SGLang's router on --port (default 30000).
# Every argument goes to `python -m sglang_oasis.launch_pd` (its own options, then SGLang's and
# --oasis-* options for both servers).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(bash "$root/scripts/bootstrap.sh")
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
exec "$venv/bin/python" -m sglang_oasis.launch_pd "$@"
