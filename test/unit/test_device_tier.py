"""The device tier: one budget divided exactly (summaries, then whole request slots), every tensor it
holds inside it, request slots claimed and reclaimed by SGLang's request lifecycle, warm starts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_oasis.attention.oasis_backend import OasisAttnBackend
from sglang_oasis.attention.request_slots import RequestSlots
from sglang_oasis.config import OasisConfig
from sglang_oasis.memory.device_layout import DeviceTierError, TierShape, layout
from sglang_oasis.memory.device_tier import DeviceTier
from sglang_oasis.memory.working_set import EMPTY

SHAPES = {
    "tiny": TierShape(
        2, 1, 4, 4, host_pages=10, block_size=4, slots_per_head=2, window_blocks=1, active_tokens=8
    ),
    "smollm2-fp32": TierShape(
        30, 3, 64, 4, host_pages=2050, block_size=16, slots_per_head=128, window_blocks=32, active_tokens=32
    ),
    "blocks-of-4-bf16": TierShape(
        6, 3, 64, 2, host_pages=8194, block_size=4, slots_per_head=129, window_blocks=0, active_tokens=4
    ),
}


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("budget_tokens", [3000, 16384, 65536])
def test_the_budget_divides_into_summaries_and_whole_request_slots(name: str, budget_tokens: int) -> None:
    shape = SHAPES[name]
    budget = budget_tokens * shape.kv_bytes_per_token
    try:
        plan = layout(budget, shape)
    except DeviceTierError:
        one = layout(10**12, shape, max_request_slots=1)
        assert budget < one.total_bytes  # not even one request fits beside the summaries
        return
    assert plan.total_bytes <= budget < plan.total_bytes + plan.request_bytes
    if shape.num_layers * shape.slots_per_head < 100:  # small enough to allocate here
        tier = DeviceTier(shape, plan, torch.float32, "cpu")
        assert tier.nbytes == plan.total_bytes  # every tensor the tier holds is in the layout


@pytest.mark.parametrize("name", SHAPES)
def test_every_tensor_of_a_tier_is_counted(name: str) -> None:
    shape = SHAPES[name]._replace(num_layers=1, host_pages=6)
    dtype = {2: torch.bfloat16, 4: torch.float32}[shape.element_bytes]
    plan = layout(10**9, shape, max_request_slots=2)
    tier = DeviceTier(shape, plan, dtype, "cpu")
    assert tier.nbytes == plan.total_bytes
    assert tier.working_sets.k.shape[0] == 2 and tier.pinned.shape[0] == 2


def _reachable_tensors(root: object) -> dict[str, torch.Tensor]:
    """Every tensor reachable from ``root``'s attributes through objects of this package (and the lists,
    tuples and dicts they hold), by attribute path."""
    found: dict[str, torch.Tensor] = {}
    seen: set[int] = set()

    def walk(value: object, path: str) -> None:
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            found[path] = value
        elif isinstance(value, list | tuple):
            for index, item in enumerate(value):
                walk(item, f"{path}[{index}]")
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}[{key!r}]")
        elif type(value).__module__.startswith("sglang_oasis"):
            for name, item in vars(value).items():
                walk(item, f"{path}.{name}")

    walk(root, "tier")
    return found


@pytest.mark.parametrize("name", SHAPES)
def test_every_tensor_reachable_from_the_tier_is_one_it_counts(name: str) -> None:
    """Found by reflection, not by the list that defines ``nbytes``: a tensor added to the working sets,
    the active blocks or the summaries and left out of ``tensors()`` (the device's) or ``host_tensors()``
    (the host plan's: the tables' mirror, the page epochs) fails here."""
    shape = SHAPES[name]._replace(num_layers=1, host_pages=6)
    dtype = {2: torch.bfloat16, 4: torch.float32}[shape.element_bytes]
    tier = DeviceTier(shape, layout(10**9, shape, max_request_slots=2), dtype, "cpu")
    counted = {
        t.untyped_storage().data_ptr() for t in [*tier.tensors().values(), *tier.host_tensors().values()]
    }
    reachable = _reachable_tensors(tier)
    assert {"tier.working_sets.k", "tier.active.start", "tier.summaries.kmin"} <= set(reachable)
    uncounted = sorted(path for path, t in reachable.items() if t.untyped_storage().data_ptr() not in counted)
    assert not uncounted, f"device-tier tensors missing from DeviceTier.tensors(): {uncounted}"
    assert "summary_epoch" not in tier.tensors()  # host bookkeeping: not in the device budget


def test_the_reflection_finds_a_tensor_left_out_of_the_count() -> None:
    tier = _tier(2)
    tier.active.extra = torch.zeros(3)  # type: ignore[attr-defined]
    counted = {
        t.untyped_storage().data_ptr() for t in [*tier.tensors().values(), *tier.host_tensors().values()]
    }
    missing = [
        p for p, t in _reachable_tensors(tier).items() if t.untyped_storage().data_ptr() not in counted
    ]
    assert missing == ["tier.active.extra"]


@pytest.mark.parametrize("name", SHAPES)
def test_a_captured_step_s_padding_slot_is_in_the_budget_and_never_claimed(name: str) -> None:
    """``--oasis-decode-step captured``: one request slot of the budget goes to padding rows; the tier
    allocates it (counted) and no request ever gets it."""
    shape = SHAPES[name]._replace(num_layers=1, host_pages=6)
    budget = 40 * shape.kv_bytes_per_token * shape.slots_per_head * shape.block_size
    plain, padded = layout(budget, shape), layout(budget, shape._replace(padding_slots=1))
    assert padded.request_slots == plain.request_slots - 1 and padded.total_bytes == plain.total_bytes
    dtype = {2: torch.bfloat16, 4: torch.float32}[shape.element_bytes]
    tier = DeviceTier(shape._replace(padding_slots=1), padded, dtype, "cpu")
    assert tier.nbytes == padded.total_bytes <= budget
    assert tier.padding_slot == padded.request_slots == tier.working_sets.k.shape[0] - 1
    assert DeviceTier(shape, plain, dtype, "cpu").padding_slot is None
    claimed = [tier.claim(req, 1, lambda req, generation: False) for req in range(padded.request_slots)]
    assert tier.padding_slot not in claimed
    with pytest.raises(RuntimeError, match="device request slots hold running requests"):
        tier.claim(99, 1, lambda req, generation: False)
    config = OasisConfig(decode_step="captured")
    assert TierShape.of(config, 2, 1, 4, 4, 10).padding_slots == 1
    assert TierShape.of(OasisConfig(), 2, 1, 4, 4, 10).padding_slots == 0


def test_page_epochs_are_counted_at_the_first_sparse_layer() -> None:
    """A dense layer's writes never restart page epochs (warm starts compare them); every layer dense: none."""
    shape = TierShape.of(OasisConfig(dense_layers=(0,)), 3, 1, 4, 4, 10)
    tier = DeviceTier(shape, layout(10**9, shape, max_request_slots=1), torch.float32, "cpu")
    assert tier.summaries.epoch_layer == 1
    assert TierShape.of(OasisConfig(), 3, 1, 4, 4, 10).epoch_layer == 0
    assert TierShape.of(OasisConfig(dense_layers=(0, 1)), 3, 1, 4, 4, 10).epoch_layer == 2
    assert TierShape.of(OasisConfig(dense_layers=(0, 2)), 3, 1, 4, 4, 10).epoch_layer == 1
    assert TierShape.of(OasisConfig(dense_layers=(0, 1, 2)), 3, 1, 4, 4, 10).epoch_layer == -1


def test_a_budget_that_holds_no_request_names_the_option() -> None:
    shape = SHAPES["smollm2-fp32"]
    with pytest.raises(DeviceTierError, match="--oasis-device-kv-tokens: the device budget"):
        layout(2048 * shape.kv_bytes_per_token, shape)  # the summaries alone take 2050 pages' worth


def _tier(slots: int) -> DeviceTier:
    shape = SHAPES["tiny"]
    return DeviceTier(shape, layout(10**9, shape, max_request_slots=slots), torch.float32, "cpu")


def test_slots_go_free_first_then_to_the_least_recently_claimed_finished_request() -> None:
    tier = _tier(3)
    done: set[tuple[int, int]] = set()

    def finished(req: int, generation: int) -> bool:
        return (req, generation) in done

    assert [tier.claim(req, 1, finished) for req in (7, 8, 9)] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="all 3 device request slots hold running requests"):
        tier.claim(10, 1, finished)
    done |= {(9, 1), (8, 1)}  # 8 was claimed before 9
    assert tier.claim(10, 1, finished) == 1
    assert tier.claim(7, 2, finished, take=2) == 2  # request row 7 again, a new generation
    assert tier.slot_of(7) == 2 and tier.holds(7, 2) and not tier.holds(7, 1)
    assert tier.owner(0) == (7, 1) and tier.slot_of(8) == -1 and tier.slot_of(9) == -1
    done.add((7, 1))
    assert sorted(tier.live_slots(finished)) == [1, 2]
    assert (
        tier.used_bytes(len(tier.live_slots(finished)))
        == tier.layout.summary_bytes + 2 * tier.layout.request_bytes
    )


