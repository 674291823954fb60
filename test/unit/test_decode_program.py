"""The captured decode step (``attention/decode_program.py``) against the eager one, in process.

Two oasis backends over identical stand-in pools (SmolLM2's attention shape: 9 query heads, 3 KV heads,
head_dim 64; blocks of 16; float32) admit the same three requests (contexts 300, 517 and 1000 tokens: no
multiple of the block). Then, step after step with the same random q, k and v, one decodes through the
eager path (``OasisAttnBackend.forward_decode``, ``--oasis-prefetch sync``) and the other through
``decode_layer`` on a plan padded to a batch bucket of 4 rows and a block bucket of 128 blocks. After
every step both must hold the same working sets (block ids, slots, last selections, data), the same
coverage, active blocks and summaries, and give the same attention output (fp32, up to the summation
order over the masked slots the captured step also reads). 40 steps: each request fills two or three
blocks, so fresh blocks, capped loads and deferrals all occur.

Then: the step has no host sync (``SyncGuard`` by op, ``fake_run`` on fake tensors; a variant with one
``.item()`` fails it, and every other kind of leak fails ``test_sync_guard.py``), and
``torch.compile(fullgraph=True, dynamic=False)`` captures it whole, once per batch bucket whatever the
layer or step, with outputs equal to eager.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sgl_kernel_oasis.key_codes import encode_key_codes
from sglang_oasis.attention.decode_program import COUNTS, LayerState, StepPlan, StepShape, decode_layer
from sglang_oasis.attention.oasis_backend import OasisAttnBackend
from sglang_oasis.attention.step_plan import symbolic_rows
from sglang_oasis.attention.sync_guard import HostSyncError, SyncGuard, fake_run
from sglang_oasis.config import OasisConfig
from sglang_oasis_testing.stand_in_pool import StandInPool

BLOCK, KV_HEADS, Q_HEADS, DIM, LAYERS, POOL = 16, 3, 9, 64, 2, 8192
CONTEXTS = (300, 517, 1000)
REQS = (1, 2, 3)  # SGLang request rows (row 0 is SGLang's padding row)
SPARSE_LAYER = 1  # layer 0 is a dense layer
BATCH_BUCKET, BLOCK_BUCKET = 4, 128
STEPS = 40
SCALE = DIM**-0.5


def layer(layer_id: int) -> SimpleNamespace:
    return SimpleNamespace(
        layer_id=layer_id, tp_q_head_num=Q_HEADS, tp_k_head_num=KV_HEADS, qk_head_dim=DIM, v_head_dim=DIM,
        scaling=SCALE, is_cross_attention=False, sliding_window_size=None,
    )  # fmt: skip


def admitted(config: OasisConfig, own_k: dict[int, int], pins: dict[int, list[int]]) -> OasisAttnBackend:
    """A backend whose requests ``REQS`` have just been admitted with ``CONTEXTS`` tokens (request row r
    at pool tokens r * 2048 ...; its first working sets by the summaries); row -> own K, row -> pinned
    block ids (every KV head) set as an admission would."""
    req_to_token = torch.zeros(len(REQS) + 1, POOL // 4, dtype=torch.int32)
    for req in REQS:
        req_to_token[req] = torch.arange(req * 2048, req * 2048 + POOL // 4, dtype=torch.int32)
    runner = SimpleNamespace(
        device="cpu",
        req_to_token_pool=SimpleNamespace(
            req_to_token=req_to_token, req_generation=torch.zeros(len(REQS) + 1, dtype=torch.int64), free_slots=[]
        ),
        token_to_kv_pool=StandInPool(POOL, BLOCK, LAYERS, KV_HEADS, DIM, seed=0),
        server_args=SimpleNamespace(port=0, enable_metrics=False, max_running_requests=len(REQS) + 1),
    )  # fmt: skip
    oasis = OasisAttnBackend(runner, config)
    if oasis.captured is not None:  # the program's tests compile (or not) at first use, not ahead
        oasis.captured.ahead = None
    reqs, pool = list(REQS), oasis.token_to_kv_pool
    for req in reqs:
        oasis.slots.claim(req, 0)
    oasis.set_batch(reqs, admission=True)
    slots = oasis.batch.slots
    oasis.intake.catch_up(oasis.batch, SPARSE_LAYER, torch.tensor(CONTEXTS))
    oasis.intake.mark(oasis.batch.req_index, SPARSE_LAYER, torch.tensor(CONTEXTS))  # as an extend records it
    generator = torch.Generator().manual_seed(1)
    oasis.selector.select(oasis.batch, SPARSE_LAYER, torch.randn(len(reqs), Q_HEADS, DIM, generator=generator),
                          list(CONTEXTS))  # fmt: skip
    oasis.selector.finish_pending()
    for req, k in own_k.items():  # after the admission's selection, which sets the requests' options' K
        oasis.tier.working_sets.top_k[oasis.tier.slot(req)] = k
    for req, blocks in pins.items():
        oasis.tier.pinned[oasis.tier.slot(req), SPARSE_LAYER, :, : len(blocks)] = torch.tensor(blocks)
    for row, (req, context) in enumerate(zip(reqs, CONTEXTS, strict=True)):  # the partial block, as an extend
        first = context - context % BLOCK
        locs = req_to_token[req, first:context].long()
        oasis.tier.active.store(SPARSE_LAYER, slots[row : row + 1], torch.tensor([first]), torch.tensor([context]),
                                pool.k[SPARSE_LAYER][locs], pool.v[SPARSE_LAYER][locs])  # fmt: skip
    return oasis


def backend_pair(
    config: OasisConfig, own_k: dict[int, int], pins: dict[int, list[int]]
) -> tuple[OasisAttnBackend, OasisAttnBackend]:
    """An eager backend and a ``--oasis-decode-step captured`` one, alike (the program run uncompiled)."""
    eager = admitted(config, own_k, pins)
    captured = admitted(dataclasses.replace(config, decode_step="captured"), own_k, pins)
    assert captured.captured is not None
    captured.captured.program = decode_layer
    return eager, captured


# which rows' drafts a verify pass accepts, step after step
ACCEPTS = torch.rand(STEPS, len(REQS), generator=torch.Generator().manual_seed(7)) < 0.5


def stop(*backends: OasisAttnBackend) -> None:
    """Stop the backends' threads (one still inside a torch op at exit aborts the process)."""
    for oasis in backends:
        oasis.selector.pipeline.shutdown()
        oasis.gauges.stop()


