"""Sparse mode with K covering every block gives exactly dense greedy output (fp32), under concurrency."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch

from sglang_oasis.server_process import ServerProcess, greedy_body

pytestmark = pytest.mark.server

# Several lengths, most not multiples of the 16-token block, sent concurrently.
PROMPT_LENGTHS = [5, 16, 17, 100, 333, 1000]
NEW_TOKENS = 24


def prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def greedy(server: ServerProcess, input_ids: list[int]) -> list[int]:
    return list(server.generate(input_ids, NEW_TOKENS)["output_ids"])


def concurrently(server: ServerProcess, batch: list[list[int]]) -> list[list[int]]:
    with ThreadPoolExecutor(len(batch)) as pool:
        return list(pool.map(lambda ids: greedy(server, ids), batch))


def test_tiny_qwen3_sparse_equals_dense(
    tiny_qwen3_server: ServerProcess, tiny_qwen3_sparse_server: ServerProcess
) -> None:
    batch = prompts(seed=1)
    assert concurrently(tiny_qwen3_sparse_server, batch) == concurrently(tiny_qwen3_server, batch)


def test_smollm2_sparse_equals_dense(
    smollm2_dense_server: ServerProcess, smollm2_sparse_server: ServerProcess
) -> None:
    batch = prompts(seed=2)
    assert concurrently(smollm2_sparse_server, batch) == concurrently(smollm2_dense_server, batch)


@pytest.fixture(scope="module")
def recall_target_server(
    tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """K = 2 blocks with a recall target of 0.99 that may grow a layer's working set to 64 blocks (every
    block of these prompts); the tiny random model's attention is nearly uniform, so the target needs them."""
    args = [
        "--model-path", str(tiny_qwen3_dir), "--oasis-top-k", "2", "--oasis-recall-target", "0.99",
        "--oasis-recall-max-top-k", "64", "--oasis-recall-sample-every", "4", "--dtype", "float32",
        "--oasis-host-kv-tokens", "6144", "--oasis-device-kv-tokens", "16384",
    ]  # fmt: skip
    with ServerProcess(args, log_path=tmp_path_factory.mktemp("logs") / "recall-target.log") as server:
        yield server


def test_a_recall_target_grows_working_sets_until_the_output_is_dense(
    tiny_qwen3_server: ServerProcess, recall_target_server: ServerProcess
) -> None:
    """Issue 27: with K = 2 of up to 62 full blocks, the target sizes each layer's first working set from
    the prefill window's attention (and resamples every 4 decode steps): every block, here, so greedy
    output equals dense token for token, concurrently, and the stats show the growth."""
    before = recall_target_server.oasis_stats()
    batch = prompts(seed=1)
    assert concurrently(recall_target_server, batch) == concurrently(tiny_qwen3_server, batch)
    after = recall_target_server.oasis_stats()
    assert after["recall_target_grows"] > before["recall_target_grows"]
    samples = after["recall_samples"] - before["recall_samples"]
    assert samples > 0
    assert (after["recall_sum_ppm"] - before["recall_sum_ppm"]) / samples / 1e6 == pytest.approx(
        1.0, abs=1e-5
    )
    assert after["recall_below_target"] == before["recall_below_target"]  # held from the first step on


def with_options(server: ServerProcess, input_ids: list[int], options: dict) -> tuple[int, str]:
    body = greedy_body(input_ids, NEW_TOKENS)
    body["sampling_params"]["custom_params"] = options
    return server.post("/generate", body)


def test_a_request_sets_its_own_top_k_and_recall_target(
    tiny_qwen3_server: ServerProcess, recall_target_server: ServerProcess
) -> None:
    """``custom_params`` (``attention/request_options.py``) on the recall-target server (K = 2, target
    0.99, up to 64 blocks): requests turning the target off and asking for K = 64 (every block) answer
    exactly as dense, concurrently, and nothing grows; requests turning it off at the server's K = 2 get
    no growth and miss attention; a request asking for more than the server reserves, or for an unknown
    option, fails alone with a message naming it, and the server goes on serving."""
    batch = prompts(seed=4)
    covering = {"oasis_top_k": 64, "oasis_recall_target": 0}
    before = recall_target_server.oasis_stats()
    with ThreadPoolExecutor(len(batch)) as pool:
        replies = list(pool.map(lambda ids: with_options(recall_target_server, ids, covering), batch))
    assert all(status == 200 for status, _ in replies), replies
    got = [json.loads(text)["output_ids"] for _, text in replies]
    assert got == concurrently(tiny_qwen3_server, batch)
    middle = recall_target_server.oasis_stats()
    assert middle["recall_target_grows"] == before["recall_target_grows"]

    for ids in batch[-2:]:  # 333 and 1000 tokens: 20 and 62 full blocks, K = 2
        status, text = with_options(recall_target_server, ids, {"oasis_recall_target": 0})
        assert status == 200, text
    after = recall_target_server.oasis_stats()
    assert after["recall_target_grows"] == middle["recall_target_grows"]
    samples = after["recall_samples"] - middle["recall_samples"]
    assert samples > 0 and (after["recall_sum_ppm"] - middle["recall_sum_ppm"]) / samples < 0.99e6

    for options, named in (({"oasis_top_k": 65}, "oasis_top_k=65: must be an integer from 1 to 64"),
                           ({"oasis_topk": 8}, "unknown oasis_topk")):  # fmt: skip
        status, text = with_options(recall_target_server, batch[3], options)
        assert status != 200 and named in text, (status, text)
    assert greedy(recall_target_server, batch[0]) == greedy(tiny_qwen3_server, batch[0])


