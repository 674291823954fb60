"""The counters' block under tensor parallelism (``stats.py``): one row per rank, written by that rank's
scheduler, aggregated for ``GET /oasis/stats`` and Prometheus. The server-level test is
``test/integration/test_sparse_tensor_parallel.py``."""

from __future__ import annotations

import os

import numpy as np
import pytest

from sglang_oasis.stats import FIELDS, LAYER_FIELDS, OasisStats, aggregate


@pytest.fixture
def port() -> int:
    return 40000 + os.getpid() % 20000  # the block is named after it; nothing listens


def test_each_rank_counts_in_its_own_row_and_the_snapshot_aggregates(port: int) -> None:
    owner = OasisStats.create(port, ranks=2)
    try:
        rank0, rank1 = OasisStats.attach(port, rank=0), OasisStats.attach(port, rank=1)
        for stats, blocks in (
            (rank0, 5),
            (rank1, 7),
        ):  # the same requests and steps, its own KV heads' blocks
            stats.add("requests", 3)
            stats.add("decode_steps", 10)
            stats.add("blocks_loaded", blocks)
            stats.set("device_request_slots", 8)
            stats.set("host_tokens_capacity", 4096)
            stats.set("device_bytes_capacity", 1000)
        rank0.add("transfer_failures")  # one rank's failure of one request
        rank1.set("recall_mean_ppm", 800_000)  # only rank 1 sampled
        rank1.set("recall_p10_ppm", 500_000)
        rank0.set(LAYER_FIELDS[2], 1 + 600_000)
        rank1.set(LAYER_FIELDS[2], 1 + 800_000)
        for reader in (owner, rank0, rank1):  # the HTTP process and either rank see the same aggregate
            total = reader.snapshot()
            assert total["blocks_loaded"] == 12 and total["device_bytes_capacity"] == 2000
            assert total["requests"] == 3 and total["decode_steps"] == 10  # counted alike: once
            assert total["device_request_slots"] == 8 and total["host_tokens_capacity"] == 4096
            assert total["transfer_failures"] == 1
            assert total["recall_mean_ppm"] == 800_000 and total["recall_p10_ppm"] == 500_000
            assert total[LAYER_FIELDS[2]] == 1 + 700_000 and total[LAYER_FIELDS[3]] == 0
        ranks = owner.rank_snapshots()
        assert [rank["blocks_loaded"] for rank in ranks] == [5, 7]
        assert [rank["transfer_failures"] for rank in ranks] == [1, 0]
        rank0.close()
        rank1.close()
    finally:
        owner.close()


def test_a_rank_the_block_has_no_row_for_counts_on_its_own(port: int) -> None:
    owner = OasisStats.create(port, ranks=1)
    try:
        stray = OasisStats.attach(port, rank=1)
        stray.add("blocks_loaded", 4)
        assert owner.snapshot()["blocks_loaded"] == 0 and stray.snapshot()["blocks_loaded"] == 4
        one = OasisStats.attach(port)  # no tensor parallelism published: rank 0
        one.add("blocks_loaded", 2)
        assert owner.snapshot()["blocks_loaded"] == 2 and owner.rank_snapshots()[0]["blocks_loaded"] == 2
        one.close()
    finally:
        owner.close()


def test_one_rank_aggregates_to_itself() -> None:
    row = np.arange(len(FIELDS), dtype=np.int64)[None, :]
    assert aggregate(row) == dict(zip(FIELDS, row[0].tolist(), strict=True))
