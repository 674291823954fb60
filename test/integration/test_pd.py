"""Prefill/decode disaggregation on CPU through ``python -m sglang_oasis.launch_pd``: real SGLang prefill
and decode servers (sparse mode) exchanging KV over the real Mooncake transfer engine (TCP on
127.0.0.1), behind SGLang's router. The tests run in file order; the last one kills the prefill server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sglang_oasis.testing.server_process import GenerateError, ServerProcess, child_env, free_port

PROMPTS = {"short": 300, "long": 1100}  # tokens; K = 128 blocks covers both


def prompt(tokens: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 30000 + 200 for i in range(tokens)]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as response:
            return bool(response.status == 200)
    except OSError:
        return False


class PDLaunch:
    """``launch_pd`` in its own process group; its ready file names the three processes."""

    def __init__(self, args: list[str], log_dir: Path) -> None:
        self.ready_file = log_dir / "ready.json"
        self.launcher_log = log_dir / "launcher.log"
        log = open(self.launcher_log, "wb")  # noqa: SIM115 - owned by the child
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sglang_oasis.launch_pd", "--port", str(free_port()), "--log-dir", str(log_dir),
             "--ready-file", str(self.ready_file), *args],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env=child_env({"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60"}),
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + 600
        while not self.ready_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"launch_pd did not come up:\n{self.launcher_log.read_text()[-4000:]}")
            time.sleep(1)
        self.info: dict[str, Any] = json.loads(self.ready_file.read_text())
        self.router = self._client("router")
        self.decode = self._client("decode")

    def _client(self, name: str) -> ServerProcess:
        """A ServerProcess used only as an HTTP client of an already running process."""
        port = int(self.info[name]["url"].rsplit(":", 1)[1])
        return ServerProcess([], Path(self.info[name]["log"]), port=port)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # the launcher stops its three children
            self.process.wait(timeout=300)


@pytest.fixture(scope="module")
def pd(smollm2_6l_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDLaunch]:
    launch = PDLaunch(
        [
            "--model-path",
            str(smollm2_6l_dir),
            "--dtype",
            "float32",
            "--oasis-host-kv-tokens",
            "16384",
            "--oasis-device-kv-tokens",
            "16384",
            "--router-args=--disable-retries --disable-circuit-breaker",
            "--prefill-args=--enable-metrics",  # sglang:kv_transfer_total_mb: bytes sent per request
            "--decode-args=--disaggregation-decode-enable-radix-cache",
        ],
        tmp_path_factory.mktemp("pd"),
    )
    try:
        yield launch
    finally:
        launch.stop()


def test_pd_sparse_serving_equals_dense(pd: PDLaunch, smollm2_dense_server: ServerProcess) -> None:
    before = pd.decode.oasis_stats()
    for seed, tokens in enumerate(PROMPTS.values()):
        ids = prompt(tokens, seed)
        got = pd.router.generate(ids, 24)["output_ids"]
        assert got == smollm2_dense_server.generate(ids, 24)["output_ids"], f"{tokens}-token prompt"
    after = pd.decode.oasis_stats()
    # the decode node served them sparsely: the KV arrived over Mooncake, no extend ran there
    assert after["arrived_requests"] - before["arrived_requests"] >= len(PROMPTS)
    assert after["decode_steps"] > before["decode_steps"]
    assert after["blocks_loaded"] > before["blocks_loaded"]


def transferred_mb(pd: PDLaunch) -> tuple[float, int]:
    """(sum, count) of the prefill server's ``sglang:kv_transfer_total_mb`` histogram."""
    with urllib.request.urlopen(pd.info["prefill"]["url"] + "/metrics", timeout=30) as response:
        text = response.read().decode()
    total, count = 0.0, 0
    for line in text.splitlines():
        if line.startswith("sglang:kv_transfer_total_mb_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("sglang:kv_transfer_total_mb_count"):
            count += int(float(line.rsplit(" ", 1)[1]))
    return total, count


def transfer_of_next_request(pd: PDLaunch, ids: list[int], reference: ServerProcess) -> float:
    """MB the prefill server sent for one request (whose output must equal the reference's)."""
    total, count = transferred_mb(pd)
    assert pd.router.generate(ids, 8)["output_ids"] == reference.generate(ids, 8)["output_ids"]
    deadline = time.monotonic() + 60
    while transferred_mb(pd)[1] == count:  # recorded once the prefill side sees the transfer done
        assert time.monotonic() < deadline, "no transfer recorded"
        time.sleep(0.5)
    return transferred_mb(pd)[0] - total


def test_a_prefix_the_decode_radix_cache_holds_is_not_transferred_again(
    pd: PDLaunch, smollm2_dense_server: ServerProcess
) -> None:
    shared = prompt(800, 11)
    first = transfer_of_next_request(pd, [*shared, *prompt(40, 12)], smollm2_dense_server)
    second = transfer_of_next_request(pd, [*shared, *prompt(40, 13)], smollm2_dense_server)
    # 840 tokens the first time; the second sends only what follows the 800 shared ones (whole pages)
    assert first > 0 and second < first / 4, (first, second)


def test_openai_chat_through_the_router(pd: PDLaunch, smollm2_dense_server: ServerProcess) -> None:
    body = {"model": "default", "temperature": 0, "max_tokens": 12,
            "messages": [{"role": "user", "content": "Name three colours."}]}  # fmt: skip
    status, text = pd.router.post("/v1/chat/completions", body)
    assert status == 200, text
    _, reference = smollm2_dense_server.post("/v1/chat/completions", body)
    content = json.loads(text)["choices"][0]["message"]["content"]
    assert content == json.loads(reference)["choices"][0]["message"]["content"]


def test_killing_the_prefill_server_fails_only_requests_that_need_it(
    pd: PDLaunch, smollm2_dense_server: ServerProcess
) -> None:
    """A request already decoding finishes (its KV is on the decode node); a new request fails with an
    error instead of hanging; the launcher restarts the prefill server and the same decode server serves
    new requests correctly."""
    ids = prompt(PROMPTS["long"], 7)
    expected = smollm2_dense_server.generate(ids, 96)["output_ids"]
    result: dict[str, Any] = {}

    def in_flight() -> None:
        try:
            result["ids"] = pd.router.generate(ids, 96)["output_ids"]
        except Exception as error:  # reported below
            result["error"] = error

    steps = pd.decode.oasis_stats()["decode_steps"]
    thread = threading.Thread(target=in_flight)
    thread.start()
    deadline = time.monotonic() + 120
    while pd.decode.oasis_stats()["decode_steps"] < steps + 4 and time.monotonic() < deadline:
        time.sleep(0.2)  # until the request is decoding on the decode node
    os.killpg(int(pd.info["prefill"]["pid"]), signal.SIGKILL)
    thread.join(timeout=300)

    assert result.get("ids") == expected, f"the request already decoding must finish: {result}"
    with pytest.raises(GenerateError):  # no prefill server: an error, not a hang
        pd.router.generate(prompt(200, 8), 8, timeout_s=120)
    assert healthy(pd.decode.url)

    # The launcher restarts the prefill server (a request routed while it is down waits on the decode
    # node for SGLANG_DISAGGREGATION_WAITING_TIMEOUT, so wait until it is up).
    deadline = time.monotonic() + 300
    while not healthy(pd.info["prefill"]["url"]):
        assert time.monotonic() < deadline, "the prefill server was not restarted"
        time.sleep(2)
    later = prompt(PROMPTS["short"], 9)
    while True:
        try:
            got = pd.router.generate(later, 16, timeout_s=120)["output_ids"]
            break
        except (GenerateError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(5)
    assert got == smollm2_dense_server.generate(later, 16)["output_ids"]
    assert "restarting it" in pd.launcher_log.read_text()