def step_inputs(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    bs = len(REQS)
    return tuple(  # type: ignore[return-value]
        torch.randn(bs, heads, DIM, generator=generator) for heads in (Q_HEADS, KV_HEADS, KV_HEADS)
    )


def eager_step(oasis: OasisAttnBackend, step: int) -> torch.Tensor:
    q, k, v = step_inputs(step)
    seq_lens = torch.tensor(CONTEXTS) + 1 + step
    locs = oasis.req_to_token_pool.req_to_token[torch.tensor(REQS), seq_lens - 1].long()
    batch = SimpleNamespace(
        forward_mode=ForwardMode.DECODE, req_pool_indices=torch.tensor(REQS), seq_lens=seq_lens,
        out_cache_loc=locs, encoder_lens=None, spec_info=None,
    )  # fmt: skip
    oasis.begin_batch(ForwardMode.DECODE, list(REQS), seq_lens.tolist(), None)
    bs = len(REQS)
    out = oasis.forward_decode(q.view(bs, -1), k.view(bs, -1), v.view(bs, -1), layer(SPARSE_LAYER), batch)
    return out.view(bs, Q_HEADS, DIM)


def shape_of(oasis: OasisAttnBackend) -> StepShape:
    tier = oasis.tier
    return StepShape.of(
        oasis.config, tier.active.span, tier.working_sets.num_slots, tier.num_request_slots - 1
    )


def plan_of(oasis: OasisAttnBackend, step: int, batch_bucket: int = BATCH_BUCKET) -> StepPlan:
    reqs = torch.tensor(REQS)
    seq_lens = torch.tensor(CONTEXTS) + 1 + step
    req_to_token = oasis.req_to_token_pool.req_to_token
    slots = torch.tensor([oasis.tier.slot(req) for req in REQS])
    return StepPlan.build(slots, seq_lens, req_to_token[reqs, seq_lens - 1], req_to_token, reqs, step + 1,
                          shape_of(oasis), batch_bucket, BLOCK_BUCKET)  # fmt: skip


def captured_inputs(oasis: OasisAttnBackend, step: int, layer_id: int = SPARSE_LAYER) -> tuple[Any, ...]:
    """``decode_layer``'s arguments for ``step`` (the host side: plan, padding)."""
    q, k, v = step_inputs(step)
    pad = BATCH_BUCKET - len(REQS)

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, torch.zeros((pad, *t.shape[1:]))])

    state = LayerState.of(oasis.tier, oasis.token_to_kv_pool, layer_id)
    return shape_of(oasis), state, plan_of(oasis, step), padded(q), padded(k), padded(v), SCALE


def captured_step(
    oasis: OasisAttnBackend, step: int, program: Any = decode_layer, layer_id: int = SPARSE_LAYER
) -> tuple[torch.Tensor, torch.Tensor]:
    out, counts = program(*captured_inputs(oasis, step, layer_id))
    return out[: len(REQS)], counts[: len(REQS)]


