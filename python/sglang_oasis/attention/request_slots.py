"""Which device request slot each request holds (warm starts: ``radix_sharing.py``).

SGLang names a request by its ``req_pool_indices`` row and bumps the row's generation at every
allocation; the device tier (``memory/device_tier.py``) has fewer request slots than SGLang has rows. A
request takes a slot at its first forward pass here (an extend, or the first decode of a PD arrival):

- cold: a free slot, or the least recently claimed slot of a finished request, emptied;
- warm start: when its cached prefix starts with blocks a slot recorded (``PrefixRecords``), it starts
  from that slot's resident blocks below the shared length: the donor slot itself when its request has
  finished, else a copy of it.

A slot whose request SGLang has freed stays as it is (a donor for later requests) until it is claimed
again; nothing polls for finished requests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from sglang_oasis.attention.radix_sharing import PrefixRecords
from sglang_oasis.memory.device_tier import DeviceTier

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool


class Admission(NamedTuple):
    """What admitting a batch's new requests did."""

    requests: int
    warm_starts: int
    blocks_reused: int


class RequestSlots:
    def __init__(self, tier: DeviceTier, req_pool: ReqToTokenPool, block_size: int) -> None:
        self.tier = tier
        self.working_sets = tier.working_sets
        self.req_pool = req_pool  # req_to_token, req_generation, free_slots
        self.block_size = block_size
        self.prefixes = PrefixRecords(tier, req_pool.req_to_token, block_size)  # what warm starts match

    def finished(self) -> Callable[[int, int], bool]:
        """``finished(req, generation)``: SGLang has freed that request (its row is free or reused)."""
        free = set(self.req_pool.free_slots)
        generations = self.req_pool.req_generation.tolist()
        return lambda req, generation: req in free or int(generations[req]) != generation

    def holds(self, req: int, generation: int) -> bool:
        return self.tier.holds(req, generation)

    def claim(self, req: int, generation: int) -> int:
        """An empty request slot for ``req``."""
        slot = self.tier.claim(req, generation, self.finished())
        self.working_sets.claim(slot, self.tier.claims)
        self._forget_records(slot)
        return slot

    def _forget_records(self, slot: int) -> None:
        """A newly claimed slot has no window pins, no recorded pages, no active tokens and no recall
        streak yet."""
        self.tier.pinned[slot] = -1
        self.tier.recall_streak[slot] = 0
        self.tier.active.reset(slot)
        self.prefixes.forget(slot)

    def admit(
        self,
        new: list[tuple[int, int, int]],
        epoch: torch.Tensor,
        failed: Callable[[int, int], bool],
        warm_start: bool,
    ) -> Admission:
        """Slots for the batch's new requests ``(req, generation, cached prefix tokens)``: warm starts
        where a donor shares their prefix (``warm_start``, ``radix_sharing.py``), cold otherwise. ``epoch``
        is the summaries' page epochs; ``failed(req, generation)`` names requests whose transfer failed."""
        warm = reused = 0
        for req, generation, prefix in new:
            donor = self.prefixes.donor(req, prefix, epoch, failed) if warm_start else None
            if donor is None:
                self.claim(req, generation)
                continue
            donor_slot, shared = donor
            finished = self.finished()
            owner = self.tier.owner(donor_slot)
            take = donor_slot if owner is not None and finished(*owner) else None
            slot = self.tier.claim(req, generation, finished, take=take)
            reused += self.working_sets.adopt(slot, self.tier.claims, donor_slot, shared)
            self._forget_records(slot)
            warm += 1
        return Admission(len(new), warm, reused)
