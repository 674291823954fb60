"""The host block pool: exact ids, all-or-nothing allocation, loud bookkeeping errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sglang_oasis.memory.host_block_pool import HostBlockPool, HostTierFull


def test_ids_lowest_first_then_in_freed_order() -> None:
    pool = HostBlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    pool.free([3, 0])
    assert pool.allocate(3) == [5, 3, 0]
    assert (pool.num_free, pool.num_used) == (0, 6)


def test_full_tier_fails_the_request_without_taking_anything() -> None:
    pool = HostBlockPool(4)
    pool.allocate(3)
    with pytest.raises(HostTierFull, match="2 blocks requested, 1 of 4 free"):
        pool.allocate(2)
    assert pool.num_free == 1


def test_double_free_and_foreign_ids_raise() -> None:
    pool = HostBlockPool(4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(blocks)
    with pytest.raises(ValueError, match="duplicate"):
        pool.free([3, 3])


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=60))
def test_every_block_freed_exactly_once_and_nothing_leaks(ops: list[tuple[bool, int]]) -> None:
    pool = HostBlockPool(16)
    held: list[list[int]] = []
    for allocate, n in ops:
        if allocate:
            try:
                held.append(pool.allocate(n))
            except HostTierFull:
                assert n > pool.num_free
        elif held:
            pool.free(held.pop(n % len(held)))
        owned = [b for blocks in held for b in blocks]
        assert len(owned) == len(set(owned)) == pool.num_used
        assert pool.num_used + pool.num_free == 16
    for blocks in held:
        pool.free(blocks)
    assert pool.num_used == 0 and pool.num_free == 16
