"""The capped prefetch pipeline on a real server: the cap bounds what decode steps load, deferred blocks
are counted, a failed background transfer fails only its own request, and requests the device tier
has no room for wait (SGLang's own admission) and then complete."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch

from sglang_oasis.server_process import ServerProcess, greedy_body

pytestmark = pytest.mark.server

NEW_TOKENS = 24
LAYERS, KV_HEADS, CAP = 4, 2, 1  # the tiny Qwen3; --oasis-top-k 4 --oasis-fetch-ratio 0.25
BLOCK_BYTES = 16 * 64 * 4 * 2  # tokens x head_dim x fp32 x (K and V)
# 768 tokens' KV bytes (3 MiB): the summaries of the 8192-token host tier take 2 MiB, each request's
# working sets (4 layers x 2 heads x 4 blocks) 0.25 MiB: 3 requests run at once.
DEVICE_REQUESTS = 3
INJECTED_FAILURE_PROMPT_LEN = 613


@pytest.fixture(scope="module")
def tiny_qwen3_capped_server(
    tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """Sparse on the tiny Qwen3 with K = 4 and a fetch cap of 1 block per head and step; decode-time
    transfers of requests with a 613-token prompt fail (injected). Module-scoped: CI's machine holds
    only so many servers at once."""
    args = [
        "--model-path", str(tiny_qwen3_dir), "--oasis-top-k", "4", "--oasis-fetch-ratio", "0.25",
        "--dtype", "float32", "--oasis-host-kv-tokens", "8192", "--oasis-device-kv-tokens", "768",
        "--oasis-recall-sample-every", "1", "--oasis-selector", "summaries",  # the 3 slots: the summaries' bytes
    ]  # fmt: skip
    env = {"SGLANG_OASIS_INJECT_TRANSFER_FAILURE": str(INJECTED_FAILURE_PROMPT_LEN)}
    log_path = tmp_path_factory.mktemp("logs") / "tiny-qwen3-capped.log"
    with ServerProcess(args, log_path=log_path, env=env) as server:
        yield server


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 49152, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate(server: ServerProcess, input_ids: list[int]) -> requests.Response:
    """The raw response: some of these requests are meant to fail."""
    return requests.post(server.url + "/generate", json=greedy_body(input_ids, NEW_TOKENS), timeout=300)


def test_the_fetch_cap_bounds_decode_loads(tiny_qwen3_capped_server: ServerProcess) -> None:
    before = tiny_qwen3_capped_server.oasis_stats()
    response = generate(tiny_qwen3_capped_server, prompt(333, seed=1))  # 20 full blocks, K = 4
    assert response.status_code == 200, response.text
    after = tiny_qwen3_capped_server.oasis_stats()
    steps = after["decode_steps"] - before["decode_steps"]
    assert steps == NEW_TOKENS - 1

    def grew(name: str) -> int:
        return after[name] - before[name]

    loaded, filled = grew("decode_blocks_loaded"), grew("blocks_just_filled")
    # At most CAP predicted blocks per (layer, KV head) and step from the host tier; the blocks that
    # fill up (two: 333 -> 356 tokens) come from the active blocks where selected. The selection drifts
    # by more than the cap, so some wait.
    assert filled == grew("blocks_from_active") <= LAYERS * KV_HEADS * 2
    assert 0 < loaded <= steps * LAYERS * KV_HEADS * CAP
    assert grew("blocks_deferred") > 0
    assert grew("scored_selections") == steps * LAYERS  # 20+ blocks, K = 4: every selection ranks
    assert grew("tail_bytes_host_to_device") == 0  # the active blocks hold every tail
    assert grew("decode_bytes_host_to_device") == loaded * BLOCK_BYTES
    assert grew("blocks_loaded") == loaded + LAYERS * KV_HEADS * 4  # + admission
    # Recall telemetry: K = 4 of 20+ blocks misses attention the whole context has (the tiny random
    # model's attention is spread out), and the telemetry's host reads are not in the counters above.
    assert grew("recall_samples") == steps * LAYERS * KV_HEADS and grew("telemetry_bytes") > 0
    assert after["recall_mean"] < 0.9 and 0 < after["recall_p10"] < 0.9
    assert set(after["recall_per_layer"]) == {str(layer) for layer in range(LAYERS)}
    per_step = after["per_decode_step"]
    assert per_step["bytes_host_to_device"] >= 0 and per_step["blocks_deferred"] > 0


def test_a_failed_transfer_fails_only_its_request(tiny_qwen3_capped_server: ServerProcess) -> None:
    before = tiny_qwen3_capped_server.oasis_stats()
    batch = [prompt(500, seed=2), prompt(INJECTED_FAILURE_PROMPT_LEN, seed=3), prompt(700, seed=4)]
    with ThreadPoolExecutor(len(batch)) as pool:
        responses = list(pool.map(lambda ids: generate(tiny_qwen3_capped_server, ids), batch))
    healthy = [responses[0], responses[2]]
    for response in healthy:
        assert response.status_code == 200, response.text
        assert len(response.json()["output_ids"]) == NEW_TOKENS
    failed = responses[1]
    assert failed.status_code == 500, failed.text
    assert "oasis: KV transfer for this request failed" in failed.text
    assert "injected transfer failure" in failed.text
    assert tiny_qwen3_capped_server.oasis_stats()["transfer_failures"] == before["transfer_failures"] + 1
    # Still serving, also the same prompt extended by one token (another length: no injected failure).
    again = generate(tiny_qwen3_capped_server, [*batch[1], 5])
    assert again.status_code == 200, again.text
    assert len(again.json()["output_ids"]) == NEW_TOKENS


def test_requests_beyond_the_device_tier_wait_and_then_complete(
    tiny_qwen3_capped_server: ServerProcess,
) -> None:
    """Eight requests at once on a device tier with working sets for three: SGLang runs at most three
    (its --max-running-requests is the tier's request slots), the others wait, and all complete."""
    stats = tiny_qwen3_capped_server.oasis_stats()
    assert stats["device_request_slots"] == DEVICE_REQUESTS
    assert stats["device_bytes_capacity"] <= 768 * LAYERS * KV_HEADS * 64 * 4 * 2
    info = requests.get(tiny_qwen3_capped_server.url + "/server_info", timeout=30).json()
    assert info["max_running_requests"] == DEVICE_REQUESTS
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], tiny_qwen3_capped_server.oasis_stats()["running_requests"])
            done.wait(0.1)

    sampler = threading.Thread(target=sample)
    sampler.start()
    batch = [prompt(200 + 37 * i, seed=20 + i) for i in range(8)]
    try:
        with ThreadPoolExecutor(len(batch)) as pool:
            responses = list(pool.map(lambda ids: generate(tiny_qwen3_capped_server, ids), batch))
    finally:
        done.set()
        sampler.join()
    for response in responses:
        assert response.status_code == 200, response.text
        assert len(response.json()["output_ids"]) == NEW_TOKENS
    assert 0 < peak[0] <= DEVICE_REQUESTS
