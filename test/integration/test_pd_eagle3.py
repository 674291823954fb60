"""PD disaggregation with EAGLE-3 lookahead (``launch_pd --oasis-lookahead eagle3``), remote partial
fetching on: the decode node's draft model must see the prompt's draft KV, which SGLang's transfer would
carry with the target's pages and which remote fetching moves itself (the prefill stages it beside the
target's, the decode reads it whole at admission).

Tiny random Qwen3 with its random EAGLE-3 head, fp32, the ``verify`` draft policy, K = 4 blocks with the
default fetch cap (one block per head and step): greedy output must equal the same configuration served
without disaggregation token for token (300- and 1000-token prompts: the decode node's working sets
start from the prefill's selection and must evolve exactly as they would have), and dense when K covers
the prompt (40 tokens: 2 full blocks); the draft KV read must be exactly the prompts' pages but the last
(which SGLang's own transfer carries)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sglang_oasis.server_process import ServerProcess
from sglang_oasis_testing.pd_launch import PDLaunch
from sglang_oasis_testing.tiny_models import TinyModelSpec, build_tiny_eagle3_head

pytestmark = pytest.mark.server

SPARSE_LENGTHS = (300, 1000)  # 18 and 62 full blocks: K = 4 selects
COVERED_LENGTH = 40  # 2 full blocks: K = 4 covers them
NEW_TOKENS = 24
BLOCK, DRAFT_LAYERS, KV_HEADS, HEAD_DIM, ITEMSIZE = 16, 1, 2, 64, 4  # the tiny head's KV, float32


def eagle3_args(tiny_qwen3_dir: Path) -> list[str]:
    head = build_tiny_eagle3_head(TinyModelSpec(arch="qwen3"), tiny_qwen3_dir.parent)
    return [
        "--model-path", str(tiny_qwen3_dir), "--oasis-lookahead", "eagle3",
        "--speculative-draft-model-path", str(head), "--oasis-draft-policy", "verify", "--dtype", "float32",
        "--oasis-top-k", "4", "--oasis-host-kv-tokens", "8192", "--oasis-device-kv-tokens", "8192",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def pd_eagle3(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDLaunch]:
    args = [*eagle3_args(tiny_qwen3_dir), "--router-args=--disable-retries --disable-circuit-breaker"]
    with PDLaunch(args, tmp_path_factory.mktemp("pd-eagle3")) as launch:
        yield launch


@pytest.fixture(scope="module")
def eagle3_sparse_server(
    tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The decode node's configuration without disaggregation."""
    log = tmp_path_factory.mktemp("logs") / "tiny-eagle3-k4.log"
    with ServerProcess(eagle3_args(tiny_qwen3_dir), log_path=log) as server:
        yield server


def prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 49152, (length,), generator=gen).tolist()


def test_pd_eagle3_equals_the_same_sparse_server_and_reads_the_draft_kv(
    pd_eagle3: PDLaunch, eagle3_sparse_server: ServerProcess, tiny_qwen3_server: ServerProcess
) -> None:
    before = pd_eagle3.decode.oasis_stats()
    for seed, length in enumerate(SPARSE_LENGTHS):
        ids = prompt(length, seed)
        got = pd_eagle3.router.generate(ids, NEW_TOKENS)
        assert got["output_ids"] == eagle3_sparse_server.generate(ids, NEW_TOKENS)["output_ids"], length
        assert got["meta_info"]["spec_verify_ct"] > 0, "decoded by the speculative worker"
    ids = prompt(COVERED_LENGTH, 7)
    got = pd_eagle3.router.generate(ids, NEW_TOKENS)
    assert got["output_ids"] == tiny_qwen3_server.generate(ids, NEW_TOKENS)["output_ids"]
    after = pd_eagle3.decode.oasis_stats()
    lengths = (*SPARSE_LENGTHS, COVERED_LENGTH)
    assert after["remote_requests"] - before["remote_requests"] == len(lengths)
    # K = 4 left most blocks of the long prompts on the prefill node, so later steps read some remotely
    assert after["remote_miss_bytes"] > before["remote_miss_bytes"], "no block read after admission"
    # every page of the draft KV but the last (SGLang's transfer carries that one), K and V
    pages_read = sum(-(-n // BLOCK) - 1 for n in lengths)
    draft_bytes = pages_read * 2 * DRAFT_LAYERS * BLOCK * KV_HEADS * HEAD_DIM * ITEMSIZE
    assert after["remote_draft_bytes"] - before["remote_draft_bytes"] == draft_bytes
    # The decode node's device tier (PD pre-allocation rows and EAGLE-3 verify rows aside) stays inside
    # its budget: 8192 tokens of the target's KV (4 layers x 2 KV heads x 64 x fp32 x K and V).
    for server in (pd_eagle3.decode, eagle3_sparse_server):
        stats = server.oasis_stats()
        assert 0 < stats["device_bytes_capacity"] <= 8192 * 4 * KV_HEADS * HEAD_DIM * ITEMSIZE * 2
        assert stats["device_request_slots"] == pd_eagle3.decode.oasis_stats()["device_request_slots"]
