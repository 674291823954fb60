"""This backend's side of PD disaggregation with remote partial fetching (``disaggregation/__init__.py``).

Prefill node: a ``PrefillStager`` stages each finished prefill's KV and hands over its first selection
(``admission_selection``, ``admission_pins``). Decode node: a ``DecodeFetcher`` reads only what working
sets use. ``PDNode`` is what both read of the backend (the ``StagingSource`` and ``FetchTarget``
protocols), and it admits the decode node's arrivals: requests whose first forward here is a decode.

Their KV arrived from a prefill node, not through an extend of this backend. Each takes a request slot;
then either

- remote partial fetching handed its admission over (``DecodeFetcher.take_arrival``: the summaries and
  the first selection's blocks were read at commit): its working sets are that selection, exactly as an
  extend here would have left them, and its first decode step is an ordinary sparse step; or
- its summaries are caught up from the pool at this step and the step attends densely (nothing is
  covered yet); its selection is the admission (uncapped, like after an extend).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from sglang_oasis.attention.kv_intake import KVIntake
from sglang_oasis.attention.request_slots import RequestSlots
from sglang_oasis.attention.selector import Selector
from sglang_oasis.attention.transfer_failures import TransferFailures
from sglang_oasis.config import OasisConfig
from sglang_oasis.disaggregation.decode_admission import Arrival
from sglang_oasis.disaggregation.decode_fetcher import DecodeFetcher
from sglang_oasis.disaggregation.prefill_stager import PrefillStager
from sglang_oasis.memory.key_code_store import KeyCodeStore
from sglang_oasis.memory.summary_store import BlockSummaryStore
from sglang_oasis.sglang_contract import BEFORE_BACKUP_LISTENER, FREED_ROW_LISTENER
from sglang_oasis.stats import OasisStats, tensor_parallel_rank

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


class PDNode:
    def __init__(
        self,
        config: OasisConfig,
        slots: RequestSlots,
        selector: Selector,
        kv_pool: MHATokenToKVPool,
        intake: KVIntake,
        stats: OasisStats,
        failures: TransferFailures,
    ) -> None:
        self.config = config
        self.slots = slots
        self.selector = selector
        self.working_sets = slots.working_sets
        self.summaries: BlockSummaryStore = slots.tier.summaries
        self.codes: KeyCodeStore | None = slots.tier.codes  # --oasis-selector codes
        self.pinned = slots.tier.pinned
        self.req_to_token_pool = slots.req_pool
        self.kv_pool = self.token_to_kv_pool = kv_pool
        self.dense_layers = frozenset(config.dense_layers)
        self.intake = intake  # the summarised positions' owner
        self.stats = stats
        self.failures = failures
        self.block_size = slots.block_size
        self.window_blocks = selector.window_blocks
        self.stager: PrefillStager | None = None  # a prefill node with remote partial fetching
        self.remote: DecodeFetcher | None = None  # a decode node with remote partial fetching
        self.decode_node = False  # a PD decode node (``start``)
        self.disaggregated = False  # either node of a PD pair (``start``)

    def start(self, args: ServerArgs) -> None:
        """Remote partial fetching's stager or fetcher, as SGLang's server ``args`` make this node."""
        mode = str(getattr(args, "disaggregation_mode", "null"))
        self.decode_node = mode == "decode"
        self.disaggregated = mode in ("prefill", "decode")
        if not self.config.remote_fetch or mode not in ("prefill", "decode"):
            return
        if str(getattr(args, "disaggregation_transfer_backend", "mooncake")) != "mooncake":
            logger.warning("oasis: remote partial fetching needs the mooncake transfer backend; off")
            return
        # The address peers reach this node at (a wildcard --host is resolved by the decode node).
        host = self.config.advertise_host or str(args.host)
        # Under tensor parallelism each rank stages (prefill) or reads (decode) its own KV heads, paired
        # with the other node's rank of the same number.
        rank, tp_size = tensor_parallel_rank(), int(getattr(args, "tp_size", 1))
        if mode == "prefill":
            self.selector.prefetcher.record_admissions()  # what ``admission_selection`` reads
            port = int(args.disaggregation_bootstrap_port)
            cap = self.config.remote_fetch_max_staged_mib * 2**20
            self.stager = PrefillStager(
                self,
                host,
                port,
                rank,
                self.config.remote_fetch_ttl,
                max_bytes=cap,
                tp_size=tp_size,
                key_codes=self.codes is not None,
            )
            logger.info("oasis remote partial fetching: prefill hand-offs at %s", self.stager.url)
        else:
            self.remote = DecodeFetcher(self, host, rank, tp_size)
            self.selector.prefetcher.read_remote_first(self.remote)
            # SGLang frees a finished request's row: release its staging then (sglang_hooks.py).
            setattr(self.req_to_token_pool, FREED_ROW_LISTENER, self.remote.release_slot)
            # SGLang backs up a retracted request's KV: its remote blocks are read first (sglang_hooks.py).
            setattr(self.req_to_token_pool, BEFORE_BACKUP_LISTENER, self.remote.complete)
            logger.info(
                "oasis remote partial fetching: decode reads through %s", self.remote.endpoint.session_id
            )

    # --- what the prefill node's stager reads ---------------------------------------------------

    def finish_pending(self) -> None:
        self.selector.finish_pending()

    def admission_selection(self, req: int, num_tokens: int) -> torch.Tensor:
        """``[layers, kv_heads, full blocks]`` bool: request row ``req``'s first working sets, as its last
        extend selected them (dense layers and layers it was not recorded for: every block)."""
        full = num_tokens // self.block_size
        selection = torch.ones(
            (int(self.kv_pool.layer_num), int(self.kv_pool.head_num), full), dtype=torch.bool
        )
        for layer, selected in self.selector.prefetcher.admitted(req).items():
            if layer not in self.dense_layers and selected.shape[-1] == full:
                selection[layer] = selected
        return selection

    def admission_pins(self, req: int, num_tokens: int) -> torch.Tensor | None:
        """``[layers, kv_heads, full blocks]`` bool: the blocks the prefill window keeps selected for
        request row ``req`` (None: the window keeps none)."""
        if not self.window_blocks:
            return None
        full = num_tokens // self.block_size
        pins = self.pinned[self.slots.tier.slot(req)]  # [layers, kv_heads, P]
        mask = torch.zeros((*pins.shape[:2], full + 1), dtype=torch.bool)
        mask.scatter_(-1, torch.where((pins >= 0) & (pins < full), pins, full), True)
        return mask[..., :full]

    # --- the decode node's arrivals -------------------------------------------------------------

    def admit(
        self, reqs: list[int], generations: list[int], seq_lens: list[int], verify: bool, step: int
    ) -> torch.Tensor:
        """Give the batch's arrivals (requests that hold no slot) theirs. ``seq_lens`` count the token a
        decode computes; a verify's do not. Returns ``[bs]`` bool: the arrivals that take the dense first
        step (their selection is an admission; the other rows' steps stay ordinary)."""
        dense_step = torch.zeros(len(reqs), dtype=torch.bool)
        arrived = [row for row, (req, gen) in enumerate(zip(reqs, generations, strict=True))
                   if not self.slots.holds(req, gen)]  # fmt: skip
        if not arrived:
            return dense_step
        self.selector.finish_pending()  # slots may change hands below
        for row in arrived:
            req, generation = reqs[row], generations[row]
            self.stats.add("requests")
            self.stats.add("arrived_requests")
            slot = self.slots.claim(req, generation)  # no window here (a hand-off may bring pins)
            prompt = seq_lens[row] - (0 if verify else 1)
            self.selector.prompts_extended([req], [prompt])
            fetched = self.remote.take_arrival(req, generation) if self.remote else None
            if fetched is not None and fetched.num_tokens == prompt:
                self.start_from_handoff(req, generation, slot, fetched, step)
                continue
            if fetched is not None:  # cannot happen unless SGLang's hand-off changed: fail the request
                message = f"oasis: request row {req} arrived with {fetched.num_tokens} staged tokens for a {prompt}-token prompt"
                logger.error(message)
                self.failures.report(req, generation, message)
            self.intake.restart(req)
            dense_step[row] = True
        return dense_step

    def start_from_handoff(self, req: int, generation: int, slot: int, arrival: Arrival, step: int) -> None:
        """Working sets = the prefill node's first selection (its blocks were read at admission, or
        arrived with the whole KV; then its summaries are caught up from the pool at this step)."""
        self.intake.restart(req, arrival.num_tokens if arrival.summaries_read else 0)
        full = arrival.selection.shape[2]
        slots = torch.tensor([slot], dtype=torch.int64)
        block = self.block_size
        pages = self.req_to_token_pool.req_to_token[[req], 0 : full * block : block].to(torch.int64) // block
        # An extend here would have selected one step before this one: blocks this step does not
        # reselect must rank below the ones it loads for LRU eviction, as they would have.
        admission_step = step - 1
        for layer in range(int(self.kv_pool.layer_num)):
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
                k_buffer, v_buffer = self.kv_pool.get_key_buffer(layer), self.kv_pool.get_value_buffer(layer)
                self.working_sets.load(plan, slots, layer, pages, k_buffer, v_buffer)
                loads = plan.num_loads
                bytes_per_block = self.working_sets.bytes_per_block
                self.stats.add_loads(loads, [(req, generation, loads)], bytes_per_block, at_decode=False)
