"""A failed transfer is filed against the request that caused it (its generation when the job was built),
never against the next owner of its SGLang request row."""

from __future__ import annotations

import torch

from sglang_oasis.attention.block_prefetcher import BlockPrefetcher, SelectionJob
from sglang_oasis.attention.transfer_failures import TransferFailures
from sglang_oasis.memory.device_layout import TierShape, layout
from sglang_oasis.memory.device_tier import DeviceTier


def test_a_failure_belongs_to_its_generation() -> None:
    failures = TransferFailures()
    assert not failures and failures.take(3, 7) is None
    assert failures.report(3, 7, "boom")
    assert not failures.report(3, 7, "again"), "a later layer of the same failure is not filed twice"
    assert failures and failures.failed(3, 7) and not failures.failed(3, 8)
    assert failures.take(3, 6) is None, "an older request of the row does not take it"
    assert failures.take(3, 7) == "boom"
    assert failures.take(3, 7) is None and not failures
    failures.report(4, 1, "old")
    assert failures.take(4, 2) is None, "the row's next request never sees it"
    assert failures.take(4, 1) is None and not failures, "and the finished request's failure is dropped"


class Pool:
    """One layer's host KV: 8 pages of 4 tokens, one KV head of dim 2."""

    def __init__(self) -> None:
        self.k = torch.randn(32, 1, 2)
        self.v = torch.randn(32, 1, 2)

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v


def _prefetcher(top_k: int) -> tuple[DeviceTier, BlockPrefetcher]:
    shape = TierShape(
        1, 1, 2, 4, host_pages=8, block_size=4, slots_per_head=top_k, window_blocks=0, active_tokens=4
    )
    tier = DeviceTier(shape, layout(10**9, shape, max_request_slots=2), torch.float32, "cpu")
    prefetcher = BlockPrefetcher(
        tier.working_sets, tier.summaries, tier.active, Pool(), sink_blocks=0, num_kv_heads=1
    )
    return tier, prefetcher


def _job(query_dim: int, fail_reqs: tuple[int, ...], top_k: int = 2) -> SelectionJob:
    """Requests 5 (generation 11) and 9 (generation 4) in request slots 0 and 1, two full blocks each."""
    return SelectionJob(
        layer_id=0, reqs=torch.tensor([5, 9]), slots=torch.tensor([0, 1]), generations=(11, 4),
        queries=torch.randn(2, 1, query_dim), prior=None, pinned=None, full=torch.tensor([2, 2]),
        pages=torch.tensor([[0, 1], [2, 3]]), step=1, admission=False, cap=None, fail_reqs=fail_reqs,
        top_k=torch.tensor([top_k, top_k]),
    )  # fmt: skip


def test_the_prefetcher_reports_the_generation_the_job_was_built_with() -> None:
    tier, prefetcher = _prefetcher(top_k=2)
    result = prefetcher.run(_job(query_dim=2, fail_reqs=(9,)))
    assert result.failed.keys() == {9}
    generation, message = result.failed[9]
    assert generation == 4 and "injected transfer failure" in message
    assert result.loads == 4 and sorted(tier.working_sets.slot_block[0, 0, 0].tolist()) == [0, 1]


def test_an_error_anywhere_in_a_job_fails_its_requests_not_the_process() -> None:
    """Issue 25 item 9: an exception outside the transfer (here: the summaries' scoring is given a query
    of the wrong width) used to be re-raised in ``wait`` and kill the scheduler; it fails the job's
    requests, each with the generation the job was built with."""
    _, prefetcher = _prefetcher(top_k=1)
    result = prefetcher.run(_job(query_dim=3, fail_reqs=(), top_k=1))
    assert result.failed.keys() == {5, 9}
    assert result.failed[5][0] == 11 and result.failed[9][0] == 4
    assert result.failed[5][1].startswith("layer 0: AssertionError")
