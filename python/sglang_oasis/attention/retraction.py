"""A retracted request's selection state, kept until SGLang resumes it.

SGLang retracts running requests under memory pressure and resumes them later in a new row:

- under PD disaggregation (decode node) it backs the request's KV pages up to host memory and restores
  them at the resume (``resume_retracted_reqs``); the request's next forward is a decode;
- otherwise it frees the request's KV and re-prefills it later: an extend over its prompt and output
  (after any radix-cached prefix), whose last row computes the next token.

Started afresh there (a PD dense first step, or the extend's dense last row and a new admission), its
continuation would leave the path it was on, and so differ from the same request served without a
retraction. So when SGLang retracts it (hooks 7 and 8 in ``sglang_hooks.py``), its working-set tables
are kept under a key stamped on SGLang's request object (not its rid: a client may send a new request
with the rid of one retracted and never resumed), and the new row gets them back:

- which block each (layer, KV head) slot holds, and when each was last selected (shifted by the decode
  steps the request sat out, so their LRU order against its next selections is the same);
- each layer's covered blocks, top-K (what a recall target grew it to) and window pins;
- its recall probe's own-step count and shrink streaks.

PD decode: the blocks' K and V and the active tail are loaded from the restored pages at the resume,
the summaries caught up from them at its step (min/max: exact); a request retracted before its first
step here keeps its prefill node's hand-off instead. Re-prefill: at the extend that reaches the
request's length (its last chunk) each layer loads the blocks from the pages the extend just wrote,
and the last row's attention becomes the sparse step the request would have taken (working set, active
tail, itself); its selection is a decode step's. The K and V its decode steps computed (positions from
its prompt's length on) are kept too and put back in place of the extend's recomputed rows at every
layer, before they are written, summarised or attended, at every chunk of the re-prefill: an extend
would compute them by dense attention, not the sparse steps that made them (up to ``SAVED_KV_BYTES`` for
all kept requests; beyond it the recompute stands). The prompt is recomputed by an extend as it
was first computed, so the step is the same up to that recompute's rounding (as for dense SGLang).

Saved states are dropped when taken and bounded in number (a retracted request SGLang aborts while it
waits is never resumed): the oldest go first.
"""

from __future__ import annotations

import logging
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from sglang_oasis.attention.batch_view import BatchView, extend_prefix_lens, extend_seq_lens
from sglang_oasis.attention.kv_intake import KVIntake
from sglang_oasis.attention.pd_node import PDNode
from sglang_oasis.attention.recall_probe import RecallProbe
from sglang_oasis.attention.request_slots import RequestSlots
from sglang_oasis.attention.retracted_kv import SavedKV, put_back
from sglang_oasis.attention.selection_snapshot import SelectionSnapshot
from sglang_oasis.attention.selector import Selector
from sglang_oasis.attention.sparse_attention import SparseAttention
from sglang_oasis.disaggregation.decode_admission import Arrival
from sglang_oasis.memory.working_set import EMPTY, TransferPlan
from sglang_oasis.sglang_contract import RETRACT_LISTENER, RETRACTION_KEY
from sglang_oasis.stats import OasisStats

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

logger = logging.getLogger(__name__)


class SavedSelection(NamedTuple):
    step: int  # the backend's decode step when it was saved (the request's last one)
    tokens: int  # prompt and output when it was retracted: what a re-prefill extends to
    slot_block: torch.Tensor  # [layers, kv_heads, slots]
    last_selected: torch.Tensor  # [layers, kv_heads, slots]
    covered: torch.Tensor  # [layers]
    top_k: torch.Tensor  # [layers]
    pinned: torch.Tensor  # [layers, kv_heads, window blocks]
    prompt_len: int | None  # as the selector knew it (fault injection picks requests by it)
    probe: tuple[int, dict[int, int]]  # RecallProbe.state_of(...)
    kv: SavedKV | None  # its decode steps' K and V (re-prefill only)


