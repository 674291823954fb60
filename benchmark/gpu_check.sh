#!/usr/bin/env bash
# The GPU check of sgl-kernel-oasis, for one CUDA machine (written for an H200, never run on one yet;
# its timeouts sum to 540 s, within the device tool's 600 s call):
#   1. the kernel tests (test/unit/test_triton_kernels.py) on the GPU, fp32/fp16/bf16, and the prefetch
#      pipeline's CUDA contract (side stream, events; test/unit/test_prefetch_worker.py -k cuda);
#   2. benchmark/gpu_check.py: each kernel against its byte floor (share of the measured copy
#      bandwidth), a dense vs sparse decode step of a Qwen3-8B-shaped layer stack at 16K and 32K, and
#      the runtime's own step in that stack under a CUDA graph (gpu_step.py: DeviceTier, GraphedStep,
#      decode_layer; --step-batches 1 8 32).
# Needs only torch, triton and pytest (not SGLang). Logs and JSON go to $OUT (default /tmp/gpu_check).
#   bash benchmark/gpu_check.sh [gpu_check.py options, e.g. --batch 16 --contexts 16384 32768]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/sgl-kernel-oasis/python:$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader || true
"$python" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
status=0
# --noconftest: test/conftest.py sets up SGLang servers, which this machine need not have.
timeout 150 "$python" -m pytest -q -p no:cacheprovider --noconftest -o addopts="" \
    test/unit/test_triton_kernels.py 2>&1 | tee "$out/kernel_tests.log" | tail -15 || status=1
timeout 60 "$python" -m pytest -q -p no:cacheprovider --noconftest -o addopts="" -k cuda \
    test/unit/test_prefetch_worker.py 2>&1 | tee "$out/pipeline_tests.log" | tail -5 || status=1
timeout 330 "$python" benchmark/gpu_check.py --json "$out/gpu_check.json" "$@" 2>&1 | tee "$out/gpu_check.log" || status=1
exit $status
