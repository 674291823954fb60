"""``--oasis-decode-step captured`` on a PD decode node (``launch_pd``: SmolLM2's first 6 layers, remote
partial fetching over the real Mooncake transfer engine on 127.0.0.1, the decode radix cache on), its
program uncompiled under the sync guard (``SGLANG_OASIS_SYNC_GUARD=1``).

An arrival's first decode pass is its admission (eager: the dense first step, the admission's reads);
while blocks of its KV are still on the prefill node its passes run eagerly too (they read what their
working sets need); the decode radix cache's background reads make its KV whole, and from then on its
passes run the program. Every answer must equal the same sparse configuration served without PD, and no
captured pass may sync with the host (one that did would raise under the guard and leave the node
decoding eagerly)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang_oasis.attention.sync_guard import SYNC_GUARD_ENV
from sglang_oasis.server_process import ServerProcess
from sglang_oasis_testing.pd_launch import PDLaunch

pytestmark = pytest.mark.server

SPARSE_ARGS = ["--dtype", "float32", "--oasis-top-k", "16", "--oasis-host-kv-tokens", "16384",
               "--oasis-device-kv-tokens", "16384"]  # fmt: skip
PROMPTS = (300, 700, 1100)  # tokens: 18 to 68 full blocks, K = 16
NEW_TOKENS = 40


def prompt(tokens: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 30000 + 200 for i in range(tokens)]


@pytest.fixture(scope="module")
def pd_captured(smollm2_6l_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDLaunch]:
    args = ["--model-path", str(smollm2_6l_dir), *SPARSE_ARGS, "--oasis-decode-step", "captured",
            "--decode-args=--disaggregation-decode-enable-radix-cache"]  # fmt: skip
    with PDLaunch(args, tmp_path_factory.mktemp("pd-captured"), env={SYNC_GUARD_ENV: "1"}) as launch:
        yield launch


@pytest.fixture(scope="module")
def eager_reference(
    smollm2_6l_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The same sparse configuration without PD, its decode step eager."""
    args = ["--model-path", str(smollm2_6l_dir), *SPARSE_ARGS, "--oasis-decode-step", "eager"]
    with ServerProcess(
        args, log_path=tmp_path_factory.mktemp("logs") / "pd-captured-reference.log"
    ) as server:
        yield server


def test_a_pd_decode_node_runs_whole_requests_captured_without_a_host_sync(
    pd_captured: PDLaunch, eager_reference: ServerProcess
) -> None:
    prompts = [prompt(n, seed) for seed, n in enumerate(PROMPTS)]
    before = pd_captured.decode.oasis_stats()
    with ThreadPoolExecutor(len(prompts)) as pool:  # at once: arrivals among running requests
        got = list(pool.map(lambda ids: pd_captured.router.generate(ids, NEW_TOKENS)["output_ids"], prompts))
    after = pd_captured.decode.oasis_stats()
    assert got == [eager_reference.generate(ids, NEW_TOKENS)["output_ids"] for ids in prompts]
    assert after["remote_requests"] - before["remote_requests"] == len(prompts)
    assert (
        after["remote_completion_bytes"] > before["remote_completion_bytes"]
    )  # made whole in the background
    passes = after["captured_decode_passes"] - before["captured_decode_passes"]
    steps = after["decode_steps"] - before["decode_steps"]
    # the arrivals' passes eager, and a request's while blocks of it are still remote; the rest captured
    # (seen: 39 of 41): most passes ran the program, not just one
    assert steps // 2 <= passes < steps, (passes, steps)
    assert "captured decode step failed" not in pd_captured.decode.log_path.read_text()
