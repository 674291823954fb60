"""Device-resident working sets: per request slot, layer and KV head, ``num_slots`` blocks of B tokens.

    k[req, layer, head, slot] : [B, head_dim]   (v alike)
    slot_block[req, layer, head, slot]          logical block index mirrored by the slot (EMPTY if none)
    last_selected[req, layer, head, slot]       decode step of its last selection (for LRU eviction)
    covered[req, layer]                         full blocks the last selection was made over; tokens
                                                from covered * B on are the active tail, read directly

Request slots are SGLang's ``req_pool_indices``; a slot is reset when a new request takes it (SGLang
bumps the slot's generation on every allocation; the owner key is that generation).
"""

from __future__ import annotations

import torch

from sglang_oasis.memory.headwise_map import EMPTY


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
    ) -> None:
        self.block_size = block_size
        self.num_slots = num_slots
        shape = (max_requests, num_layers, num_kv_heads, num_slots, block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        table_shape = (max_requests, num_layers, num_kv_heads, num_slots)
        self.slot_block = torch.full(table_shape, EMPTY, dtype=torch.int64)
        self.last_selected = torch.full(table_shape, EMPTY, dtype=torch.int64)
        self.covered = torch.zeros((max_requests, num_layers), dtype=torch.int64)
        self.owner: list[int | None] = [None] * max_requests
        self._block_offsets = torch.arange(block_size, device=device)

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
        return True

    def resident_blocks(self, reqs: list[int]) -> int:
        """Occupied (layer, head, slot) entries of the given request slots."""
        return int((self.slot_block[reqs] != EMPTY).sum())

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
        """Make every selected block resident, for a whole batch in tensor ops, and copy it in.

        ``HeadwiseMap.apply_selection`` is the readable per-head reference this must agree with
        (``test/unit/test_sparse_stores.py`` checks it on random selections).

        Args:
            reqs: ``[bs]`` request slots.
            selected: ``[bs, kv_heads, N]`` bool, the blocks each head must hold (at most ``num_slots``).
            block_pages: ``[bs, N]`` host page of each logical block (entries past a request's blocks
                are ignored).
            step: decode step, recorded as the last selection of every selected block.

        Returns the number of blocks loaded. Same plan as the per-head reference: kept blocks stay in
        their slots; missing blocks, in ascending order, go to free slots first (in slot order), then
        to slots of unselected blocks, least recently selected first.
        """
        bs, heads, num_blocks = selected.shape
        blocks = self.slot_block[reqs, layer]  # [bs, H, S]
        last = self.last_selected[reqs, layer]
        occupied = blocks != EMPTY
        holds_selected = occupied & selected.gather(-1, blocks.clamp(0, num_blocks - 1))
        resident = torch.zeros((bs, heads, num_blocks + 1), dtype=torch.bool)
        resident.scatter_(-1, torch.where(occupied, blocks, num_blocks), True)
        missing = selected & ~resident[..., :num_blocks]
        # Victim order: free slots (key -1), then unselected blocks by last selection; kept slots last.
        key = torch.where(occupied, last, -1)
        key = torch.where(holds_selected, torch.iinfo(torch.int64).max, key)
        victims = key.sort(dim=-1, stable=True).indices
        missing_first = (~missing).to(torch.int8).sort(dim=-1, stable=True).indices  # ascending ids
        ranks = min(self.num_slots, num_blocks)
        take = torch.arange(ranks) < missing.sum(-1, keepdim=True)  # [bs, H, ranks]
        b_idx, h_idx, r_idx = take.nonzero(as_tuple=True)
        slots = victims[b_idx, h_idx, r_idx]
        new = missing_first[b_idx, h_idx, r_idx]
        blocks[b_idx, h_idx, slots] = new
        now_selected = (blocks != EMPTY) & selected.gather(-1, blocks.clamp(0, num_blocks - 1))
        self.slot_block[reqs, layer] = blocks
        self.last_selected[reqs, layer] = torch.where(now_selected, step, last)
        if new.numel():
            req_ids = reqs[b_idx]
            tokens = block_pages[b_idx, new][:, None] * self.block_size + self._block_offsets
            self.k[req_ids, layer, h_idx, slots] = k_buffer[tokens, h_idx[:, None]].to(self.k.dtype)
            self.v[req_ids, layer, h_idx, slots] = v_buffer[tokens, h_idx[:, None]].to(self.v.dtype)
        return int(new.numel())

    def gather(self, reqs: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Working sets of a batch in block order: keys, values ``[bs, heads, slots * B, dim]`` and valid.

        Slots are sorted by the block they hold (empty slots last), so with every block resident the
        tokens appear in sequence order, exactly as dense attention sees them.
        """
        blocks = self.slot_block[reqs, layer]  # [bs, H, S]
        order = torch.where(blocks == EMPTY, torch.iinfo(torch.int64).max, blocks).argsort(dim=-1)
        bs, heads, slots = blocks.shape
        index = order[..., None, None].expand(bs, heads, slots, self.block_size, self.k.shape[-1])
        keys = self.k[reqs, layer].gather(2, index).flatten(2, 3)
        values = self.v[reqs, layer].gather(2, index).flatten(2, 3)
        valid = (blocks.gather(-1, order) != EMPTY)[..., None].expand(bs, heads, slots, self.block_size)
        return keys, values, valid.flatten(2, 3)
