"""Recall telemetry (``attention/recall_probe.py``) on a constructed case: one request, one KV head,
head_dim 2, blocks of 4 tokens. Block b's keys point along direction b, so a query pointing at block 2
puts nearly all its attention there; a working set without block 2 misses that mass."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sglang_oasis.attention.batch_view import BatchView
from sglang_oasis.attention.oasis_backend import OasisAttnBackend
from sglang_oasis.attention.recall_probe import SHRINK_AFTER, RecallProbe, window_top_k
from sglang_oasis.config import OasisConfig
from sglang_oasis.http_routes import counters_and_gauges

BLOCK, DIM, SEQ = 4, 2, 4 * 4 + 1  # four full blocks and one tail token
DIRECTIONS = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]])


class Pool:
    """The slice of SGLang's KV pool the backend reads: one layer, one KV head."""

    size, page_size, layer_num, head_num, head_dim, dtype = 64, BLOCK, 1, 1, DIM, torch.float32

    def __init__(self) -> None:
        self.k = torch.zeros(64 + 2 * BLOCK, 1, DIM)
        self.v = torch.randn(64 + 2 * BLOCK, 1, DIM)
        for block in range(4):
            self.k[block * BLOCK : (block + 1) * BLOCK, 0] = DIRECTIONS[block] * 3
        self.k[4 * BLOCK, 0] = torch.tensor([0.1, 0.1])

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v


def _probe_after_selecting(top_k: int, selecting_block: int, **options: Any) -> OasisAttnBackend:
    """A backend whose request holds the working set a query at ``selecting_block`` selects."""
    req_to_token = torch.zeros(2, 64, dtype=torch.int32)
    req_to_token[0, :SEQ] = torch.arange(SEQ, dtype=torch.int32)
    runner = SimpleNamespace(
        device="cpu",
        req_to_token_pool=SimpleNamespace(
            req_to_token=req_to_token, req_generation=torch.zeros(2, dtype=torch.int64), free_slots=[1]
        ),
        token_to_kv_pool=Pool(),
        server_args=SimpleNamespace(port=1, enable_metrics=False),
    )
    config = OasisConfig(
        block_size=BLOCK,
        top_k=top_k,
        recall_sample_every=1,
        prefill_window=0,
        **{"selector": "summaries", **options},
    )
    backend = OasisAttnBackend(runner, config)
    backend.slots.claim(0, 0)
    backend.set_batch([0], admission=True)
    backend.intake.catch_up(backend.batch, 0, torch.tensor([SEQ]))
    backend.selector.select(backend.batch, 0, DIRECTIONS[selecting_block][None, None] * 10, [SEQ])
    backend.selector.finish_pending()
    return backend


@pytest.mark.parametrize(("top_k", "expect_full"), [(8, True), (1, False)])
def test_recall_is_one_when_the_working_set_holds_every_block_and_drops_when_the_key_block_is_missing(
    top_k: int, expect_full: bool
) -> None:
    backend = _probe_after_selecting(top_k, selecting_block=0)
    assert backend.working_sets.slot_block[0, 0, 0, :1].tolist() == [0]
    query = DIRECTIONS[2][None] * 5  # attends block 2
    recall, agreement = backend.recall.measure(0, 0, 0, query, SEQ, scale=1.0)
    if expect_full:
        torch.testing.assert_close(recall, torch.ones(1))
        assert agreement.tolist() == [1.0]
    else:
        assert float(recall[0]) < 0.05  # block 0 and the tail token: almost none of the mass
        assert agreement.tolist() == [0.0]  # the true top-1 (block 2) was not held
    backend.set_batch([0])
    backend.recall.begin(backend.batch)  # --oasis-recall-sample-every 1: this pass samples row 0
    backend.recall.sample(backend.batch, 0, query[None], [SEQ], scale=1.0)
    report = counters_and_gauges(backend.stats.snapshot())
    assert report["recall_samples"] == 1
    assert report["recall_sum_ppm"] == round(1e6 * float(recall[0]))
    assert report["recall_mean"] == pytest.approx(float(recall[0]), abs=1e-6)
    assert report["recall_p10"] == pytest.approx(float(recall[0]), abs=1e-6)
    assert report["lookahead_agreement"] == float(agreement[0])
    assert report["recall_per_layer"] == {"0": pytest.approx(float(recall[0]), abs=1e-6)}
    assert report["telemetry_bytes"] == 2 * SEQ * DIM * 4  # measure and sample: the whole context's keys
    # Host reads: the summaries' catch-up (the context's keys) and the loaded blocks; no telemetry.
    loaded = backend.stats.snapshot()["blocks_loaded"] * BLOCK * DIM * 4 * 2
    assert report["bytes_host_to_device"] == SEQ * DIM * 4 + loaded