def assert_same_state(eager: OasisAttnBackend, captured: OasisAttnBackend) -> None:
    slots = [eager.tier.slot(req) for req in REQS]
    assert slots == [captured.tier.slot(req) for req in REQS]
    one, two = eager.tier.working_sets, captured.tier.working_sets
    at = (slots, SPARSE_LAYER)
    for name in ("slot_block", "last_selected", "covered", "top_k"):
        assert torch.equal(getattr(one, name)[at], getattr(two, name)[at]), name
    resident = one.slot_block[at] != -1
    assert torch.equal(one.k[at][resident], two.k[at][resident])
    assert torch.equal(one.v[at][resident], two.v[at][resident])
    for name in ("start", "end"):
        assert torch.equal(getattr(eager.tier.active, name)[at], getattr(captured.tier.active, name)[at]), (
            name
        )
    for name in ("kmin", "kmax"):  # page 0 is SGLang's padding page: the padding rows' token lands there
        ours, theirs = getattr(eager.tier.summaries, name), getattr(captured.tier.summaries, name)
        assert torch.equal(ours[SPARSE_LAYER, 1:], theirs[SPARSE_LAYER, 1:]), name
    pool_one, pool_two = eager.token_to_kv_pool, captured.token_to_kv_pool
    assert torch.equal(pool_one.k[SPARSE_LAYER][BLOCK:], pool_two.k[SPARSE_LAYER][BLOCK:])


def assert_same_codes(eager: OasisAttnBackend, captured: OasisAttnBackend, step: int) -> None:
    """``--oasis-selector codes``: after ``step``, every full block of every request is coded, the eager
    step's codes (its selection jobs') and the captured step's (its program's) alike."""
    if eager.tier.codes is None or captured.tier.codes is None:
        return
    table = eager.req_to_token_pool.req_to_token
    for req, context in zip(REQS, CONTEXTS, strict=True):
        full = (context + 1 + step) // BLOCK
        pages = table[req, 0 : full * BLOCK : BLOCK].long() // BLOCK
        ours, theirs = (
            eager.tier.codes.codes[SPARSE_LAYER, pages],
            captured.tier.codes.codes[SPARSE_LAYER, pages],
        )
        assert torch.equal(ours, theirs), (req, step)
        keys = eager.token_to_kv_pool.k[SPARSE_LAYER].view(-1, BLOCK, KV_HEADS, DIM)[pages]
        kmin, kmax = keys.amin(dim=1), keys.amax(dim=1)
        assert torch.equal(theirs, encode_key_codes(keys, kmin, kmax)), (req, step)


CASES = {
    # K < N with a cap of 2 blocks per head and step (K = 8), one sink block
    "k_sparse_capped": (dict(top_k=8, fetch_ratio=0.25, sink_blocks=1), {}, {}),
    # each row its own K (4 / 8 / 12), the server's default cap
    "k_per_row": (dict(top_k=8, recall_max_top_k=12), {1: 4, 3: 12}, {}),
    # no cap: every predicted block loads at once
    "k_sparse_uncapped": (dict(top_k=6, fetch_ratio=1.0), {}, {}),
    # pinned blocks (the prefill window's) outrank every score
    "pinned": (dict(top_k=8, sink_blocks=1, prefill_window=16), {}, {2: [3, 7], 3: [10]}),
    # K covers every block: nothing to select, every block resident (the eager step's shortcut)
    "k_covering": (dict(top_k=80), {}, {}),
    # --oasis-selector codes: every full block scored by its coded keys (coded_selection.py)
    "codes": (dict(top_k=6, selector="codes", sink_blocks=1), {}, {}),
    # the same over each head's 2 x K best blocks by the bound, each row its own K (2 / 4 / 6), a pin
    "codes_candidates": (
        dict(top_k=4, selector="codes", code_candidates=2, recall_max_top_k=6, prefill_window=16),
        {1: 2, 3: 6},
        {2: [5]},
    ),
}


def configs(name: str) -> tuple[OasisConfig, dict[int, int], dict[int, list[int]]]:
    options, own_k, pins = CASES[name]
    base: dict[str, Any] = dict(block_size=BLOCK, device_kv_tokens=POOL, dense_layers=(0,), prefill_window=0,
                                prefetch="sync", selector="summaries")  # fmt: skip
    return OasisConfig(**{**base, **options}), own_k, pins


