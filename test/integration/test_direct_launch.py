"""The ``oasis`` backend in a server SGLang starts itself (``python -m sglang.launch_server
--attention-backend oasis``, on its CPU engine), not through ``python -m sglang_oasis.launch_server``: it
serves with the ``--oasis-*`` defaults, the hooks the backend needs (a malformed request's options are
refused with a 400, by hook 12), ``GET /oasis/stats``, and a running cap its device tier holds. Before,
it fell back to the defaults with no hooks and no cap: a malformed request was served as if valid, a
failure was never taken, and more requests than the tier holds failed a forward pass."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from sglang_oasis.server_process import ServerProcess, greedy_body

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def direct_server(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = [
        "--model-path", str(tiny_qwen3_dir), "--device", "cpu", "--attention-backend", "oasis",
        "--page-size", "16", "--max-total-tokens", "4096", "--dtype", "float32", "--sleep-on-idle",
    ]  # fmt: skip
    log = tmp_path_factory.mktemp("logs") / "direct-sglang.log"
    # No configuration: a unit test in the same pytest may have left one in this process's environment.
    env = {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_OASIS_CONFIG": ""}
    server = ServerProcess(args, log, env, module="sglang.launch_server")
    with server as started:
        yield started


@pytest.fixture(scope="module")
def dense_server(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Dense SGLang on the same model, through the launcher (this module runs in the unit lane, which
    shares no session server)."""
    args = ["--model-path", str(tiny_qwen3_dir), "--oasis-mode", "dense", "--dtype", "float32",
            "--max-total-tokens", "4096"]  # fmt: skip
    with ServerProcess(args, tmp_path_factory.mktemp("logs") / "direct-dense.log") as server:
        yield server


def test_sglang_started_directly_serves_sparse_with_the_hooks(
    direct_server: ServerProcess, dense_server: ServerProcess
) -> None:
    ids = [
        (i * 7919) % 30000 + 100 for i in range(240)
    ]  # 15 full blocks, 16 decoded: the default K = 16 covers
    assert direct_server.generate(ids, 16)["output_ids"] == dense_server.generate(ids, 16)["output_ids"]
    stats = direct_server.oasis_stats()
    assert stats["mode"] == "sparse" and stats["decode_steps"] > 0 and stats["device_request_slots"] > 0
    body = greedy_body(ids, 4)
    body["sampling_params"]["custom_params"] = ["oasis_top_k", 3]  # took the server down once
    status, text = direct_server.post("/generate", body)
    assert status == 400 and "custom_params: must be a JSON object" in text, (status, text)
    assert (
        direct_server.alive() and requests.get(direct_server.url + "/health", timeout=30).status_code == 200
    )
    log = direct_server.log_path.read_text(errors="replace")
    assert "started without python -m sglang_oasis.launch_server" in log
