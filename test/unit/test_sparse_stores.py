"""The paged summary store and the working-set pool against plain references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_kernel_oasis import build_block_summaries
from sglang_oasis.memory.plan_cpu import PlanLimits, plan_tables
from sglang_oasis.memory.summary_store import BlockSummaryStore
from sglang_oasis.memory.working_set import EMPTY, WorkingSetPool, plan_in_torch
from sglang_oasis_testing.headwise_reference import HeadwiseMap

B = 4


def test_summary_store_matches_per_block_summaries_across_pages_and_appends() -> None:
    gen = torch.Generator().manual_seed(0)
    store = BlockSummaryStore(1, 10, 2, 3, B, torch.float32, "cpu")
    # A request whose 11 tokens live in pages 7, 2, 5 (pool locations page*B + offset).
    pages = [7, 2, 5]
    locations = torch.tensor([pages[t // B] * B + t % B for t in range(11)])
    keys = torch.randn(11, 2, 3, generator=gen)
    store.update(0, locations[:6], keys[:6])  # prefill of 6 tokens
    store.update(0, locations[6:7], keys[6:7])  # then decode appends, one token at a time
    for t in range(7, 11):
        store.update(0, locations[t : t + 1], keys[t : t + 1])
    want_min, want_max = build_block_summaries(keys, B)
    got_min, got_max = store.lookup(0, torch.tensor(pages))
    assert torch.equal(got_min, want_min) and torch.equal(got_max, want_max)


def test_recycled_page_forgets_its_previous_owner() -> None:
    store = BlockSummaryStore(1, 4, 1, 2, B, torch.float32, "cpu")
    store.update(0, torch.tensor([4, 5, 6, 7]), torch.full((4, 1, 2), 100.0))
    store.update(0, torch.tensor([4]), torch.ones(1, 1, 2))  # page 1 reused from offset 0
    kmin, kmax = store.lookup(0, torch.tensor([1]))
    assert torch.equal(kmax, torch.ones(1, 1, 2)) and torch.equal(kmin, torch.ones(1, 1, 2))


def test_page_epoch_changes_exactly_when_a_page_restarts() -> None:
    store = BlockSummaryStore(2, 4, 1, 2, B, torch.float32, "cpu", epoch_layer=1)
    store.update(1, torch.tensor([4, 5, 6]), torch.ones(3, 1, 2))  # page 1 starts
    store.update(0, torch.tensor([8]), torch.ones(1, 1, 2))  # another layer: not counted
    store.update(1, torch.tensor([7]), torch.ones(1, 1, 2))  # page 1 fills up: same content so far
    assert store.epoch.tolist() == [0, 1, 0, 0]
    store.update(1, torch.tensor([4, 8, 13]), torch.ones(3, 1, 2))  # page 1 rewritten, page 2 starts
    assert store.epoch.tolist() == [0, 2, 1, 0]


def test_adopt_keeps_the_shared_blocks_of_a_donor_slot() -> None:
    gen = torch.Generator().manual_seed(2)
    ws = WorkingSetPool(3, 2, 2, 3, 4, B, torch.float32, "cpu")
    ws.k.copy_(torch.randn(ws.k.shape, generator=gen))
    ws.v.copy_(torch.randn(ws.v.shape, generator=gen))
    ws.claim(1, owner=7)
    ws.slot_block[1] = torch.tensor([[[0, 5, 2, -1], [3, 1, -1, 4]], [[6, 0, 1, 2], [-1, -1, 0, 9]]])
    ws.last_selected[1] = torch.where(ws.slot_block[1] >= 0, 3, -1)
    donor_k = ws.k[1].clone()
    kept = ws.adopt(2, owner=8, donor=1, shared_blocks=3)  # blocks 0, 1, 2 are shared
    want = torch.tensor([[[0, -1, 2, -1], [-1, 1, -1, -1]], [[-1, 0, 1, 2], [-1, -1, 0, -1]]])
    assert torch.equal(ws.slot_block[2], want) and kept == int((want >= 0).sum())
    held = want >= 0
    assert torch.equal(ws.k[2][held], donor_k[held])  # the kept blocks' data came along
    assert torch.equal(ws.last_selected[2], torch.where(held, 3, -1))
    assert ws.owner[2] == 8 and ws.owner[1] == 7 and ws.slot_block[1, 0, 0, 1] == 5  # donor untouched
    # The slot handed to the next turn of its own conversation keeps its blocks in place.
    assert ws.adopt(1, owner=9, donor=1, shared_blocks=1) == 3 and ws.owner[1] == 9
    assert torch.equal(ws.k[1][held], donor_k[held])


def test_what_a_capped_plan_evicts_does_not_depend_on_where_blocks_sit() -> None:
    """Issue 25 item 13: a warm start leaves the shared blocks in its donor's slots, a cold start in
    block order. Blocks 1 and 8 are both unselected and were last selected at the same step; which one
    the capped plan evicts (the other stays resident, and attended) is the same in both layouts."""
    resident = []
    for layout in ([1, 2, 3, 8], [8, 3, 2, 1]):
        ws = WorkingSetPool(1, 1, 1, 2, 4, B, torch.float32, "cpu")
        ws.claim(0, owner=1)
        ws.slot_block[0, 0, 0] = torch.tensor(layout)
        ws.last_selected[0, 0, 0] = 5
        selected = torch.zeros(1, 1, 10, dtype=torch.bool)
        selected[0, 0, [2, 3, 4, 9]] = True
        priority = torch.arange(10, dtype=torch.float32).expand(1, 1, -1)
        plan = ws.plan_selections(torch.tensor([0]), 0, selected, 6, cap=1, priority=priority)
        assert plan.num_loads == 1 and plan.deferred == 1  # block 9 loads (highest priority), 4 waits
        resident.append(sorted(ws.slot_block[0, 0, 0].tolist()))
        ref = HeadwiseMap(1, 4)
        ref.slot_block[0] = torch.tensor(layout)
        ref.last_selected[0] = 5
        ref.plan([{2, 3, 4, 9}], 6, cap=1, priority=[dict(enumerate(map(float, range(10))))])
        assert torch.equal(ref.slot_block, ws.slot_block[0, 0])
    assert resident[0] == resident[1] == [2, 3, 8, 9]  # the lower block id of the tie went


def test_working_set_loads_blocks_and_gathers_them_in_block_order() -> None:
    gen = torch.Generator().manual_seed(1)
    pool_k = torch.randn(40, 2, 3, generator=gen)  # host tier: 10 pages of B tokens
    pool_v = torch.randn(40, 2, 3, generator=gen)
    ws = WorkingSetPool(max_requests=2, num_layers=1, num_kv_heads=2, head_dim=3, num_slots=3,
                        block_size=B, dtype=torch.float32, device="cpu")  # fmt: skip
    block_pages = torch.tensor([[9, 3, 6, 0]])  # the request's logical blocks 0..3
    selected = torch.tensor([[[True, False, True, False], [False, False, False, True]]])
    loads = ws.apply_selections(torch.tensor([1]), 0, selected, block_pages, 0, pool_k, pool_v)
    assert loads == 3
    keys, values, valid = ws.gather(torch.tensor([1]), 0)
    assert keys.shape == (1, 2, 3 * B, 3)
    # head 0 holds blocks 0 and 2 (pages 9 and 6), in block order, then an empty slot
    want0 = torch.cat([pool_k[36:40, 0], pool_k[24:28, 0]])
    assert torch.equal(keys[0, 0, : 2 * B], want0) and valid[0, 0].tolist() == [True] * 8 + [False] * 4
    assert torch.equal(values[0, 1, :B], pool_v[0:4, 1]) and int(valid[0, 1].sum()) == B
    assert ws.resident_blocks([1]) == 3 and ws.resident_blocks([0]) == 0
    assert ws.claim(1, owner=5) and not ws.claim(1, owner=5)
    assert ws.resident_blocks([1]) == 0


def selections(max_blocks: int) -> st.SearchStrategy[list[list[set[int]]]]:
    """One step's selections: 3 requests x 2 KV heads, each up to ``max_blocks`` block ids below 10."""
    per_head = st.sets(st.integers(0, 9), max_size=max_blocks)
    return st.lists(st.lists(per_head, min_size=2, max_size=2), min_size=3, max_size=3)