def test_stats_count_the_sparse_work(tiny_qwen3_sparse_server: ServerProcess) -> None:
    before = tiny_qwen3_sparse_server.oasis_stats()
    assert before["mode"] == "sparse"
    prompt = prompts(seed=3)[4]  # 333 tokens: 20 full blocks
    greedy(tiny_qwen3_sparse_server, prompt)
    after = tiny_qwen3_sparse_server.oasis_stats()
    assert after["requests"] == before["requests"] + 1
    assert after["decode_steps"] - before["decode_steps"] == NEW_TOKENS - 1

    def grew(name: str) -> int:
        return after[name] - before[name]

    # Prefill (admission) loads every full block of every layer and KV head (4 layers x 2 heads x 20
    # blocks) from the host tier. The two blocks that fill up during decode (356 tokens: 22 full blocks)
    # are copied from the active blocks on the device, which also hold each step's tail (the tokens
    # after the covered blocks): K covers everything, so decode reads nothing from the host tier.
    layers, heads, token_bytes = 4, 2, 64 * 4 * 2  # head_dim x fp32 x (K and V)
    bytes_per_block = 16 * token_bytes
    assert grew("blocks_loaded") == layers * heads * 20
    assert grew("blocks_just_filled") == grew("blocks_from_active") == layers * heads * 2
    assert grew("decode_blocks_loaded") == grew("blocks_deferred") == 0
    assert grew("tail_bytes_host_to_device") == grew("decode_bytes_host_to_device") == 0
    assert grew("bytes_host_to_device") == layers * heads * 20 * bytes_per_block
    assert grew("scored_selections") == 0  # K covers every block: nothing to rank
    assert grew("stage_select_us") > 0 and grew("stage_transfer_us") > 0
    assert after["host_tokens_capacity"] == 6144
    # The device tier: 16384 tokens' KV bytes, the summaries of the 6144-token host tier, whole
    # requests' working sets of 64 blocks of 16 per layer and KV head and active blocks of 16 tokens
    # (the running cap).
    budget = 16384 * layers * heads * token_bytes
    assert after["device_bytes_capacity"] <= budget
    summaries = (
        2 * layers * (6144 // 16 + 2) * heads * 64 * 4
    )  # min/max (the pages' epochs: host bookkeeping)
    index = layers * heads * (2 * 64 + 16) * 8 + 4 * layers * 8  # head-wise map, pins; covered, top-K, active
    recall = layers * 8 + layers * heads * 2 * 4  # the recall probe's streak and last sample (float32)
    per_request = layers * heads * 65 * bytes_per_block + index + recall  # 64 working-set blocks, 1 active
    assert after["device_request_slots"] == (budget - summaries) // per_request == 15
    assert after["device_bytes_capacity"] == summaries + 15 * per_request


def test_recall_telemetry_reports_full_recall_when_k_covers_every_block(
    tiny_qwen3_sparse_server: ServerProcess,
) -> None:
    before = tiny_qwen3_sparse_server.oasis_stats()
    greedy(tiny_qwen3_sparse_server, prompts(seed=5)[3])  # 100 tokens
    after = tiny_qwen3_sparse_server.oasis_stats()
    layers, heads = 4, 2
    assert after["recall_samples"] - before["recall_samples"] == (NEW_TOKENS - 1) * layers * heads
    assert after["telemetry_bytes"] > before["telemetry_bytes"]

    def mean(name: str) -> float:  # over this request's samples (the window also holds earlier tests')
        return (after[name] - before[name]) / (after["recall_samples"] - before["recall_samples"]) / 1e6

    assert mean("recall_sum_ppm") == pytest.approx(1.0, abs=1e-5)
    assert mean("lookahead_agreement_sum_ppm") == pytest.approx(1.0, abs=1e-5)
    assert set(after["recall_per_layer"]) == {"0", "1", "2", "3"}
    assert 0 < after["recall_p10"] <= 1 and 0 < after["recall_mean"] <= 1  # the window: all tests' samples


def test_gauges_return_to_zero_when_requests_end(tiny_qwen3_sparse_server: ServerProcess) -> None:
    concurrently(tiny_qwen3_sparse_server, prompts(seed=4)[:3])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        current = tiny_qwen3_sparse_server.oasis_stats()
        if current["running_requests"] == 0 and current["device_working_set_tokens"] == 0:
            break
        time.sleep(0.2)
    assert current["running_requests"] == 0
    assert current["device_working_set_tokens"] == 0


def test_counters_are_exported_to_prometheus(tiny_qwen3_sparse_server: ServerProcess) -> None:
    greedy(tiny_qwen3_sparse_server, prompts(seed=5)[1])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the scheduler publishes every 0.5 s
        metrics = requests.get(tiny_qwen3_sparse_server.url + "/metrics", timeout=30).text
        exported = {
            line.split("{")[0].split(" ")[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("sglang_oasis:")
        }
        if exported.get("sglang_oasis:requests", 0) >= 1:
            break
        time.sleep(0.3)
    current = tiny_qwen3_sparse_server.oasis_stats()
    assert exported["sglang_oasis:requests"] >= 1
    assert exported["sglang_oasis:host_tokens_capacity"] == current["host_tokens_capacity"]
    assert exported["sglang_oasis:blocks_loaded"] > 0
    # Recall per layer (this server samples every decode step): one labelled series per sampled layer.
    layers = {
        line.split('layer="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("sglang_oasis:recall_layer{")
    }
    assert set(layers) == set(current["recall_per_layer"]) == {"0", "1", "2", "3"}, layers
    assert all(0 < value <= 1 for value in layers.values())


def test_request_larger_than_the_host_tier_fails_alone(tiny_qwen3_sparse_server: ServerProcess) -> None:
    too_long = torch.randint(3, 49152, (7000,), generator=torch.Generator().manual_seed(6)).tolist()
    body = {"input_ids": too_long, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    response = requests.post(tiny_qwen3_sparse_server.url + "/generate", json=body, timeout=300)
    assert response.status_code == 400
    assert "exceeds the maximum allowed length" in response.text
    assert len(greedy(tiny_qwen3_sparse_server, prompts(seed=7)[2])) == NEW_TOKENS  # still serving


# Malformed per-request options, each with what the 400 must name: wrong shapes of custom_params, wrong
# types, nesting, out-of-range values, unknown oasis_* keys, and a target on a server with no room to grow.
BAD_OPTIONS: list[tuple[object, str]] = [
    (["oasis_top_k", 3], "custom_params: must be a JSON object"),
    ("oasis_top_k=3", "custom_params: must be a JSON object"),
    (3, "custom_params: must be a JSON object"),
    ({"oasis_top_k": "abc"}, "oasis_top_k='abc'"),
    ({"oasis_top_k": 3.5}, "oasis_top_k=3.5"),
    ({"oasis_top_k": True}, "oasis_top_k=True"),
    ({"oasis_top_k": 0}, "oasis_top_k=0"),
    ({"oasis_top_k": -4}, "oasis_top_k=-4"),
    ({"oasis_top_k": 10**12}, "oasis_top_k=1000000000000"),
    ({"oasis_top_k": [3]}, "oasis_top_k=[3]"),
    ({"oasis_top_k": {"value": 3}}, "oasis_top_k={'value': 3}"),
    ({"oasis_top_k": None}, "oasis_top_k=None"),
    ({"oasis_recall_target": "0.5"}, "oasis_recall_target='0.5'"),
    ({"oasis_recall_target": 1}, "oasis_recall_target=1"),
    ({"oasis_recall_target": -0.5}, "oasis_recall_target=-0.5"),
    (
        {"oasis_recall_target": 0.9, "oasis_top_k": 64},
        "oasis_recall_target=0.9: the working sets cannot grow",
    ),
    ({"oasis_top_k": 8, "oasis_topk": 8}, "unknown oasis_topk"),
    ({"oasis_": 1}, "unknown oasis_"),
    ({"oasis_top_k": 8, "nested": {"oasis_top_k": "x"}, "oasis_x": {"y": [1]}}, "unknown oasis_x"),
]


def test_malformed_request_options_fail_alone_with_400(tiny_qwen3_sparse_server: ServerProcess) -> None:
    """Each malformed ``custom_params`` answers HTTP 400 naming what is wrong, through ``/generate`` and
    the OpenAI API (hook 12, before the request is queued); the server stays up and serves after each, and
    a valid request with options (and keys that are not ``oasis_*``) is served as before."""
    server = tiny_qwen3_sparse_server
    ids = prompts(seed=5)[3]  # 100 tokens
    expected = greedy(server, ids)
    for options, named in BAD_OPTIONS:
        status, text = with_options(server, ids, options)  # type: ignore[arg-type]
        assert status == 400 and named in text, (options, status, text)
        assert server.alive() and requests.get(server.url + "/health", timeout=30).status_code == 200
    for options, named in BAD_OPTIONS[3:6]:  # the OpenAI API: custom_params at the top level
        body = {"model": "default", "prompt": "Hello", "max_tokens": 2, "custom_params": options}
        reply = requests.post(server.url + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 400 and named in reply.text, (options, reply.status_code, reply.text)
    status, text = with_options(server, ids, {"oasis_top_k": 64, "client_tag": [1, {"x": 2}]})
    assert status == 200 and json.loads(text)["output_ids"] == expected, text
    assert greedy(server, ids) == expected