class Retractions:
    def __init__(
        self, slots: RequestSlots, selector: Selector, snapshot: SelectionSnapshot, attention: SparseAttention,
        recall: RecallProbe, intake: KVIntake, stats: OasisStats, sparse_layers: list[int],
        step: Callable[[], int], pd: PDNode,
    ) -> None:  # fmt: skip
        self.slots, self.selector, self.attention, self.recall, self.pd = slots, selector, attention, recall, pd  # fmt: skip
        self.tier = slots.tier
        self.working_sets = slots.working_sets
        # Each slot's tables as they were before its last selection (the selector's ``before_select``).
        self.snapshot = snapshot
        self.intake = intake  # the summarised positions' owner
        self.stats = stats
        self.req_pool, self.kv_pool = attention.req_to_token_pool, attention.kv_pool
        self.layers = sparse_layers  # the backend's (its layers but ``--oasis-dense-layers``)
        self.limit = 4 * self.tier.num_request_slots
        self._saved: OrderedDict[str, SavedSelection | Arrival] = OrderedDict()
        self._restoring: dict[tuple[int, int], SavedKV] = {}  # (row, generation): this extend's to put back
        self.step = step  # the backend's decode steps so far
        setattr(self.req_pool, RETRACT_LISTENER, self.keep)  # called by hooks 7 and 8

    def held(self) -> int:
        """Kept selection states not resumed yet."""
        return len(self._saved)

    def keep(self, req: int, key: str, tokens: int, backed_up: bool) -> None:
        """SGLang retracts request row ``req`` (``key``: its retraction key, hooks 7 and 8; ``tokens`` of
        prompt and output; ``backed_up``: its KV, hook 7): keep its selection state (the oldest kept goes
        beyond the limit). A PD decode node keeps backed-up requests only (the others come back from the
        prefill node, sent again)."""
        if self.pd.decode_node and not backed_up:
            return
        generation = int(self.req_pool.req_generation[req])
        if not self.slots.holds(req, generation):
            # Retracted before its first step here: it holds no slot yet, but may hold a hand-off.
            # Or retracted again before its resume took a step: what its last retraction kept stays.
            arrival = self.pd.remote.take_arrival(req, generation) if self.pd.remote else None
            if arrival is not None:
                self._remember(key, arrival)
            logger.info("oasis: retracted request %s before its first step here (kept: %s)", key,
                        arrival is not None or key in self._saved)  # fmt: skip
            return
        self.selector.finish_pending()  # its working sets as the next step would find them
        slot = self.tier.slot(req)
        step, (steps, above) = self.step(), self.recall.state_of(req, slot)
        source, before = self.snapshot.current(), self.snapshot.before(slot, tokens)
        if before is not None:
            # Its last forward computed the token at `tokens - 1` (seq_len `tokens`), but SGLang kept
            # neither its output nor its KV: it redoes that step after the resume. Keep the tables
            # from before it (an admission redone is chosen the same way again: nothing to keep).
            if before.admission:
                return
            source = before.tables
            step, steps = before.step - 1, steps - 1
        tables = {name: table[slot].clone() for name, table in source.items()}
        prompt_len = self.selector.prompt_len.get(req)
        kv = None
        if not backed_up and prompt_len is not None:
            kept = sum(s.kv.nbytes for s in self._saved.values() if isinstance(s, SavedSelection) and s.kv)
            kv = SavedKV.of(self.kv_pool, self.req_pool.req_to_token[req], prompt_len, tokens - 1, kept, key)
        self._remember(key, SavedSelection(
            step, tokens, tables["slot_block"], tables["last_selected"], tables["covered"], tables["top_k"],
            self.tier.pinned[slot].clone(), prompt_len, (steps, above), kv,
        ))  # fmt: skip
        logger.info(
            "oasis: retracted request %s at step %d, %d tokens: selection state kept", key, step, tokens
        )

    def _remember(self, key: str, saved: SavedSelection | Arrival) -> None:
        self._saved[key] = saved
        self._saved.move_to_end(key)
        while len(self._saved) > self.limit:
            self._saved.popitem(last=False)
        self.stats.add("retracted_requests")

    # --- PD decode: the KV was backed up and restored ------------------------------------------------

    def resume(
        self, reqs: list[int], generations: list[int], seq_lens: list[int], keys: list[str | None], verify: bool,
        step: int,
    ) -> None:  # fmt: skip
        """Retracted requests back in a decode batch at ``step`` (in new rows, ``seq_lens`` counting the
        token a decode computes): a slot with their kept state, its blocks and active tail loaded from
        the restored pages. Their step is then the sparse step they would have taken without the
        retraction (no dense step, no new admission)."""
        if not self._saved:
            return
        for row, (req, generation, key) in enumerate(zip(reqs, generations, keys, strict=True)):
            if key is None or self.slots.holds(req, generation) or key not in self._saved:
                continue
            saved = self._saved.pop(key)
            committed = seq_lens[row] - (0 if verify else 1)
            if isinstance(saved, Arrival) and saved.num_tokens != committed:
                continue  # not the request it was (cannot happen unless SGLang changed): a dense first step
            self.selector.finish_pending()  # slots may change hands below
            slot = self.slots.claim(req, generation)
            self.stats.add("resumed_requests")
            logger.info("oasis: request %s resumed at step %d with %d tokens from its kept %s", key, step,
                        committed, "hand-off" if isinstance(saved, Arrival) else "selection state")  # fmt: skip
            if isinstance(saved, Arrival):  # its hand-off, as its first step here would have taken it
                self.selector.prompts_extended([req], [committed])
                self.pd.start_from_handoff(req, generation, slot, saved, step)
                self.intake.restart(req)  # the hand-off's summaries went to its old pages: caught up
                continue
            self._restore(saved, req, generation, slot, step)
            self._load(torch.tensor([slot]), torch.tensor([req]), self.layers)
            self.intake.restart(req)  # caught up from the restored pages at this step (exact min/max)
            self.attention.load_tail(req, slot, self.layers, committed, 0 if verify else 1)

    # --- re-prefill: the KV is recomputed by an extend ----------------------------------------------

    def resume_extend(
        self, reqs: list[int], generations: list[int], seq_lens: list[int], keys: list[str | None], step: int
    ) -> torch.Tensor:
        """An extend's retracted requests re-prefilled whole (the extend reaching the length they were
        retracted at: their last chunk; each holds a slot, ``_admit`` gave it one): their kept state
        back in that slot. ``[bs]`` bool, those rows: they are not admissions (``attend_resumed``)."""
        resumed = torch.zeros(len(reqs), dtype=torch.bool)
        self._restoring.clear()
        for row, (req, generation, key, length) in enumerate(
            zip(reqs, generations, keys, seq_lens, strict=True)
        ):
            if key is None:  # never retracted
                continue
            saved = self._saved.get(key)
            if not isinstance(saved, SavedSelection) or saved.tokens < length:
                continue
            if saved.tokens > length:  # an earlier chunk: an admission overwritten at the last one, but
                if saved.kv is not None:  # the decode steps' K and V it reaches are put back already
                    self._restoring[(req, generation)] = saved.kv
                continue
            del self._saved[key]
            self.selector.finish_pending()  # the slot's earlier chunk may still be selecting
            self._restore(saved, req, generation, self.tier.slot(req), step)
            if saved.kv is not None:
                self._restoring[(req, generation)] = saved.kv
            self.stats.add("resumed_requests")
            logger.info("oasis: request %s re-prefilled at step %d with %d tokens: kept selection state", key,
                        step, length)  # fmt: skip
            resumed[row] = True
        return resumed

    def restore_kv(
        self,
        batch: BatchView,
        layer_id: int,
        forward_batch: ForwardBatch,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """An extend's new K and V at ``layer_id`` (``forward_batch``: SGLang's, whose rows are each
        request's new tokens after its cached prefix) with the re-prefilled requests' kept decode K and V in
        their positions' rows (copies; ``k`` and ``v`` as they are when there is none). Positions in the
        prefix are the radix cache's or an earlier chunk's, not rewritten."""
        if not self._restoring or k is None or v is None:
            return k, v
        prefix_lens = extend_prefix_lens(forward_batch)
        extend_lens = extend_seq_lens(forward_batch)
        k, v, restored = put_back(self._restoring, batch, layer_id, prefix_lens, extend_lens, k, v,
                                  self.attention.num_kv_heads)  # fmt: skip
        if layer_id == 0 and restored:
            self.stats.add("resumed_kv_tokens", restored)
        return k, v

    def attend_resumed(
        self, batch: BatchView, layer: RadixAttention, q_rows: torch.Tensor, last: torch.Tensor,
        k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, seq_lens: torch.Tensor,
    ) -> None:  # fmt: skip
        """An extend's re-prefilled retracted requests (its rows that are not admissions), at ``layer``:
        their blocks are loaded from the pages the extend just wrote, and each one's last row attends as
        the decode step it would have taken (working set, active tail, itself), not densely: ``out``'s
        rows are replaced."""
        rows = ~batch.admitting
        part = batch.subset(rows)
        self._load(part.slots, part.req_index, [layer.layer_id])
        at = last[rows.to(last.device)]
        heads = self.attention.num_kv_heads
        keys, values = k.reshape(k.shape[0], heads, -1)[at], v.reshape(v.shape[0], heads, -1)[at]
        sparse = self.attention.decode(part, q_rows[at], layer, seq_lens[rows], keys, values)
        out.view(-1, layer.tp_q_head_num, layer.v_head_dim)[at] = sparse.to(out.dtype)

    # --- both ---------------------------------------------------------------------------------------

    def _restore(self, saved: SavedSelection, req: int, generation: int, slot: int, step: int) -> None:
        """Request slot ``slot`` gets the ``saved`` tables; its next selection is made at ``step``."""
        sets = self.working_sets
        resident = saved.slot_block != EMPTY
        # Without the retraction the request's next selection would have been made at saved.step + 1.
        shift = step - saved.step - 1
        sets.slot_block[slot] = saved.slot_block
        sets.last_selected[slot] = torch.where(resident, saved.last_selected + shift, EMPTY)
        sets.covered[slot] = saved.covered
        sets.top_k[slot] = saved.top_k
        self.tier.pinned[slot] = saved.pinned
        if saved.prompt_len is not None:
            self.selector.prompts_extended([req], [saved.prompt_len])
        self.recall.resume(req, generation, slot, saved.probe)

    def _load(self, slots: torch.Tensor, reqs: torch.Tensor, layers: list[int]) -> None:
        """Load every block the request slots ``slots`` hold at ``layers`` from their requests' (rows
        ``reqs``) pages in the host tier; counted."""
        sets, block = self.working_sets, self.working_sets.block_size
        for slot, req in zip(slots.tolist(), reqs.tolist(), strict=True):
            generation = int(self.req_pool.req_generation[req])
            full = int(sets.covered[slot].max()) if len(sets.covered[slot]) else 0
            pages = self.req_pool.req_to_token[req, 0 : full * block : block].to(torch.int64) // block
            one = torch.tensor([slot], dtype=torch.int64)
            for layer in layers:
                heads, positions = (sets.slot_block[slot, layer] != EMPTY).nonzero(as_tuple=True)
                blocks = sets.slot_block[slot, layer][heads, positions]
                plan = TransferPlan(torch.zeros_like(blocks), heads, positions, blocks, 0)
                k_buffer, v_buffer = self.kv_pool.get_key_buffer(layer), self.kv_pool.get_value_buffer(layer)
                sets.load(plan, one, layer, pages[None], k_buffer, v_buffer)
                loads = plan.num_loads
                self.stats.add_loads(loads, [(req, generation, loads)], sets.bytes_per_block, at_decode=True)


def keep_retracted(req_to_token_pool: ReqToTokenPool, req: Req, backed_up: bool) -> None:
    """Tell the pool's retraction listener (the oasis backend) that ``req`` is retracted: its row, a key
    stamped on the request object (hook 9 hands it to the backend when the request comes back; a new
    request reusing the rid has none), the tokens its resume will hold (prompt and output), and whether its
    KV was backed up."""
    keep = getattr(req_to_token_pool, RETRACT_LISTENER, None)
    row = getattr(getattr(req, "kv", None), "req_pool_idx", None)
    if keep is None or row is None:
        return
    # This request object's key, not its (client-chosen) rid; the same at every retraction of it: one
    # retracted again before it took a step (SGLang resumed it and retracted it at once) still finds
    # the state its first retraction kept.
    key = getattr(req, RETRACTION_KEY, None) or f"{req.rid}#{uuid.uuid4().hex[:16]}"
    setattr(req, RETRACTION_KEY, key)
    try:
        keep(int(row), key, len(req.origin_input_ids) + len(req.output_ids), backed_up)
    except Exception:  # it resumes with a new admission then, as without the hook
        logger.exception("oasis: keeping retracted request %s's selection state failed", req.rid)