class ReqPool(SimpleNamespace):
    """The slice of SGLang's ReqToTokenPool the slots read."""


def _slots(num_slots: int) -> tuple[RequestSlots, ReqPool]:
    pool = ReqPool(
        req_to_token=torch.arange(4 * 40, dtype=torch.int32).view(4, 40),  # row r: tokens 40r..40r+39
        req_generation=torch.tensor([1, 1, 1, 1]),
        free_slots=[],
    )
    return RequestSlots(_tier(num_slots), pool, block_size=4), pool


def _hold_blocks(slots: RequestSlots, slot: int, req: int, blocks: int) -> None:
    """Slot ``slot`` selected request row ``req``'s first ``blocks`` blocks (layer 0, head 0)."""
    ws = slots.working_sets
    ws.slot_block[slot, 0, 0, :blocks] = torch.arange(blocks)
    ws.k[slot, 0, 0, :blocks] = float(req)
    pages = slots.req_pool.req_to_token[req, 0 : 10 * 4 : 4].to(torch.int64)[None] // 4
    slots.prefixes.record(
        torch.tensor([slot]), pages, torch.tensor([10]), torch.zeros(200, dtype=torch.int64)
    )


def test_a_warm_start_takes_over_a_finished_donor_and_copies_a_running_one() -> None:
    slots, pool = _slots(3)
    epoch = torch.zeros(200, dtype=torch.int64)
    never = lambda req, generation: False  # noqa: E731
    first = slots.admit([(0, 1, 0)], epoch, never, warm_start=True)
    assert first == (1, 0, 0) and slots.tier.slot_of(0) == 0
    _hold_blocks(slots, 0, req=0, blocks=2)
    # Request row 1 shares row 0's first 8 tokens (2 blocks) while row 0 is still running: a copy.
    pool.req_to_token[1, :8] = pool.req_to_token[0, :8]
    admitted = slots.admit([(1, 1, 8)], epoch, never, warm_start=True)
    assert admitted.warm_starts == 1 and admitted.blocks_reused == 2
    copy = slots.tier.slot_of(1)
    assert copy != 0 and torch.equal(slots.working_sets.k[copy, 0, 0, :2], slots.working_sets.k[0, 0, 0, :2])
    # Row 0 finishes; row 2 shares its first block: it takes row 0's slot over, keeps block 0 only.
    pool.free_slots.append(0)
    pool.req_to_token[2, :4] = pool.req_to_token[0, :4]
    assert slots.admit([(2, 1, 4)], epoch, never, warm_start=True).blocks_reused == 1
    assert slots.tier.slot_of(2) == 0
    assert slots.working_sets.slot_block[0, 0, 0, :2].tolist() == [0, EMPTY]
    # A request whose transfer failed donates nothing; without warm starts nothing is reused either.
    pool.req_to_token[3, :8] = pool.req_to_token[1, :8]
    pool.free_slots.append(2)
    assert slots.admit([(3, 1, 8)], epoch, lambda req, gen: req in (1, 2), warm_start=True).warm_starts == 0


