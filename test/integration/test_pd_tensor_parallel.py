"""PD disaggregation with tensor parallelism on both sides (issue 41 item 5): ``launch_pd --tp-size 2`` on
the tiny Qwen3 (2 KV heads: one per rank), sparse with K = 4 blocks, remote partial fetching over the real
Mooncake transfer engine on 127.0.0.1. Each prefill rank stages its own KV head's KV and registers its
hand-offs under its rank; each decode rank reads only its head's selected blocks and summaries from the
prefill rank of the same number.

- The pair answers as the same sparse TP 2 server without PD, token for token, and each decode rank read
  its own head's summaries (half the model's) and admission blocks. The decode radix cache is on: the
  ranks agree on whether a finished request's KV is whole (``DecodeFetcher.on_every_rank``).
- An admission that fails on decode rank 1 only (injected) fails its request once, on both ranks (the
  ranks' transfer polls are all-reduced: ``decode_queue.AdmissionGate``), while the requests beside it
  answer as before; nothing stays held on either node's ranks and the pair serves on.

One server at a time, as in ``test_sparse_tensor_parallel.py``: the reference's server answers and stops
before the pair starts.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from sglang_oasis.disaggregation.decode_admission import ADMISSION_FAILURE_ENV
from sglang_oasis.server_process import ServerProcess, greedy_body
from sglang_oasis_testing.pd_launch import PDLaunch

NEW_TOKENS = 24
LAYERS, HEAD_DIM, BLOCK = 4, 64, 16  # the tiny Qwen3; one KV head per rank
SPARSE = ["--oasis-top-k", "4", "--dtype", "float32", "--oasis-host-kv-tokens", "16384",
          "--oasis-device-kv-tokens", "16384", "--tp-size", "2"]  # fmt: skip
PROMPT_LENS = (150, 230, 301, 370)
FAILING_LEN = 211  # decode rank 1's admission of prompts this long fails (injected)


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 49152, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [prompt(n, seed=40 + i) for i, n in enumerate(PROMPT_LENS)]
BESIDE = [prompt(n, seed=50 + i) for i, n in enumerate((180, 260))]  # beside the failing one
AFTER = prompt(140, seed=60)


def generate(url: str, input_ids: list[int]) -> requests.Response:
    return requests.post(url + "/generate", json=greedy_body(input_ids, NEW_TOKENS), timeout=300)


def at_once(url: str, prompts: list[list[int]]) -> list[requests.Response]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda ids: generate(url, ids), prompts))


def output_ids(response: requests.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return list(response.json()["output_ids"])


@pytest.fixture(scope="module")
def reference(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same sparse TP 2 configuration without PD: its answers (its server stopped before the pair
    starts: a 2-rank server holds ~5 GiB)."""
    log = tmp_path_factory.mktemp("logs") / "tiny-qwen3-sparse-tp2-reference.log"
    with ServerProcess(["--model-path", str(tiny_qwen3_dir), *SPARSE], log_path=log) as server:
        answers = [output_ids(r) for r in at_once(server.url, PROMPTS)]
        beside = [output_ids(r) for r in at_once(server.url, BESIDE)]
        after = output_ids(generate(server.url, AFTER))
    return {"prompts": answers, "beside": beside, "after": after}


@pytest.fixture(scope="module")
def pair(
    reference: dict[str, Any], tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PDLaunch]:
    launch = PDLaunch(
        # the decode radix cache on: a finished request is shared only if every rank read all its blocks
        [
            "--model-path",
            str(tiny_qwen3_dir),
            *SPARSE,
            "--router-args=--disable-retries",
            "--decode-args=--disaggregation-decode-enable-radix-cache",
        ],
        tmp_path_factory.mktemp("pd-tp2"),
        env={ADMISSION_FAILURE_ENV: str(FAILING_LEN), "SGLANG_OASIS_INJECT_ON_RANK": "1"},
    )
    try:
        yield launch
    finally:
        launch.stop()