def as_mask(per_request: list[list[set[int]]], heads: int, num_blocks: int) -> torch.Tensor:
    """``[requests, heads, num_blocks]`` bool: each request's and head's selected block ids."""
    selected = torch.zeros(len(per_request), heads, num_blocks, dtype=torch.bool)
    for i, per_head in enumerate(per_request):
        for h, chosen in enumerate(per_head):
            selected[i, h, sorted(chosen)] = True
    return selected


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.lists(
            st.lists(st.sets(st.integers(0, 9), max_size=3), min_size=2, max_size=2), min_size=3, max_size=3
        ),
        min_size=1,
        max_size=8,
    )
)
def test_batched_selection_matches_the_per_head_reference(steps: list[list[list[set[int]]]]) -> None:
    """apply_selections (tensor ops over a batch) plans exactly what HeadwiseMap does head by head."""
    num_blocks, heads, slots = 10, 2, 3
    gen = torch.Generator().manual_seed(len(steps))
    pool_k = torch.randn(4 * 16, heads, 2, generator=gen)  # 16 host pages of B tokens
    ws = WorkingSetPool(4, 1, heads, 2, slots, B, torch.float32, "cpu")
    reference = {req: HeadwiseMap(heads, slots) for req in (0, 2, 3)}
    reqs = torch.tensor([0, 2, 3])
    pages = torch.stack([torch.randperm(16, generator=gen)[:num_blocks] for _ in range(3)])
    for step, per_request in enumerate(steps):
        selected = as_mask(per_request, heads, num_blocks)
        loads = ws.apply_selections(reqs, 0, selected, pages, step, pool_k, pool_k)
        expected_loads = 0
        for i, req in enumerate(reqs.tolist()):
            expected_loads += len(reference[req].apply_selection(per_request[i], step))
            assert torch.equal(ws.slot_block[req, 0], reference[req].slot_block)
            assert torch.equal(ws.last_selected[req, 0], reference[req].last_selected)
            for h in range(heads):  # every resident block's tokens are the right host page's
                for s in range(slots):
                    block = reference[req].block_at(h, s)
                    if block is not None:
                        page = int(pages[i, block])
                        assert torch.equal(ws.k[req, 0, h, s], pool_k[page * B : (page + 1) * B, h])
        assert loads == expected_loads


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            selections(max_blocks=3),
            st.integers(0, 3),  # cap
            st.lists(st.integers(0, 10), min_size=3, max_size=3),  # fresh_from per request
            st.lists(st.integers(0, 2), min_size=10, max_size=10),  # priorities: ties likely
        ),
        min_size=1,
        max_size=8,
    )
)
def test_batched_capped_plan_matches_the_per_head_reference(
    steps: list[tuple[list[list[set[int]]], int, list[int], list[int]]],
) -> None:
    num_blocks, heads, slots = 10, 2, 3
    ws = WorkingSetPool(4, 1, heads, 2, slots, B, torch.float32, "cpu")
    reference = {req: HeadwiseMap(heads, slots) for req in (0, 2, 3)}
    reqs = torch.tensor([0, 2, 3])
    for step, (per_request, cap, fresh_from, prio) in enumerate(steps):
        selected = as_mask(per_request, heads, num_blocks)
        priority = torch.tensor(prio, dtype=torch.float32).expand(3, heads, -1)
        plan = ws.plan_selections(reqs, 0, selected, step, cap, torch.tensor(fresh_from), priority)
        want_loads, want_deferred = 0, 0
        for i, req in enumerate(reqs.tolist()):
            ref = reference[req].plan(
                per_request[i], step, cap, fresh_from[i], [dict(enumerate(map(float, prio)))] * heads
            )
            want_loads += len(ref.loads)
            want_deferred += len(ref.deferred)
            assert torch.equal(ws.slot_block[req, 0], reference[req].slot_block)
            assert torch.equal(ws.last_selected[req, 0], reference[req].last_selected)
        assert (plan.num_loads, plan.deferred) == (want_loads, want_deferred)