@pytest.mark.parametrize("case", list(CASES))
def test_captured_step_equals_eager_step(case: str) -> None:
    config, own_k, pins = configs(case)
    eager, captured = admitted(config, own_k, pins), admitted(config, own_k, pins)
    assert_same_state(eager, captured)
    totals = torch.zeros(len(COUNTS), dtype=torch.int64)
    before = eager.stats.snapshot()
    for step in range(STEPS):
        expected = eager_step(eager, step)
        out, counts = captured_step(captured, step)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        assert_same_state(eager, captured)
        assert_same_codes(eager, captured, step)
        totals += counts.sum(dim=0)
    eager.selector.finish_pending()  # the last step's job is folded in at the next wait
    after = eager.stats.snapshot()
    got = dict(zip(COUNTS, totals.tolist(), strict=True))
    assert got["overflow"] == 0
    assert got["loads"] == after["selection_changes"] - before["selection_changes"]
    assert got["fresh"] == after["blocks_just_filled"] - before["blocks_just_filled"]
    assert got["from_active"] == after["blocks_from_active"] - before["blocks_from_active"]
    assert got["deferred"] == after["blocks_deferred"] - before["blocks_deferred"]
    assert got["scored"] == after["scored_selections"] - before["scored_selections"]
    if case == "k_sparse_capped":  # the case exercises what it names
        assert got["deferred"] > 0 and got["loads"] > got["fresh"] > 0
    if case == "k_per_row":
        assert captured.tier.working_sets.top_k[
            [captured.tier.slot(r) for r in REQS], SPARSE_LAYER
        ].tolist() == [4, 8, 12]
    stop(eager)


def counted_program() -> tuple[list[int], Any]:
    """``decode_layer`` under ``torch.compile(fullgraph=True, dynamic=False)`` from a fresh Dynamo cache,
    with a backend that runs each graph as traced and records it (its node count) in the list; each call's
    batch and block dimensions marked symbolic first, as ``CapturedStep`` marks a pass's."""
    torch._dynamo.reset()
    graphs: list[int] = []

    def counting(gm: torch.fx.GraphModule, inputs: list[Any]) -> Any:
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    compiled = torch.compile(decode_layer, fullgraph=True, dynamic=False, backend=counting)

    def program(shape: StepShape, state: LayerState, plan: StepPlan, *rest: Any) -> Any:
        plan.mark_symbolic()
        symbolic_rows(*rest[:3])
        return compiled(shape, state, plan, *rest)

    return graphs, program


def _with_one_item(*args: Any) -> Any:
    """A deliberately broken step: one host read of a tensor's value."""
    out, counts = decode_layer(*args)
    if int(counts.sum()) < 0:
        raise AssertionError("unreachable")
    return out, counts


@pytest.mark.parametrize("case", ["k_sparse_capped", "codes_candidates"])
def test_captured_step_has_no_host_sync(case: str) -> None:
    config, own_k, pins = configs(case)
    captured = admitted(config, own_k, pins)
    for step in range(3):
        inputs = captured_inputs(captured, step)  # the host plan may sync; the step may not
        fake_run(decode_layer, *inputs)  # no op that needs a value or makes a shape of the data
        with SyncGuard() as guard:
            decode_layer(*inputs)
        assert guard.ops > 100  # the guard saw the step's ops
    inputs = captured_inputs(captured, 3)
    with pytest.raises(HostSyncError, match="_local_scalar_dense"), SyncGuard():
        _with_one_item(*inputs)


def test_eager_step_is_what_the_guard_catches() -> None:
    """The eager step syncs (the reason for the captured one): the guard stops it at its first."""
    config, own_k, pins = configs("k_sparse_capped")
    eager = admitted(config, own_k, pins)
    with pytest.raises(HostSyncError), SyncGuard():
        eager_step(eager, 0)
    stop(eager)


def padding_plan(oasis: OasisAttnBackend, rows: int) -> StepPlan:
    """A plan of ``rows`` padding rows (what ``CompileAhead`` compiles on)."""
    none = torch.zeros(0, dtype=torch.int64)
    req_to_token = oasis.req_to_token_pool.req_to_token
    return StepPlan.build(none, none, none, req_to_token, none, 0, shape_of(oasis), rows, BLOCK_BUCKET)


@pytest.mark.parametrize("case", ["k_sparse_capped", "codes_candidates"])
def test_compiled_step_captures_whole_once_per_bucket(case: str) -> None:
    """fullgraph: no graph break; the batch dimension symbolic: one graph serves every batch bucket above
    one row (4, then 2, 8 and 16 here) across steps and layers (the views of layer 0 and layer 1 have the
    same strides), with outputs equal to the eager program's; a pass of one row gets a second graph
    (torch specializes a dimension of one)."""
    graphs, compiled = counted_program()
    config, own_k, pins = configs(case)
    eager, captured = admitted(config, own_k, pins), admitted(config, own_k, pins)
    for step in range(6):
        for layer_id in (0, SPARSE_LAYER):
            if layer_id == SPARSE_LAYER:
                expected, expected_counts = captured_step(eager, step)
                out, counts = captured_step(captured, step, program=compiled)
                torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
                assert torch.equal(counts, expected_counts)
            else:  # another layer's state views: the same graph
                captured_step(captured, step, program=compiled, layer_id=0)
    assert len(graphs) == 1, graphs
    state = LayerState.of(captured.tier, captured.token_to_kv_pool, SPARSE_LAYER)
    for bucket in (2, 8, 16, 1):
        q, k, v = (torch.zeros(bucket, heads, DIM) for heads in (Q_HEADS, KV_HEADS, KV_HEADS))
        wide = bucket >= len(REQS)  # the requests' rows padded, else padding rows alone
        plan = plan_of(captured, 6, batch_bucket=bucket) if wide else padding_plan(captured, bucket)
        out, counts = compiled(shape_of(captured), state, plan, q, k, v, SCALE)
        assert out.shape == (bucket, Q_HEADS, DIM) and counts.shape == (bucket, len(COUNTS))
        compiled(shape_of(captured), state, plan._replace(step=torch.tensor(8)), q, k, v, SCALE)
        assert len(graphs) == (1 if bucket > 1 else 2), (bucket, graphs)
    stop(eager, captured)