def summary_bytes(tokens: int) -> int:
    """One KV head's min and max summaries of a prompt, every layer (float32)."""
    return LAYERS * 2 * -(-tokens // BLOCK) * HEAD_DIM * 4


def ranks(server: ServerProcess) -> list[dict[str, Any]]:
    rows = server.oasis_stats()["ranks"]
    assert len(rows) == 2, rows
    return list(rows)


def test_pd_under_tp2_answers_as_tp2_without_pd_and_each_rank_reads_its_own_head(
    pair: PDLaunch, reference: dict[str, Any]
) -> None:
    before = ranks(pair.decode)
    got = [output_ids(r) for r in at_once(pair.router.url, PROMPTS)]
    for i, (a, b) in enumerate(zip(got, reference["prompts"], strict=True)):
        first = next((j for j, (p, q) in enumerate(zip(a, b, strict=True)) if p != q), None)
        assert first is None, f"prompt {i} ({PROMPT_LENS[i]} tokens) parts from non-PD TP 2 at token {first}"
    after = ranks(pair.decode)
    for rank, (old, new) in enumerate(zip(before, after, strict=True)):
        grew = {name: new[name] - old[name] for name in new if isinstance(new[name], int)}
        # staged and read partially (none sent whole: launch_pd's warm-up request was the handshake)
        assert grew["remote_requests"] == len(PROMPTS) and grew["remote_whole_requests"] == 0, (rank, grew)
        # each rank read its own KV head's summaries: half of the model's
        assert grew["remote_summary_bytes"] == sum(summary_bytes(n) for n in PROMPT_LENS), (rank, grew)
        assert grew["remote_admission_blocks"] > 0 and grew["decode_steps"] > 0, (rank, grew)
        # the remaining blocks were read in the background for the decode radix cache
        assert grew["remote_completion_bytes"] > 0, (rank, grew)
    # the prefill node's ranks staged each its own head and released it once the decode node was done
    deadline = time.monotonic() + 30
    while any(row["staged_bytes"] or row["held_handoffs"] for row in ranks(pair.prefill)):
        assert time.monotonic() < deadline, f"staged KV never released: {ranks(pair.prefill)}"
        time.sleep(0.5)
    assert all(row["staged_requests"] >= len(PROMPTS) for row in ranks(pair.prefill))


def test_an_admission_failing_on_one_decode_rank_fails_its_request_on_both(
    pair: PDLaunch, reference: dict[str, Any]
) -> None:
    failing = prompt(FAILING_LEN, seed=70)
    responses = at_once(pair.router.url, [failing, *BESIDE])
    assert responses[0].status_code == 500, responses[0].text
    assert [output_ids(r) for r in responses[1:]] == reference["beside"]
    log = Path(pair.info["decode"]["log"]).read_text()
    assert "TP1] " in log and f"injected admission failure ({ADMISSION_FAILURE_ENV})" in log
    # nothing held on either node's ranks once the pair is idle: the failed request's fetch state and
    # its staging on both prefill ranks (rank 1's admission released its own; rank 0's went at the free,
    # by its bootstrap address where rank 0's admission had not begun when rank 1's failure failed it).
    # SGLang may hold a failed transfer's row until the prefill ranks acknowledge its abort, up to
    # SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT (30 s): the row is freed after that.
    deadline = time.monotonic() + 90
    held = ("held_fetch_requests", "held_handoffs", "held_failures", "running_requests", "staged_bytes")

    def holding() -> list[str]:
        return [f"{node} rank {rank}: {name} {row[name]}" for node, server in (("decode", pair.decode),
                ("prefill", pair.prefill)) for rank, row in enumerate(ranks(server)) for name in held if row[name]]  # fmt: skip

    while holding():
        assert time.monotonic() < deadline, holding()
        time.sleep(0.5)
    assert output_ids(generate(pair.router.url, AFTER)) == reference["after"], "the pair serves on"