def test_nothing_is_reported_before_a_sample() -> None:
    report = counters_and_gauges(_probe_after_selecting(8, 0).stats.snapshot())
    assert report["recall_mean"] is None and report["recall_per_layer"] == {}
    assert not any(name.startswith("recall_layer_ppm") for name in report)


def test_an_error_in_the_telemetry_turns_it_off_instead_of_failing_the_step() -> None:
    backend = _probe_after_selecting(8, 0)
    backend.set_batch([0])
    backend.recall.begin(backend.batch)

    def broken(*args: object) -> None:
        raise IndexError("no such row")

    backend.recall.measure = broken  # type: ignore[method-assign]
    backend.recall.sample_safely(backend.batch, 0, DIRECTIONS[2][None, None], [SEQ], 1.0)
    backend.recall.begin(backend.batch)
    assert backend.recall.every == 0 and not backend.recall.due()


def test_a_recall_target_grows_the_layer_that_misses_the_key_block_and_shrinks_it_back() -> None:
    """Issue 27: K = 1 holds block 0 while the step's query attends block 2. Below the target the layer's
    top-K doubles; the next selection then holds block 2 (recall ~1.0); after SHRINK_AFTER samples well
    above the target it halves back to K."""
    backend = _probe_after_selecting(1, selecting_block=0, recall_target=0.9, recall_max_top_k=4)
    assert backend.working_sets.slot_block.shape[-1] == 4  # the device tier reserves the maximum
    query = DIRECTIONS[2][None] * 5

    def sample() -> float:
        backend.set_batch([0])
        backend.recall.begin(backend.batch)
        recall, _ = backend.recall.measure(0, 0, 0, query, SEQ, scale=1.0)
        backend.recall.sample(backend.batch, 0, query[None], [SEQ], scale=1.0)
        return float(recall.min())

    assert sample() < 0.05 and int(backend.working_sets.top_k[0, 0]) == 2
    backend.selector.select(backend.batch, 0, query[None], [SEQ])
    backend.selector.finish_pending()
    assert 2 in backend.working_sets.slot_block[0, 0, 0].tolist()
    for _ in range(SHRINK_AFTER - 1):
        assert sample() > 0.99 and int(backend.working_sets.top_k[0, 0]) == 2
    assert sample() > 0.99 and int(backend.working_sets.top_k[0, 0]) == 1
    stats = counters_and_gauges(backend.stats.snapshot())
    assert (stats["recall_below_target"], stats["recall_target_grows"], stats["recall_target_shrinks"]) == (
        1,
        1,
        1,
    )
    backend.selector.select(backend.batch, 0, query[None], [SEQ])  # K = 1 again: one block resident
    backend.selector.finish_pending()
    assert [b for b in backend.working_sets.slot_block[0, 0, 0].tolist() if b >= 0] == [2]


def test_without_a_target_recall_is_only_reported() -> None:
    backend = _probe_after_selecting(1, selecting_block=0)
    backend.set_batch([0])
    backend.recall.begin(backend.batch)
    backend.recall.sample(backend.batch, 0, (DIRECTIONS[2][None] * 5)[None], [SEQ], scale=1.0)
    assert int(backend.working_sets.top_k[0, 0]) == 1 and backend.working_sets.slot_block.shape[-1] == 1
    assert backend.stats.snapshot()["recall_below_target"] == 0