@pytest.mark.parametrize("case", ["k_sparse_capped", "k_covering"])
def test_backend_runs_plain_decode_passes_captured(case: str) -> None:
    """``--oasis-decode-step captured`` through ``OasisAttnBackend.forward_decode`` (its program run
    uncompiled here; compiled in the server test): the same outputs, state and counters as the eager
    backend, step after step, the recall samples' passes too (the sample inside the program). With K
    covering the contexts (80 slots, at most 64 blocks held) attention reads only the slots below the
    highest one held, rounded up to 8 (``step_plan.held_slots``)."""
    config, own_k, pins = configs(case)
    eager, captured = backend_pair(config, own_k, pins)
    assert captured.tier.padding_slot == captured.tier.num_request_slots and captured.captured is not None
    widths: list[int] = []

    def program(*args: Any) -> Any:
        state, plan = args[1], args[2]
        assert plan.held is not None and torch.equal(plan.held, torch.arange(len(plan.held)))
        occupied = (state.slot_block[plan.slots[: len(REQS)]] != -1).flatten(0, -2).any(dim=0).nonzero()
        assert (
            int(occupied.max()) < len(plan.held) <= -(-(int(occupied.max()) + 1) // 8) * 8
        )  # every one read
        widths.append(len(plan.held))
        return decode_layer(*args)

    captured.captured.program = program
    for step in range(STEPS):
        torch.testing.assert_close(eager_step(captured, step), eager_step(eager, step), rtol=1e-5, atol=1e-6)
        assert_same_state(eager, captured)
    eager.selector.finish_pending()
    ours, theirs = eager.stats.snapshot(), captured.stats.snapshot()
    assert_captured_samples(captured, theirs)
    for name in ("selections", "scored_selections", "selection_changes", "blocks_loaded", "decode_bytes_host_to_device",
                 "blocks_just_filled", "blocks_from_active", "blocks_deferred"):  # fmt: skip
        assert ours[name] == theirs[name], name
    assert_same_recall(ours, theirs)
    assert len(widths) == STEPS
    if case == "k_covering":  # 1,000 tokens: 62 full blocks, then 64 at most: 64 of the 80 slots read
        assert (captured.tier.working_sets.num_slots, max(widths)) == (80, 64), widths
    stop(eager, captured)


def assert_captured_samples(captured: OasisAttnBackend, stats: dict[str, int], verify: bool = False) -> None:
    """Every decode pass ran captured (verify passes: most; a tail of a just-filled block plus the rows that
    outgrows the active blocks' ring runs eagerly), and the program took recall samples (it alone leaves
    the figures in the tier)."""
    passes = stats["captured_decode_passes"]
    assert stats["decode_steps"] == STEPS and (passes > STEPS // 2 if verify else passes == STEPS), stats
    assert bool((captured.tier.recall[[captured.tier.slot(req) for req in REQS], SPARSE_LAYER] != 0).any())


def assert_same_recall(ours: dict[str, int], theirs: dict[str, int]) -> None:
    """The recall probe's counters and window alike (the figures in fp32, up to the summation order: a
    ppm or two per sample); at least one sample taken."""
    samples = ours["recall_samples"]
    assert (
        samples > 0
        and theirs["recall_samples"] == samples
        and ours["telemetry_bytes"] == theirs["telemetry_bytes"]
    )
    for name in ("recall_sum_ppm", "lookahead_agreement_sum_ppm"):
        assert abs(ours[name] - theirs[name]) <= 2 * samples, name
    for name in (
        "recall_mean_ppm",
        "recall_p10_ppm",
        "lookahead_agreement_ppm",
        f"recall_layer_ppm_{SPARSE_LAYER}",
    ):
        assert abs(ours[name] - theirs[name]) <= 2, name
    for name in ("recall_below_target", "recall_target_grows", "recall_target_shrinks"):
        assert ours[name] == theirs[name], name


TARGET = dict(top_k=4, recall_max_top_k=64, recall_target=0.6, recall_sample_every=3, sink_blocks=1)


@pytest.mark.parametrize("verify", [False, True], ids=["decode", "verify"])
def test_backend_holds_a_recall_target_captured(verify: bool) -> None:
    """A recall target (K 4, grown up to 64; a sample at each request's first and every 3rd step) through
    the captured program: its samples' figures, its growths (as samples fall below the target and as
    blocks fill up past a working set grown to hold them all) and its shrinks (after samples well above)
    leave the same top-K, streaks, working sets and outputs as the eager backend's, pass after pass,
    every pass captured; decode passes and verify passes (drafts accepted at random)."""
    config, own_k, pins = configs("k_sparse_capped")
    config = dataclasses.replace(config, **TARGET)
    eager, captured = backend_pair(config, own_k, pins)
    first = torch.tensor(CONTEXTS)
    slots = [eager.tier.slot(req) for req in REQS]
    seen_k: set[int] = set()
    for step in range(STEPS):
        if verify:
            got, expected = verify_step(captured, step, first), verify_step(eager, step, first)
            first = first + 1 + ACCEPTS[step].long()
        else:
            got, expected = eager_step(captured, step), eager_step(eager, step)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        assert_same_state(eager, captured)
        assert torch.equal(eager.tier.recall_streak[slots], captured.tier.recall_streak[slots])
        seen_k |= set(captured.tier.working_sets.top_k[slots, SPARSE_LAYER].tolist())
    eager.selector.finish_pending()
    ours, theirs = eager.stats.snapshot(), captured.stats.snapshot()
    assert_captured_samples(captured, theirs, verify)
    assert_same_recall(ours, theirs)
    assert ours["recall_below_target"] > 0 and ours["recall_target_grows"] > 0, ours
    assert ours["recall_target_shrinks"] > 0 and len(seen_k) >= 3, (ours, seen_k)
    stop(eager, captured)


def test_a_captured_step_that_fails_leaves_the_server_decoding_eagerly() -> None:
    """A program that cannot compile (here: raises at the 5th pass) is logged, that layer and every later
    pass run the eager step, and the answers stay the eager backend's: nothing is lost."""
    config, own_k, pins = configs("k_sparse_capped")
    eager = admitted(config, own_k, pins)
    captured = admitted(dataclasses.replace(config, decode_step="captured"), own_k, pins)
    assert captured.captured is not None
    calls = [0]

    def failing(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] >= 5:
            raise RuntimeError("no C++ compiler")
        return decode_layer(*args)

    captured.captured.program = failing
    for step in range(12):
        torch.testing.assert_close(eager_step(captured, step), eager_step(eager, step), rtol=1e-5, atol=1e-6)
        assert_same_state(eager, captured)
    assert calls[0] == 5 and captured.stats.snapshot()["captured_decode_passes"] == 4
    stop(eager, captured)


def test_one_graph_per_batch_bucket_whatever_the_contexts() -> None:
    """Through the backend (``CapturedStep.decode``): the block dimension is symbolic, so the passes of
    one batch bucket share one graph while the contexts grow across block buckets (64 -> 80 here: the
    1,000-token request passes 64 full blocks at its 24th step; above the first bucket one every 16
    blocks, not the next power of two), with outputs and state still the eager
    backend's; a recall sample's passes have a graph of their own (one more, whatever the contexts); the
    compile time is counted."""
    graphs, compiled = counted_program()
    config, own_k, pins = configs("k_sparse_capped")
    eager = admitted(config, own_k, pins)
    captured = admitted(dataclasses.replace(config, decode_step="captured"), own_k, pins)
    assert captured.captured is not None
    buckets: set[int] = set()

    def program(*args: Any) -> Any:
        buckets.add(args[2].pages.shape[1])
        return compiled(*args)

    captured.captured.program = program
    for step in range(STEPS):
        torch.testing.assert_close(eager_step(captured, step), eager_step(eager, step), rtol=1e-5, atol=1e-6)
        assert_same_state(eager, captured)
    assert buckets == {64, 80}, buckets
    assert len(graphs) == 2 and captured.stats.snapshot()["recall_samples"] > 0, graphs
    assert captured.stats.snapshot()["captured_compile_ms"] > 0
    stop(eager, captured)


@pytest.mark.parametrize("case", ["k_per_row", "k_sparse_capped"])
def test_program_with_the_triton_kernels_equals_the_reference(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA the program's scoring, summary update, attention and copies are sgl-kernel-oasis's Triton
    kernels (``ops.uses_triton``: CUDA tensors): here, with the kernels under Triton's interpreter
    (test/conftest.py) on the CPU tensors, the steps leave the reference's outputs (fp32, up to the online
    softmax's summation order), the same counts, the same blocks selected and the same state."""
    import importlib

    from sgl_kernel_oasis import ops

    pytest.importorskip("triton")
    kernels = importlib.import_module("sgl_kernel_oasis.triton_kernels")
    config, own_k, pins = configs(case)
    reference, triton = admitted(config, own_k, pins), admitted(config, own_k, pins)
    called: dict[str, int] = {}

    def counted(name: str) -> Any:
        kernel = getattr(kernels, name)

        def run(*args: Any) -> Any:
            called[name] = called.get(name, 0) + 1
            return kernel(*args)

        return run

    steps = 6
    for step in range(steps):
        expected = captured_step(reference, step)
        with monkeypatch.context() as patch:
            patch.setattr(ops, "uses_triton", lambda tensor: True)
            for name in kernels.__all__:
                patch.setattr(kernels, name, counted(name))
            got = captured_step(triton, step)
        torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(got[1], expected[1])
        assert_same_state(reference, triton)
    # one launch each per step, two for the copies (host tier, active ring)
    assert called == {"score_paged_blocks": steps, "update_page_summaries": steps,
                      "headwise_decode_attention": steps, "copy_blocks_to_slots": 2 * steps}, called  # fmt: skip
    stop(reference, triton)


VERIFY_ROWS = 2  # the lookahead's: the real token and one draft


def verify_step(oasis: OasisAttnBackend, step: int, first: torch.Tensor) -> torch.Tensor:
    """A TARGET_VERIFY pass through the backend: row 0 of each request at position ``first`` (SGLang's
    seq_lens), its draft at ``first + 1``; the same random q, k, v for both backends."""
    generator = torch.Generator().manual_seed(500 + step)
    bs, rows = len(REQS), VERIFY_ROWS
    q, k, v = (
        torch.randn(bs * rows, heads * DIM, generator=generator) for heads in (Q_HEADS, KV_HEADS, KV_HEADS)
    )
    positions = first[:, None] + torch.arange(rows)
    locs = oasis.req_to_token_pool.req_to_token[torch.tensor(REQS)[:, None], positions].long().flatten()
    batch = SimpleNamespace(
        forward_mode=ForwardMode.TARGET_VERIFY, req_pool_indices=torch.tensor(REQS), seq_lens=first.clone(),
        out_cache_loc=locs, encoder_lens=None, spec_info=None,
    )  # fmt: skip
    oasis.begin_batch(ForwardMode.TARGET_VERIFY, list(REQS), first.tolist(), None)
    return oasis.forward_extend(q, k, v, layer(SPARSE_LAYER), batch).view(bs, rows, Q_HEADS, DIM)


@pytest.mark.parametrize("case", ["k_sparse_capped", "k_covering"])
def test_backend_runs_verify_passes_captured(case: str) -> None:
    """The lookahead's verify passes (a real and a draft row per request) through the compiled program:
    the same outputs and state as the eager backend's ``forward_verify``, step after step, with drafts
    accepted at random (an accepted draft joins the summaries at the next pass: the catch-up), the recall
    samples' passes too (the real row's query sampled)."""
    config, own_k, pins = configs(case)
    eager, captured = backend_pair(config, own_k, pins)
    first = torch.tensor(CONTEXTS)
    for step in range(STEPS):
        torch.testing.assert_close(
            verify_step(captured, step, first), verify_step(eager, step, first), rtol=1e-5, atol=1e-6
        )
        assert_same_state(eager, captured)
        first = first + 1 + ACCEPTS[step].long()  # the draft accepted: two tokens committed
    ours, theirs = eager.stats.snapshot(), captured.stats.snapshot()
    assert_captured_samples(captured, theirs, verify=True)
    assert_same_recall(ours, theirs)
    stop(eager, captured)


def verify_inputs(oasis: OasisAttnBackend, step: int, batch_bucket: int = BATCH_BUCKET) -> tuple[Any, ...]:
    """``decode_layer``'s arguments for a verify pass (every row's draft rejected: row 0 at ``CONTEXTS +
    step``), padded to the batch bucket."""
    generator = torch.Generator().manual_seed(900 + step)
    bs, rows, pad = len(REQS), VERIFY_ROWS, batch_bucket - len(REQS)
    q, k, v = (
        torch.randn(batch_bucket, rows, heads, DIM, generator=generator)
        for heads in (Q_HEADS, KV_HEADS, KV_HEADS)
    )
    reqs, first = torch.tensor(REQS), torch.tensor(CONTEXTS) + step
    req_to_token = oasis.req_to_token_pool.req_to_token
    locs = req_to_token[reqs[:, None], first[:, None] + torch.arange(rows)].long()
    slots = torch.tensor([oasis.tier.slot(req) for req in REQS])
    tree = torch.ones(rows, rows, dtype=torch.bool).tril().expand(bs, -1, -1)
    plan = StepPlan.build(slots, first + 1, locs[:, 0], req_to_token, reqs, step + 1, shape_of(oasis), batch_bucket,
                          BLOCK_BUCKET, locs[:, 1:], tree)  # fmt: skip
    assert plan.tree is not None and plan.tree.shape == (batch_bucket, rows, rows) and pad > 0
    state = LayerState.of(oasis.tier, oasis.token_to_kv_pool, SPARSE_LAYER)
    return shape_of(oasis), state, plan, q, k, v, SCALE


def test_verify_program_has_no_host_sync_and_compiles_whole() -> None:
    """With the lookahead's rows the program still passes the sync guard, and compiles as one graph across
    steps (fullgraph) with the uncompiled program's outputs and counts."""
    graphs, compiled = counted_program()
    config, own_k, pins = configs("k_sparse_capped")
    plain, captured = admitted(config, own_k, pins), admitted(config, own_k, pins)
    for step in range(4):
        inputs = verify_inputs(plain, step)  # the host plan may sync; the step may not
        fake_run(decode_layer, *inputs)
        with SyncGuard() as guard:
            expected, expected_counts = decode_layer(*inputs)
        assert guard.ops > 100 and expected.shape == (BATCH_BUCKET, VERIFY_ROWS, Q_HEADS, DIM)
        out, counts = compiled(*verify_inputs(captured, step))
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        assert torch.equal(counts, expected_counts)
    assert len(graphs) == 1, graphs
    out, _ = compiled(*verify_inputs(captured, 4, batch_bucket=8))  # another batch bucket: the same graph
    assert out.shape == (8, VERIFY_ROWS, Q_HEADS, DIM) and len(graphs) == 1, graphs
    stop(plain, captured)


def sampled_inputs(oasis: OasisAttnBackend, step: int, verify: bool) -> tuple[Any, ...]:
    """``decode_layer``'s arguments for a recall-sample pass with a target (rows 0 and 2 sampled; row 1's
    own target 0: none), a decode or a verify pass."""
    inputs = list(verify_inputs(oasis, step) if verify else captured_inputs(oasis, step))
    own_k, target = torch.tensor([4, 8, 4]), torch.tensor([0.9, 0.0, 0.6], dtype=torch.float64)
    sampled = torch.tensor([True, True, True]) if step % 2 else torch.tensor([True, False, True])
    pad = BATCH_BUCKET - len(REQS)
    inputs[2] = inputs[2]._replace(
        own_k=torch.cat([own_k, torch.ones(pad, dtype=torch.int64)]),
        target=torch.cat([target, torch.zeros(pad, dtype=torch.float64)]),
        sampled=torch.cat([sampled, torch.zeros(pad, dtype=torch.bool)]),
    )
    return tuple(inputs)


def test_recall_sample_program_has_no_host_sync_and_compiles_whole() -> None:
    """A recall sample with targets inside the program, decode and verify passes: no host sync; compiled,
    one graph each across steps, leaving the uncompiled program's outputs, counts, figures, streaks and
    top-K (its decisions taken: some rows grow)."""
    graphs, compiled = counted_program()
    config, own_k, pins = configs("k_sparse_capped")
    config = dataclasses.replace(config, **TARGET)
    plain, captured = admitted(config, own_k, pins), admitted(config, own_k, pins)
    slots = [plain.tier.slot(req) for req in REQS]
    for verify in (False, True):
        for step in range(4):
            inputs = sampled_inputs(plain, step, verify)  # the host plan may sync; the step may not
            fake_run(decode_layer, *inputs)
            with SyncGuard() as guard:
                expected, expected_counts = decode_layer(*inputs)
            assert guard.ops > 100
            out, counts = compiled(*sampled_inputs(captured, step, verify))
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
            assert torch.equal(counts, expected_counts)
            assert_same_state(plain, captured)
            for name in ("recall_streak", "recall"):
                ours, theirs = getattr(plain.tier, name)[slots], getattr(captured.tier, name)[slots]
                torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    grown = plain.tier.working_sets.top_k[slots, SPARSE_LAYER]
    assert int(grown[0]) > 4 and int(grown[1]) == 4, grown  # row 0 grew; row 1 (no target) did not
    assert len(graphs) == 2, graphs
    stop(plain, captured)


def test_verify_program_with_the_triton_kernels_equals_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """A verify pass's rows through the Triton kernels (under the interpreter) as through the torch forms."""
    from sgl_kernel_oasis import ops

    pytest.importorskip("triton")
    config, own_k, pins = configs("k_per_row")
    reference, triton = admitted(config, own_k, pins), admitted(config, own_k, pins)
    for step in range(3):
        expected = decode_layer(*verify_inputs(reference, step))
        with monkeypatch.context() as patch:
            patch.setattr(ops, "uses_triton", lambda tensor: True)
            got = decode_layer(*verify_inputs(triton, step))
        torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(got[1], expected[1])
        assert_same_state(reference, triton)
    stop(reference, triton)