def test_gather_of_a_batch_reads_each_requests_own_layer_in_block_order() -> None:
    gen = torch.Generator().manual_seed(5)
    heads, slots, dim = 3, 4, 2
    ws = WorkingSetPool(5, 3, heads, dim, slots, B, torch.float32, "cpu")
    ws.k.copy_(torch.randn(ws.k.shape, generator=gen))
    ws.v.copy_(torch.randn(ws.v.shape, generator=gen))
    for index in torch.cartesian_prod(*(torch.arange(n) for n in ws.slot_block.shape[:3])).tolist():
        distinct = torch.randperm(9, generator=gen)[:slots]  # a head never holds a block twice
        ws.slot_block[tuple(index)] = torch.where(torch.rand(slots, generator=gen) < 0.3, -1, distinct)
    reqs = torch.tensor([4, 1, 2])
    keys, values, valid = ws.gather(reqs, 2)
    for i, req in enumerate(reqs.tolist()):
        for h in range(heads):
            blocks = ws.slot_block[req, 2, h].tolist()
            order = sorted(range(slots), key=lambda s: (blocks[s] == -1, blocks[s]))
            want_k = torch.cat([ws.k[req, 2, h, s] for s in order])
            want_v = torch.cat([ws.v[req, 2, h, s] for s in order])
            want_valid = [blocks[s] != -1 for s in order for _ in range(B)]
            assert valid[i, h].tolist() == want_valid
            seen = torch.tensor(want_valid)  # what an empty slot's tokens hold does not matter (masked)
            assert torch.equal(keys[i, h][seen], want_k[seen]) and torch.equal(
                values[i, h][seen], want_v[seen]
            )


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            selections(max_blocks=4),
            st.lists(st.integers(1, 5), min_size=3, max_size=3),  # capacity per request
            st.integers(0, 3),  # cap
        ),
        min_size=1,
        max_size=8,
    )
)
def test_a_plan_within_a_smaller_capacity_matches_the_per_head_reference(
    steps: list[tuple[list[list[set[int]]], list[int], int]],
) -> None:
    """A working set the recall target shrank (capacity below the slots) gives its extra blocks back:
    the batched plan empties the same slots as the reference, and no head holds more than its capacity."""
    num_blocks, heads, slots = 10, 2, 5
    ws = WorkingSetPool(4, 1, heads, 2, slots, B, torch.float32, "cpu")
    reference = {req: HeadwiseMap(heads, slots) for req in (0, 2, 3)}
    reqs = torch.tensor([0, 2, 3])
    for step, (drawn, capacity, cap) in enumerate(steps):
        # a selection fits its capacity
        per_request = [
            [set(sorted(chosen)[: capacity[i]]) for chosen in per_head] for i, per_head in enumerate(drawn)
        ]
        selected = as_mask(per_request, heads, num_blocks)
        plan = ws.plan_selections(reqs, 0, selected, step, cap, None, None, torch.tensor(capacity))
        want_loads = 0
        for i, req in enumerate(reqs.tolist()):
            ref = reference[req].plan(per_request[i], step, cap, None, None, capacity[i])
            want_loads += len(ref.loads)
            assert torch.equal(ws.slot_block[req, 0], reference[req].slot_block)
            assert torch.equal(ws.last_selected[req, 0], reference[req].last_selected)
            assert int((ws.slot_block[req, 0] != EMPTY).sum(-1).max()) <= capacity[i]
        assert plan.num_loads == want_loads


