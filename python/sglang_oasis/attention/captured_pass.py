"""A captured decode pass as the host keeps it: what it planned (``Planned``), and, once the program ran,
its counts and tables folded into the server's (``fold_pass``: the pass's one read of the device)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from sglang_oasis.attention.batch_view import BatchView
from sglang_oasis.attention.block_prefetcher import JobResult
from sglang_oasis.attention.decode_program import COUNTS
from sglang_oasis.attention.step_plan import StepPlan, StepShape

if TYPE_CHECKING:
    from sglang_oasis.attention.recall_probe import RecallProbe
    from sglang_oasis.memory.device_tier import DeviceTier
    from sglang_oasis.stats import OasisStats

logger = logging.getLogger(__name__)


class Planned(NamedTuple):
    """A planned pass as the host knows it: the batch (its requests and their slots, as they were when it
    ran), the rows' ``seq_lens`` and the plan built on the host (``StepPlan``; the program reads its
    device copy)."""

    batch: BatchView
    seq_lens: torch.Tensor
    plan: StepPlan

    @classmethod
    def none(cls) -> Planned:
        none = torch.zeros(0, dtype=torch.int64)
        return cls(BatchView.empty(), none, StepPlan(none, none, none, none.view(0, 0), torch.tensor(0)))


class Folded(Protocol):
    """What ``fold_pass`` reads of the captured step (``CapturedStep``)."""

    planned: Planned
    counts: torch.Tensor  # [rows, len(COUNTS)] on the tier's device
    tier: DeviceTier
    shape: StepShape
    stats: OasisStats
    sparse_layers: list[int]
    probe: RecallProbe | None
    account: Callable[[JobResult], None]


def fold_pass(step: Folded, batch_rows: int, layers: int) -> None:
    """``step``'s planned pass, as one finished selection job of each of its first ``layers`` sparse layers,
    into the server's counters and each request's figures (``Selector.account``), credited to the requests
    it ran (not whoever holds their slots now); the tables the program wrote come back with the counts,
    in one copy (``TierTables.download``)."""
    batch, seq_lens, plan = step.planned
    host_counts = step.tier.tables.download(batch.slots, step.counts[:batch_rows])
    assert host_counts is not None
    counts = dict(zip(COUNTS, host_counts.t(), strict=True))
    if int(counts["overflow"].sum()):  # the plan's bound on fresh blocks failed: a bug, say it loudly
        logger.error("oasis: a captured step had more loads than its %d copies per head", step.shape.copies)
    host = counts["loads"] - counts["from_active"]
    owners = zip(batch.reqs, batch.generations, host.tolist(), strict=True)
    loads = [(req, generation, n) for req, generation, n in owners if n]
    total = {name: int(values.sum()) for name, values in counts.items()}
    step.account(JobResult(
        layer_id=step.sparse_layers[-1], admission=False, selections=batch_rows * layers, loads=total["loads"],
        fresh=total["fresh"], from_active=total["from_active"], scored=total["scored"],
        deferred=total["deferred"], heads=batch_rows * layers * step.tier.shape.num_kv_heads, select_ns=0,
        transfer_ns=0, failed={}, host_loads=tuple(loads),
    ))  # fmt: skip
    step.stats.add("captured_decode_passes")
    for name in ("below_target", "target_grows", "target_shrinks"):
        step.stats.add(f"recall_{name}", total[name])
    if plan.sampled is not None and step.probe is not None:  # the sample's figures, from the tier
        step.probe.fold(batch, step.sparse_layers, seq_lens.tolist())
