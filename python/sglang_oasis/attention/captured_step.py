"""``--oasis-decode-step captured``: plain decode batches' sparse layers through the compiled
``decode_layer`` (``decode_program.py``), and verify passes' (the lookahead's real and draft rows).

Per decode pass, at its first sparse layer, ``CapturedStep.prepare`` (host side) decides whether the pass
runs captured (``eligible``: every row an ordinary decode row whose tail the active blocks hold, nothing
the program does not cover; a recall sample's rows and the rows' targets go into the plan), waits for any
eager prefetch job pending, does the step's host bookkeeping once for every layer (new pages' epochs, the
warm-start record, the retraction snapshot, the summarised positions) and pads the batch to its buckets.
Each sparse layer then runs the compiled program; its counts are folded into the server's after the last.

The program is compiled alone (``torch.compile(fullgraph=True, dynamic=False)``), not by SGLang's CPU graph
runner (``--enable-torch-compile``): that runner compiles the whole model per batch size (minutes per size on
these CPUs), needs every layer's backend to support CPU graphs (the dense layers' torch_native does not) and
refuses speculative decoding (the lookahead). One compiled graph per kind of pass serves every batch bucket
above one row and every block bucket (both dimensions symbolic, ``StepPlan.mark_symbolic``; one row has a
graph of its own), every sparse layer (their state views have the same strides) and every step (the step
is a tensor).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from sglang_oasis.attention.batch_view import BatchView
from sglang_oasis.attention.captured_pass import Planned, fold_pass
from sglang_oasis.attention.compile_ahead import CompileAhead, Compiles, kind_of
from sglang_oasis.attention.decode_program import COUNTS, LayerState, decode_layer
from sglang_oasis.attention.request_slots import RequestSlots
from sglang_oasis.attention.sparse_attention import verify_tree_mask
from sglang_oasis.attention.step_plan import (
    StepPlan,
    StepShape,
    bucket,
    held_slots,
    powers_of_two,
    steps_of,
    symbolic_rows,
)
from sglang_oasis.attention.sync_guard import guarded, sync_guard_on
from sglang_oasis.memory.device_tier import DeviceTier
from sglang_oasis.stats import OasisStats

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

    from sglang_oasis.attention.block_prefetcher import JobResult
    from sglang_oasis.attention.kv_intake import KVIntake
    from sglang_oasis.attention.recall_probe import RecallProbe
    from sglang_oasis.attention.selector import Selector
    from sglang_oasis.attention.strict_mode import StrictMode
    from sglang_oasis.config import OasisConfig

logger = logging.getLogger(__name__)

MIN_BLOCK_BUCKET = 64
BLOCK_BUCKET_STEP = 16  # blocks: at most 15 padded ones a pass


class StepParts(Protocol):
    """What the captured step takes from the oasis backend (``OasisAttnBackend``, which imports this file)."""

    config: OasisConfig
    tier: DeviceTier
    token_to_kv_pool: MHATokenToKVPool
    req_to_token_pool: ReqToTokenPool
    slots: RequestSlots
    stats: OasisStats
    sparse_layers: list[int]
    selector: Selector
    intake: KVIntake
    strict: StrictMode | None
    recall: RecallProbe


class CapturedStep:
    verify_rows = True  # TARGET_VERIFY passes run the program too (``GraphedStep``: not yet)
    sample_passes = True  # passes with a recall sample due too (``GraphedStep``: another graph; eager)
    probe: RecallProbe | None = None  # the server's recall probe (None: no sample, no target)

    def __init__(
        self, config: OasisConfig, tier: DeviceTier, kv_pool: MHATokenToKVPool, req_to_token: torch.Tensor,
        slots: RequestSlots, stats: OasisStats, sparse_layers: Sequence[int],
    ) -> None:  # fmt: skip
        if tier.padding_slot is None:
            raise ValueError("a captured decode step needs the device tier's padding slot")
        self.tier, self.kv_pool, self.req_to_token = tier, kv_pool, req_to_token
        self.slots, self.stats = slots, stats
        self.shape = StepShape.of(config, tier.active.span, tier.working_sets.num_slots, tier.padding_slot)
        self.sparse_layers = list(sparse_layers)
        self.batch_buckets = powers_of_two(1, tier.num_request_slots)
        blocks = req_to_token.shape[1] // config.block_size
        # The block dimension is symbolic in the graph (one graph whatever the contexts); buckets of more
        # than a working set's slots keep it one (no branch on N < S, and no
        # bucket of exactly S, which torch would specialize to a constant: seen, 128 slots). Above the
        # first, a bucket every BLOCK_BUCKET_STEP blocks: a pass scores and sorts its bucket's blocks, and
        # powers of two padded 188 blocks to 256 (the key codes score each one's keys)
        first = max(MIN_BLOCK_BUCKET, tier.working_sets.num_slots + 1)
        self.block_buckets = steps_of(first, blocks, BLOCK_BUCKET_STEP)
        self.program: Callable[..., tuple[torch.Tensor, torch.Tensor]] = torch.compile(
            decode_layer, fullgraph=True, dynamic=False
        )
        self._states: dict[int, LayerState] = {}
        self.compiles = Compiles(stats)  # the shapes the program has run at; torch's compiles there
        self.ahead: CompileAhead | None = None  # the programs compiled before ready (None: at first use)
        if sync_guard_on():  # SGLANG_OASIS_SYNC_GUARD=1: the program uncompiled, each call under the guard
            self.program = guarded(decode_layer)
            logger.warning(
                "oasis: the captured decode step runs uncompiled under the sync guard (a test mode)"
            )
        self.plan: StepPlan | None = None  # what the program reads (on the tier's device)
        self.planned = Planned.none()  # the host's record of the planned pass
        self.rows = 0
        self.layers_done = 0  # sparse layers of the planned pass the program ran
        self.counts = torch.zeros((0, len(COUNTS)), dtype=torch.int64)
        self.pending = False  # a decode pass began that may run captured; its first sparse layer plans it
        self.finish_pending: Callable[[], None] = lambda: None  # eager prefetch jobs still running
        self.account: Callable[[JobResult], None] = lambda result: None  # ``Selector.account``
        self.before_select: Callable[[BatchView, int | None, list[int]], None] | None = None
        # False while the server runs what the program does not cover (strict mode, fault injection,
        # remote reads under tensor parallelism): every pass then runs eagerly
        self.covers: Callable[[], bool] = lambda: True
        # Every row's KV in the local host tier? (remote partial fetching: until a request's remaining
        # blocks are read, its passes run eagerly, reading what its working sets need)
        self.local: Callable[[BatchView], bool] = lambda batch: True
        # The step folds its token into every sparse layer's summaries: they are summarised up to ``upto``
        self.summarised: Callable[[BatchView, torch.Tensor], None] = lambda batch, upto: None
        # Keys committed since the last summary update into every sparse layer's summaries (``KVIntake.catch_up``)
        self.catch_up: Callable[[BatchView, torch.Tensor], None] = lambda batch, upto: None

    @classmethod
    def for_backend(cls, backend: StepParts, model_runner: ModelRunner | None = None) -> CapturedStep:
        """The captured step of an ``OasisAttnBackend``, over its device tier, pool and counters; with SGLang's
        ``model_runner``, its programs compile before the server is ready (``compile_ahead.py``)."""
        config = backend.config
        step = cls(
            config, backend.tier, backend.token_to_kv_pool, backend.req_to_token_pool.req_to_token, backend.slots,
            backend.stats, backend.sparse_layers,
        )  # fmt: skip
        if model_runner is not None and not sync_guard_on():
            sampling = config.recall_sample_every > 0
            step.ahead = CompileAhead.for_server(
                step.batch_buckets, model_runner, config.verify_rows, sampling
            )
        selector = backend.selector
        step.finish_pending, step.before_select = selector.finish_pending, selector.before_select
        step.account = selector.account
        intake, layers = backend.intake, backend.sparse_layers
        step.summarised = lambda batch, upto: intake.mark(batch.req_index, layers, upto)
        step.probe = backend.recall
        step.catch_up = lambda batch, upto: intake.catch_up_layers(batch, layers, upto)
        remote = selector.prefetcher.remote  # remote partial fetching (a PD decode node)
        step.covers = lambda: backend.strict is None and selector.faults.prompt_len is None and (
            remote is None or remote.tp_size == 1  # under TP the ranks' blocks arrive apart: eager
        )  # fmt: skip
        step.local = lambda batch: remote is None or all(remote.whole(req) for req in batch.reqs)
        return step

    def begin(self, plain_decode: bool) -> None:
        """A forward pass begins: a decode pass of ordinary rows may run captured (decided at its first
        sparse layer, ``ready``)."""
        self.plan, self.pending = None, plain_decode and self.covers()

    def run(
        self, batch: BatchView, forward_batch: ForwardBatch, layer: RadixAttention, q: torch.Tensor,
        k: torch.Tensor | None, v: torch.Tensor | None,
    ) -> torch.Tensor | None:  # fmt: skip
        """A sparse layer's decode, captured when the pass is (its first sparse layer plans it); None: the
        layer runs eagerly."""
        if self.pending and self.ahead is not None and not self.ahead.done:  # SGLang's warm-up: before ready
            self.ahead.run(self, layer, q.dtype)
        if k is None or v is None or not self.ready(batch, forward_batch):
            return None
        return self.decode(layer, q, k, v)

    def ready(self, batch: BatchView, forward_batch: ForwardBatch) -> bool:
        """At a sparse layer of the pass: whether it runs captured (its first plans the pass)."""
        if self.pending:
            self.pending = False
            self.finish_pending()  # the eager step's jobs change the tables the plan reads
            cpu = getattr(forward_batch, "seq_lens_cpu", None)  # SGLang's host copy, if it has one
            seq_lens = (forward_batch.seq_lens if cpu is None else cpu).cpu().to(torch.int64)
            locs = forward_batch.out_cache_loc.cpu().to(torch.int64)
            bs = len(batch.reqs)
            rows = len(locs) // max(1, bs)
            if rows == 1:
                self.prepare(batch, seq_lens, locs)
            elif self.verify_rows:  # TARGET_VERIFY: SGLang's seq_lens leave out row 0, committed here
                tree = verify_tree_mask(forward_batch, bs, rows)
                self.prepare(batch, seq_lens + 1, locs.view(bs, rows), tree)
        return self.plan is not None

    def prepare(
        self, batch: BatchView, seq_lens: torch.Tensor, locs: torch.Tensor, tree: torch.Tensor | None = None
    ) -> bool:
        """Plan a decode pass of ``batch`` (``seq_lens`` with this step's token at host ``locs``; a verify
        pass: ``locs`` ``[bs, R]``, row 0 the committed token, and the rows' ``tree``); False: it runs
        eagerly."""
        self.plan = None
        bs, rows = len(batch.reqs), 1 if tree is None else tree.shape[1]
        if bs == 0 or bs > self.batch_buckets[-1] or not self.local(batch):
            return False
        if not self._tails_held(batch, seq_lens, rows):
            return False
        block = self.shape.block_size
        full = int(seq_lens.max()) // block
        if full > self.block_buckets[-1]:
            return False
        recall = None if self.probe is None else self.probe.plan_fields(batch)
        sample = recall is not None and recall[2] is not None
        if sample and not self.sample_passes:
            return False
        if self.ahead is not None and not self.ahead.covers(
            bucket(bs, self.batch_buckets), kind_of(rows > 1, sample)
        ):
            self.stats.add("captured_uncompiled_passes")  # not compiled before ready: eager, not a stall
            return False
        if self.before_select is not None:  # retraction's snapshot of the tables the step will change
            self.before_select(batch, None, seq_lens.tolist())
        # keys committed since the summaries last saw them (a verify's accepted drafts, a resumed retracted
        # request's restored pages) join every sparse layer's summaries first, as in the eager step
        self.catch_up(batch, seq_lens - 1)
        drafts = None
        if tree is not None:
            locs, drafts = locs[:, 0], locs[:, 1:]
        summaries = self.tier.summaries
        plan = StepPlan.build(
            batch.slots, seq_lens, locs, self.req_to_token, batch.req_index, batch.step, self.shape,
            bucket(bs, self.batch_buckets), bucket(full, self.block_buckets), drafts, tree, recall,
        )._replace(held=held_slots(self.tier, batch.slots))  # fmt: skip
        self.slots.prefixes.record(batch.slots, plan.pages[:bs, :full], seq_lens // block, summaries.epoch)
        self.summarised(batch, seq_lens)
        self.plan, self.rows, self.planned = self.upload(plan, batch), bs, Planned(batch, seq_lens, plan)
        self.plan.mark_symbolic()  # one graph for every batch bucket above one row and every block bucket
        self.layers_done = 0
        self.counts = torch.zeros((len(plan.slots), len(COUNTS)), dtype=torch.int64, device=self.tier.device)
        return True

    def upload(self, plan: StepPlan, batch: BatchView) -> StepPlan:
        """The host plan's writes and ``plan`` to the device (on CPU: nothing to do): the batch's rows of
        the tier's tables (``tier_tables.py``), then the plan the program reads."""
        self.tier.tables.upload(batch.slots)
        return plan.to(self.tier.device)

    def _tails_held(self, batch: BatchView, seq_lens: torch.Tensor, rows: int) -> bool:
        """Every sparse layer's tail (positions ``covered * B .. seq_len - 1``) is in the active blocks with
        room for the step's ``rows`` tokens, and at most one block filled up since the last selection."""
        layers, slots = self.sparse_layers, batch.slots
        if bool((slots < 0).any()):
            return False
        covered = self.tier.working_sets.covered[slots][:, layers]  # [bs, layers]
        position = (seq_lens - 1)[:, None]
        starts = covered * self.shape.block_size
        held = self.tier.active.holds(slots[:, None], torch.tensor(layers), starts, position)
        short = position - starts + rows <= self.shape.span
        fresh = (seq_lens // self.shape.block_size)[:, None] - covered <= 1
        return bool((held & short & fresh).all())

    def decode(
        self, layer: RadixAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor | None:
        """One sparse layer (SGLang's ``RadixAttention``) of the planned pass: SGLang's ``q``, ``k``, ``v``
        rows of the batch's requests; returns the attention output as SGLang's decode does (None: the
        program failed: the layer runs eagerly, and every later pass; a failure to compile, the likely
        one, changed nothing)."""
        plan, bs, layer_id = self.plan, self.rows, layer.layer_id
        assert plan is not None
        heads, per_request = self.tier.shape.num_kv_heads, 1 if plan.tree is None else plan.tree.shape[1]
        lead = (bs,) if plan.tree is None else (bs, per_request)  # a verify pass: its rows per request
        # contiguous, as the programs compiled ahead were (strides are in torch's guards)
        q = q.reshape(*lead, layer.tp_q_head_num, layer.qk_head_dim).contiguous()
        k, v = k.reshape(*lead, heads, -1).contiguous(), v.reshape(*lead, heads, -1).contiguous()
        rows = len(plan.slots)
        if rows > bs:  # padding rows: zeros (their outputs are dropped)

            def padded(t: torch.Tensor) -> torch.Tensor:
                return torch.cat([t, t.new_zeros((rows - bs, *t.shape[1:]))])

            q, k, v = padded(q), padded(k), padded(v)
        symbolic_rows(q, k, v)  # as the plan's rows (``prepare``)
        state = self.state(layer_id)
        try:
            with self.compiles.at(
                rows, plan.pages.shape[1], kind_of(plan.tree is not None, plan.sampled is not None)
            ):
                out, counts = self.program(self.shape, state, plan, q, k, v, layer.scaling)
        except Exception:  # never the process: this server decodes eagerly from here on
            logger.exception("oasis: the captured decode step failed (%d rows x %d blocks); decoding eagerly "
                             "from now on", rows, plan.pages.shape[1])  # fmt: skip
            self.covers = lambda: False
            if self.layers_done:  # what the program did at the layers before: the host's, and counted
                self._fold(bs, self.layers_done)
            self.plan = None  # this layer and the pass's later ones run eagerly, as any eager pass
            return None
        self.counts += counts
        self.layer_done(layer_id, bs)
        return out[:bs].reshape(bs * per_request, layer.tp_q_head_num * layer.v_head_dim)

    def layer_done(self, layer_id: int, batch_rows: int) -> None:
        """The program ran ``layer_id``: at the summaries' epoch layer, the pages the step's tokens start
        get a new epoch (once per pass, as the eager step does there); after the last sparse layer the
        pass's counts go into the server's (``GraphedStep``: at the next pass)."""
        self.layers_done += 1
        summaries = self.tier.summaries
        if layer_id == summaries.epoch_layer:
            summaries.restart_epochs(self.planned.plan.locs[:batch_rows])
        if layer_id == self.sparse_layers[-1]:
            self.last_layer_done(batch_rows)

    def last_layer_done(self, batch_rows: int) -> None:
        self._fold(batch_rows)

    def state(self, layer_id: int) -> LayerState:
        """The program's views of ``layer_id``'s tier and pool (made once per layer)."""
        state = self._states.get(layer_id)
        if state is None:
            state = self._states[layer_id] = LayerState.of(self.tier, self.kv_pool, layer_id)
        return state

    def _fold(self, batch_rows: int, layers: int | None = None) -> None:
        """The pass's counts into the server's (``captured_pass.fold_pass``; ``layers``: the sparse layers the
        program ran, when it stopped before the last)."""
        fold_pass(self, batch_rows, len(self.sparse_layers) if layers is None else layers)
