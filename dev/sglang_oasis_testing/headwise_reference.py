"""The head-wise mapping of one (request, layer): which host block each device slot mirrors, per KV head.

This is the readable per-head reference of the plan; serving runs the batched tensor version,
``WorkingSetPool.apply_selections``, which is tested to make exactly the same plan.

Each KV head has its own ``num_slots`` device slots (its working set: K selected blocks plus the active
block and any sinks), so heads can hold different blocks. For every slot the table keeps the host block
it holds (or nothing) and the decode step at which that block was last selected, for least-recently-
selected eviction. SGLang's own page tables are not touched: the attention backend reads through this
map.

Applying a selection for a step::

    needed   = the head's selected blocks (the prediction for the next step)
    keep     = needed ∩ resident           (stay in their slots, last-selected := step)
    missing  = needed − resident           (loaded into free slots first, then into the slots of
    victims  = resident − needed            victims, least recently selected first, ties by block id)

With a fetch cap C (``--oasis-fetch-ratio``), at most C missing blocks per head come from the host tier
in one step, the highest-priority (summary score) first, ties by block id; the rest are *deferred* and
stay missing until a later step's plan admits them. Blocks that have just filled up (ids from
``fresh_from`` on: the step's active block, already in device memory) are admitted whatever the cap.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from sglang_oasis.memory.working_set import EMPTY  # the Python API here uses None


class Load(NamedTuple):
    """Copy host block ``block`` into device slot ``slot`` of KV head ``head``."""

    head: int
    slot: int
    block: int


class Plan(NamedTuple):
    """One step's plan for one (request, layer): the loads (per head, ascending block ids) and the
    predicted blocks the cap deferred, as ``(head, block)``."""

    loads: list[Load]
    deferred: list[tuple[int, int]]


class HeadwiseMap:
    def __init__(self, num_kv_heads: int, num_slots: int) -> None:
        if num_kv_heads <= 0 or num_slots <= 0:
            raise ValueError(f"need positive heads and slots, got {num_kv_heads}, {num_slots}")
        self.num_kv_heads = num_kv_heads
        self.num_slots = num_slots
        self.slot_block = torch.full((num_kv_heads, num_slots), EMPTY, dtype=torch.int64)
        self.last_selected = torch.full((num_kv_heads, num_slots), EMPTY, dtype=torch.int64)

    def block_at(self, head: int, slot: int) -> int | None:
        block = int(self.slot_block[head, slot])
        return None if block == EMPTY else block

    def resident(self, head: int) -> set[int]:
        row = self.slot_block[head]
        return set(row[row != EMPTY].tolist())

    def apply_selection(self, selected: Sequence[set[int]], step: int) -> list[Load]:
        """Make every selected block resident; returns the loads that requires.

        Blocks that stay selected keep their slots; unselected blocks leave only when their slot is
        needed (free slots are used first), so once a head's slots are full its resident set equals its
        selection. ``selected[h]`` may hold at most ``num_slots`` blocks.
        """
        return self.plan(selected, step).loads

    def plan(
        self,
        selected: Sequence[set[int]],
        step: int,
        cap: int | None = None,
        fresh_from: int | None = None,
        priority: Sequence[Mapping[int, float]] | None = None,
        capacity: int | None = None,
    ) -> Plan:
        """``apply_selection`` with a per-head fetch cap: at most ``cap`` missing blocks below
        ``fresh_from`` are loaded per head, by ``priority[head][block]`` (higher first, default 0), ties
        by ascending block id; blocks ``>= fresh_from`` are always loaded. ``cap=None``: no cap. Then
        each head holds at most ``capacity`` blocks (None: ``num_slots``): unselected blocks leave, least
        recently selected first (ties: lowest block id)."""
        if len(selected) != self.num_kv_heads:
            raise ValueError(f"selection for {len(selected)} heads, map has {self.num_kv_heads}")
        loads: list[Load] = []
        deferred: list[tuple[int, int]] = []
        for head, needed in enumerate(selected):
            if len(needed) > self.num_slots:
                raise ValueError(f"head {head}: {len(needed)} blocks selected for {self.num_slots} slots")
            head_priority = priority[head] if priority is not None else {}
            head_loads, head_deferred = self._apply_head(head, needed, step, cap, fresh_from, head_priority)
            if capacity is not None:
                self._shrink_head(head, needed, capacity)
            loads += head_loads
            deferred += [(head, block) for block in head_deferred]
        return Plan(loads, deferred)

    def _apply_head(
        self,
        head: int,
        needed: set[int],
        step: int,
        cap: int | None,
        fresh_from: int | None,
        priority: Mapping[int, float],
    ) -> tuple[list[Load], list[int]]:
        blocks = self.slot_block[head].tolist()
        last = self.last_selected[head].tolist()
        slot_of = {block: slot for slot, block in enumerate(blocks) if block != EMPTY}
        for block in needed & slot_of.keys():
            self.last_selected[head, slot_of[block]] = step
        missing = needed - slot_of.keys()
        deferred: list[int] = []
        if cap is not None:
            fresh = {block for block in missing if fresh_from is not None and block >= fresh_from}
            by_priority = sorted(missing - fresh, key=lambda block: (-priority.get(block, 0.0), block))
            deferred = by_priority[cap:]
            missing = fresh | set(by_priority[:cap])
        free_slots = [slot for slot, block in enumerate(blocks) if block == EMPTY]
        victims = sorted(
            (slot for block, slot in slot_of.items() if block not in needed),
            key=lambda s: (last[s], blocks[s]),
        )
        loads = []
        for block, slot in zip(sorted(missing), free_slots + victims, strict=False):
            self.slot_block[head, slot] = block
            self.last_selected[head, slot] = step
            loads.append(Load(head, slot, block))
        return loads, deferred

    def _shrink_head(self, head: int, needed: set[int], capacity: int) -> None:
        """Empty the least recently selected unselected slots of ``head`` until it holds ``capacity``."""
        blocks, last = self.slot_block[head].tolist(), self.last_selected[head].tolist()
        held = [slot for slot, block in enumerate(blocks) if block != EMPTY]
        spare = sorted(
            (slot for slot in held if blocks[slot] not in needed), key=lambda s: (last[s], blocks[s])
        )
        for slot in spare[: max(0, len(held) - capacity)]:
            self.slot_block[head, slot] = EMPTY
            self.last_selected[head, slot] = EMPTY

    def clear(self) -> list[int]:
        """Empty every slot (request finished); returns the distinct host blocks that were mirrored."""
        mirrored = sorted(set(self.slot_block[self.slot_block != EMPTY].tolist()))
        self.slot_block.fill_(EMPTY)
        self.last_selected.fill_(EMPTY)
        return mirrored
