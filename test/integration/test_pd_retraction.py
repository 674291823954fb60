"""A PD decode node that retracts running requests (SGLang's own test switch, every 15 forward passes):
each retracted request is backed up with its still-remote blocks read first (hook 7,
``backup_kv_cache``), keeps its selection state, and resumes on the path it was on, so every answer
equals the same sparse server's without PD. A decode node without hook 7's registration would resume
requests with a dense first step and a fresh selection (and blocks still on the prefill node missing
from the backup): answers differ and nothing is counted as resumed. The tiny Qwen3, K = 4 blocks."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from sglang_oasis.server_process import ServerProcess
from sglang_oasis_testing.pd_launch import PDLaunch

pytestmark = pytest.mark.server

SPARSE = ["--dtype", "float32", "--oasis-top-k", "4", "--oasis-host-kv-tokens", "4096",
          "--oasis-device-kv-tokens", "16384"]  # fmt: skip
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def retracting_pd(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDLaunch]:
    env = {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "15"}
    launch = PDLaunch(
        ["--model-path", str(tiny_qwen3_dir), *SPARSE], tmp_path_factory.mktemp("pd-retract"), env
    )
    try:
        yield launch
    finally:
        launch.stop()


@pytest.fixture(scope="module")
def reference(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The same sparse configuration without PD, and without retractions."""
    log = tmp_path_factory.mktemp("logs") / "pd-retraction-reference.log"
    with ServerProcess(["--model-path", str(tiny_qwen3_dir), *SPARSE], log) as server:
        yield server


def test_retracted_pd_requests_resume_where_they_were(
    retracting_pd: PDLaunch, reference: ServerProcess
) -> None:
    gen = torch.Generator().manual_seed(17)
    prompts = [torch.randint(3, 30000, (n,), generator=gen).tolist() for n in (200, 333, 450, 517, 600, 777)]
    before = retracting_pd.decode.oasis_stats()
    with ThreadPoolExecutor(len(prompts)) as pool:  # at once: several decode together, and are retracted
        got = list(
            pool.map(lambda ids: retracting_pd.router.generate(ids, NEW_TOKENS)["output_ids"], prompts)
        )
    after = retracting_pd.decode.oasis_stats()
    retracted = after["retracted_requests"] - before["retracted_requests"]
    resumed = after["resumed_requests"] - before["resumed_requests"]
    assert retracted > 0 and resumed == retracted, (retracted, resumed)
    assert after["remote_requests"] - before["remote_requests"] == len(prompts)  # all staged, partly read
    assert got == [reference.generate(ids, NEW_TOKENS)["output_ids"] for ids in prompts]
