"""Block ids of the host-memory tier that holds every request's full KV cache.

Only bookkeeping: which of ``capacity`` block ids are free. The KV tensors indexed by these ids belong to
the host KV store. Ids are handed out lowest-first from the initially free range, then in the order they
were freed, so tests can expect exact ids.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class HostTierFull(RuntimeError):
    """Not enough free host blocks for a request; the message says how many were asked and free."""


class HostBlockPool:
    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"host block pool capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._free: deque[int] = deque(range(capacity))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` ids, all or nothing."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if num_blocks > len(self._free):
            raise HostTierFull(
                f"host KV tier full: {num_blocks} blocks requested, {len(self._free)} of {self.capacity} free"
            )
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Return ids; freeing an id that is not in use is a bookkeeping bug and raises."""
        blocks = list(blocks)
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"duplicate block ids in free: {sorted(blocks)}")
        not_used = [b for b in blocks if b not in self._used]
        if not_used:
            raise ValueError(f"freeing host blocks that are not allocated: {not_used}")
        self._used.difference_update(blocks)
        self._free.extend(blocks)
