"""Soak, CI variant (issue 25): a seeded mix of 80 greedy requests, 10 at a time, against a sparse server
on the tiny Qwen3 with K = 4 blocks (most prompts have 5-44 full blocks, so selection is live at every
step) and a host tier small enough that SGLang holds back and retracts requests: mixed lengths, shared
stems and exact repeats (radix hits), streaming and not, client disconnects and ``/abort_request``.

Checked: no request fails unless the client aborted or left; every completed request that SGLang did
not retract answers exactly as the same request served alone; after the drain and a radix flush the
server holds no request slot, no working-set token, no staged byte and no host-pool token; the server
still answers. The same mix against dense SGLang shows the engine itself is exact under this load. A
second server retracts running requests every 15 forward passes (SGLang's own test switch): nothing is
lost or held, and every request, retracted or not, still answers as alone.
``benchmark/bench_soak.py`` is the long variant.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from sglang_oasis.evaluation.passkey import essays_text
from sglang_oasis.server_process import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

from soak import HELD, compare, drain, nothing_held, run_mix, solo_outputs, workload

pytestmark = pytest.mark.server

REQUESTS, CONCURRENCY = 80, 10


@pytest.fixture(scope="module")
def soak_server(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = [
        "--model-path", str(tiny_qwen3_dir), "--dtype", "float32", "--oasis-top-k", "4",
        "--oasis-host-kv-tokens", "3072", "--oasis-device-kv-tokens", "16384",
    ]  # fmt: skip
    log = tmp_path_factory.mktemp("logs") / "soak-sparse.log"
    with ServerProcess(args, log_path=log) as server:
        yield server


@pytest.fixture(scope="module")
def soak_workload(tiny_qwen3_dir: Path) -> list:
    from transformers import AutoTokenizer

    corpus = AutoTokenizer.from_pretrained(tiny_qwen3_dir).encode(essays_text(), add_special_tokens=False)
    return workload(seed=25, count=REQUESTS, corpus=corpus, prompt_tokens=(80, 700), new_tokens=(8, 40))


def _soak(server: ServerProcess, reqs: list, sparse: bool) -> dict:
    outcomes = run_mix(server.url, reqs, CONCURRENCY)
    held = drain(server.url, sparse)
    solo = solo_outputs(server.url, reqs, outcomes)
    report = {**compare(reqs, outcomes, solo), "held_after_drain": held}
    print(report)
    return report


def test_sparse_soak_serves_every_surviving_request_as_alone(
    soak_server: ServerProcess, soak_workload: list
) -> None:
    report = _soak(soak_server, soak_workload, sparse=True)
    assert report["failed_unexpectedly"] == 0, report["problems"]
    assert report["differing"] == 0, report["problems"]
    assert report["completed"] >= REQUESTS // 2 and report["failed_as_expected"] > 0, report
    held = report["held_after_drain"]
    assert nothing_held(held) == {} and len(held) == len(HELD) + 1, held
    stats = soak_server.oasis_stats()
    assert stats["scored_selections"] > 0 and stats["transfer_failures"] == 0, stats
    assert soak_server.alive() and requests.get(soak_server.url + "/health", timeout=30).status_code == 200


def test_a_repeated_prompt_still_computes_its_prefill_window(
    soak_server: ServerProcess, soak_workload: list
) -> None:
    """The radix cache serves a repeat all but the window's last 32 tokens (SGLang alone would recompute
    one page at most), so the first working set, and the output, are the first time's."""
    request = max(soak_workload, key=lambda r: len(r.input_ids))
    body = {"input_ids": list(request.input_ids),
            "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    first, second = (
        requests.post(soak_server.url + "/generate", json=body, timeout=300).json() for _ in "12"
    )
    cached = second["meta_info"]["cached_tokens"]
    assert 0 < cached <= len(request.input_ids) - 32, (cached, len(request.input_ids))
    assert second["output_ids"] == first["output_ids"]


@pytest.fixture(scope="module")
def retracting_server(
    tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The soak server's configuration, with SGLang's own test switch that retracts running requests
    every 15 forward passes (``SGLANG_TEST_RETRACT``): real retractions, without depending on when the
    host tier happens to fill up."""
    args = [
        "--model-path", str(tiny_qwen3_dir), "--dtype", "float32", "--oasis-top-k", "4",
        "--oasis-host-kv-tokens", "3072", "--oasis-device-kv-tokens", "16384",
    ]  # fmt: skip
    env = {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "15"}
    log = tmp_path_factory.mktemp("logs") / "soak-retracting.log"
    with ServerProcess(args, log_path=log, env=env) as server:
        yield server


def test_retractions_lose_nothing(
    retracting_server: ServerProcess, soak_server: ServerProcess, soak_workload: list
) -> None:
    """Under forced retractions: no request fails unless the client ended it, the requests SGLang did not
    retract answer as alone (on the soak server, same configuration without the switch), nothing is held
    after the drain, and the retracted ones were re-prefilled from their kept selection state and their
    decode steps' K and V (hook 8, ``retracted_kv.py``), so they too answer as alone: recomputed by the
    re-prefill's dense extend instead, the keys of their output tokens flipped near-tied block scores at
    K = 4 on this random-weight model (3 of 5 retracted requests differed)."""
    reqs = soak_workload[:40]
    outcomes = run_mix(retracting_server.url, reqs, CONCURRENCY)
    held = drain(retracting_server.url, sparse=True)
    report = compare(reqs, outcomes, solo_outputs(soak_server.url, reqs, outcomes))
    stats = requests.get(retracting_server.url + "/oasis/stats", timeout=30).json()
    print(
        {
            **report,
            "held_after_drain": held,
            "kept": stats["retracted_requests"],
            "resumed": stats["resumed_requests"],
            "resumed_kv_tokens": stats["resumed_kv_tokens"],
        }
    )
    assert report["retracted"] > 0, report  # the switch did retract
    assert stats["retracted_requests"] > 0 and stats["resumed_requests"] > 0, stats
    assert stats["resumed_kv_tokens"] > 0, stats  # some were retracted after decode steps
    assert report["failed_unexpectedly"] == 0, report["problems"]
    assert report["differing"] == 0 and report["differing_retracted"] == 0, report["problems"]
    assert nothing_held(held, kept_retractions=True) == {} and len(held) == len(HELD) + 1, held
    assert retracting_server.alive()


def test_dense_soak_is_exact_on_this_engine(tiny_qwen3_server: ServerProcess, soak_workload: list) -> None:
    report = _soak(tiny_qwen3_server, soak_workload, sparse=False)
    assert report["failed_unexpectedly"] == 0, report["problems"]
    assert report["differing"] == 0 and report["differing_retracted"] == 0, report["problems"]
