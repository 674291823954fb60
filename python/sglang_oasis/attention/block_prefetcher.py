"""The work of one prefetch-pipeline job: for one layer of a batch, predict (score the block summaries
with the predicting query, or with ``--oasis-selector codes`` its attention over the coded keys), select
(top-K per KV head), plan (capped delta against the resident working set) and transfer (copy the
admitted blocks from the host tier into their slots; a block that just filled up is copied from the
active blocks, on the device).

``Selector`` builds the ``SelectionJob`` in the foreground, ``PrefetchPipeline`` runs
``BlockPrefetcher.run`` (in the background unless ``--oasis-prefetch sync``), and the selector folds the
``JobResult`` into its counters when the layer's next attention waits for it. A transfer that fails is
retried request by request, and only the requests whose own copies fail are reported (to be aborted),
with the generation each had when the job was built.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, NamedTuple, Protocol, cast

import torch

from sgl_kernel_oasis import ops, select_top_blocks
from sglang_oasis.memory.active_blocks import ActiveBlocks
from sglang_oasis.memory.summary_store import BlockSummaryStore
from sglang_oasis.memory.working_set import TransferPlan, WorkingSetPool

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from sglang_oasis.memory.key_code_store import KeyCodeStore

logger = logging.getLogger(__name__)

# Fault injection for tests: decode-time transfers of requests whose prompt is exactly this many tokens
# long fail (the request must fail alone; the server keeps serving).
INJECT_ENV = "SGLANG_OASIS_INJECT_TRANSFER_FAILURE"


class OasisTransferError(RuntimeError):
    """A block transfer into a working set failed."""


class SelectionJob(NamedTuple):
    """One layer's prediction -> selection -> transfer for a batch, as handed to the pipeline."""

    layer_id: int
    reqs: torch.Tensor  # [bs] SGLang's req pool indices
    slots: torch.Tensor  # [bs] their device request slots
    generations: tuple[int, ...]  # SGLang's generation of each request when the job was built
    queries: torch.Tensor  # [bs, q_heads, dim] the predicting query rows
    prior: torch.Tensor | None  # [bs, kv_heads, N] scores replacing the summaries' (prefill window)
    pinned: torch.Tensor | None  # [bs, kv_heads, P] blocks always selected (prefill window), -1: none
    full: torch.Tensor  # [bs] full blocks of each request
    top_k: torch.Tensor  # [bs] blocks each request's heads select by score (the sinks aside)
    pages: torch.Tensor  # [bs, N] host page of each logical block
    step: int
    admission: bool  # the first working set after an extend: nothing capped, nothing "fresh"
    cap: int | torch.Tensor | None  # None: no cap; [bs]: each request's own
    fail_reqs: tuple[int, ...]  # injected failures
    scale: float = 0.0  # the layer's attention scale (--oasis-selector codes' softmax); 0: 1 / sqrt(dim)


class JobResult(NamedTuple):
    layer_id: int
    admission: bool
    selections: int
    loads: int
    fresh: int  # loads of blocks that filled up since the last selection
    from_active: int  # of those, copied from the active blocks (the rest, and every other load: host)
    scored: int  # requests whose selection scored the summaries (or the prior) and ran top-K
    deferred: int
    heads: int
    select_ns: int
    transfer_ns: int
    failed: dict[int, tuple[int, str]]  # req row -> (generation of the request that failed, message)
    host_loads: tuple[tuple[int, int, int], ...] = ()  # (req row, generation, blocks read from the host)
    coded: int = 0  # --oasis-selector codes: pages whose keys this job coded


class RemoteBlocks(Protocol):
    """Where blocks still on another node are read from before a load (remote partial fetching's decode
    side, ``disaggregation/decode_fetcher.py``'s ``DecodeFetcher``)."""

    tp_size: int  # tensor-parallel ranks (each reads its own KV heads' blocks)

    def ensure(self, layer: int, wanted: dict[int, torch.Tensor]) -> dict[int, str]:
        """Read ``wanted`` (request row -> blocks) of ``layer`` into the host tier where they are not yet;
        returns the rows whose reads failed, with a message."""
        ...

    def whole(self, req: int) -> bool:
        """Whether request row ``req`` holds all its KV in the local host tier (never reads)."""
        ...


