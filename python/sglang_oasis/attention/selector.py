"""Selection: each request's next working set per layer and KV head, and the jobs that move its blocks.

After a layer's attention the step's query (or the lookahead's) picks the blocks for the next step:
requests with at most K + sinks full blocks keep all of them; the others keep their sinks plus the top-K
by summary score (or, after an extend, by the prefill window's attention mass), with the window's best
blocks pinned. The blocks that changed load in a prefetch-pipeline job (``block_prefetcher.py``), at
most the fetch cap per KV head at a decode step (``--oasis-adaptive-cap``: per layer, following the
measured drift); the layer's next attention waits for its job. Finished jobs are folded into the
counters and their failures filed against the generation of the request that caused them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from sglang_oasis.attention.batch_view import BatchView
from sglang_oasis.attention.block_prefetcher import BlockPrefetcher, JobResult, SelectionJob
from sglang_oasis.attention.fetch_caps import FetchCaps
from sglang_oasis.attention.prefetch_pipeline import PrefetchPipeline
from sglang_oasis.attention.prefill_window import PrefillWindow
from sglang_oasis.attention.recall_probe import on_ladder, window_top_k
from sglang_oasis.attention.request_slots import RequestSlots
from sglang_oasis.attention.transfer_failures import TransferFailures
from sglang_oasis.config import OasisConfig
from sglang_oasis.memory.device_tier import DeviceTier
from sglang_oasis.memory.working_set import EMPTY
from sglang_oasis.stats import OasisStats

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

logger = logging.getLogger(__name__)


class FaultInjection(NamedTuple):
    """For tests: decode-time transfers of requests whose prompt is ``prompt_len`` tokens long fail."""

    prompt_len: int | None = None

    def failing(self, reqs: list[int], prompt_lens: dict[int, int]) -> tuple[int, ...]:
        if self.prompt_len is None:
            return ()
        return tuple(req for req in reqs if prompt_lens.get(req) == self.prompt_len)


class Selector:
    def __init__(
        self,
        config: OasisConfig,
        tier: DeviceTier,
        slots: RequestSlots,
        kv_pool: MHATokenToKVPool,
        req_to_token_pool: ReqToTokenPool,
        record_layer: int,
        stats: OasisStats,
        failures: TransferFailures,
        faults: FaultInjection,
        device: torch.device | str,
        before_select: Callable[[BatchView, int | None, list[int]], None] | None = None,
    ) -> None:
        self.config = config
        self.block_size = config.block_size
        self.window_blocks = config.window_blocks
        self.working_sets = tier.working_sets
        self.summaries = tier.summaries
        self.pinned = tier.pinned
        self.slots = slots
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool
        self.num_kv_heads = int(kv_pool.head_num)
        self.record_layer = record_layer  # warm starts match the pages selected at this layer
        self.stats = stats
        self.failures = failures
        self.faults = faults
        self.prompt_len: dict[int, int] = {}  # request row -> tokens after its last extend (its one writer)
        self.pipeline: PrefetchPipeline[JobResult] = PrefetchPipeline(config.prefetch == "async", device)
        self.prefetcher = BlockPrefetcher(
            self.working_sets,
            self.summaries,
            tier.active,
            kv_pool,
            config.sink_blocks,
            self.num_kv_heads,
            tier.codes,
            config.code_candidates,
        )
        self.caps = FetchCaps(config, int(kv_pool.layer_num))
        self.window = PrefillWindow(config, kv_pool, req_to_token_pool, tier.pinned.shape[-2:], stats)
        # CUDA graphs' replays whose results are not folded into the host's tables yet (``fold_first``)
        self._before_drain: Callable[[], None] = lambda: None
        # called with (batch, layer, seq_lens) before a selection changes the working sets
        # (selection_snapshot.py; layer None: every layer, before a captured pass)
        self.before_select = before_select

    def fold_first(self, fold: Callable[[], None]) -> None:
        """Every drain first calls ``fold``: SGLang makes its CUDA graphs after this backend is built
        (``init_cuda_graph_state``), and host code that waits for the tables gets their replays' results
        (graph_hooks.py)."""
        self._before_drain = fold

    def prompts_extended(self, reqs: list[int], lengths: list[int]) -> None:
        """Request rows ``reqs`` hold ``lengths`` tokens after an extend (fault injection picks them so)."""
        self.prompt_len.update(zip(reqs, lengths, strict=True))

    def select(
        self,
        batch: BatchView,
        layer_id: int,
        queries: torch.Tensor,
        seq_lens: list[int],
        prior: torch.Tensor | None = None,
        scale: float = 0.0,
    ) -> None:
        """Choose each request's working set for the next step from ``queries`` ``[bs, q_heads, dim]``
        (or ``prior`` ``[bs, kv_heads, N]``) and submit the job that loads the blocks that changed.
        ``scale``: the layer's attention scale (``--oasis-selector codes``; 0: ``1 / sqrt(dim)``)."""
        if not seq_lens:
            return
        if batch.admits and not batch.admission:
            self._select_apart(batch, layer_id, queries, seq_lens, prior, scale)
            return
        if not batch.admission:
            prior = None  # the prefill window's: admissions only
        if self.before_select is not None:
            self.before_select(batch, layer_id, seq_lens)
        slots, config = batch.slots, self.config
        full = torch.tensor(seq_lens, dtype=torch.int64) // self.block_size
        own_k, targets = batch.top_ks(config.top_k), batch.targets(config.recall_target)  # [bs] each
        targeted = targets > 0
        if bool(targeted.any()) and not batch.admission:
            self._keep_holding_every_block(slots, layer_id, full, own_k, targeted)
        if not batch.admission and self._holds_every_block(slots, layer_id, full, targeted):
            self.working_sets.touch(slots, layer_id, batch.step)
            self.stats.add("selections", len(seq_lens))
            return
        top_k = self.working_sets.top_k
        if (
            batch.admission
        ):  # the first working sets: K, or what the window's attention needs to hold the target
            top_k[slots, layer_id] = own_k
            if bool(targeted.any()) and prior is not None:
                sized = window_top_k(prior, full, config.sink_blocks, own_k, config.max_top_k, targets)
                top_k[slots, layer_id] = torch.where(targeted, sized, own_k)
                self.stats.add("recall_target_grows", int(((sized > own_k) & targeted).sum()))
        job = self._job(batch, layer_id, queries, full, own_k, prior, scale)
        for result in self.pipeline.submit(layer_id, lambda: self.prefetcher.run(job)):
            self.account(result)

    def _select_apart(
        self,
        batch: BatchView,
        layer_id: int,
        queries: torch.Tensor,
        seq_lens: list[int],
        prior: torch.Tensor | None,
        scale: float,
    ) -> None:
        """A PD arrival's dense first step among ordinary decode rows, or re-prefilled retracted requests
        among an extend's new ones: each part selects apart, so an ordinary row's step (its cap, top-K
        and window pins) is the one it would take alone."""
        for part in (batch.admitting, ~batch.admitting):
            lens = [seq_lens[row] for row in part.nonzero().flatten().tolist()]
            part_prior = None  # the window's (the batch's widest blocks): the admissions' only
            if prior is not None and part is batch.admitting:
                part_prior = prior[part][..., : max(lens) // self.block_size]
            rows = queries[part.to(queries.device)]
            self.select(batch.subset(part), layer_id, rows, lens, part_prior, scale)

    def _holds_every_block(
        self, slots: torch.Tensor, layer_id: int, full: torch.Tensor, targeted: torch.Tensor
    ) -> bool:
        """Every block is selected and none filled up since the last selection: the working sets already
        hold them all (this layer's job was waited for), nothing to plan or move."""
        capacity = self.working_sets.top_k[slots, layer_id] + self.config.sink_blocks
        unchanged = bool((full <= capacity).all())
        if unchanged and bool(targeted.any()):  # a target that just grew K: blocks still to load
            unchanged = bool((self._held(slots, layer_id) >= full).all())
        return unchanged and bool((self.working_sets.covered[slots, layer_id] == full).all())

    def _job(
        self,
        batch: BatchView,
        layer_id: int,
        queries: torch.Tensor,
        full: torch.Tensor,
        own_k: torch.Tensor,
        prior: torch.Tensor | None,
        scale: float,
    ) -> SelectionJob:
        """The selection job of this layer's rows: their pages, the window's pins, the step's cap."""
        block, slots, admission = self.block_size, batch.slots, batch.admission
        req_to_token = self.req_to_token_pool.req_to_token
        pages = req_to_token[batch.req_index, 0 : int(full.max()) * block : block].to(torch.int64) // block
        if layer_id == self.record_layer:  # for warm starts of later requests sharing these pages
            self.slots.prefixes.record(slots, pages, full, self.summaries.epoch)
        pinned = None
        if self.window_blocks:
            if admission:  # the window's best blocks stay selected until the request's next extend
                self.pinned[slots, layer_id] = self.window.pins(prior, full, own_k)
            else:
                pinned = self.pinned[slots, layer_id].clone()
        top_k = self.working_sets.top_k[slots, layer_id]
        return SelectionJob(
            layer_id=layer_id,
            reqs=batch.req_index,
            slots=slots,
            generations=tuple(batch.generations),
            queries=queries.detach().clone(),
            prior=prior,
            pinned=pinned,
            full=full,
            pages=pages,
            step=batch.step,
            admission=admission,
            cap=None if admission else self._cap(layer_id, top_k),
            fail_reqs=() if admission else self.faults.failing(batch.reqs, self.prompt_len),
            top_k=top_k.clone(),
            scale=scale,
        )

    def _cap(self, layer_id: int, top_k: torch.Tensor) -> int | torch.Tensor | None:
        """The decode step's fetch cap: ``--oasis-fetch-ratio`` x each working set's top-K at the layer
        (``top_k`` ``[bs]``: the request's own K, or what a recall target grew it to, so a grown working
        set fills at the pace a server of that K would), the layer's when every row has the server's K;
        ``--oasis-adaptive-cap``: the layer's."""
        cap = self.caps[layer_id]
        if cap is None or self.config.adaptive_cap or bool((top_k == self.config.top_k).all()):
            return cap
        return torch.tensor([self.config.fetch_cap_for(k) or 0 for k in top_k.tolist()])

    def _keep_holding_every_block(
        self, slots: torch.Tensor, layer_id: int, full: torch.Tensor, own_k: torch.Tensor, targeted: torch.Tensor
    ) -> None:  # fmt: skip
        """Recall target (rows ``targeted``): a working set the target grew past its request's top-K
        (``own_k``) and that held every block of the layer at its last selection grows (up the ladder) to
        hold the blocks that filled up since, rather than drop one until the next recall sample notices."""
        config, top_k = self.config, self.working_sets.top_k
        current = top_k[slots, layer_id]
        capacity = current + config.sink_blocks
        held_all = self._held(slots, layer_id) >= self.working_sets.covered[slots, layer_id]
        outgrew = held_all & targeted & (current > own_k) & (full > capacity) & (current < config.max_top_k)
        if bool(outgrew.any()):
            grown = on_ladder(full - config.sink_blocks, own_k, config.max_top_k)
            top_k[slots[outgrew], layer_id] = grown[outgrew]
            self.stats.add("recall_target_grows", int(outgrew.sum()))

    def _held(self, slots: torch.Tensor, layer_id: int) -> torch.Tensor:
        """``[bs]``: blocks resident in each request's least-filled KV head's working set at the layer."""
        return (self.working_sets.slot_block[slots, layer_id] != EMPTY).sum(dim=-1).amin(dim=-1)

    def finish_pending(self) -> None:
        """Wait for every layer's pending selection and transfer (and fold a CUDA graph replay's results,
        ``fold_first``): the host's tables are then the ones the next step will find."""
        self._before_drain()
        for result in self.pipeline.drain():
            self.account(result)

    def wait(self, layer_id: int) -> None:
        """Wait for the layer's pending job (its next attention reads the working sets it loads)."""
        for result in self.pipeline.wait(layer_id):
            self.account(result)
        self.stats.add("foreground_wait_us", self.pipeline.take_waited_ns() // 1000)

    def account(self, result: JobResult) -> None:
        """Fold a finished job into the counters, the adaptive cap and the failures (foreground only:
        the counters are not thread-safe)."""
        host_loads = result.loads - result.from_active  # blocks that just filled up: from the device
        stats = self.stats
        stats.add("scored_selections", result.scored)
        stats.add("key_code_pages", result.coded)
        stats.add("selections", result.selections)
        stats.add("selection_changes", result.loads)
        stats.add_loads(
            host_loads, result.host_loads, self.working_sets.bytes_per_block, not result.admission
        )
        stats.add("stage_select_us", result.select_ns // 1000)
        stats.add("stage_transfer_us", result.transfer_ns // 1000)
        if not result.admission:
            stats.add("blocks_just_filled", result.fresh)
            stats.add("blocks_from_active", result.from_active)
            stats.add("blocks_deferred", result.deferred)
            self.caps.observe(result.layer_id, (host_loads + result.deferred) / max(1, result.heads))
        for req, (generation, message) in result.failed.items():
            if self.failures.report(
                req, generation, f"oasis: KV transfer for this request failed ({message})"
            ):
                stats.add("transfer_failures")
                logger.error("oasis: KV transfer failed for request row %d: %s", req, message)
