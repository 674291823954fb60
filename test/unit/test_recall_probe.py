"""Recall telemetry (``attention/recall_probe.py``) on a constructed case: one request, one KV head,
head_dim 2, blocks of 4 tokens. Block b's keys point along direction b, so a query pointing at block 2
puts nearly all its attention there; a working set without block 2 misses that mass."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_oasis.attention.oasis_backend import OasisAttnBackend
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


def _probe_after_selecting(top_k: int, selecting_block: int) -> OasisAttnBackend:
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
    config = OasisConfig(block_size=BLOCK, top_k=top_k, recall_sample_every=1, prefill_window=0)
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

    def broken(*args: object) -> None:
        raise IndexError("no such row")

    backend.recall.measure = broken  # type: ignore[method-assign]
    backend.recall.sample_safely(backend.batch, 0, DIRECTIONS[2][None, None], [SEQ], 1.0)
    assert backend.recall.every == 0 and not backend.recall.due(32)
