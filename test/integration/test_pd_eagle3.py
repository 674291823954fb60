"""PD disaggregation with EAGLE-3 lookahead (``launch_pd --oasis-lookahead eagle3``), remote partial
fetching on: the decode node's draft model must see the prompt's draft KV, which SGLang's transfer would
carry with the target's pages and which remote fetching moves itself (the prefill stages it beside the
target's, the decode reads it whole at admission).

Tiny random Qwen3 with its random EAGLE-3 head, fp32, K = 64 blocks (covers every block), the ``verify``
draft policy: greedy output must equal dense token for token, and the draft KV read must be exactly the
prompt's pages but the last (which SGLang's own transfer carries)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sglang_oasis.models.tiny_models import TinyModelSpec, build_tiny_eagle3_head
from sglang_oasis.testing.pd_launch import PDLaunch
from sglang_oasis.testing.server_process import ServerProcess

pytestmark = pytest.mark.server

PROMPT_LENGTHS = (300, 1000)
NEW_TOKENS = 24
BLOCK, DRAFT_LAYERS, KV_HEADS, HEAD_DIM, ITEMSIZE = 16, 1, 2, 64, 4  # the tiny head's KV, float32


@pytest.fixture(scope="module")
def pd_eagle3(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDLaunch]:
    head = build_tiny_eagle3_head(TinyModelSpec(arch="qwen3"), tiny_qwen3_dir.parent)
    args = [
        "--model-path", str(tiny_qwen3_dir), "--oasis-lookahead", "eagle3",
        "--speculative-draft-model-path", str(head), "--oasis-draft-policy", "verify", "--dtype", "float32",
        "--oasis-top-k", "64", "--oasis-host-kv-tokens", "8192", "--oasis-device-kv-tokens", "8192",
        "--router-args=--disable-retries --disable-circuit-breaker",
    ]  # fmt: skip
    with PDLaunch(args, tmp_path_factory.mktemp("pd-eagle3")) as launch:
        yield launch


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def test_pd_eagle3_equals_dense_and_reads_the_draft_kv(
    pd_eagle3: PDLaunch, tiny_qwen3_server: ServerProcess
) -> None:
    before = pd_eagle3.decode.oasis_stats()
    for ids in prompts():
        got = pd_eagle3.router.generate(ids, NEW_TOKENS)
        assert got["output_ids"] == tiny_qwen3_server.generate(ids, NEW_TOKENS)["output_ids"]
        assert got["meta_info"]["spec_verify_ct"] > 0, "decoded by the speculative worker"
    after = pd_eagle3.decode.oasis_stats()
    assert after["remote_requests"] - before["remote_requests"] == len(PROMPT_LENGTHS)
    # every page of the draft KV but the last (SGLang's transfer carries that one), K and V
    pages_read = sum(-(-n // BLOCK) - 1 for n in PROMPT_LENGTHS)
    draft_bytes = pages_read * 2 * DRAFT_LAYERS * BLOCK * KV_HEADS * HEAD_DIM * ITEMSIZE
    assert after["remote_draft_bytes"] - before["remote_draft_bytes"] == draft_bytes
