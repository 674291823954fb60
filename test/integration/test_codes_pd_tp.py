"""``--oasis-selector codes`` served apart (the tiny Qwen3, K = 4 blocks, 2 KV heads): every answer equals
the same configuration on one server of one rank.

- Tensor parallelism (``--tp-size 2``: one KV head per rank): each rank codes and ranks its own head's
  keys (selection is per KV head), and both ranks code.
- PD with remote partial fetching (``launch_pd``, the real Mooncake transfer engine on 127.0.0.1): the
  prefill node stages every full block's key codes beside its summaries, the decode node reads them at
  admission and ranks every block by them while the blocks' K and V stay on the prefill node until a
  working set needs them. The codes read must be exactly the prompts' full blocks' (every layer), and
  the decode node must not have coded those blocks itself from KV it never read.

One server at a time where a 2-rank one runs (~5 GiB; the other test lane's PD servers need the rest):
the reference answers both tests' prompts and stops, then the TP 2 server runs its test and stops, then
the PD pair starts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from sglang_oasis.server_process import ServerProcess
from sglang_oasis_testing.pd_launch import PDLaunch

pytestmark = pytest.mark.server

CODES = ["--dtype", "float32", "--oasis-top-k", "4", "--oasis-selector", "codes", "--oasis-host-kv-tokens",
         "4096", "--oasis-device-kv-tokens", "16384"]  # fmt: skip
PROMPT_LENS = (200, 333, 517, 777)  # tokens: 12 to 48 full blocks of 16, K = 4
NEW_TOKENS = 24
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 64, 16  # the tiny Qwen3's (TinyModelSpec's defaults)


def prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 30000, (n,), generator=gen).tolist() for n in PROMPT_LENS]


# Each test its own prompts: a prompt the radix cache holds would be admitted differently.
PD_PROMPTS, TP_PROMPTS = prompts(23), prompts(29)


def answers(
    generate: Callable[[list[int], int], dict[str, Any]], prompts: list[list[int]]
) -> list[list[int]]:
    """The prompts' output ids, sent at once (they decode together)."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda ids: generate(ids, NEW_TOKENS)["output_ids"], prompts))


@pytest.fixture(scope="module")
def reference(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[list[int]]]:
    """One server of one rank's answers to both tests' prompts (its server stopped)."""
    log = tmp_path_factory.mktemp("logs") / "codes-reference.log"
    with ServerProcess(["--model-path", str(tiny_qwen3_dir), *CODES], log) as server:
        return {"pd": answers(server.generate, PD_PROMPTS), "tp": answers(server.generate, TP_PROMPTS)}


def test_codes_under_tp2_answer_as_one_rank(
    reference: dict[str, list[list[int]]], tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    log = tmp_path_factory.mktemp("logs") / "codes-tp2.log"
    with ServerProcess(["--model-path", str(tiny_qwen3_dir), *CODES, "--tp-size", "2"], log) as server:
        got = answers(server.generate, TP_PROMPTS)
        stats = server.oasis_stats()
    assert got == reference["tp"]
    full_blocks = sum(n // BLOCK for n in PROMPT_LENS)
    ranks = stats["ranks"]
    assert len(ranks) == 2 and all(rank["key_code_pages"] >= full_blocks * LAYERS for rank in ranks), ranks
    assert all(rank["scored_selections"] > 0 for rank in ranks)


@pytest.fixture(scope="module")
def codes_pd(
    reference: dict[str, list[list[int]]], tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PDLaunch]:
    with PDLaunch(
        ["--model-path", str(tiny_qwen3_dir), *CODES], tmp_path_factory.mktemp("pd-codes")
    ) as launch:
        yield launch


def test_a_pd_decode_node_ranks_by_codes_it_read_and_answers_as_without_pd(
    codes_pd: PDLaunch, reference: dict[str, list[list[int]]]
) -> None:
    before = codes_pd.decode.oasis_stats()
    got = answers(codes_pd.router.generate, PD_PROMPTS)
    after = codes_pd.decode.oasis_stats()
    grew = {name: after[name] - before[name] for name in after if isinstance(after[name], int)}
    assert got == reference["pd"]
    assert grew["remote_requests"] == len(PD_PROMPTS)
    full_blocks = sum(n // BLOCK for n in PROMPT_LENS)
    assert grew["remote_code_bytes"] == full_blocks * LAYERS * BLOCK * KV_HEADS * HEAD_DIM // 4
    assert grew["scored_selections"] > 0  # decode steps ranked blocks (by codes: the only scorer here)
    # The decode node coded only the blocks its steps filled (at most two per request and layer), never
    # the prompts' blocks it ranked by: their codes came with the summaries.
    assert grew["key_code_pages"] <= 2 * len(PROMPT_LENS) * LAYERS < full_blocks * LAYERS
    assert grew["remote_admission_bytes"] < full_blocks * LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * 4
