"""A retracted request's selection state, kept until SGLang resumes it.

Under PD disaggregation SGLang retracts a decode request under memory pressure by backing up its KV
pages to host memory and freeing its row; it later resumes the request in a new row with the same KV
restored (``resume_retracted_reqs``). Started afresh there (a dense first step and a new admission
selection), its continuation would leave the path it was on, and so differ from the same request
served without a retraction. So at the backup (hook 7's ``backup_kv_cache``) the request's working-set
tables are saved under its rid, and when it arrives again the new slot gets them back:

- which block each (layer, KV head) slot holds, and when each was last selected (shifted by the decode
  steps the request sat out, so its LRU order against its next selections is the same);
- each layer's covered blocks, top-K (what a recall target grew it to) and window pins;
- its recall probe's own-step count and shrink streaks.

The blocks' K and V, and the active tail after the covered blocks, are loaded from the restored host
pages (counted in ``blocks_loaded`` and ``tail_bytes_host_to_device``); the summaries are caught up from
them at the first step (min/max: exact). The first step after the resume is then the sparse step the
request would have taken without the retraction.

Saved states are dropped when taken and bounded in number (a retracted request SGLang aborts while it
waits is never resumed): the oldest go first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from sglang_oasis.attention.recall_probe import RecallProbe
from sglang_oasis.attention.request_slots import RequestSlots
from sglang_oasis.attention.selector import Selector
from sglang_oasis.attention.sparse_attention import SparseAttention
from sglang_oasis.memory.headwise_map import EMPTY
from sglang_oasis.memory.working_set import TransferPlan
from sglang_oasis.sglang_hooks import RETRACT_LISTENER
from sglang_oasis.stats import OasisStats


class SavedSelection(NamedTuple):
    step: int  # the backend's decode step when it was saved (the request's last one)
    slot_block: torch.Tensor  # [layers, kv_heads, slots]
    last_selected: torch.Tensor  # [layers, kv_heads, slots]
    covered: torch.Tensor  # [layers]
    top_k: torch.Tensor  # [layers]
    pinned: torch.Tensor  # [layers, kv_heads, window blocks]
    prompt_len: int | None  # as the selector knew it (fault injection picks requests by it)
    probe: Any  # RecallProbe.state_of(...)


class Retractions:
    def __init__(
        self,
        slots: RequestSlots,
        selector: Selector,
        attention: SparseAttention,
        recall: RecallProbe,
        summarised: torch.Tensor,
        stats: OasisStats,
        dense_layers: frozenset[int],
        step: Callable[[], int],
    ) -> None:
        self.slots, self.selector, self.attention, self.recall = slots, selector, attention, recall
        self.tier = slots.tier
        self.working_sets = slots.working_sets
        self.summarised = summarised  # [req rows, layers] positions whose keys are in the summaries
        self.stats = stats
        self.req_pool, self.kv_pool = attention.req_to_token_pool, attention.kv_pool
        self.layers = [layer for layer in range(int(self.kv_pool.layer_num)) if layer not in dense_layers]
        self.limit = 4 * self.tier.num_request_slots
        self._saved: OrderedDict[str, SavedSelection] = OrderedDict()
        self.step = step  # the backend's decode steps so far
        setattr(self.req_pool, RETRACT_LISTENER, self.keep)  # called by hook 7 at a retraction's backup

    def __len__(self) -> int:
        return len(self._saved)

    def keep(self, req: int, rid: str) -> None:
        """SGLang backed request row ``req`` (``rid``) up for a retraction: keep its selection state (the
        oldest kept goes beyond the limit)."""
        generation = int(self.req_pool.req_generation[req])
        if not self.slots.holds(req, generation):
            return
        self.selector.finish_pending()  # its working sets as the next step would find them
        slot, sets = self.tier.slot(req), self.working_sets
        self._saved[rid] = SavedSelection(
            self.step(), sets.slot_block[slot].clone(), sets.last_selected[slot].clone(), sets.covered[slot].clone(),
            sets.top_k[slot].clone(), self.tier.pinned[slot].clone(), self.selector.prompt_len.get(req),
            self.recall.state_of(req, slot),
        )  # fmt: skip
        self._saved.move_to_end(rid)
        while len(self._saved) > self.limit:
            self._saved.popitem(last=False)
        self.stats.add("retracted_requests")

    def resume(
        self, reqs: list[int], generations: list[int], seq_lens: list[int], rids: list[str], verify: bool,
        step: int,
    ) -> None:  # fmt: skip
        """Retracted requests back in a decode batch at ``step`` (in new rows, ``seq_lens`` counting the
        token a decode computes): a slot with their kept state, its blocks and active tail loaded from
        the restored pages. Their step is then the sparse step they would have taken without the
        retraction (no dense step, no new admission)."""
        if not self._saved:
            return
        for row, (req, generation, rid) in enumerate(zip(reqs, generations, rids, strict=True)):
            if self.slots.holds(req, generation) or rid not in self._saved:
                continue
            saved = self._saved.pop(rid)
            self.selector.finish_pending()  # slots may change hands below
            slot = self.slots.claim(req, generation)
            if saved.prompt_len is not None:
                self.selector.prompt_len[req] = saved.prompt_len
            loads = self._restore(saved, slot, req, step)
            self.stats.add("blocks_loaded", loads)
            self.stats.add("bytes_host_to_device", loads * self.working_sets.bytes_per_block)
            self.summarised[req] = 0  # caught up from the restored pages at this step (exact min/max)
            self.attention.load_tail(
                req, slot, self.layers, seq_lens[row] - (0 if verify else 1), 0 if verify else 1
            )
            self.recall.resume(req, generation, slot, saved.probe)
            self.stats.add("resumed_requests")

    def _restore(self, saved: SavedSelection, slot: int, req: int, step: int) -> int:
        """Give the freshly claimed request slot ``slot`` the ``saved`` tables at decode step ``step`` and
        load its resident blocks from request row ``req``'s new pages. Returns the blocks loaded."""
        sets, block = self.working_sets, self.working_sets.block_size
        resident = saved.slot_block != EMPTY
        # The request's next step is `step`; without the retraction it would have been saved.step + 1.
        shift = step - saved.step - 1
        sets.slot_block[slot] = saved.slot_block
        sets.last_selected[slot] = torch.where(resident, saved.last_selected + shift, EMPTY)
        sets.covered[slot] = saved.covered
        sets.top_k[slot] = saved.top_k
        self.tier.pinned[slot] = saved.pinned
        full = int(saved.covered.max()) if len(saved.covered) else 0
        pages = self.req_pool.req_to_token[req, 0 : full * block : block].to(torch.int64) // block
        slots, loads = torch.tensor([slot], dtype=torch.int64), 0
        for layer in self.layers:
            heads, positions = resident[layer].nonzero(as_tuple=True)
            if not len(heads):
                continue
            blocks = saved.slot_block[layer][heads, positions]
            plan = TransferPlan(torch.zeros_like(blocks), heads, positions, blocks, 0)
            k_buffer, v_buffer = self.kv_pool.get_key_buffer(layer), self.kv_pool.get_value_buffer(layer)
            sets.load(plan, slots, layer, pages[None], k_buffer, v_buffer)
            loads += plan.num_loads
        return loads
