"""Start-up: a bad SGLang option stops the launcher with a message naming it; the host tier's default size."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_oasis.memory.host_tier import available_host_memory, kv_footprint
from sglang_oasis.server_process import ServerProcess, child_env, greedy_body

pytestmark = pytest.mark.server


def test_bad_sglang_option_exits_naming_it() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sglang_oasis.launch_server", "--model-path", "/nonexistent", "--no-such-flag", "3"],
        capture_output=True, text=True, timeout=300, env=child_env(),
    )  # fmt: skip
    assert result.returncode != 0
    assert "--no-such-flag" in result.stderr


def test_host_tier_is_sized_from_the_available_ram(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    """Without --oasis-host-kv-tokens or --max-total-tokens, sparse mode's host tier (SGLang's KV pool) is
    the share --oasis-host-memory-fraction of the available RAM over the model's KV bytes per token. The
    share asked for is one that holds ~4,096 tokens of the tiny Qwen3 now; the RAM available to the
    launcher a moment later differs a little, so the size must match what the launcher announced."""
    footprint = kv_footprint(tiny_qwen3_dir, dtype="float32")
    assert footprint is not None and footprint.bytes_per_token == 4 * 2 * 64 * 2 * 4
    fraction = 4096 * footprint.bytes_per_token / available_host_memory()
    args = [
        "--model-path",
        str(tiny_qwen3_dir),
        "--dtype",
        "float32",
        "--oasis-host-memory-fraction",
        str(fraction),
    ]
    with ServerProcess(args, log_path=tmp_path / "ram-sized.log") as server:  # __enter__ starts it
        announced = re.search(
            r"host KV tier: (\d+) tokens, [\d.]+ GiB at 4096 KV bytes per token", server.log_tail(10**6)
        )
        assert announced, server.log_tail()
        tokens = int(announced.group(1))
        assert 2048 <= tokens <= 8192 and tokens % 16 == 0
        assert server.oasis_stats()["host_tokens_capacity"] == tokens
        assert len(server.generate(list(range(100, 400)), 4)["output_ids"]) == 4
        status, text = server.post("/generate", greedy_body(list(range(100, 100 + tokens + 64)), 4))
        assert status == 400 and "exceeds the maximum allowed length" in text  # longer than the tier: alone
        assert len(server.generate(list(range(100, 400)), 4)["output_ids"]) == 4
    # stopped, not crashed: SGLang skipped its crash diagnostics (ServerProcess: 5 s asleep at every stop)
    stopped = (tmp_path / "ram-sized.log").read_text()
    assert "SIGTERM received" in stopped and "before crash diagnostics" not in stopped, stopped[-2000:]
