"""benchmark/gpu_check.py at toy sizes (on CPU under Triton's interpreter): every kernel it times is first
checked against its torch reference on the same inputs, the decode step runs both ways, and the runtime's
prefetch pipeline runs inside the step (sync and async) with every working-set copy checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from sglang_oasis.server_process import child_env

REPO = Path(__file__).resolve().parents[2]


def gpu_check(option: str, out: Path) -> tuple[subprocess.CompletedProcess[str], dict]:
    """``benchmark/gpu_check.py option --json out`` in a child: its output and its report."""
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmark" / "gpu_check.py"), option, "--json", str(out)],
        env=child_env({"PYTHONPATH": str(REPO / "sgl-kernel-oasis" / "python")}),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result, json.loads(out.read_text())


def test_gpu_check_smoke(tmp_path: Path) -> None:
    result, report = gpu_check("--smoke", tmp_path / "gpu_check.json")
    kernels = {row["kernel"]: row for row in report["kernels"]}
    assert {"summary update (prefill)", "block scoring (2 rows)", "sparse attention (2 rows)"} <= set(kernels)
    for row in kernels.values():
        assert row["rel_err"] < 1e-3, row  # the Triton kernel computed what its reference computes
        assert row["bytes"] > 0 and row["triton_ms"] > 0
    (step,) = report["decode_steps"]
    assert step["dense_ms"] > 0 and step["sparse_ms"] > 0
    assert "sparse attention" in result.stdout  # the table was printed
    shape = report["shape"]
    most = shape["layers"] * 2 * shape["kv_heads"] * report["pipeline"][0]["cap_per_head"]  # batch 2
    rows = {row["mode"]: row for row in report["pipeline"]}
    assert set(rows) == {"none", "sync", "async"}
    assert all(row["copies_ok"] for row in rows.values()), rows  # every slot holds its host block
    assert rows["none"]["loads_per_step"] == 0
    for mode in ("sync", "async"):  # random predicting queries: capped loads every step, the rest deferred
        assert 0 < rows[mode]["loads_per_step"] <= most and rows[mode]["deferred_per_step"] > 0, rows[mode]
    # The runtime's captured step (gpu_step.py) in the stack: replayed = eager, K covering = SDPA, and the
    # capped copies of random selections each step
    captured = report["captured_step"]
    checks = captured["checks"]
    assert checks["replay_equals_eager"] and checks["state_equal"], checks
    assert checks["covering_rel_err"] < 1e-3, checks
    assert [(r["context"], r["batch"]) for r in captured["rows"]] == [(128, 1), (128, 2)]
    for row in captured["rows"]:
        assert row["eager_ms"] > 0 and row["dense_ms"] > 0 and row["host_blocks_per_step"] > 0, row
    assert "captured step" in result.stdout


def test_gpu_check_on_a_fake_cuda_device(tmp_path: Path) -> None:
    """``gpu_check.py --fake-cuda``: the GPU check's own step (the runtime's ``DeviceTier``, page-locked
    host tier and ``GraphedStep``) at toy sizes on a fake CUDA device, where a device mismatch, or a sync
    or copy inside a replay, fails the run; its replays equal eager passes on plans of their own."""
    captured = gpu_check("--fake-cuda", tmp_path / "fake.json")[1]["captured_step"]
    checks = captured["checks"]
    assert checks["replay_equals_eager"] and checks["state_equal"] and checks["host_tier_device_view"], checks
    assert checks["covering_rel_err"] < 1e-3
    assert [row["batch"] for row in captured["rows"]] == [1, 2]
    assert all(row["host_blocks_per_step"] > 0 and row["pass_ms"] > 0 for row in captured["rows"])


def test_gpu_check_sh_fits_one_device_call() -> None:
    """The device tool runs one command for at most 600 s: the script's timeouts sum to 540 s."""
    import re

    script = (REPO / "benchmark" / "gpu_check.sh").read_text()
    assert sum(int(t) for t in re.findall(r"^timeout (\d+) ", script, flags=re.M)) <= 540
