"""SGLang's radix cache in sparse mode: a cached prefix (ending inside a block) is reused, the output
still equals dense, and concurrent requests sharing a prefix hold its host blocks once."""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests
import torch

from sglang_oasis.server_process import ServerProcess

pytestmark = pytest.mark.server

BLOCK = 16
WINDOW = 32  # the prefill window: sparse mode's prefix match leaves at least these tokens to compute


def tokens(length: int, seed: int) -> list[int]:
    return torch.randint(3, 49152, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate(server: ServerProcess, input_ids: list[int], new_tokens: int = 24) -> dict:
    return server.generate(input_ids, new_tokens)


def test_a_cached_prefix_ending_inside_a_block_is_reused_and_output_equals_dense(
    tiny_qwen3_server: ServerProcess, tiny_qwen3_sparse_server: ServerProcess
) -> None:
    prefix = tokens(700, seed=11)  # 43 full blocks and 12 tokens of a 44th
    first, second = [*prefix, *tokens(37, seed=12)], [*prefix, *tokens(5, seed=13)]
    sparse = [generate(tiny_qwen3_sparse_server, ids) for ids in (first, second)]
    dense = [generate(tiny_qwen3_server, ids) for ids in (first, second)]
    # Sparse mode caches whole blocks: the shared part of the partly shared block is recomputed into
    # the second request's own block, never written into the first's.
    # (At most the prompt minus the prefill window's tokens is matched: sglang_hooks, hook 5.)
    assert sparse[1]["meta_info"]["cached_tokens"] >= min(len(prefix), len(second) - WINDOW) // BLOCK * BLOCK
    assert [r["output_ids"] for r in sparse] == [r["output_ids"] for r in dense]
    # The first request's cached blocks were not corrupted by the second: asking again gives the same.
    assert generate(tiny_qwen3_sparse_server, first)["output_ids"] == sparse[0]["output_ids"]


def test_concurrent_requests_share_their_prefix_host_blocks(tiny_qwen3_sparse_server: ServerProcess) -> None:
    server = tiny_qwen3_sparse_server
    assert requests.post(server.url + "/flush_cache", timeout=60).status_code == 200

    def host_used() -> int:
        return int(server.oasis_stats()["host_tokens_used"])

    def settle() -> int:  # the gauge refreshes every 0.5 s
        time.sleep(1.2)
        return host_used()

    baseline = settle()
    prefix = tokens(2048, seed=21)
    results: dict[str, dict] = {}

    def run(name: str, ids: list[int]) -> None:
        results[name] = generate(server, ids, new_tokens=600)

    first = threading.Thread(target=run, args=("first", [*prefix, *tokens(20, seed=22)]))
    first.start()
    deadline = time.monotonic() + 120
    while host_used() - baseline < 2048 and time.monotonic() < deadline:  # the first is decoding
        time.sleep(0.1)
    one = settle() - baseline
    second = threading.Thread(target=run, args=("second", [*prefix, *tokens(30, seed=23)]))
    second.start()
    deadline = time.monotonic() + 120
    while "second" not in results and host_used() - baseline <= one + 16 and time.monotonic() < deadline:
        time.sleep(0.1)
    both = settle() - baseline
    first.join(300)
    second.join(300)
    assert results["second"]["meta_info"]["cached_tokens"] >= (2048 + 30 - WINDOW) // BLOCK * BLOCK
    assert "first" in results and len(results["first"]["output_ids"]) == 600
    # Two requests with a shared 2K prefix hold far less than twice one request's host blocks.
    assert one >= 2048 and both < 1.5 * one, (one, both)


def test_next_turn_starts_from_the_previous_turns_working_sets(
    tiny_qwen3_server: ServerProcess, tiny_qwen3_sparse_server: ServerProcess, tiny_qwen3_dir
) -> None:
    """Turn 2 of a conversation (turn 1's prompt and answer, then a new message) reuses turn 1's KV
    through the radix cache and starts from turn 1's resident blocks: at admission only the blocks past
    the shared ones load from the host tier. The output still equals dense (K covers every block)."""
    config = json.loads((tiny_qwen3_dir / "config.json").read_text())
    per_block = config["num_hidden_layers"] * config["num_key_value_heads"]  # (layer, head) entries
    server = tiny_qwen3_sparse_server
    assert requests.post(server.url + "/flush_cache", timeout=60).status_code == 200

    turn1 = tokens(300, seed=31)
    answer = generate(server, turn1)["output_ids"]
    turn2 = [*turn1, *answer, *tokens(50, seed=32)]
    before = server.oasis_stats()
    result = generate(server, turn2)
    after = server.oasis_stats()
    delta = {key: after[key] - before[key] for key in ("warm_starts", "blocks_reused", "blocks_loaded")}
    admission_loads = delta["blocks_loaded"] - (
        after["decode_blocks_loaded"] - before["decode_blocks_loaded"]
    )
    cached = result["meta_info"]["cached_tokens"]
    assert cached >= (len(turn1) + len(answer) - 1) // BLOCK * BLOCK
    assert delta["warm_starts"] == 1
    # Every shared block was resident in turn 1's working sets (K covers them all) and stays.
    assert delta["blocks_reused"] == cached // BLOCK * per_block
    assert admission_loads + delta["blocks_reused"] == len(turn2) // BLOCK * per_block
    assert result["output_ids"] == generate(tiny_qwen3_server, turn2)["output_ids"]
    # A cold first selection would load every block of the 23: here only the 3 new ones.
    assert admission_loads < len(turn2) // BLOCK * per_block / 4