class TinyKVPool(SimpleNamespace):
    """The slice of SGLang's KV pool the backend reads at construction."""


def _backend(rows: int, max_running: int | None, sglang_running: int = 0, **config: int) -> OasisAttnBackend:
    pool = TinyKVPool(size=64, page_size=4, layer_num=2, head_num=1, head_dim=2, dtype=torch.float32)
    runner = SimpleNamespace(
        device="cpu",
        req_to_token_pool=SimpleNamespace(
            req_to_token=torch.zeros(rows, 64, dtype=torch.int32),
            req_generation=torch.zeros(rows, dtype=torch.int64),
            free_slots=list(range(rows)),
        ),
        token_to_kv_pool=pool,
        server_args=SimpleNamespace(port=1, enable_metrics=False, max_running_requests=max_running),
        max_running_requests=sglang_running or rows,  # what SGLang's scheduler will read
    )
    backend = OasisAttnBackend(
        runner, OasisConfig(block_size=4, top_k=2, **{"selector": "summaries", **config})
    )
    backend.runner = runner  # type: ignore[attr-defined]
    return backend


def test_a_server_started_without_a_running_cap_runs_no_more_requests_than_the_tier_holds() -> None:
    """Started without ``--max-running-requests`` (not through the launcher), SGLang would run as many
    requests as it has rows and the tier's ``claim`` would fail inside a forward pass, which SGLang treats
    as fatal: the backend caps what SGLang's scheduler reads, so the others wait in its queue."""
    backend = _backend(rows=40, max_running=None, device_kv_tokens=64)
    fitting = backend.tier.num_request_slots
    assert 0 < fitting < 40 and backend.runner.max_running_requests == fitting  # type: ignore[attr-defined]
    kept = _backend(rows=40, max_running=None, sglang_running=2, device_kv_tokens=64).runner  # type: ignore[attr-defined]
    assert kept.max_running_requests == 2  # a smaller cap stays


def test_the_backend_holds_working_sets_for_the_running_cap_not_for_sglang_rows() -> None:
    """A PD decode node has ``--max-running-requests`` + pre-allocation slots + 1 request rows: the device
    tier holds working sets for the running requests only, inside the budget."""
    backend = _backend(rows=40, max_running=3, device_kv_tokens=80)
    budget = 80 * 2 * 1 * 2 * 2 * 4  # tokens x layers x heads x head_dim x (K, V) x fp32
    assert backend.tier.num_request_slots == 3
    assert backend.tier.nbytes <= budget
    assert backend.stats.snapshot()["device_bytes_capacity"] == backend.tier.nbytes
    backend.gauges.refresh()
    assert backend.stats.snapshot()["running_requests"] == 0
    backend.gauges.stop()  # its refresh thread ends
    assert not backend.gauges._thread.is_alive()


def test_a_running_cap_the_budget_cannot_hold_is_refused_by_name() -> None:
    fitting = _backend(rows=40, max_running=None, device_kv_tokens=64).tier.num_request_slots
    with pytest.raises(DeviceTierError, match=f"--max-running-requests {fitting + 1}: the device budget"):
        _backend(rows=40, max_running=fitting + 1, device_kv_tokens=64)
