"""Start-up errors: a bad SGLang option stops the launcher with a message naming it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sglang_oasis.testing.server_process import child_env

pytestmark = pytest.mark.server


def test_bad_sglang_option_exits_naming_it() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sglang_oasis.launch_server", "--model-path", "/nonexistent", "--no-such-flag", "3"],
        capture_output=True, text=True, timeout=300, env=child_env(),
    )  # fmt: skip
    assert result.returncode != 0
    assert "--no-such-flag" in result.stderr
