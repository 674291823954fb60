"""The head-wise mapping table: exact plans on tiny cases, invariants under random selections."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sglang_oasis.memory.headwise_map import HeadwiseMap, Load


def test_first_selection_fills_free_slots_in_order() -> None:
    table = HeadwiseMap(num_kv_heads=2, num_slots=3)
    loads = table.apply_selection([{7, 2}, {5}], step=0)
    assert loads == [Load(0, 0, 2), Load(0, 1, 7), Load(1, 0, 5)]
    assert table.block_at(0, 2) is None


def test_kept_blocks_stay_put_and_least_recently_selected_is_evicted() -> None:
    table = HeadwiseMap(num_kv_heads=1, num_slots=3)
    table.apply_selection([{1, 2, 3}], step=0)  # slots: 1, 2, 3
    table.apply_selection([{1, 2, 3}], step=1)
    table.apply_selection([{2, 3, 9}], step=2)  # 1 (last selected at 1) leaves slot 0 for 9
    assert [table.block_at(0, s) for s in range(3)] == [9, 2, 3]
    loads = table.apply_selection([{9, 3, 4}], step=3)  # 2 was last selected at 2, so it goes
    assert loads == [Load(0, 1, 4)]
    assert table.resident(0) == {9, 4, 3}


def test_clear_returns_each_mirrored_block_once() -> None:
    table = HeadwiseMap(num_kv_heads=2, num_slots=2)
    table.apply_selection([{4, 5}, {5, 6}], step=0)
    assert table.clear() == [4, 5, 6]
    assert table.resident(0) == set() and table.resident(1) == set()


@given(
    st.lists(
        st.lists(st.sets(st.integers(0, 12), max_size=4), min_size=3, max_size=3),
        min_size=1,
        max_size=25,
    )
)
def test_invariants_under_random_selections(steps: list[list[set[int]]]) -> None:
    table = HeadwiseMap(num_kv_heads=3, num_slots=4)
    for step, selection in enumerate(steps):
        before = [dict(zip(table.slot_block[h].tolist(), range(4), strict=True)) for h in range(3)]
        loads = table.apply_selection(selection, step)
        for head in range(3):
            row = [b for b in table.slot_block[head].tolist() if b >= 0]
            assert len(row) == len(set(row)), "a block mapped to two slots of one head"
            assert selection[head] <= table.resident(head), "a selected block is not resident"
            for block in selection[head] & before[head].keys():  # kept blocks did not move
                assert table.block_at(head, before[head][block]) == block
            head_loads = [ld for ld in loads if ld.head == head]
            assert {ld.block for ld in head_loads} == selection[head] - before[head].keys()
