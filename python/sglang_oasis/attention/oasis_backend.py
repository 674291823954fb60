"""SGLang attention backend ``oasis``: dense prefill, sparse decode over per-KV-head working sets.

In sparse mode SGLang's KV pool is the host tier (page size = block size); the device tier
(``memory/device_tier.py``) holds the block summaries and each running request's working sets. This
class adapts SGLang's backend interface to the parts that do the work, one file each: ``request_slots.py``
(device slots; warm starts), ``sparse_attention.py`` (working set + active tail), ``selector.py`` (top-K
and the prefetch jobs), ``captured_step.py`` and ``graph_hooks.py`` (the step compiled on CPU, in CUDA
graphs), ``pd_node.py`` (PD arrivals), ``transfer_failures.py``, ``extend_attention.py`` and
``triton_prefill.py`` (dense extends: after a cached prefix only their own rows; on CUDA SGLang's Triton).

An extend attends densely, folds the new keys into the summaries and selects the first working sets (by
the prefill window's exact attention, ``--oasis-prefill-window``, or the summaries). Decode step t attends
over each KV head's working set plus the active tail, then the step's query (or the lookahead's) selects
the blocks for step t+1, loaded in the background; step t+1 at that layer waits for that job only.
Layers in ``dense_layers`` decode densely. K covering every block: dense output.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sglang_oasis.attention.batch_view import BatchView, extend_prefix_lens, extend_seq_lens, host_ints
from sglang_oasis.attention.block_prefetcher import INJECT_ENV
from sglang_oasis.attention.captured_step import CapturedStep
from sglang_oasis.attention.draft_backend import DraftAttnBackend
from sglang_oasis.attention.extend_attention import CachedPrefixExtend
from sglang_oasis.attention.gauges import Gauges, held_by
from sglang_oasis.attention.graph_hooks import GraphHooks
from sglang_oasis.attention.kv_intake import KVIntake
from sglang_oasis.attention.oracle import attention_kind
from sglang_oasis.attention.pd_node import PDNode
from sglang_oasis.attention.recall_probe import RecallProbe
from sglang_oasis.attention.request_options import RequestOptions, batch_params, read_options, retraction_keys
from sglang_oasis.attention.request_slots import RequestSlots
from sglang_oasis.attention.retraction import Retractions
from sglang_oasis.attention.selection_snapshot import SelectionSnapshot
from sglang_oasis.attention.selector import FaultInjection, Selector
from sglang_oasis.attention.sparse_attention import verify_tree_mask
from sglang_oasis.attention.strict_mode import StrictMode
from sglang_oasis.attention.transfer_failures import TransferFailures
from sglang_oasis.attention.triton_prefill import TritonPrefill
from sglang_oasis.config import OasisConfig
from sglang_oasis.memory.device_tier import DeviceTier
from sglang_oasis.serving_gates import Serving, check_host_tier, check_sparse_serving
from sglang_oasis.stats import OasisStats, injects_here

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class OasisAttnBackend(GraphHooks, TritonPrefill, CachedPrefixExtend, TorchNativeAttnBackend):
    # SGLang declares them KVCache and ReqToTokenPool | None: this backend serves MHA pools (``head_num``)
    token_to_kv_pool: MHATokenToKVPool
    req_to_token_pool: ReqToTokenPool

    def __init__(
        self, model_runner: ModelRunner, config: OasisConfig, faults: FaultInjection | None = None,
        strict: StrictMode | None = None,
    ) -> None:  # fmt: skip
        check_sparse_serving(config, Serving.of(model_runner))  # serving_gates.py: as the launcher refuses
        super().__init__(model_runner)
        pool, self.config, self.block_size = self.token_to_kv_pool, config, config.block_size
        check_host_tier(pool, model_runner.device)
        self.init_triton_prefill(model_runner, config.prefill_attention)  # triton_prefill.py: extends
        if pool.page_size != self.block_size:
            raise ValueError(f"oasis backend needs --page-size {self.block_size} (= --oasis-block-size), got "
                             f"{pool.page_size}")  # fmt: skip
        self.num_kv_heads, args = pool.head_num, model_runner.server_args
        self.tier = tier = DeviceTier.for_pool(
            pool, config, getattr(args, "max_running_requests", None), self.req_to_token_pool, self.device
        )
        tier.cap_running_requests(model_runner)
        self.summaries, self.working_sets, self.pinned = tier.summaries, tier.working_sets, tier.pinned  # fmt: skip
        self.dense_layers = frozenset(config.dense_layers)
        self.sparse_layers = [layer for layer in range(pool.layer_num) if layer not in self.dense_layers]
        self.stats = OasisStats.attach(args.port)
        self.failures = TransferFailures()
        self.slots = RequestSlots(self.tier, self.req_to_token_pool, self.block_size)
        snapshot = SelectionSnapshot(self.working_sets)  # tables before each selection (retraction.py)
        self.selector = Selector(
            config, self.tier, self.slots, pool, self.req_to_token_pool, self.summaries.epoch_layer, self.stats,
            self.failures, faults or FaultInjection(), self.device, snapshot.remember,
        )  # fmt: skip
        self.strict = strict  # tests: prove decode attention reads the device tier only (strict_mode.py)
        self.attention = attention_kind(config)(  # oracle.py: an evaluation-only oracle's attention
            tier, self.req_to_token_pool, pool, self.block_size, self.stats, strict is not None
        )
        self.recall = RecallProbe(
            config.recall_sample_every, tier, self.req_to_token_pool, pool, config.top_k, self.stats,
            config.recall_target, config.max_top_k,
        )  # fmt: skip
        self.intake = KVIntake(tier, self.attention, pool, len(self.req_to_token_pool.req_to_token))
        self.pd = PDNode(config, self.slots, self.selector, pool, self.intake, self.stats, self.failures)
        self.batch = BatchView.empty()
        self.step = 0
        self.pd.start(args)  # remote partial fetching under PD disaggregation
        self.retractions = Retractions(self.slots, self.selector, snapshot, self.attention, self.recall,
                                       self.intake, self.stats, self.sparse_layers, lambda: self.step, self.pd)  # fmt: skip
        captured = config.decode_step == "captured"  # captured_step.py; CUDA graphs: graph_hooks.py
        self.captured = CapturedStep.for_backend(self, model_runner) if captured else None
        allocator = getattr(model_runner, "token_to_kv_pool_allocator", None)
        metrics = bool(getattr(args, "enable_metrics", False))
        self.gauges = Gauges(self.slots, pool, allocator, self.stats, metrics, lambda: held_by(self))
        logger.info(
            "oasis sparse KV: block %d, top-k %d, sinks %d, dense layers %s; device tier %.1f MiB of a %.1f "
            "MiB budget: working sets for %d requests, summaries %.1f MiB",
            self.block_size, config.top_k, config.sink_blocks, sorted(self.dense_layers) or "none",
            self.tier.nbytes / 2**20, self.tier.layout.budget_bytes / 2**20, self.tier.num_request_slots,
            self.summaries.nbytes / 2**20,
        )  # fmt: skip

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        super().init_forward_metadata(forward_batch)
        if not self.graph_begun(forward_batch):  # graph_hooks.py: hook 14 may have begun it
            self.begin_forward(forward_batch)

    def begin_forward(self, forward_batch: ForwardBatch) -> None:
        mode = forward_batch.forward_mode
        reqs, seq_lens = host_ints(forward_batch, "req_pool_indices"), host_ints(forward_batch, "seq_lens")
        prefix_lens = (
            extend_prefix_lens(forward_batch) if mode.is_extend() and not mode.is_target_verify() else None
        )
        rids = getattr(forward_batch, "rids", None)
        self.begin_batch(mode, reqs, seq_lens, prefix_lens, rids, batch_params(rids), retraction_keys(rids))

    def begin_batch(
        self, mode: ForwardMode, reqs: list[int], seq_lens: list[int], prefix_lens: list[int] | None,
        rids: list[str] | None = None, params: list[dict[str, Any] | None] | None = None,
        keys: list[str | None] | None = None,
    ) -> None:  # fmt: skip
        """A forward pass of ``mode`` over request rows ``reqs`` (``rids``, ``custom_params``): admit the new
        ones (an extend's, with their cached ``prefix_lens``; a decode's PD arrivals; retracted ones by
        their retraction ``keys``, None: the rids) and set the batch the layers see (each row's own top-K
        and recall target: ``request_options.py``)."""
        keys = list(rids) if keys is None and rids is not None else keys
        generations = [int(g) for g in self.req_to_token_pool.req_generation[reqs].tolist()]
        options = read_options(params, self.config, self.pd.disaggregated)
        self.stats.requests.begin(reqs, generations, rids, mode.is_decode() or mode.is_target_verify())
        for row, message in options.errors.items():  # they fail alone, at this pass's result
            self.failures.report(reqs[row], generations[row], message)
        admission: bool | torch.Tensor = mode.is_extend() and not mode.is_target_verify()
        if admission:
            self._admit(reqs, generations, prefix_lens or [0] * len(reqs))
            self.selector.prompts_extended(reqs, seq_lens)
            self.recall.restart(reqs)
            if keys:  # retracted requests re-prefilled: they go on where they were (retraction.py)
                admission = ~self.retractions.resume_extend(reqs, generations, seq_lens, keys, self.step)
        elif mode.is_decode() or mode.is_target_verify():
            self.step += 1
            self.stats.add("decode_steps")
            if keys:
                self.retractions.resume(reqs, generations, seq_lens, keys, mode.is_target_verify(), self.step)
            admission = self.pd.admit(reqs, generations, seq_lens, mode.is_target_verify(), self.step)
        self.set_batch(reqs, admission, generations, options)
        if mode.is_decode() or mode.is_target_verify():
            self.recall.begin(self.batch)
        if self.captured is not None:  # captured_step.py: decode and verify passes of ordinary rows
            stepping = mode.is_decode() or mode.is_target_verify()
            self.captured.begin(stepping and not self.batch.admits)

    def set_batch(
        self, reqs: list[int], admission: bool | torch.Tensor = False, generations: list[int] | None = None,
        options: RequestOptions | None = None,
    ) -> None:  # fmt: skip
        """The batch the next layers' attention calls see: ``admission`` for every row, or ``[bs]`` bool
        per row (``generations``: None reads SGLang's; ``options``: None, the server's for every row)."""
        if generations is None:
            generations = [int(g) for g in self.req_to_token_pool.req_generation[reqs].tolist()]
        slots = torch.tensor([self.tier.slot_of(req) for req in reqs], dtype=torch.int64)
        req_index = torch.tensor(reqs, dtype=torch.int64)
        if not isinstance(admission, torch.Tensor):
            admission = torch.full((len(reqs),), bool(admission), dtype=torch.bool)
        top_k, target = (None, None) if options is None else options[:2]
        self.batch = BatchView(reqs, req_index, slots, generations, self.step, admission, top_k, target)

    def _admit(self, reqs: list[int], generations: list[int], prefix_lens: list[int]) -> None:
        """Give each new request its request slot (``RequestSlots.admit``: empty, or a warm start). A
        request that holds one already (a chunked prefill going on) keeps it as it is."""
        new = [(req, gen, prefix) for req, gen, prefix in zip(reqs, generations, prefix_lens, strict=True)
               if not self.slots.holds(req, gen)]  # fmt: skip
        if not new:
            return
        self.selector.finish_pending()  # slots may change hands below
        done = self.slots.admit(new, self.summaries.epoch, self.failures.failed, self.config.warm_start)
        self.stats.add("requests", done.requests)
        self.stats.add("warm_starts", done.warm_starts)
        self.stats.add("blocks_reused", done.blocks_reused)

    # ignore[override]: SGLang's base passes a layer's extra **kwargs on; torch_native (our base) takes none
    def forward_extend(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache=True):  # type: ignore[override]
        if forward_batch.forward_mode.is_target_verify():
            return self.forward_verify(q, k, v, layer, forward_batch, save_kv_cache)
        layer_id = layer.layer_id
        k, v = self.retractions.restore_kv(self.batch, layer_id, forward_batch, k, v)  # retraction.py
        out = super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        if layer.is_cross_attention or layer_id in self.dense_layers:  # dense layers never select
            return out
        extend_lens = extend_seq_lens(forward_batch)
        seq_lens_cpu = forward_batch.seq_lens.cpu().to(torch.int64)
        if k is not None and v is not None and save_kv_cache:
            self.selector.wait(layer_id)  # its job may be copying from the active blocks
            self.intake.extend(
                self.batch, layer_id, seq_lens_cpu, extend_lens, forward_batch.out_cache_loc, k, v
            )
        else:  # nothing new to fold in (KVIntake.extend records it otherwise)
            self.intake.mark(self.batch.req_index, layer_id, seq_lens_cpu)
        q_rows = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        assert forward_batch.extend_seq_lens is not None  # SGLang's ForwardBatch: None outside extends
        last = torch.cumsum(forward_batch.extend_seq_lens, 0) - 1  # last new token of each request
        seq_lens = forward_batch.seq_lens.tolist()
        if not self.batch.admission and k is not None:  # re-prefilled retracted requests: their sparse step
            self.retractions.attend_resumed(self.batch, layer, q_rows, last, k, v, out, seq_lens_cpu)
        prior = self.selector.window.prior(self.batch, layer, q_rows, last.tolist(), extend_lens, seq_lens)
        self.selector.select(self.batch, layer_id, q_rows[last], seq_lens, prior, layer.scaling)
        return out

    def forward_decode(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache=True):  # type: ignore[override]
        layer_id = layer.layer_id
        if layer.is_cross_attention or layer_id in self.dense_layers:
            if not layer.is_cross_attention:  # attends every committed token, read from the host tier
                self.attention.count_host_read("dense_layer_bytes_host_to_device", self.batch.reqs,
                                               forward_batch.seq_lens.cpu())  # fmt: skip
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        out = self.captured.run(self.batch, forward_batch, layer, q, k, v) if self.captured else None
        if out is not None:  # captured_step.py; None: this layer runs eagerly
            return out
        self.selector.wait(layer_id)
        seq_lens = forward_batch.seq_lens.cpu().to(torch.int64)
        # PD arrivals and resumed retracted requests: their KV joins the summaries first (others: no-op)
        self.intake.catch_up(self.batch, layer_id, seq_lens - 1)
        pool, loc = self.token_to_kv_pool, forward_batch.out_cache_loc
        if save_kv_cache and k is not None and v is not None:
            pool.set_kv_buffer(layer, KVWriteLoc(loc, self.swa_out_cache_loc), k, v)
            self.intake.summarise(self.batch, layer_id, loc, k, seq_lens)
        else:  # the token's K and V are already in the host tier only
            new = torch.full((len(self.batch.reqs),), len(loc) // max(1, len(self.batch.reqs)))
            self.attention.count_host_read("tail_bytes_host_to_device", self.batch.reqs, new)
            k, v = pool.get_key_buffer(layer_id)[loc], pool.get_value_buffer(layer_id)[loc]
        q_rows = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        kv_shape = (len(loc), self.num_kv_heads, -1)
        out = self.attention.decode(self.batch, q_rows, layer, seq_lens, k.view(kv_shape), v.view(kv_shape))
        if self.recall.due():  # before the host copy is poisoned, before the working set changes
            self.recall.sample_safely(self.batch, layer_id, q_rows, seq_lens.tolist(), layer.scaling)
        self._poison_if_strict(layer_id)
        self.selector.select(self.batch, layer_id, q_rows, seq_lens.tolist(), scale=layer.scaling)
        return out.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    def forward_verify(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache=True):
        """TARGET_VERIFY with ``rows`` query rows per request: row 0 is the real token (the last verified
        one, at position ``seq_len``), rows 1.. the draft tokens after it::

            keys per request and KV head: | working set | active tail (< seq_len) | row 0 | row 1 | ...
            row r sees:                   |     all     |          all            | rows 0..r (tree mask)

        Row 0 is committed whatever the verification decides: its key joins the summaries now; drafts
        join once accepted (``KVIntake.catch_up``). The last draft row's query selects the next blocks.
        """
        layer_id = layer.layer_id
        sparse, captured = layer_id not in self.dense_layers, self.captured
        out = captured.run(self.batch, forward_batch, layer, q, k, v) if captured and sparse else None
        if out is not None:  # captured_step.py: the pass's sparse layers run the compiled program
            return out
        self.selector.wait(layer_id)
        batch = len(self.batch.reqs)
        rows = q.shape[0] // batch
        heads, dim = layer.tp_q_head_num, layer.qk_head_dim
        pool = self.token_to_kv_pool
        if save_kv_cache and k is not None and v is not None:
            pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v)
        seq_lens = forward_batch.seq_lens.cpu().to(torch.int64)
        draft_locs = forward_batch.out_cache_loc.view(batch, rows).to(torch.int64)
        tree = verify_tree_mask(forward_batch, batch, rows)  # [bs, rows, rows]
        q_rows = q.reshape(batch, rows, heads, dim)
        if not sparse:
            out = self.attention.dense_verify(self.batch, q_rows, layer, seq_lens, draft_locs, tree)
            return out.reshape(-1, heads * layer.v_head_dim)
        self.intake.catch_up(self.batch, layer_id, seq_lens)
        self.intake.summarise(
            self.batch, layer_id, draft_locs[:, 0], k.view(batch, rows, -1)[:, 0], seq_lens + 1
        )
        kv_shape = (batch * rows, self.num_kv_heads, -1)
        out = self.attention.verify(
            self.batch, q_rows, layer, seq_lens, k.view(kv_shape), v.view(kv_shape), tree
        )
        lens = (seq_lens + 1).tolist()
        if self.recall.due():  # the real row, over the working set the last draft row chose
            last = draft_locs[:, 0].tolist()
            self.recall.sample_safely(self.batch, layer_id, q_rows[:, 0], lens, layer.scaling, last)
        self._poison_if_strict(layer_id)
        self.selector.select(self.batch, layer_id, q_rows[:, -1], lens, scale=layer.scaling)
        return out.reshape(-1, heads * layer.v_head_dim)

    def _poison_if_strict(self, layer_id: int) -> None:
        if self.strict is not None:
            pool, table = self.token_to_kv_pool, self.req_to_token_pool.req_to_token
            StrictMode.poison_resident_blocks(self.working_sets, table, pool, self.batch, layer_id)


def create_oasis_backend(model_runner: ModelRunner) -> TorchNativeAttnBackend:
    """The target model gets the sparse backend; a draft model (EAGLE-3 lookahead) attends densely over
    its own small KV cache. Fault injection and strict device mode for tests are read here, once
    (``INJECT_ENV``, on one tensor-parallel rank only with ``stats.INJECT_RANK_ENV``; ``STRICT_ENV``)."""
    if getattr(model_runner, "is_draft_worker", False):
        return DraftAttnBackend(model_runner)
    config = OasisConfig.for_backend()
    inject = os.environ.get(INJECT_ENV)
    faults = FaultInjection(int(inject) if inject and injects_here() else None)
    return OasisAttnBackend(model_runner, config, faults, StrictMode.from_env())
