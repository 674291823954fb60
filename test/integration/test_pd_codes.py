"""``--oasis-selector codes`` under PD with remote partial fetching (``launch_pd``: the tiny Qwen3, K = 4,
the real Mooncake transfer engine on 127.0.0.1): the prefill node stages every full block's key codes
beside its summaries, the decode node reads them at admission and ranks every block by them while the
blocks' K and V stay on the prefill node until a working set needs them. Every answer must equal the same
configuration served without PD, the codes read must be exactly the prompts' full blocks' (every layer),
and the decode node must not have coded those blocks itself from KV it never read."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from sglang_oasis.server_process import ServerProcess
from sglang_oasis_testing.pd_launch import PDLaunch

pytestmark = pytest.mark.server

CODES = ["--dtype", "float32", "--oasis-top-k", "4", "--oasis-selector", "codes", "--oasis-host-kv-tokens",
         "4096", "--oasis-device-kv-tokens", "16384"]  # fmt: skip
PROMPTS = (200, 333, 517, 777)  # tokens: 12 to 48 full blocks of 16, K = 4
NEW_TOKENS = 24
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 64, 16  # the tiny Qwen3's (TinyModelSpec's defaults)


@pytest.fixture(scope="module")
def codes_pd(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDLaunch]:
    with PDLaunch(
        ["--model-path", str(tiny_qwen3_dir), *CODES], tmp_path_factory.mktemp("pd-codes")
    ) as launch:
        yield launch


@pytest.fixture(scope="module")
def reference(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The same configuration without PD."""
    log = tmp_path_factory.mktemp("logs") / "pd-codes-reference.log"
    with ServerProcess(["--model-path", str(tiny_qwen3_dir), *CODES], log) as server:
        yield server


def test_a_pd_decode_node_ranks_by_codes_it_read_and_answers_as_without_pd(
    codes_pd: PDLaunch, reference: ServerProcess
) -> None:
    gen = torch.Generator().manual_seed(23)
    prompts = [torch.randint(3, 30000, (n,), generator=gen).tolist() for n in PROMPTS]
    before = codes_pd.decode.oasis_stats()
    with ThreadPoolExecutor(len(prompts)) as pool:  # at once: they decode together
        got = list(pool.map(lambda ids: codes_pd.router.generate(ids, NEW_TOKENS)["output_ids"], prompts))
    after = codes_pd.decode.oasis_stats()
    grew = {name: after[name] - before[name] for name in after if isinstance(after[name], int)}
    want = [reference.generate(ids, NEW_TOKENS)["output_ids"] for ids in prompts]
    assert got == want
    assert grew["remote_requests"] == len(prompts)
    full_blocks = sum(n // BLOCK for n in PROMPTS)
    assert grew["remote_code_bytes"] == full_blocks * LAYERS * BLOCK * KV_HEADS * HEAD_DIM // 4
    assert grew["scored_selections"] > 0  # decode steps ranked blocks (by codes: the only scorer here)
    # The decode node coded only the blocks its steps filled (at most two per request and layer), never
    # the prompts' blocks it ranked by: their codes came with the summaries.
    assert grew["key_code_pages"] <= 2 * len(PROMPTS) * LAYERS < full_blocks * LAYERS
    assert grew["remote_admission_bytes"] < full_blocks * LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * 4
