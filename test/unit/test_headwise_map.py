"""The head-wise mapping table: exact plans on tiny cases, invariants under random selections."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sglang_oasis_testing.headwise_reference import HeadwiseMap, Load


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


# --- the fetch cap ---------------------------------------------------------------------------------


def test_cap_admits_the_highest_priority_missing_blocks_and_defers_the_rest() -> None:
    table = HeadwiseMap(num_kv_heads=1, num_slots=4)
    table.apply_selection([{0, 1, 2, 3}], step=0)
    priority = [{4: 1.0, 5: 3.0, 6: 2.0, 1: 9.0}]
    plan = table.plan([{1, 4, 5, 6}], step=1, cap=2, priority=priority)
    # 5 and 6 beat 4; they replace the least recently selected unpredicted blocks (0 and 2: all were
    # selected at step 0, so slot order decides), 3 stays resident although not predicted.
    assert plan.loads == [Load(0, 0, 5), Load(0, 2, 6)]
    assert plan.deferred == [(0, 4)]
    assert table.resident(0) == {1, 3, 5, 6}
    plan = table.plan([{1, 4, 5, 6}], step=2, cap=2, priority=priority)
    assert plan.loads == [Load(0, 3, 4)] and plan.deferred == []


def test_fresh_blocks_are_admitted_whatever_the_cap() -> None:
    table = HeadwiseMap(num_kv_heads=2, num_slots=3)
    table.apply_selection([{0, 1}, {0, 1}], step=0)
    plan = table.plan([{0, 2, 3}, {1, 3, 2}], step=1, cap=0, fresh_from=3)
    assert plan.loads == [Load(0, 2, 3), Load(1, 2, 3)]  # block 3 just filled up
    assert sorted(plan.deferred) == [(0, 2), (1, 2)]


def test_ties_in_priority_go_by_block_id() -> None:
    table = HeadwiseMap(num_kv_heads=1, num_slots=3)
    plan = table.plan([{7, 3, 5}], step=0, cap=2)
    assert plan.loads == [Load(0, 0, 3), Load(0, 1, 5)] and plan.deferred == [(0, 7)]


@given(
    steps=st.lists(
        st.tuples(
            st.lists(st.sets(st.integers(0, 11), max_size=4), min_size=2, max_size=2),
            st.integers(0, 3),  # cap
            st.integers(0, 12),  # fresh_from
            st.lists(st.integers(0, 3), min_size=12, max_size=12),  # priority per block (ties likely)
        ),
        min_size=1,
        max_size=25,
    )
)
def test_capped_plans_keep_their_invariants(steps: list[tuple[list[set[int]], int, int, list[int]]]) -> None:
    """Cap never exceeded (fresh blocks aside); a full working set keeps its size; nothing predicted and
    resident is evicted; evictions come from resident minus predicted in least-recently-selected order;
    the admitted capped blocks are the best by priority."""
    heads, slots = 2, 4
    table = HeadwiseMap(num_kv_heads=heads, num_slots=slots)
    for step, (selection, cap, fresh_from, prio) in enumerate(steps):
        before = [table.resident(h) for h in range(heads)]
        last = {
            (h, int(table.slot_block[h, s])): int(table.last_selected[h, s])
            for h in range(heads)
            for s in range(slots)
            if int(table.slot_block[h, s]) >= 0
        }
        priority = [dict(enumerate(map(float, prio)))] * heads
        plan = table.plan(selection, step, cap=cap, fresh_from=fresh_from, priority=priority)
        for h in range(heads):
            loaded = {ld.block for ld in plan.loads if ld.head == h}
            capped_loads = {b for b in loaded if b < fresh_from}
            assert len(capped_loads) <= cap
            after = table.resident(h)
            assert len(after) == min(slots, len(before[h]) + len(loaded)), "working set size changed"
            evicted = before[h] - after
            assert not evicted & selection[h], "a predicted resident block was evicted"
            stale = before[h] - selection[h]
            if evicted:  # the evicted are the least recently selected of the stale
                worst_kept = min((last[(h, b)] for b in stale - evicted), default=None)
                assert worst_kept is None or max(last[(h, b)] for b in evicted) <= worst_kept
            deferred = {b for hd, b in plan.deferred if hd == h}
            assert deferred | loaded == selection[h] - before[h] and not deferred & loaded
            if deferred and capped_loads:
                assert min(prio[b] for b in capped_loads) >= max(prio[b] for b in deferred)
