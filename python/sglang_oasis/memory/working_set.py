"""Device-resident working sets: per request slot, layer and KV head, ``num_slots`` blocks of B tokens.

    k[req, layer, head, slot] : [B, head_dim]   (v alike)
    slot_block[req, layer, head, slot]          logical block index mirrored by the slot (EMPTY if none)
    last_selected[req, layer, head, slot]       decode step of its last selection (for LRU eviction)
    covered[req, layer]                         full blocks the last selection was made over; tokens
                                                from covered * B on are the active tail (``active_blocks.py``)
    top_k[req, layer]                           blocks the layer's selection takes by score (the sinks
                                                aside): ``--oasis-top-k``, or what ``--oasis-recall-target``
                                                grew it to; at most ``num_slots`` - sinks blocks are resident

Request slots are SGLang's ``req_pool_indices``; a slot is reset when a new request takes it (SGLang
bumps the slot's generation on every allocation; the owner key is that generation).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sgl_kernel_oasis import ops
from sglang_oasis.memory.plan_cpu import BLOCK_ID_SPAN, EMPTY, PlanLimits, plan_tables


def stable_ranks(key: torch.Tensor) -> torch.Tensor:
    """Each entry's rank along the last dim by ascending ``key`` (stable: ties by index)."""
    order = key.argsort(dim=-1, stable=True)
    index = torch.arange(key.shape[-1], device=key.device).expand_as(order).contiguous()
    return torch.empty_like(order).scatter_(-1, order, index)


class TransferPlan(NamedTuple):
    """Blocks to copy into working sets: load i puts logical block ``blocks[i]`` of batch row
    ``batch_rows[i]`` into slot ``slots[i]`` of KV head ``heads[i]``; ``deferred`` counts predicted
    blocks the fetch cap left for later steps."""

    batch_rows: torch.Tensor
    heads: torch.Tensor
    slots: torch.Tensor
    blocks: torch.Tensor
    deferred: int

    @property
    def num_loads(self) -> int:
        return int(self.blocks.numel())

    def subset(self, keep: torch.Tensor, deferred: int = 0) -> TransferPlan:
        """The loads ``keep`` (``[loads]`` bool) marks."""
        return TransferPlan(
            self.batch_rows[keep], self.heads[keep], self.slots[keep], self.blocks[keep], deferred
        )


