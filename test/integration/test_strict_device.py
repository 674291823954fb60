"""Decode attention reads the device tier only (strict mode, ``attention/strict_mode.py``).

With K covering every block, a server that overwrites the host tier's copy of every block resident in a
working set with garbage after each step still answers exactly as dense SGLang, and reads no tail from
the host tier; a deliberately broken variant of it that reads the host tier (dense over SGLang's pool;
``sglang_oasis_testing/broken_variant.py``, an SGLang plugin of the dev package)
answers differently, which proves the garbage reaches whatever reads the host tier.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from sglang_oasis.attention.strict_mode import STRICT_ENV
from sglang_oasis.server_process import ServerProcess
from sglang_oasis_testing.broken_variant import BROKEN_ENV

pytestmark = pytest.mark.server

# Distinct random prompts: a radix hit would prefill over poisoned pages (garbage is for decode reads).
PROMPT_LENGTHS = [17, 100, 333, 600]
NEW_TOKENS = 24


def _serve(tiny_qwen3_dir: Path, tmp: pytest.TempPathFactory, broken: str) -> Iterator[ServerProcess]:
    args = [
        "--model-path", str(tiny_qwen3_dir), "--oasis-top-k", "64", "--dtype", "float32",
        "--oasis-host-kv-tokens", "6144", "--oasis-device-kv-tokens", "16384",
    ]  # fmt: skip
    log = tmp.mktemp("logs") / f"tiny-qwen3-strict{broken and '-' + broken}.log"
    with ServerProcess(args, log_path=log, env={STRICT_ENV: "1", BROKEN_ENV: broken}) as server:
        yield server


@pytest.fixture(scope="module")
def strict_server(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _serve(tiny_qwen3_dir, tmp_path_factory, "")


@pytest.fixture(scope="module")
def broken_server(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _serve(tiny_qwen3_dir, tmp_path_factory, "read-host-pool")


def prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def concurrently(server: ServerProcess, batch: list[list[int]]) -> list[list[int]]:
    with ThreadPoolExecutor(len(batch)) as pool:
        return list(pool.map(lambda ids: list(server.generate(ids, NEW_TOKENS)["output_ids"]), batch))


def test_garbage_in_the_host_tier_of_loaded_blocks_changes_nothing(
    tiny_qwen3_server: ServerProcess, strict_server: ServerProcess
) -> None:
    batch = prompts(seed=11)
    before = strict_server.oasis_stats()
    assert concurrently(strict_server, batch) == concurrently(tiny_qwen3_server, batch)
    after = strict_server.oasis_stats()

    def grew(name: str) -> int:
        return after[name] - before[name]

    # Every decode-time block came from the active blocks; no tail, no block was read from the host.
    assert grew("blocks_from_active") == grew("blocks_just_filled") > 0
    assert grew("decode_blocks_loaded") == 0
    assert grew("tail_bytes_host_to_device") == 0
    assert grew("decode_bytes_host_to_device") == 0


def test_a_variant_that_reads_the_host_tier_is_caught(
    tiny_qwen3_server: ServerProcess, broken_server: ServerProcess
) -> None:
    batch = prompts(seed=12)
    broken, dense = concurrently(broken_server, batch), concurrently(tiny_qwen3_server, batch)
    differ = sum(b != d for b, d in zip(broken, dense, strict=True))
    assert differ == len(batch), f"only {differ} of {len(batch)} outputs changed"
