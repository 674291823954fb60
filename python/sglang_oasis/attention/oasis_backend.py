"""SGLang attention backend ``oasis``: dense prefill, sparse decode over per-KV-head working sets.

In sparse mode SGLang's KV pool is the host tier (page size = block size), holding every request's full
KV; this backend keeps, beside it, the block summaries (``BlockSummaryStore``) and the working sets
(``WorkingSetPool``) that stand for device memory. Per layer:

- extend (prefill, or a suffix after a prefix hit): dense attention over the pool, exactly as SGLang's
  torch_native backend; the new keys are folded into the summaries; the first working set is each KV
  head's top-K blocks by the exact attention of the last ``--oasis-prefill-window`` new tokens' queries
  (the best ``--oasis-window-keep`` share of them stays selected at every later step), or with the
  window off, by the summaries' scores for the last token's query;
- decode step t: attention over each KV head's working set plus the active tail (tokens after the
  blocks the selection covered); then the step-t query (or, with lookahead, the draft token's) scores
  every full block's summary and its top-K is the prediction for step t+1. The blocks that changed load
  from the host tier in the prefetch pipeline (``memory/prefetch_pipeline.py``: in the background, at
  most the fetch cap per KV head and step); step t+1's attention at the layer waits for that job only.

Layers in ``dense_layers`` decode densely. With K at least the number of full blocks every block is
selected and the output equals dense attention.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sgl_kernel_oasis import ops, sparse_decode_attention, window_block_mass
from sglang_oasis.attention.block_prefetcher import INJECT_ENV, BlockPrefetcher, JobResult, SelectionJob
from sglang_oasis.attention.request_slots import RequestSlots
from sglang_oasis.config import OasisConfig
from sglang_oasis.disaggregation.pd_partial import Arrival, DecodeFetcher, PrefillStager, register_draft_pool
from sglang_oasis.memory.device_layout import DeviceTierError, TierShape
from sglang_oasis.memory.device_layout import layout as device_tier_layout
from sglang_oasis.memory.device_tier import DeviceTier
from sglang_oasis.memory.prefetch_pipeline import PrefetchPipeline
from sglang_oasis.stats import OasisStats

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

logger = logging.getLogger(__name__)


class OasisAttnBackend(TorchNativeAttnBackend):
    def __init__(self, model_runner: Any, config: OasisConfig) -> None:
        super().__init__(model_runner)
        pool = self.token_to_kv_pool
        self.config = config
        self.block_size = config.block_size
        if pool.page_size != self.block_size:
            raise ValueError(
                f"oasis backend needs --page-size {self.block_size} (= --oasis-block-size), got {pool.page_size}"
            )
        num_layers = pool.layer_num
        self.num_kv_heads = pool.head_num
        max_requests = self.req_to_token_pool.req_to_token.shape[0]
        self.num_slots = config.top_k + config.sink_blocks
        self.tier = self._device_tier(model_runner, config)
        self.summaries = self.tier.summaries
        self.working_sets = self.tier.working_sets
        self.pinned = self.tier.pinned
        self.dense_layers = frozenset(config.dense_layers)
        # Bytes of one token's K and V for one KV head in one layer (host-tier reads are counted in them).
        self._token_bytes = 2 * pool.head_dim * self.working_sets.k.element_size()
        # Warm starts match prefixes against the pages each request slot selected at the first sparse layer.
        sparse_layers = [layer for layer in range(num_layers) if layer not in self.dense_layers]
        self._record_layer = sparse_layers[0] if sparse_layers else -1
        self.summaries.epoch_layer = self._record_layer
        request_slots = self.tier.num_request_slots
        self.slots = RequestSlots(self.tier, self.req_to_token_pool, self.block_size)
        # Per request (SGLang's req pool index) and layer: positions whose keys are in the summaries
        # (speculative verify commits drafts only after the forward pass that wrote them).
        self.summarised = torch.zeros((max_requests, num_layers), dtype=torch.int64)
        self.stats = OasisStats.attach(model_runner.server_args.port)
        self.stats.set("host_tokens_capacity", int(pool.size))
        self.stats.set("device_working_set_bytes", self.working_sets.nbytes)
        self.stats.set("device_summary_bytes", self.summaries.nbytes)
        self.stats.set("device_bytes_capacity", self.tier.nbytes)
        self.stats.set("device_request_slots", request_slots)
        self.allocator = getattr(model_runner, "token_to_kv_pool_allocator", None)
        self.export_metrics = bool(getattr(model_runner.server_args, "enable_metrics", False))
        self.step = 0
        self._reqs: list[int] = []
        self._req_index = torch.zeros(0, dtype=torch.int64)
        self._slot_index = torch.zeros(0, dtype=torch.int64)  # the batch's device request slots
        self._admission = False
        self.pipeline: PrefetchPipeline[JobResult] = PrefetchPipeline(config.prefetch == "async", self.device)
        self.prefetcher = BlockPrefetcher(
            self.working_sets, self.summaries, pool, config.top_k, config.sink_blocks, self.num_kv_heads
        )
        self.window_blocks = config.window_blocks
        self._caps: list[int | None] = [config.fetch_cap] * num_layers
        self._drift = [0.0] * num_layers
        self.prompt_len: dict[int, int] = {}  # request slot -> tokens after its last extend
        inject = os.environ.get(INJECT_ENV)
        self._inject_prompt_len = int(inject) if inject else None
        # Requests whose transfer failed: slot -> (generation, message); the scheduler hook
        # (sglang_hooks.abort_failed_transfers) aborts them when their batch's result is processed.
        self.failed_requests: dict[int, tuple[int, str]] = {}
        self._failed_lock = threading.Lock()
        self._reported_failures: dict[int, int] = {}  # slot -> generation already reported
        # Remote partial fetching under PD disaggregation (disaggregation/pd_partial.py).
        self.stager: PrefillStager | None = None
        self.remote: DecodeFetcher | None = None
        self._admission_selections: dict[int, dict[int, torch.Tensor]] = {}  # slot -> layer -> [H, N]
        self._setup_remote_fetch(model_runner)
        # Gauges change when requests finish, which no forward pass sees while the server is idle.
        self._gauge_thread = threading.Thread(target=self._refresh_gauges, name="oasis-gauges", daemon=True)
        self._gauge_thread.start()
        logger.info(
            "oasis sparse KV: block %d, top-k %d, sinks %d, dense layers %s; device tier %.1f MiB of a %.1f "
            "MiB budget: working sets for %d requests, summaries %.1f MiB",
            self.block_size, config.top_k, config.sink_blocks, sorted(self.dense_layers) or "none",
            self.tier.nbytes / 2**20, self.tier.layout.budget_bytes / 2**20, request_slots,
            self.summaries.nbytes / 2**20,
        )  # fmt: skip

    def _device_tier(self, model_runner: Any, config: OasisConfig) -> DeviceTier:
        """The device tier of ``--oasis-device-kv-tokens`` x this pool's KV bytes per token, with at most
        ``--max-running-requests`` request slots; refuses a running-request cap the budget cannot hold."""
        pool = self.token_to_kv_pool
        shape = TierShape(
            num_layers=pool.layer_num,
            num_kv_heads=pool.head_num,
            head_dim=pool.head_dim,
            element_bytes=torch.empty(0, dtype=pool.dtype).element_size(),
            host_pages=pool.size // self.block_size + 2,  # SGLang keeps padding pages past ``size``
            block_size=self.block_size,
            slots_per_head=self.num_slots,
            window_blocks=config.window_blocks,
        )
        budget = config.device_kv_tokens * shape.kv_bytes_per_token
        fitting = device_tier_layout(budget, shape)
        running = getattr(model_runner.server_args, "max_running_requests", None)
        if running is not None and int(running) > fitting.request_slots:
            raise DeviceTierError(
                f"--max-running-requests {running}: the device budget (--oasis-device-kv-tokens "
                f"{config.device_kv_tokens}) holds {fitting.request_slots} requests' working sets; lower it "
                "or raise the budget"
            )
        limit = int(running) if running is not None else self.req_to_token_pool.req_to_token.shape[0]
        return DeviceTier(shape, device_tier_layout(budget, shape, limit), pool.dtype, self.device)

    def _setup_remote_fetch(self, model_runner: Any) -> None:
        args = model_runner.server_args
        mode = str(getattr(args, "disaggregation_mode", "null"))
        if not self.config.remote_fetch or mode not in ("prefill", "decode"):
            return
        if str(getattr(args, "disaggregation_transfer_backend", "mooncake")) != "mooncake":
            logger.warning("oasis: remote partial fetching needs the mooncake transfer backend; off")
            return
        if int(getattr(args, "tp_size", 1)) != 1:
            logger.warning("oasis: remote partial fetching supports --tp-size 1 only; off")
            return
        host = str(args.host)
        if mode == "prefill":
            self.prefetcher.record_admissions = self._admission_selections
            port = int(args.disaggregation_bootstrap_port)
            self.stager = PrefillStager(self, host, port, engine_rank=0, ttl_s=self.config.remote_fetch_ttl)
            logger.info("oasis remote partial fetching: prefill hand-offs at %s", self.stager.url)
        else:
            self.remote = DecodeFetcher(self, host)
            self.prefetcher.remote = self.remote
            logger.info(
                "oasis remote partial fetching: decode reads through %s", self.remote.endpoint.session_id
            )

    def admission_selection(self, req: int, num_tokens: int) -> torch.Tensor:
        """``[layers, kv_heads, full blocks]`` bool: request slot ``req``'s first working sets, as its last
        extend selected them (dense layers and layers it was not recorded for: every block)."""
        full = num_tokens // self.block_size
        selection = torch.ones((self.token_to_kv_pool.layer_num, self.num_kv_heads, full), dtype=torch.bool)
        for layer, selected in self._admission_selections.get(req, {}).items():
            if layer not in self.dense_layers and selected.shape[-1] == full:
                selection[layer] = selected
        return selection

    def admission_pins(self, req: int, num_tokens: int) -> torch.Tensor | None:
        """``[layers, kv_heads, full blocks]`` bool: the blocks the prefill window keeps selected for
        request ``req`` (None: the window keeps none)."""
        if not self.window_blocks:
            return None
        full = num_tokens // self.block_size
        pins = self.pinned[self.tier.slot(req)]  # [layers, kv_heads, P]
        mask = torch.zeros((*pins.shape[:2], full + 1), dtype=torch.bool)
        mask.scatter_(-1, torch.where((pins >= 0) & (pins < full), pins, full), True)
        return mask[..., :full]

    # --- per forward batch ------------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        super().init_forward_metadata(forward_batch)
        mode = forward_batch.forward_mode
        self._set_batch(forward_batch.req_pool_indices.tolist())
        self._admission = mode.is_extend() and not mode.is_target_verify()
        if self._admission:
            self.finish_pending()  # request slots may change hands below
            generations = [int(g) for g in self.req_to_token_pool.req_generation[self._reqs].tolist()]
            self._admit(generations, self._prefix_lens(forward_batch))
            for req, seq_len in zip(self._reqs, forward_batch.seq_lens.tolist(), strict=True):
                self.prompt_len[req] = int(seq_len)
        elif mode.is_decode() or mode.is_target_verify():
            self.step += 1
            self.stats.add("decode_steps")
            self._admit_arrived(forward_batch)

    def _admit_arrived(self, forward_batch: ForwardBatch) -> None:
        """Requests whose first forward here is a decode: their KV arrived from a prefill node (PD
        disaggregation), not through an extend of this backend. They take their slots, their summaries
        are caught up from the pool at this step (every position before the current token), and this
        step attends them densely (nothing is covered yet); its selection is their admission (uncapped,
        like after an extend)."""
        generations = [int(g) for g in self.req_to_token_pool.req_generation[self._reqs].tolist()]
        arrived = [row for row, (req, gen) in enumerate(zip(self._reqs, generations, strict=True))
                   if not self.slots.holds(req, gen)]  # fmt: skip
        if not arrived:
            return
        self.finish_pending()
        self._claim_arrivals(forward_batch, arrived, generations)
        self._set_batch(self._reqs)

    def _claim_arrivals(
        self, forward_batch: ForwardBatch, arrived: list[int], generations: list[int]
    ) -> None:
        seq_lens = forward_batch.seq_lens.tolist()
        # Tokens already committed: a decode's seq_len counts the token it computes, a verify's does not.
        current = 0 if forward_batch.forward_mode.is_target_verify() else 1
        for row in arrived:
            req = self._reqs[row]
            self.stats.add("requests")
            self.stats.add("arrived_requests")
            slot = self.slots.claim(req, generations[row])  # no window here (a hand-off may bring pins)
            self.prompt_len[req] = int(seq_lens[row]) - current
            fetched = self.remote.take_arrival(req, generations[row]) if self.remote else None
            if fetched is not None and fetched.num_tokens == self.prompt_len[req]:
                self._start_from_handoff(req, slot, fetched)
            else:
                if fetched is not None:  # cannot happen unless SGLang's hand-off changed: fail the request
                    message = (f"oasis: request slot {req} arrived with {fetched.num_tokens} staged tokens for "
                               f"a {self.prompt_len[req]}-token prompt")  # fmt: skip
                    logger.error(message)
                    with self._failed_lock:
                        self.failed_requests[req] = (generations[row], message)
                self.summarised[req] = 0
                self._admission = True

    def _start_from_handoff(self, req: int, slot: int, arrival: Arrival) -> None:
        """A request admitted by remote partial fetching: its summaries and its first selection's blocks
        are here (read at admission); its working sets are that selection, exactly as an extend here
        would have left them, so its first decode step is an ordinary sparse step."""
        self.summarised[req] = arrival.num_tokens
        full = arrival.selection.shape[2]
        slots = torch.tensor([slot], dtype=torch.int64)
        block = self.block_size
        pages = self.req_to_token_pool.req_to_token[[req], 0 : full * block : block].to(torch.int64) // block
        pool = self.token_to_kv_pool
        # An extend here would have selected one step before this one: blocks this step does not
        # reselect must rank below the ones it loads for LRU eviction, as they would have.
        admission_step = self.step - 1
        for layer in range(pool.layer_num):
            if layer in self.dense_layers:
                continue
            if arrival.pinned is not None and self.window_blocks:
                kept = [b.nonzero().flatten()[: self.window_blocks] for b in arrival.pinned[layer]]
                for head, blocks in enumerate(kept):
                    self.pinned[slot, layer, head, : len(blocks)] = blocks
            self.working_sets.covered[slot, layer] = full
            if full:
                plan = self.working_sets.plan_selections(
                    slots, layer, arrival.selection[layer][None], admission_step
                )
                self.working_sets.load(
                    plan, slots, layer, pages, pool.get_key_buffer(layer), pool.get_value_buffer(layer)
                )
                self.stats.add("blocks_loaded", plan.num_loads)
                self.stats.add("bytes_host_to_device", plan.num_loads * self.working_sets.bytes_per_block)

    def _set_batch(self, reqs: list[int]) -> None:
        """The forward batch's requests (SGLang's req pool indices), as a list and as the index tensor
        SGLang's tables take, and their device request slots (-1 until admitted: admission sets it again)."""
        self._reqs = reqs
        self._req_index = torch.tensor(reqs, dtype=torch.int64)
        self._slot_index = torch.tensor([self.tier.slot_of(req) for req in reqs], dtype=torch.int64)

    @staticmethod
    def _prefix_lens(forward_batch: ForwardBatch) -> list[int]:
        if forward_batch.extend_prefix_lens_cpu is not None:
            return [int(n) for n in forward_batch.extend_prefix_lens_cpu]
        if forward_batch.extend_prefix_lens is not None:
            return [int(n) for n in forward_batch.extend_prefix_lens.tolist()]
        return [0] * len(forward_batch.seq_lens)

    def _admit(self, generations: list[int], prefix_lens: list[int]) -> None:
        """Give each new request its request slot (``RequestSlots.admit``: empty, or a warm start). A
        request that holds one already (a chunked prefill going on) keeps it as it is."""
        new = [(req, gen, prefix) for req, gen, prefix in zip(self._reqs, generations, prefix_lens, strict=True)
               if not self.slots.holds(req, gen)]  # fmt: skip
        if not new:
            return
        done = self.slots.admit(new, self.summaries.epoch, self._reported_failures, self.config.warm_start)
        self._set_batch(self._reqs)
        self.stats.add("requests", done.requests)
        self.stats.add("warm_starts", done.warm_starts)
        self.stats.add("blocks_reused", done.blocks_reused)

    def _refresh_gauges(self, period_s: float = 0.5) -> None:
        while True:
            try:
                finished = self.slots.finished()
                live = self.tier.live_slots(finished)
                self.stats.set("running_requests", len(live))
                self.stats.set("device_bytes_used", self.tier.used_bytes(finished))
                self.stats.set(
                    "device_working_set_tokens", self.working_sets.resident_blocks(live) * self.block_size
                )
                if self.allocator is not None:
                    used = self.token_to_kv_pool.size - self.allocator.available_size()
                    self.stats.set("host_tokens_used", int(used))
                if self.remote is not None:  # issue 25: release from the scheduler's request lifecycle
                    self.remote.release_finished(
                        set(self.req_to_token_pool.free_slots), self.req_to_token_pool.req_generation.tolist()
                    )
                if self.export_metrics:
                    self.stats.publish_prometheus()
            except Exception:  # a gauge is not worth a crash; read again next period
                logger.debug("oasis gauge refresh failed", exc_info=True)
            time.sleep(period_s)

    # --- attention -------------------------------------------------------------------------------

    def forward_extend(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache=True):
        if forward_batch.forward_mode.is_target_verify():
            return self.forward_verify(q, k, v, layer, forward_batch, save_kv_cache)
        out = super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        if layer.is_cross_attention:
            return out
        layer_id = layer.layer_id
        if layer_id in self.dense_layers:  # never selects, so never needs summaries
            return out
        if k is not None and save_kv_cache:
            self._summarise(layer, forward_batch, k)
        self.summarised[self._req_index, layer_id] = forward_batch.seq_lens.cpu()
        q_rows = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        last = torch.cumsum(forward_batch.extend_seq_lens, 0) - 1  # last new token of each request
        seq_lens = forward_batch.seq_lens.tolist()
        extend_lens = forward_batch.extend_seq_lens_cpu or forward_batch.extend_seq_lens.tolist()
        prior = self._window_prior(layer, q_rows, last.tolist(), [int(n) for n in extend_lens], seq_lens)
        self._select(layer, q_rows[last], seq_lens, prior)
        return out

    def _window_prior(
        self,
        layer: RadixAttention,
        q_rows: torch.Tensor,
        last_rows: list[int],
        extend_lens: list[int],
        seq_lens: list[int],
    ) -> torch.Tensor | None:
        """``[bs, kv_heads, N]`` scores for the first working sets (``--oasis-prefill-window``): each full
        block's exact attention mass from the last (up to) ``window`` new tokens' queries; None when the
        window is off or every request keeps all its blocks anyway."""
        window, block = self.config.prefill_window, self.block_size
        full = [n // block for n in seq_lens]
        if window == 0 or max(full, default=0) <= self.num_slots:
            return None
        keys = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        req_to_token = self.req_to_token_pool.req_to_token
        prior = torch.zeros((len(seq_lens), self.num_kv_heads, max(full)))
        for row, (req, last, new, total) in enumerate(
            zip(self._reqs, last_rows, extend_lens, seq_lens, strict=True)
        ):
            if full[row] <= self.num_slots:
                continue  # keeps every block: nothing to rank
            rows = min(window, new)
            locs = req_to_token[req, :total].to(torch.int64)
            mass = window_block_mass(q_rows[last - rows + 1 : last + 1], keys[locs], block, layer.scaling)
            prior[row, :, : full[row]] = mass.cpu()
            self.stats.add("window_selections")
        return prior

    def forward_decode(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache=True):
        layer_id = layer.layer_id
        if layer.is_cross_attention or layer_id in self.dense_layers:
            if not layer.is_cross_attention:  # attends every committed token, read from the host tier
                self._count_host_read("dense_layer_bytes_host_to_device", int(forward_batch.seq_lens.sum()))
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        self._wait(layer_id)
        pool = self.token_to_kv_pool
        if self._admission:  # requests that arrived from a prefill node: summarise their KV first
            self._catch_up_summaries(layer_id, forward_batch.seq_lens.cpu().to(torch.int64) - 1)
        if save_kv_cache and k is not None and v is not None:
            pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v)
            self._summarise(layer, forward_batch, k)
            self.summarised[self._req_index, layer_id] = forward_batch.seq_lens.cpu()
        q_rows = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        seq_lens = forward_batch.seq_lens.tolist()
        tail_locs, tail_valid = self._tail(layer_id, seq_lens)
        out = self._headwise_attention(q_rows[:, None], layer, tail_locs, tail_valid[:, None, :])[:, 0]
        self._select(layer, q_rows, seq_lens)
        return out.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    def forward_verify(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache=True):
        """TARGET_VERIFY with ``rows`` query rows per request: row 0 is the real token (the last verified
        one, at position ``seq_len``), rows 1.. the draft tokens after it::

            keys per request and KV head: | working set | active tail (< seq_len) | row 0 | row 1 | ...
            row r sees:                   |     all     |          all            | rows 0..r (tree mask)

        Row 0 is committed whatever the verification decides, so its key joins the summaries now; drafts
        join later, once accepted (``_catch_up_summaries``). The last draft row's query selects the
        blocks for the next step: the lookahead.
        """
        layer_id = layer.layer_id
        self._wait(layer_id)
        reqs = self._reqs
        batch = len(reqs)
        rows = q.shape[0] // batch
        heads, dim = layer.tp_q_head_num, layer.qk_head_dim
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v
            )
        seq_lens = forward_batch.seq_lens.cpu().to(torch.int64)
        draft_locs = forward_batch.out_cache_loc.view(batch, rows).to(torch.int64)
        dense = layer_id in self.dense_layers
        tree = self._tree_mask(forward_batch, batch, rows)  # [bs, rows, rows]
        q_rows = q.reshape(batch, rows, heads, dim)
        if dense:
            out = self._dense_verify_attention(q_rows, layer, seq_lens, draft_locs, tree)
        else:
            self._catch_up_summaries(layer_id, seq_lens)
            real_locs = draft_locs[:, 0]
            self.summaries.update(
                layer_id, real_locs, self.token_to_kv_pool.get_key_buffer(layer_id)[real_locs]
            )
            self.summarised[self._req_index, layer_id] = seq_lens + 1
            # The draft rows' own tokens follow the active tail; the tree mask says which rows see them.
            tail_locs, tail_valid = self._tail(layer_id, seq_lens.tolist())
            self._count_host_read("tail_bytes_host_to_device", draft_locs.numel())
            locs = torch.cat([tail_locs, draft_locs.cpu()], dim=1)
            valid = torch.cat([tail_valid[:, None, :].expand(-1, rows, -1), tree], dim=2)
            out = self._headwise_attention(q_rows, layer, locs, valid)
        if not dense:
            self._select(layer, q_rows[:, -1], (seq_lens + 1).tolist())
        return out.reshape(-1, heads * layer.v_head_dim)

    @staticmethod
    def _tree_mask(forward_batch: ForwardBatch, batch: int, rows: int) -> torch.Tensor:
        """``[batch, rows, rows]``: which verify rows each row attends (a chain unless the drafter sent a
        qlen-only tree mask)."""
        spec_info = getattr(forward_batch, "spec_info", None)
        mask = getattr(spec_info, "custom_mask", None)
        if mask is not None and mask.numel() == batch * rows * rows:
            return mask.view(batch, rows, rows).to(torch.bool).cpu()
        if mask is not None:
            raise NotImplementedError(
                f"oasis verify attention reads a qlen-only tree mask; got {mask.numel()} entries for "
                f"{batch} requests x {rows} rows"
            )
        return torch.tril(torch.ones(rows, rows, dtype=torch.bool)).expand(batch, -1, -1)

    def _dense_token_sets(self, layer_id: int, seq_lens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every committed token of each request (for dense layers), padded to the longest."""
        reqs = self._req_index
        positions = torch.arange(max(1, int(seq_lens.max())))[None, :].expand(len(self._reqs), -1)
        valid = positions < seq_lens[:, None]
        locations = torch.where(
            valid, self.req_to_token_pool.req_to_token[reqs[:, None], positions], 0
        ).long()
        pool = self.token_to_kv_pool
        keys = pool.get_key_buffer(layer_id)[locations].transpose(1, 2)
        values = pool.get_value_buffer(layer_id)[locations].transpose(1, 2)
        return keys, values, valid[:, None, :].expand(-1, keys.shape[1], -1)

    def _catch_up_summaries(self, layer_id: int, seq_lens: torch.Tensor) -> None:
        """Fold in the keys committed since the last summary update (accepted drafts), read back from the
        pool: positions ``[summarised, seq_len)`` of each request."""
        reqs = self._req_index
        starts = self.summarised[reqs, layer_id]
        lengths = (seq_lens - starts).clamp(min=0)
        if int(lengths.sum()) == 0:
            return
        rows = torch.repeat_interleave(reqs, lengths)
        first = torch.cumsum(lengths, 0) - lengths
        cols = torch.repeat_interleave(starts, lengths) + (
            torch.arange(int(lengths.sum())) - torch.repeat_interleave(first, lengths)
        )
        locations = self.req_to_token_pool.req_to_token[rows, cols].to(torch.int64)
        self._count_host_read("catch_up_bytes_host_to_device", len(locations), keys_only=True)
        keys = self.token_to_kv_pool.get_key_buffer(layer_id)[locations]
        self.summaries.update(layer_id, locations, keys)

    def _summarise(self, layer: RadixAttention, forward_batch: ForwardBatch, k: torch.Tensor) -> None:
        self.summaries.update(
            layer.layer_id, forward_batch.out_cache_loc, k.reshape(-1, self.num_kv_heads, layer.qk_head_dim)
        )

    def _tail(self, layer_id: int, seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool locations ``[bs, tail]`` of each request's active tail (the tokens after the blocks its
        last selection covered) and which of them are real (``[bs, tail]`` bool)."""
        reqs = self._req_index
        ends = torch.tensor(seq_lens, dtype=torch.int64)
        starts = self.working_sets.covered[self._slot_index, layer_id] * self.block_size
        positions = starts[:, None] + torch.arange(int((ends - starts).max()))  # [bs, tail]
        tail_valid = positions < ends[:, None]
        req_to_token = self.req_to_token_pool.req_to_token
        positions = positions.clamp(max=req_to_token.shape[1] - 1)
        locations = torch.where(tail_valid, req_to_token[reqs[:, None], positions].to(torch.int64), 0)
        self._count_host_read("tail_bytes_host_to_device", int(tail_valid.sum()))
        return locations, tail_valid

    def _count_host_read(self, counter: str, tokens: int, keys_only: bool = False) -> None:
        """Count a decode-time read of ``tokens`` tokens' K and V (or keys only) of every KV head of one
        layer from the host tier, outside the working-set loads: in ``counter`` and in the totals."""
        nbytes = tokens * self.num_kv_heads * (self._token_bytes // 2 if keys_only else self._token_bytes)
        self.stats.add(counter, nbytes)
        self.stats.add("bytes_host_to_device", nbytes)
        self.stats.add("decode_bytes_host_to_device", nbytes)

    def _headwise_attention(
        self, q_rows: torch.Tensor, layer: RadixAttention, tail_locs: torch.Tensor, tail_valid: torch.Tensor
    ) -> torch.Tensor:
        """``[bs, rows, q_heads, dim]`` queries over each KV head's working set (read in place through
        the head-wise mapping) and the tail tokens ``tail_locs`` (row r sees those in ``tail_valid[:, r]``):
        the Triton kernel on CUDA, its torch reference on CPU."""
        layer_id = layer.layer_id
        pool = self.token_to_kv_pool
        ws_k, ws_v = self.working_sets.block_views()
        device = ws_k.device  # host-built index tensors: non_blocking, so the stream need not drain first
        return ops.headwise_decode_attention(
            q_rows,
            ws_k,
            ws_v,
            self.working_sets.slot_rows(self._slot_index, layer_id).to(device, non_blocking=True),
            pool.get_key_buffer(layer_id),
            pool.get_value_buffer(layer_id),
            tail_locs.to(device, non_blocking=True),
            tail_valid.to(device, non_blocking=True),
            layer.scaling,
        )

    def _dense_verify_attention(
        self,
        q_rows: torch.Tensor,
        layer: RadixAttention,
        seq_lens: torch.Tensor,
        draft_locs: torch.Tensor,
        tree: torch.Tensor,
    ) -> torch.Tensor:
        """Verify rows of a dense layer: every committed token, then the draft rows' (tree mask)."""
        layer_id = layer.layer_id
        keys, values, valid = self._dense_token_sets(layer_id, seq_lens)
        rows, kv_heads = draft_locs.shape[1], keys.shape[1]
        self._count_host_read("dense_layer_bytes_host_to_device", int(seq_lens.sum()) + draft_locs.numel())
        pool = self.token_to_kv_pool
        draft_keys = pool.get_key_buffer(layer_id)[draft_locs].transpose(1, 2).to(keys.dtype)
        draft_values = pool.get_value_buffer(layer_id)[draft_locs].transpose(1, 2).to(values.dtype)
        keys = torch.cat([keys, draft_keys], dim=2)
        values = torch.cat([values, draft_values], dim=2)
        valid = torch.cat(
            [
                valid[:, :, None, :].expand(-1, -1, rows, -1),
                tree[:, None, :, :].expand(-1, kv_heads, -1, -1),
            ],
            dim=3,
        )
        return sparse_decode_attention(q_rows, keys, values, valid, layer.scaling)

    # --- selection and transfer (the prefetch pipeline) -----------------------------------------

    def _select(
        self,
        layer: RadixAttention,
        queries: torch.Tensor,
        seq_lens: list[int],
        prior: torch.Tensor | None = None,
    ) -> None:
        """Choose each request's working set for the next step from ``queries`` ``[bs, q_heads, dim]``
        and load the blocks that changed: a job for the prefetch pipeline (in the background unless
        ``--oasis-prefetch sync``), waited for at this layer's next attention.

        Requests with at most ``top_k + sink_blocks`` full blocks keep all of them; the others keep
        their sink blocks plus the top-K blocks by summary score (or by ``prior`` ``[bs, kv_heads, N]``,
        the prefill window's attention mass), per KV head. After an extend (the admission) every
        selected block loads; at decode at most the fetch cap per head.
        """
        layer_id = layer.layer_id
        if not seq_lens:
            return
        block = self.block_size
        reqs, slots = self._req_index, self._slot_index
        full = torch.tensor(seq_lens, dtype=torch.int64) // block
        num_blocks = int(full.max())
        admission = self._admission
        # Every block is selected; if none filled up since the last selection the working sets already
        # hold them all (this layer's job was waited for): nothing to plan or move.
        unchanged = not admission and num_blocks <= self.num_slots
        if unchanged and bool((self.working_sets.covered[slots, layer_id] == full).all()):
            self.working_sets.touch(slots, layer_id, self.step)
            self.stats.add("selections", len(seq_lens))
            return
        req_to_token = self.req_to_token_pool.req_to_token
        pages = req_to_token[reqs, 0 : num_blocks * block : block].to(torch.int64) // block  # [bs, N]
        if layer_id == self._record_layer:  # for warm starts of later requests sharing these pages
            self.slots.record(slots, pages, full, self.summaries.epoch)
        pinned = None
        if self.window_blocks:
            if admission:  # the window's best blocks stay selected until the request's next extend
                self.pinned[slots, layer_id] = self._window_pins(prior, full)
            else:
                pinned = self.pinned[slots, layer_id].clone()
        job = SelectionJob(
            layer_id=layer_id,
            reqs=reqs,
            slots=slots,
            queries=queries.detach().clone(),
            prior=prior,
            pinned=pinned,
            full=full,
            pages=pages,
            step=self.step,
            admission=admission,
            cap=None if admission else self._caps[layer_id],
            fail_reqs=() if admission else self._injected_failures(self._reqs),
        )
        for result in self.pipeline.submit(layer_id, lambda: self.prefetcher.run(job)):
            self._account(result)

    def _window_pins(self, prior: torch.Tensor | None, full: torch.Tensor) -> torch.Tensor:
        """``[bs, kv_heads, window_blocks]`` block ids the prefill window keeps selected (-1: none),
        the best by ``prior`` for requests with more blocks than their working sets hold."""
        pins = torch.full((len(full), self.num_kv_heads, self.window_blocks), -1, dtype=torch.int64)
        if prior is None:
            return pins
        over = full > self.num_slots  # only these have a prior; they have more blocks than pins
        valid = torch.arange(prior.shape[-1])[None, None, :] < full[:, None, None]
        best = prior.masked_fill(~valid, float("-inf")).topk(self.window_blocks, dim=-1).indices
        pins[over] = best[over]
        return pins

    def finish_pending(self) -> None:
        """Wait for every layer's pending selection and transfer."""
        for result in self.pipeline.drain():
            self._account(result)

    def _wait(self, layer_id: int) -> None:
        for result in self.pipeline.wait(layer_id):
            self._account(result)
        self.stats.add("foreground_wait_us", self.pipeline.take_waited_ns() // 1000)

    def take_failed_request(self, req: int, generation: int) -> str | None:
        """The failure message of request slot ``req`` (its ``generation``), removed once taken; stale
        entries (the slot went to a newer request) are dropped."""
        with self._failed_lock:
            entry = self.failed_requests.get(req)
            if entry is None:
                return None
            if entry[0] != generation:
                if entry[0] < generation:
                    del self.failed_requests[req]
                return None
            del self.failed_requests[req]
            return entry[1]

    @property
    def has_failed_requests(self) -> bool:
        return bool(self.failed_requests)

    def _injected_failures(self, reqs: list[int]) -> tuple[int, ...]:
        if self._inject_prompt_len is None:
            return ()
        return tuple(req for req in reqs if self.prompt_len.get(req) == self._inject_prompt_len)

    def _account(self, result: JobResult) -> None:
        """Fold a finished job into the counters, the adaptive cap and the failed-request registry
        (foreground only: the counters are not thread-safe)."""
        host_loads = result.loads  # blocks that just filled up are copied from the host tier too
        stats = self.stats
        stats.add("scored_selections", result.scored)
        stats.add("selections", result.selections)
        stats.add("selection_changes", result.loads)
        stats.add("blocks_loaded", host_loads)
        stats.add("bytes_host_to_device", host_loads * self.working_sets.bytes_per_block)
        stats.add("stage_select_us", result.select_ns // 1000)
        stats.add("stage_transfer_us", result.transfer_ns // 1000)
        if not result.admission:
            stats.add("blocks_just_filled", result.fresh)
            stats.add("decode_blocks_loaded", host_loads)
            stats.add("decode_bytes_host_to_device", host_loads * self.working_sets.bytes_per_block)
            stats.add("blocks_deferred", result.deferred)
            if self.config.adaptive_cap:
                self._adapt_cap(result.layer_id, (host_loads + result.deferred) / max(1, result.heads))
        for req, message in result.failed.items():
            generation = int(self.req_to_token_pool.req_generation[req])
            if self._reported_failures.get(req) == generation:  # a later layer or step of the same
                continue
            self._reported_failures[req] = generation
            stats.add("transfer_failures")
            logger.error("oasis: KV transfer failed for request slot %d: %s", req, message)
            with self._failed_lock:
                self.failed_requests[req] = (
                    generation,
                    f"oasis: KV transfer for this request failed ({message})",
                )

    def _adapt_cap(self, layer_id: int, missing_per_head: float) -> None:
        """``--oasis-adaptive-cap``: the layer's cap follows its measured drift, within the bounds."""
        low, high = self.config.fetch_cap_bounds
        drift = 0.75 * self._drift[layer_id] + 0.25 * missing_per_head
        self._drift[layer_id] = drift
        self._caps[layer_id] = min(high, max(low, math.ceil(1.25 * drift)))


def create_oasis_backend(model_runner: Any) -> TorchNativeAttnBackend:
    """The target model gets the sparse backend; a draft model (EAGLE-3 lookahead) attends densely over
    its own small KV cache."""
    if getattr(model_runner, "is_draft_worker", False):
        return DraftAttnBackend(model_runner)
    config = OasisConfig.from_env() or OasisConfig()
    return OasisAttnBackend(model_runner, config)


class DraftAttnBackend(TorchNativeAttnBackend):
    """Dense attention for the draft model of ``--oasis-lookahead eagle3`` (one layer, its own KV)."""

    def __init__(self, model_runner: Any) -> None:
        super().__init__(model_runner)
        register_draft_pool(model_runner.token_to_kv_pool)  # PD remote fetching moves it whole