@pytest.mark.parametrize("seed", range(6))
def test_the_cpu_plan_is_the_torch_plan_slot_for_slot(seed: int) -> None:
    """``plan_tables`` (one numba call, the CPU path) against ``plan_in_torch`` over a run of steps on
    awkward sizes: the same new tables and the same loads in the same order, with and without a cap
    (one for all, or per request), fresh blocks, priorities with ties and infinities, and capacities."""
    gen = torch.Generator().manual_seed(seed)
    bs, heads, slots, num_blocks = 5, 3, 7, 37
    blocks = torch.full((bs, heads, slots), EMPTY, dtype=torch.int64)
    last = torch.full((bs, heads, slots), EMPTY, dtype=torch.int64)
    for step in range(12):
        full = torch.randint(1, num_blocks + 1, (bs,), generator=gen)
        capacity = torch.randint(2, slots + 1, (bs,), generator=gen)
        scores = torch.randint(0, 4, (bs, heads, num_blocks), generator=gen).float()  # ties likely
        scores[..., :2] = float("inf")  # sinks
        valid = (torch.arange(num_blocks) < full[:, None, None]).expand(-1, heads, -1)
        rank = scores.masked_fill(~valid, float("-inf")).argsort(dim=-1, descending=True, stable=True)
        selected = torch.zeros_like(valid).scatter_(-1, rank[..., :slots], True) & valid
        # some steps' selections fit the capacity, others do not
        selected &= torch.arange(num_blocks) < capacity[:, None, None] + (step % 3) * 5
        kinds = [None, int(step % 4), torch.randint(0, 3, (bs,), generator=gen)]
        cap = kinds[step % 3]
        fresh_from = None if step % 2 else full - 1
        priority = None if step % 5 == 4 else scores
        shrink = capacity if step % 4 == 1 else None
        limits = PlanLimits(cap, fresh_from, priority, shrink)
        want = plan_in_torch(blocks.clone(), last.clone(), selected, step, limits)
        got_blocks, got_last = blocks.clone(), last.clone()
        loads, deferred = plan_tables(got_blocks, got_last, selected, step, limits)
        assert torch.equal(got_blocks, want[0]) and torch.equal(got_last, want[1])
        plan = want[2]
        assert torch.equal(loads, torch.stack([plan.batch_rows, plan.heads, plan.slots, plan.blocks]))
        assert deferred == plan.deferred
        blocks, last = got_blocks, got_last
    assert int((blocks != EMPTY).sum()) > 0  # the run filled working sets