def test_the_first_working_set_is_sized_to_hold_the_target_of_the_windows_attention() -> None:
    """``window_top_k``: the smallest K whose top blocks hold ``target`` of the window's attention for
    the worst head (sinks always held, so they do not count), rounded up to K x 2**n, within [K, max]."""
    prior = torch.tensor(
        [
            [[0.50, 0.30, 0.10, 0.05, 0.0], [0.9, 0.05, 0.0, 0.0, 0.0]],  # head 0 needs 3 blocks for 0.9
            [[0.02, 0.02, 0.02, 0.02, 0.9], [0.2, 0.2, 0.2, 0.2, 0.19]],  # 5 blocks: capped at max 4
        ]
    )
    full = torch.tensor([5, 5])
    assert window_top_k(prior, full, 0, 1, 4, 0.9).tolist() == [4, 4]  # 3 -> 4 on the ladder 1, 2, 4, ...
    assert window_top_k(prior, full, 0, 1, 3, 0.9).tolist() == [3, 3]  # the maximum is on it
    assert window_top_k(prior, full, 0, 1, 8, 0.5).tolist() == [1, 4]
    assert window_top_k(prior, full, 0, 3, 8, 0.9).tolist() == [3, 6]  # at least K: 3, 6, 12, ...
    # A sink (block 0) is held anyway: head 0 of request 0 then needs 0.3 and 0.1 (0.05 missed).
    assert window_top_k(prior, full, 1, 1, 8, 0.9).tolist()[0] == 2
    assert window_top_k(prior, torch.tensor([2, 5]), 0, 1, 8, 0.99).tolist()[0] == 2  # only 2 full blocks


def test_a_grown_working_set_that_held_every_block_keeps_holding_them_as_blocks_fill() -> None:
    """Without this the first block to fill after a target-sized admission pushes one block out (top-4
    of 5) and the output leaves dense until the next recall sample."""
    backend = _probe_after_selecting(
        1, selecting_block=0, recall_target=0.9, recall_max_top_k=8, fetch_ratio=1.0
    )
    ws = backend.working_sets
    backend.req_to_token_pool.req_to_token[0, :21] = torch.arange(21, dtype=torch.int32)
    backend.set_batch([0])
    ws.top_k[0, 0] = 4  # as if the target had grown it
    backend.selector.select(backend.batch, 0, DIRECTIONS[0][None, None], [SEQ])  # 4 full blocks: all held
    backend.selector.finish_pending()
    assert sorted(ws.slot_block[0, 0, 0].tolist())[-4:] == [0, 1, 2, 3]
    backend.selector.select(backend.batch, 0, DIRECTIONS[0][None, None], [21])  # a fifth block filled
    backend.selector.finish_pending()
    assert int(ws.top_k[0, 0]) == 8
    assert sorted(b for b in ws.slot_block[0, 0, 0].tolist() if b >= 0) == [0, 1, 2, 3, 4]
    ws.top_k[0, 0] = 1  # at K (not grown): a filled block competes as usual
    backend.selector.select(backend.batch, 0, DIRECTIONS[0][None, None], [21])
    backend.selector.finish_pending()
    assert int(ws.top_k[0, 0]) == 1


def test_with_a_target_each_request_is_sampled_at_its_own_steps() -> None:
    """What a request attends must not depend on what else runs: with a target, a request is sampled at
    every ``every``-th decode step of its own (counted per request row and generation), whoever shares
    its batches; without one, up to 4 rows rotate at every ``every``-th pass."""
    backend = _probe_after_selecting(1, selecting_block=0, recall_target=0.9)
    probe = RecallProbe(3, backend.tier, None, None, 1, backend.stats, target=0.9)

    def rows(reqs: list[int], generations: list[int], step: int) -> list[int]:
        batch = BatchView(
            reqs,
            torch.tensor(reqs),
            torch.tensor(reqs),
            generations,
            step,
            torch.zeros(len(reqs), dtype=torch.bool),
        )
        probe.begin(batch)
        return probe.rows

    assert rows([0], [1], 1) == [0] and rows([0], [1], 2) == []  # its first step, then every third
    assert rows([0, 1], [1, 1], 3) == [0, 1]  # request 0's third step, request 1's first
    assert rows([1, 0], [1, 1], 4) == [] and rows([1, 0], [1, 1], 5) == [0]  # request 1's third
    assert rows([0, 1], [2, 1], 6) == [0]  # a new request on row 0: its first step
    probe.restart([1])  # row 1 extended again (e.g. re-prefilled): its count restarts
    assert rows([1], [1], 7) == [0] and rows([1], [1], 8) == [] and rows([1], [1], 9) == [0]
    rotating = RecallProbe(3, backend.tier, None, None, 1, backend.stats)
    batch = BatchView(
        list(range(6)), torch.arange(6), torch.arange(6), [1] * 6, 3, torch.zeros(6, dtype=torch.bool)
    )
    rotating.begin(batch)
    assert rotating.rows == [0, 1, 4, 5]  # pass 3 (the first sampled): rows 4, 5, 0, 1 of 6
    rotating.begin(batch._replace(step=4))
    assert rotating.rows == []