class WorkingSetPool:
    def __init__(
        self,
        max_requests: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_slots: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        top_k: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.num_slots = num_slots
        self.base_top_k = num_slots if top_k is None else top_k
        shape = (max_requests, num_layers, num_kv_heads, num_slots, block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        table_shape = (max_requests, num_layers, num_kv_heads, num_slots)
        self.slot_block = torch.full(table_shape, EMPTY, dtype=torch.int64)
        self.last_selected = torch.full(table_shape, EMPTY, dtype=torch.int64)
        self.covered = torch.zeros((max_requests, num_layers), dtype=torch.int64)
        self.top_k = torch.full((max_requests, num_layers), self.base_top_k, dtype=torch.int64)
        self.owner: list[int | None] = [None] * max_requests

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    @property
    def bytes_per_block(self) -> int:
        """Bytes of K and V for one block of one KV head."""
        return self.block_size * self.k.shape[-1] * self.k.element_size() * 2

    def claim(self, req: int, owner: int) -> bool:
        """Give the slot to ``owner``; clears it if it held another. Returns True if it was cleared."""
        if self.owner[req] == owner:
            return False
        self.owner[req] = owner
        self.slot_block[req].fill_(EMPTY)
        self.last_selected[req].fill_(EMPTY)
        self.covered[req].zero_()
        self.top_k[req] = self.base_top_k
        return True

    def adopt(self, req: int, owner: int, donor: int, shared_blocks: int) -> int:
        """Give slot ``req`` to ``owner`` starting from ``donor``'s working sets: every layer's and head's
        resident blocks with id below ``shared_blocks`` (the blocks the two requests share, same pages,
        unchanged) are kept, the rest of the slots emptied. ``donor`` may be ``req`` itself (a finished
        request's slot handed to its next turn). Returns the number of (layer, head, slot) blocks kept."""
        if donor != req:
            self.k[req] = self.k[donor]
            self.v[req] = self.v[donor]
            self.slot_block[req] = self.slot_block[donor]
            self.last_selected[req] = self.last_selected[donor]
        self.owner[req] = owner
        drop = self.slot_block[req] >= shared_blocks
        self.slot_block[req][drop] = EMPTY
        self.last_selected[req][drop] = EMPTY
        self.covered[req].zero_()
        self.top_k[req] = self.base_top_k
        return int((self.slot_block[req] != EMPTY).sum())

    def resident_blocks(self, reqs: list[int]) -> int:
        """Occupied (layer, head, slot) entries of the given request slots."""
        return int((self.slot_block[reqs] != EMPTY).sum())

    def extra_blocks(self, reqs: list[int]) -> int:
        """Blocks per (layer, KV head) the given request slots select beyond their base top-K, summed."""
        extra = (self.top_k[reqs] - self.base_top_k).clamp(min=0)
        return int(extra.sum()) * self.k.shape[2]

    def plan_selections(
        self,
        reqs: torch.Tensor,
        layer: int,
        selected: torch.Tensor,
        step: int,
        cap: int | torch.Tensor | None = None,
        fresh_from: torch.Tensor | None = None,
        priority: torch.Tensor | None = None,
        capacity: torch.Tensor | None = None,
    ) -> TransferPlan:
        """Decide, for a whole batch, which selected blocks to load into which slots, and record the new
        mapping (``load`` then copies the data): on CPU tables in one call (``plan_cpu.py``), otherwise in
        tensor ops (``plan_in_torch``). ``HeadwiseMap.plan``
        (sglang_oasis_testing.headwise_reference) is the readable per-head reference this must agree with
        (``test/unit/test_sparse_stores.py`` checks it on random selections, caps and priorities).

        Args:
            reqs: ``[bs]`` request slots.
            selected: ``[bs, kv_heads, N]`` bool, the blocks each head should hold (at most ``num_slots``).
            step: decode step, recorded as the last selection of every selected resident block.
            cap, fresh_from, priority: at most ``cap`` missing blocks below ``fresh_from`` load per head,
                the best by ``priority`` first (``under_cap``; None: all load).
            capacity: ``[bs]`` blocks each head of the request may hold (its top-K + sinks, below
                ``num_slots`` when the recall target shrank it). None: ``num_slots``.

        Same plan as the per-head reference: kept blocks stay in their slots; admitted missing blocks,
        in ascending order, go to free slots first (in slot order), then to slots of unselected blocks,
        least recently selected first (ties: lowest block id first); then, past ``capacity``, unselected
        blocks leave in that same order.
        """
        blocks = self.slot_block[reqs, layer]  # [bs, H, S] copies, the new tables once planned
        last = self.last_selected[reqs, layer]
        limits = PlanLimits(cap, fresh_from, priority, capacity)
        if selected.device.type == "cpu":  # one GIL-free call (plan_cpu.py)
            loads, deferred = plan_tables(blocks, last, selected, step, limits)
            plan = TransferPlan(loads[0], loads[1], loads[2], loads[3], deferred)
        else:
            blocks, last, plan = plan_in_torch(blocks, last, selected, step, limits)
        self.slot_block[reqs, layer] = blocks
        self.last_selected[reqs, layer] = last
        return plan

    def load(
        self,
        plan: TransferPlan,
        reqs: torch.Tensor,
        layer: int,
        block_pages: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
    ) -> None:
        """Copy the planned blocks from the host tier (``block_pages[b, block]`` = host page of request
        ``b``'s logical block) into their device slots: one batched ``copy_blocks_to_slots``."""
        if plan.blocks.numel():
            self.load_pages(plan, reqs, layer, block_pages[plan.batch_rows, plan.blocks], k_buffer, v_buffer)

    def load_pages(
        self,
        plan: TransferPlan,
        reqs: torch.Tensor,
        layer: int,
        pages: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
    ) -> None:
        """Copy load i of the plan from page ``pages[i]`` of ``k_buffer``/``v_buffer`` (``[tokens, kv_heads,
        head_dim]``: a layer of the host tier, or of the active blocks) into its slot."""
        if not plan.blocks.numel():
            return
        rows = self._block_rows(reqs[plan.batch_rows], layer, plan.heads) + plan.slots
        device = self.k.device
        ws_k, ws_v = self.block_views()
        # non_blocking: a copy from pageable host memory is staged at once, and the stream need not drain
        rows, pages, heads = (t.to(device, non_blocking=True) for t in (rows, pages, plan.heads))
        ops.copy_blocks_to_slots(ws_k, ws_v, rows, k_buffer, v_buffer, pages, heads)

    def block_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as ``[requests * layers * heads * slots, B, head_dim]`` block rows."""
        block_shape = (-1, self.block_size, self.k.shape[-1])
        return self.k.view(block_shape), self.v.view(block_shape)

    def _block_rows(self, reqs: torch.Tensor, layer: int, heads: torch.Tensor) -> torch.Tensor:
        """Block row of slot 0 of (request, layer, head) in ``block_views``."""
        num_layers, num_heads = self.k.shape[1], self.k.shape[2]
        return ((reqs * num_layers + layer) * num_heads + heads) * self.num_slots

    def apply_selections(
        self,
        reqs: torch.Tensor,
        layer: int,
        selected: torch.Tensor,
        block_pages: torch.Tensor,
        step: int,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
    ) -> int:
        """Plan without a cap and load at once; returns the number of blocks loaded."""
        plan = self.plan_selections(reqs, layer, selected, step)
        self.load(plan, reqs, layer, block_pages, k_buffer, v_buffer)
        return plan.num_loads

    def touch(self, reqs: torch.Tensor, layer: int, step: int) -> None:
        """Record every resident block of these requests as selected at ``step`` (the plan when the
        selection is exactly the resident set)."""
        resident = self.slot_block[reqs, layer] != EMPTY
        self.last_selected[reqs, layer] = torch.where(resident, step, self.last_selected[reqs, layer])

    def slot_rows(self, reqs: torch.Tensor, layer: int) -> torch.Tensor:
        """``[bs, heads, slots]`` block rows (in ``block_views``) of each head's working set, sorted by
        the block they hold, empty slots last as -1: with every block resident the tokens appear in
        sequence order, exactly as dense attention sees them."""
        blocks = self.slot_block[reqs, layer]  # [bs, H, S]
        order = torch.where(blocks == EMPTY, torch.iinfo(torch.int64).max, blocks).argsort(dim=-1)
        heads = torch.arange(blocks.shape[1])
        rows = self._block_rows(reqs[:, None, None], layer, heads[None, :, None]) + order
        return torch.where(blocks.gather(-1, order) == EMPTY, -1, rows)

    def gather(self, reqs: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Working sets of a batch in block order: keys, values ``[bs, heads, slots * B, dim]`` and valid
        (the tokens ``headwise_decode_attention`` reads in place)."""
        rows = self.slot_rows(reqs, layer)
        bs, heads, slots = rows.shape
        shape = (bs, heads, slots * self.block_size, self.k.shape[-1])
        ws_k, ws_v = self.block_views()
        keys = ws_k[rows.clamp(min=0)].view(shape)
        values = ws_v[rows.clamp(min=0)].view(shape)
        valid = (rows >= 0)[..., None].expand(bs, heads, slots, self.block_size)
        return keys, values, valid.flatten(2, 3)


def plan_in_torch(
    blocks: torch.Tensor, last: torch.Tensor, selected: torch.Tensor, step: int, limits: PlanLimits
) -> tuple[torch.Tensor, torch.Tensor, TransferPlan]:
    """``WorkingSetPool.plan_selections`` in tensor ops, for a batch's tables ``blocks``/``last``
    ``[bs, H, S]``: the new tables and the plan (``plan_cpu.plan_tables`` is the same plan in one call)."""
    cap, fresh_from, priority, capacity = limits
    bs, heads, num_blocks = selected.shape
    num_slots = blocks.shape[-1]
    occupied = blocks != EMPTY
    holds_selected = occupied & selected.gather(-1, blocks.clamp(0, num_blocks - 1))
    resident = torch.zeros((bs, heads, num_blocks + 1), dtype=torch.bool)
    resident.scatter_(-1, torch.where(occupied, blocks, num_blocks), True)
    missing = selected & ~resident[..., :num_blocks]
    missing, deferred = (missing, 0) if cap is None else under_cap(missing, cap, fresh_from, priority)
    # Victim order: free slots (key -1), then unselected blocks by last selection, ties by block id
    # (not by slot: where a block sits depends on the slot's history, e.g. a warm start's donor, and
    # what is evicted must not); kept slots last.
    key = torch.where(occupied, last * BLOCK_ID_SPAN + blocks, -1)
    key = torch.where(holds_selected, torch.iinfo(torch.int64).max, key)
    victims = key.sort(dim=-1, stable=True).indices
    missing_first = (~missing).to(torch.int8).sort(dim=-1, stable=True).indices  # ascending ids
    ranks = min(num_slots, num_blocks)
    take = torch.arange(ranks) < missing.sum(-1, keepdim=True)  # [bs, H, ranks]
    b_idx, h_idx, r_idx = take.nonzero(as_tuple=True)
    slots = victims[b_idx, h_idx, r_idx]
    new = missing_first[b_idx, h_idx, r_idx]
    blocks[b_idx, h_idx, slots] = new
    now_selected = (blocks != EMPTY) & selected.gather(-1, blocks.clamp(0, num_blocks - 1))
    if capacity is not None:  # a working set the recall target shrank gives its extra blocks back
        dropped = past_capacity(blocks, last, now_selected, capacity)
        blocks, last = blocks.masked_fill(dropped, EMPTY), last.masked_fill(dropped, EMPTY)
    return blocks, torch.where(now_selected, step, last), TransferPlan(b_idx, h_idx, slots, new, deferred)


def under_cap(
    missing: torch.Tensor,
    cap: int | torch.Tensor,
    fresh_from: torch.Tensor | None,
    priority: torch.Tensor | None,
) -> tuple[torch.Tensor, int]:
    """``missing`` ``[bs, H, N]`` with only the blocks a fetch cap admits: every block from ``fresh_from``
    ``[bs]`` on (just filled up), and of the others the ``cap`` best by ``priority`` (ties by block id);
    and how many it deferred."""
    num_blocks = missing.shape[-1]
    fresh = (
        torch.arange(num_blocks)[None, None, :] >= fresh_from[:, None, None]
        if fresh_from is not None
        else torch.zeros((1, 1, num_blocks), dtype=torch.bool)
    )
    capped = missing & ~fresh
    order_key = -priority.float() if priority is not None else torch.zeros(missing.shape)
    rank = stable_ranks(torch.where(capped, order_key, float("inf")))
    admitted = capped & (rank < (cap.view(-1, 1, 1) if isinstance(cap, torch.Tensor) else cap))
    return missing & (fresh | admitted), int((capped & ~admitted).sum())


def past_capacity(
    blocks: torch.Tensor, last: torch.Tensor, now_selected: torch.Tensor, capacity: torch.Tensor
) -> torch.Tensor:
    """``[bs, H, S]`` slots whose unselected blocks leave a working set holding more than its ``capacity``
    ``[bs]``, least recently selected first (ties: lowest block id)."""
    spare = (blocks != EMPTY) & ~now_selected
    excess = (blocks != EMPTY).sum(-1, keepdim=True) - capacity[:, None, None]  # [bs, H, 1]
    spare_key = torch.where(spare, last * BLOCK_ID_SPAN + blocks, torch.iinfo(torch.int64).max)
    return spare & (stable_ranks(spare_key) < excess)