class BlockPrefetcher:
    """Runs selection jobs against the working sets, the summaries and the host tier (SGLang's pool)."""

    def __init__(
        self,
        working_sets: WorkingSetPool,
        summaries: BlockSummaryStore,
        active: ActiveBlocks,
        kv_pool: MHATokenToKVPool,
        sink_blocks: int,
        num_kv_heads: int,
        codes: KeyCodeStore | None = None,
        code_candidates: int = 0,
    ) -> None:
        self.working_sets = working_sets
        self.codes = codes  # --oasis-selector codes: blocks ranked by their coded keys' attention mass
        self.code_candidates = code_candidates  # --oasis-code-candidates (0: every full block coded)
        self.summaries = summaries
        self.active = active
        self.kv_pool = kv_pool
        self.sink_blocks = sink_blocks
        self.num_kv_heads = num_kv_heads
        # Prefill node of remote partial fetching (``record_admissions``): request row -> layer ->
        # ``[kv_heads, N]``, its last admission's selection.
        self._admissions: dict[int, dict[int, torch.Tensor]] | None = None
        # Decode node of remote partial fetching (``read_remote_first``): reads blocks still on the
        # prefill node before loads.
        self.remote: RemoteBlocks | None = None

    def record_admissions(self) -> None:
        """From now on keep each request row's last admission selection per layer (a prefill node of
        remote partial fetching hands them to the decode node: ``admitted``)."""
        if self._admissions is None:
            self._admissions = {}

    def read_remote_first(self, remote: RemoteBlocks) -> None:
        """From now on read the blocks a load needs that are still on the prefill node through
        ``remote`` first (a PD decode node: it starts once SGLang's server arguments say so)."""
        self.remote = remote

    def admitted(self, req: int) -> dict[int, torch.Tensor]:
        """Request row ``req``'s last admission selection per layer (``[kv_heads, N]`` bool; empty: none
        recorded)."""
        return (self._admissions or {}).get(req, {})

    def run(self, job: SelectionJob) -> JobResult:
        """Prediction -> selection -> transfer for one layer of a batch (runs in the pipeline). An error
        anywhere in it fails the job's requests (reported like a failed transfer), never the process: the
        scheduler would otherwise meet it in ``wait`` and die with every request."""
        try:
            return self._run(job)
        except Exception as error:
            logger.exception("oasis: selection job of layer %d failed", job.layer_id)
            message = f"layer {job.layer_id}: {type(error).__name__}: {error}"
            failed = {
                req: (generation, message)
                for req, generation in zip(job.reqs.tolist(), job.generations, strict=True)
            }
            return JobResult(job.layer_id, job.admission, len(job.reqs),
                             0, 0, 0, 0, 0, 0, 0, 0, failed)  # fmt: skip

    def _run(self, job: SelectionJob) -> JobResult:
        started = time.perf_counter_ns()
        # Blocks from the last selection's coverage on filled up since: the active block, no transfer.
        fresh_from = None if job.admission else self.working_sets.covered[job.slots, job.layer_id].clone()
        self.working_sets.covered[job.slots, job.layer_id] = job.full
        if job.pages.shape[1] == 0:  # no request has a full block yet
            return JobResult(job.layer_id, job.admission, len(job.reqs),
                             0, 0, 0, 0, 0, 0, 0, 0, {})  # fmt: skip
        selected, priority, scored, coded = self._choose(job)
        if job.admission and self._admissions is not None:
            for row, req in enumerate(job.reqs.tolist()):
                layers = self._admissions.setdefault(req, {})
                layers[job.layer_id] = selected[row, :, : int(job.full[row])].clone()
        chosen = time.perf_counter_ns()
        capacity = job.top_k + self.sink_blocks
        plan = self.working_sets.plan_selections(
            job.slots, job.layer_id, selected, job.step, job.cap, fresh_from, priority,
            None if bool((capacity >= self.working_sets.num_slots).all()) else capacity,
        )  # fmt: skip
        fresh = torch.zeros(plan.num_loads, dtype=torch.bool)
        if fresh_from is not None:
            fresh = plan.blocks >= fresh_from[plan.batch_rows]
        from_active = self._copy_from_active(job, plan, fresh)
        generation = dict(zip(job.reqs.tolist(), job.generations, strict=True))
        host_plan = plan.subset(~from_active, plan.deferred)
        failed = {req: (generation[req], message) for req, message in self._transfer(job, host_plan).items()}
        per_row = torch.bincount(host_plan.batch_rows, minlength=len(job.reqs)).tolist()
        host_loads = tuple(
            (req, generation[req], n) for req, n in zip(job.reqs.tolist(), per_row, strict=True) if n
        )
        return JobResult(
            layer_id=job.layer_id,
            admission=job.admission,
            selections=len(job.reqs),
            loads=plan.num_loads,
            fresh=int(fresh.sum()),
            from_active=int(from_active.sum()),
            scored=scored,
            deferred=plan.deferred,
            heads=len(job.reqs) * self.num_kv_heads,
            select_ns=chosen - started,
            transfer_ns=time.perf_counter_ns() - chosen,
            failed=failed,
            host_loads=host_loads,
            coded=coded,
        )

    def _choose(self, job: SelectionJob) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """``[bs, kv_heads, N]``: the blocks each head should hold next step, and their priority (summary
        score, or the job's prior where it has one; sink blocks first); and how many requests had more
        blocks than their working sets hold (scored and ran top-K)."""
        num_blocks = job.pages.shape[1]
        index = torch.arange(num_blocks)
        valid = index[None, :] < job.full[:, None]  # [bs, N]
        selected = valid[:, None, :].expand(-1, self.num_kv_heads, -1).clone()
        priority = torch.zeros(selected.shape)
        over = job.full > job.top_k + self.sink_blocks
        # every row's full blocks coded, scored here or not: the captured step codes only what fills
        coded = 0 if self.codes is None else self.codes.ensure(job.layer_id, job.pages[valid], self.kv_pool)
        if bool(over.any()):
            if job.prior is not None:
                scores = job.prior[over]  # [n, H, N]
            elif self.codes is not None:  # --oasis-selector codes: the decoded keys' attention mass
                scores = self._coded_mass(job, over, valid)
            else:
                scores = self._bound(job, over)
            if job.pinned is not None:  # the window's blocks outrank every summary score
                pinned = job.pinned[over]
                forced = torch.zeros((*scores.shape[:-1], num_blocks + 1), dtype=torch.bool)
                forced.scatter_(-1, torch.where(pinned >= 0, pinned, num_blocks), True)  # -1: column N
                scores = scores.masked_fill(forced[..., :num_blocks], float("inf"))
            sinks = (index < self.sink_blocks)[None, None, :]
            top_k, valid_over = job.top_k[over], valid[over][:, None, :]
            chosen = torch.zeros(scores.shape, dtype=torch.bool)
            for k in top_k.unique().tolist():  # one top-K per size (one unless a recall target grew some)
                rows = top_k == k
                chosen[rows] = select_top_blocks(scores[rows], int(k), sinks, valid_over[rows])
            selected[over] = chosen
            priority[over] = scores.masked_fill(sinks, float("inf"))
        return selected, priority, int(over.sum()), coded

    def _bound(self, job: SelectionJob, over: torch.Tensor) -> torch.Tensor:
        """``[n, H, N]``: the ``over`` rows' blocks scored by the min/max summaries' bound for their
        predicting query (Quest's score)."""
        kmin, kmax = self.summaries.kmin[job.layer_id], self.summaries.kmax[job.layer_id]
        device = kmin.device
        queries, pages = job.queries[over][:, None].to(device), job.pages[over].to(device, non_blocking=True)
        return ops.score_paged_blocks(queries, kmin, kmax, pages)[:, 0].cpu()

    def _coded_mass(self, job: SelectionJob, over: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """``[n, H, N]``: the ``over`` rows' blocks scored by the attention mass of their predicting query
        over their full blocks' coded keys (``key_code_store.py``). With ``--oasis-code-candidates m``, a
        row with more than m x K full blocks scores each KV head's m x K best by the summaries' bound
        alone (others score 0)."""
        codes = cast("KeyCodeStore", self.codes)
        pages, full, valid = job.pages[over], job.full[over], valid[over]
        candidates = None
        if self.code_candidates:
            counts = torch.minimum(full, self.code_candidates * job.top_k[over])  # [n]
            if bool((counts < full).any()):
                candidates = self._candidates(self._bound(job, over), valid, counts)
        scale = job.scale or job.queries.shape[-1] ** -0.5
        return codes.block_mass(job.layer_id, job.queries[over], pages, full, scale, candidates).cpu()

    @staticmethod
    def _candidates(bound: torch.Tensor, valid: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``[n, H, max(counts)]``: each row's ``counts[row]`` best full blocks per KV head by ``bound``
        ``[n, H, N]``, -1 past a row's count."""
        scores = bound.masked_fill(~valid[:, None, :], float("-inf"))
        ranked = scores.argsort(dim=-1, descending=True, stable=True)[..., : int(counts.max())]
        return ranked.masked_fill(torch.arange(ranked.shape[-1]) >= counts[:, None, None], -1)

    def _copy_from_active(self, job: SelectionJob, plan: TransferPlan, fresh: torch.Tensor) -> torch.Tensor:
        """Copy the loads of blocks that just filled up and are still in the active blocks from there
        (device to device); returns ``[loads]`` bool, the loads done."""
        slots, block = job.slots[plan.batch_rows], self.active.block_size
        held = fresh & self.active.holds(slots, job.layer_id, plan.blocks * block, (plan.blocks + 1) * block)
        if bool(held.any()):
            layer = job.layer_id
            pages = self.active.pages(slots[held], plan.blocks[held])
            self.working_sets.load_pages(
                plan.subset(held), job.slots, layer, pages, self.active.k[layer], self.active.v[layer]
            )
        return held

    def _transfer(self, job: SelectionJob, plan: TransferPlan) -> dict[int, str]:
        """Copy the plan's blocks in; a failure is retried request by request, and the requests whose
        own transfer fails are returned (slot -> message) to be failed alone."""
        pool = self.kv_pool
        k_buffer, v_buffer = pool.get_key_buffer(job.layer_id), pool.get_value_buffer(job.layer_id)
        failed: dict[int, str] = {}
        if self.remote is not None and plan.num_loads:
            plan, failed = self._read_remote(job, plan, self.remote)
        try:
            self._check_injected(job, plan.batch_rows)
            self.working_sets.load(plan, job.slots, job.layer_id, job.pages, k_buffer, v_buffer)
            return failed
        except Exception as error:
            logger.warning(
                "oasis: batched transfer of layer %d failed (%s); retrying request by request",
                job.layer_id,
                error,
            )
        for row, req in enumerate(job.reqs.tolist()):
            own = plan.subset(plan.batch_rows == row)
            try:
                self._check_injected(job, own.batch_rows)
                self.working_sets.load(own, job.slots, job.layer_id, job.pages, k_buffer, v_buffer)
            except Exception as error:
                failed[req] = f"layer {job.layer_id}: {type(error).__name__}: {error}"
        return failed

    def _read_remote(
        self, job: SelectionJob, plan: TransferPlan, remote: RemoteBlocks
    ) -> tuple[TransferPlan, dict[int, str]]:
        """Remote partial fetching: the planned blocks still on the prefill node are read into the host
        tier first (all requests of the batch at once). Requests whose reads fail are returned and their
        loads dropped from the plan."""
        reqs = job.reqs.tolist()
        wanted = {req: plan.blocks[plan.batch_rows == row] for row, req in enumerate(reqs)}
        wanted = {req: blocks for req, blocks in wanted.items() if blocks.numel()}
        try:
            failed = remote.ensure(job.layer_id, wanted)
        except Exception as error:  # never the process: every request of the batch with reads fails
            logger.exception("oasis: remote reads of layer %d failed", job.layer_id)
            failed = {req: f"remote KV read for layer {job.layer_id} failed: {error}" for req in wanted}
        if not failed:
            return plan, {}
        keep = torch.tensor([reqs[row] not in failed for row in plan.batch_rows.tolist()], dtype=torch.bool)
        return plan.subset(keep, plan.deferred), failed

    def _check_injected(self, job: SelectionJob, rows: torch.Tensor) -> None:
        if job.fail_reqs and rows.numel():
            hit = set(job.reqs[rows].tolist()) & set(job.fail_reqs)
            if hit:
                raise OasisTransferError(
                    f"injected transfer failure ({INJECT_ENV}) for request slot(s) {sorted(hit)}"
                )
