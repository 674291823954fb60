"""The oasis backend's TARGET_VERIFY path, PD arrivals and the prefill window's first selection on
constructed cases, with small stand-in pools (pure logic: the real-server equivalence tests are in
test/integration/test_lookahead.py, the window's passkey test in test/integration/test_passkey.py).

One request, one KV head, head_dim 2, blocks of 4 tokens, K = 1. Block b's keys all point along one
direction, so a query selects the block it points at. The real row's query points at block 0 and the
draft row's query at block 2: after the verify step the working set must hold block 2.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sgl_kernel_oasis import build_block_summaries
from sglang_oasis import sglang_hooks as hooks
from sglang_oasis.attention.decode_program import decode_layer
from sglang_oasis.attention.oasis_backend import OasisAttnBackend
from sglang_oasis.attention.request_options import retraction_keys
from sglang_oasis.attention.retraction import keep_retracted
from sglang_oasis.attention.sync_guard import SyncGuard
from sglang_oasis.config import OasisConfig
from sglang_oasis.sglang_contract import RETRACT_LISTENER

BLOCK, DIM = 4, 2
DIRECTIONS = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]])  # block b -> direction b


class TinyKVPool:
    """The slice of SGLang's MHATokenToKVPool the backend uses: one layer, one KV head."""

    def __init__(self, size: int) -> None:
        self.size, self.page_size, self.layer_num, self.head_num, self.head_dim = size, BLOCK, 1, 1, DIM
        self.dtype = torch.float32
        self.k = torch.zeros(size + 2 * BLOCK, 1, DIM)
        self.v = torch.zeros(size + 2 * BLOCK, 1, DIM)

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v

    def set_kv_buffer(self, layer, loc, k, v) -> None:  # SGLang's signature; loc is a KVWriteLoc
        locations = loc.loc  # a KVWriteLoc
        self.k[locations] = k.view(-1, 1, DIM)
        self.v[locations] = v.view(-1, 1, DIM)


def _backend(pool: TinyKVPool, top_k: int = 1, **config: int) -> OasisAttnBackend:
    req_to_token = torch.zeros(2, 64, dtype=torch.int32)
    runner = SimpleNamespace(
        device="cpu",
        req_to_token_pool=SimpleNamespace(
            req_to_token=req_to_token, req_generation=torch.zeros(2, dtype=torch.int64), free_slots=[1]
        ),
        token_to_kv_pool=pool,
        server_args=SimpleNamespace(port=1, enable_metrics=False),
    )
    backend = OasisAttnBackend(
        runner, OasisConfig(block_size=BLOCK, top_k=top_k, **{"selector": "summaries", **config})
    )
    if backend.captured is not None:  # no compiles ahead: their padding rows write location 0, a token here
        backend.captured.ahead = None
    return backend


def _layer(scaling: float = 1.0) -> SimpleNamespace:
    """The slice of SGLang's RadixAttention the backend reads: layer 0, one query head, one KV head."""
    return SimpleNamespace(layer_id=0, tp_q_head_num=1, tp_k_head_num=1, qk_head_dim=DIM, v_head_dim=DIM,
                           scaling=scaling, is_cross_attention=False, attn_type=None, sliding_window_size=None)  # fmt: skip


def _decode_batch(rows: list[int], seq_lens: list[int], locs: object) -> SimpleNamespace:
    """The slice of SGLang's ForwardBatch a decode pass reads."""
    return SimpleNamespace(forward_mode=ForwardMode.DECODE, req_pool_indices=torch.tensor(rows),
                           seq_lens=torch.tensor(seq_lens), out_cache_loc=torch.as_tensor(locs))  # fmt: skip


def _verify_step(backend: OasisAttnBackend, seq_len: int, scaling: float) -> tuple[SimpleNamespace, ...]:
    """``(layer, batch)`` of a verify step for request 0 (committed length ``seq_len``, its two verify
    rows at the next two locations), with the prefill's summaries already folded in."""
    backend.req_to_token_pool.req_to_token[0, : seq_len + 2] = torch.arange(seq_len + 2, dtype=torch.int32)
    layer = _layer(scaling)
    batch = SimpleNamespace(
        forward_mode=ForwardMode.TARGET_VERIFY,
        req_pool_indices=torch.tensor([0]),
        seq_lens=torch.tensor([seq_len]),
        out_cache_loc=torch.tensor([seq_len, seq_len + 1]),
        spec_info=None,
    )
    backend.slots.claim(0, 0)
    backend.set_batch([0])
    backend.recall.begin(backend.batch)  # as begin_batch does for a verify pass
    backend.intake.catch_up(backend.batch, 0, torch.tensor([seq_len]))
    return layer, batch


def test_draft_row_query_selects_the_next_working_set() -> None:
    pool = TinyKVPool(64)
    backend = _backend(pool)
    seq_len = 4 * BLOCK + 1  # four full blocks and one tail token
    for block in range(4):
        pool.k[block * BLOCK : (block + 1) * BLOCK, 0] = (
            DIRECTIONS[block] * torch.linspace(1, 2, BLOCK)[:, None]
        )
    pool.v[:seq_len, 0] = torch.randn(seq_len, DIM)
    layer, batch = _verify_step(backend, seq_len, scaling=1.0)
    # Rows: the real token's query points at block 0, the draft token's at block 2.
    q = torch.stack([DIRECTIONS[0], DIRECTIONS[2]]) * 10
    k = torch.randn(2, DIM)
    v = torch.randn(2, DIM)
    out = backend.forward_verify(q, k, v, layer, batch)
    backend.selector.finish_pending()  # the next step waits for the prefetch pipeline; so does this check
    assert out.shape == (2, DIM)
    held = backend.working_sets.slot_block[0, 0, 0].tolist()
    assert held == [2], f"the draft row should select block 2, the working set holds {held}"
    # The real row's key (position seq_len) is in the summaries, the draft's (seq_len + 1) is not yet.
    assert int(backend.intake.summarised[0, 0]) == seq_len + 1


def test_verify_rows_attend_causally_over_the_whole_context_when_k_covers_it() -> None:
    """K covering every block: each row's output equals dense causal attention over the context plus
    the verify rows up to itself."""
    pool = TinyKVPool(64)
    backend = _backend(pool, top_k=8, recall_sample_every=1)
    seq_len = 3 * BLOCK + 2
    gen = torch.Generator().manual_seed(0)
    pool.k[:seq_len, 0] = torch.randn(seq_len, DIM, generator=gen)
    pool.v[:seq_len, 0] = torch.randn(seq_len, DIM, generator=gen)
    layer, batch = _verify_step(backend, seq_len, scaling=0.7)
    backend.selector.select(
        backend.batch, 0, torch.randn(1, 1, DIM, generator=gen), [seq_len]
    )  # the prefill's
    q, k, v = (torch.randn(2, DIM, generator=gen) for _ in range(3))
    out = backend.forward_verify(q, k, v, layer, batch)
    keys = torch.cat([pool.k[:seq_len, 0], k])
    values = torch.cat([pool.v[:seq_len, 0], v])
    for row in range(2):
        visible = seq_len + row + 1
        weights = torch.softmax(keys[:visible] @ q[row] * 0.7, dim=0)
        torch.testing.assert_close(out[row], weights @ values[:visible])
    # Recall telemetry samples the real row (its own key at its verify location): every block is held.
    stats = backend.stats.snapshot()
    assert stats["recall_samples"] == 1 and stats["recall_mean_ppm"] == 1_000_000
    assert stats["lookahead_agreement_ppm"] == 1_000_000


def test_a_request_whose_kv_arrived_from_a_prefill_node_is_summarised_and_admitted_at_decode() -> None:
    """PD decode: the prompt's KV is in the pool but this backend never ran its extend. The first decode
    step catches the summaries up from the pool, attends densely (nothing selected yet) and makes the
    admission selection with its query; the next step is an ordinary decode step."""
    pool = TinyKVPool(64)
    backend = _backend(pool)
    prompt = 4 * BLOCK + 1  # written by the prefill node: four full blocks and one tail token
    for block in range(4):
        pool.k[block * BLOCK : (block + 1) * BLOCK, 0] = (
            DIRECTIONS[block] * torch.linspace(1, 2, BLOCK)[:, None]
        )
    pool.k[prompt - 1, 0] = torch.tensor([0.3, 0.1])
    pool.v[:prompt, 0] = torch.randn(prompt, DIM)
    backend.req_to_token_pool.req_to_token[0, : prompt + 2] = torch.arange(prompt + 2, dtype=torch.int32)
    backend.req_to_token_pool.req_generation[0] = 5
    layer = _layer()

    def decode(position: int, query: torch.Tensor) -> torch.Tensor:
        batch = _decode_batch([0], [position + 1], [position])
        backend.begin_batch(ForwardMode.DECODE, [0], [position + 1], None)
        k, v = torch.tensor([[0.2, 0.2]]), torch.randn(1, DIM)
        out = backend.forward_decode(query[None], k, v, layer, batch)
        backend.selector.finish_pending()
        return out[0]

    q = DIRECTIONS[2] * 10  # points at block 2
    out = decode(prompt, q)

    assert backend.slots.holds(0, 5) and backend.stats.snapshot()["arrived_requests"] == 1
    kmin, kmax = build_block_summaries(pool.k[: prompt + 1], BLOCK)
    torch.testing.assert_close(backend.summaries.kmin[0, : kmin.shape[0]], kmin)
    torch.testing.assert_close(backend.summaries.kmax[0, : kmax.shape[0]], kmax)
    dense = torch.softmax(pool.k[: prompt + 1, 0] @ q, dim=0) @ pool.v[: prompt + 1, 0]
    torch.testing.assert_close(out, dense)  # the first step attends every token
    assert backend.working_sets.slot_block[0, 0, 0].tolist() == [2], (
        "admission selected by the real summaries"
    )

    decode(prompt + 1, DIRECTIONS[1] * 10)  # an ordinary step: no second admission
    assert backend.stats.snapshot()["arrived_requests"] == 1 and not backend.batch.admission


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY])
def test_a_remotely_fetched_arrival_starts_from_the_prefill_selection(mode: ForwardMode) -> None:
    """PD with remote partial fetching: the first working set is the prefill node's selection (no dense
    step, no catch-up), whether the first forward is a decode (its seq_len counts the token it computes)
    or a verify (it does not); a staged length that does not match the prompt fails the request."""
    from sglang_oasis.disaggregation.decode_admission import Arrival

    pool = TinyKVPool(64)
    backend = _backend(pool, top_k=2)
    prompt = 4 * BLOCK + 1
    backend.req_to_token_pool.req_to_token[:2, : prompt + 2] = torch.arange(prompt + 2, dtype=torch.int32)
    backend.req_to_token_pool.req_generation[:2] = torch.tensor([5, 6])
    selection = torch.tensor([[[False, True, False, True]]])  # [layers, kv heads, full blocks]
    pinned = torch.tensor([[[False, False, False, True]]])  # the prefill window keeps block 3
    arrivals = {0: Arrival(5, selection, prompt, pinned), 1: Arrival(6, selection, prompt + 1)}
    backend.pd.remote = SimpleNamespace(take_arrival=lambda slot, generation: arrivals.pop(slot, None))
    seq_len = prompt + (1 if mode == ForwardMode.DECODE else 0)

    def arrive(slot: int) -> None:
        backend.begin_batch(mode, [slot], [seq_len], None)

    arrive(0)
    assert not backend.batch.admission, "no dense first step for the fetched request"
    assert backend.intake.summarised[0, 0] == prompt and backend.working_sets.covered[0, 0] == 4
    assert sorted(backend.working_sets.slot_block[0, 0, 0].tolist()) == [1, 3]
    assert backend.pinned[0, 0, 0].tolist() == [3], "the prefill window's pins arrive with the hand-off"
    assert torch.equal(backend.pd.admission_pins(0, prompt), pinned)
    assert backend.failures.take(0, 5) is None
    arrive(1)
    assert backend.failures.take(1, 6) is not None, "a mismatched hand-off fails its request"


@pytest.mark.parametrize(
    ("window", "keep", "first", "later"), [(0, 0.5, 0, 0), (1, 0.0, 1, 0), (3, 1.0, 1, 1)]
)
def test_the_prefill_window_chooses_the_first_working_set_by_exact_attention(
    window: int, keep: float, first: int, later: int
) -> None:
    """Block 0's keys spread over a wide box whose corner the query points at, though no key in it
    does (q . k = 0); block 1's keys point along the query. The min/max bound ranks block 0 first, the
    window's exact attention mass block 1; block 2 (small keys) neither. K = 1. At the next decode step
    the summaries would pick block 0 again, unless the window's block stays pinned (--oasis-window-keep)."""
    pool = TinyKVPool(64)
    backend = _backend(pool, prefill_window=window, window_keep=keep)
    seq_len = 3 * BLOCK + 1
    pool.k[0:BLOCK:2, 0] = torch.tensor([5.0, -5.0])
    pool.k[1:BLOCK:2, 0] = torch.tensor([-5.0, 5.0])
    pool.k[BLOCK : 2 * BLOCK, 0] = torch.tensor([1.0, 1.0])
    pool.k[2 * BLOCK : seq_len + 1, 0] = 0.1
    backend.req_to_token_pool.req_to_token[0, : seq_len + 1] = torch.arange(seq_len + 1, dtype=torch.int32)
    layer = _layer()
    backend.slots.claim(0, 0)
    backend.set_batch([0], admission=True)
    backend.intake.catch_up(backend.batch, 0, torch.tensor([seq_len]))
    q_rows = torch.tensor([1.0, 1.0]).expand(seq_len, 1, DIM) * 2  # the prompt's queries, last row last
    prior = backend.selector.window.prior(backend.batch, layer, q_rows, [seq_len - 1], [seq_len], [seq_len])
    assert (prior is None) == (window == 0)
    backend.selector.select(backend.batch, 0, q_rows[-1:], [seq_len], prior)
    backend.selector.finish_pending()
    assert backend.working_sets.slot_block[0, 0, 0].tolist() == [first]

    backend.set_batch([0], admission=False)  # a decode step, its query the same
    backend.selector.select(backend.batch, 0, q_rows[-1:], [seq_len + 1])
    backend.selector.finish_pending()
    assert backend.working_sets.slot_block[0, 0, 0].tolist() == [later]


def test_a_dense_first_step_arrival_leaves_the_rest_of_its_batch_as_it_would_be_alone() -> None:
    """PD decode: an arrival without a hand-off (a retracted request resumed in a new row) takes the dense
    first step with an uncapped admission selection. Another request decoding in the same batch must get
    exactly the step it would get alone: its capped plan, its top-K and the prefill window's pins (before
    the fix the whole batch was an admission: the window's pins were cleared and the cap lifted)."""
    from sglang_oasis.disaggregation.decode_admission import Arrival

    prompt, late = 4 * BLOCK + 1, 2 * BLOCK + 1  # request 0 (handed over), request 1 (no hand-off)
    layer = _layer()

    def run(with_arrival: bool) -> tuple[list[int], list[int], int, torch.Tensor]:
        pool = TinyKVPool(64)
        for block in range(4):
            pool.k[block * BLOCK : (block + 1) * BLOCK, 0] = (
                DIRECTIONS[block] * torch.linspace(1, 2, BLOCK)[:, None]
            )
        pool.k[32 : 32 + late, 0] = torch.linspace(-1, 1, late)[:, None]
        pool.v[:48, 0] = torch.linspace(0, 1, 96).view(48, DIM)
        backend = _backend(pool, top_k=2, fetch_ratio=0.5)  # a cap of one block per step
        table = backend.req_to_token_pool.req_to_token
        table[0, : prompt + 2] = torch.arange(prompt + 2, dtype=torch.int32)
        table[1, : late + 1] = torch.arange(32, 32 + late + 1, dtype=torch.int32)
        backend.req_to_token_pool.req_generation[:2] = torch.tensor([5, 6])
        selection = torch.tensor([[[False, True, False, True]]])  # blocks 1 and 3; the window pins 3
        arrivals = {0: Arrival(5, selection, prompt, torch.tensor([[[False, False, False, True]]]))}
        backend.pd.remote = SimpleNamespace(take_arrival=lambda slot, generation: arrivals.pop(slot, None))
        backend.begin_batch(ForwardMode.DECODE, [0], [prompt + 1], None)  # request 0's first step, alone
        reqs, seq_lens, locs = [0], [prompt + 2], [prompt + 1]
        if with_arrival:
            reqs, seq_lens, locs = [0, 1], [prompt + 2, late + 1], [prompt + 1, 32 + late]
        backend.begin_batch(ForwardMode.DECODE, reqs, seq_lens, None)
        batch = _decode_batch(reqs, seq_lens, locs)
        q = torch.stack([(DIRECTIONS[0] + DIRECTIONS[2]) * 10, DIRECTIONS[1]])[: len(reqs)]
        out = backend.forward_decode(
            q, torch.full((len(reqs), DIM), 0.1), torch.ones(len(reqs), DIM), layer, batch
        )
        backend.selector.finish_pending()
        slot = backend.tier.slot_of(0)
        held = sorted(backend.working_sets.slot_block[slot, 0, 0].tolist())
        pins = backend.pinned[slot, 0, 0].tolist()
        return held, pins, int(backend.working_sets.top_k[slot, 0]), out[0]

    alone, batched = run(False), run(True)
    assert alone[1] == [3] and batched[1] == alone[1], "the window's pin of request 0 survives the arrival"
    assert batched[0] == alone[0], "request 0's plan is capped as alone (one new block, pinned 3 kept)"
    assert batched[2] == alone[2] == 2
    torch.testing.assert_close(batched[3], alone[3], rtol=0, atol=0)


@pytest.mark.parametrize("step", ["eager", "captured"])
@pytest.mark.parametrize("redo", [False, True])
def test_a_retracted_pd_request_resumes_on_the_path_it_was_on(redo: bool, step: str) -> None:
    """PD decode: SGLang backs a retracted request's KV up, frees its row and later resumes it in a new
    row with the same KV at new locations. With its selection state kept (hook 7 at the backup, restored
    when it reappears by rid) each step after the resume must equal, bit for bit, the step the request
    takes when it is never retracted: the same output and the same working sets. ``redo``: SGLang
    dropped the token of the request's last forward (overlap scheduling: retracted before that
    forward's result was processed) and redoes that step, which must then start from the tables as they
    were before it (seen on a server: the redone step saw the working sets it had already moved on to).
    Before, the resume was a new arrival: a dense first step and a fresh uncapped selection.

    ``captured`` (``--oasis-decode-step captured``, both backends): the PD arrival's dense first step runs
    eagerly (an admission), every later pass, the resumed request's first included, through the program,
    with no host sync in it (the guard wraps each call); the resume's restored pages reach the summaries
    in the host plan (before, the captured pass skipped that catch-up and the step left the path)."""
    prompt, steps_before, steps_after = 6 * BLOCK + 1, 3, 4
    layer = _layer()
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(prompt + steps_before + steps_after, DIM, generator=gen) * 3
    values = torch.randn(len(keys), DIM, generator=gen)
    queries = torch.randn(len(keys), DIM, generator=gen) * 4

    def backend_with_request() -> OasisAttnBackend:
        pool = TinyKVPool(64)
        pool.k[:prompt, 0], pool.v[:prompt, 0] = keys[:prompt], values[:prompt]
        backend = _backend(
            pool, top_k=2, fetch_ratio=0.5, decode_step=step
        )  # K = 2 of 6 blocks, 1 load a step
        backend.req_to_token_pool.req_to_token[0, :40] = torch.arange(40, dtype=torch.int32)
        backend.req_to_token_pool.req_generation[0] = 5  # arrives without a hand-off: a dense first step
        if backend.captured is not None:
            backend.captured.program = guarded
        return backend

    def decode(
        backend: OasisAttnBackend, row: int, position: int
    ) -> tuple[torch.Tensor, tuple[list[int], int]]:
        loc = int(backend.req_to_token_pool.req_to_token[row, position])
        backend.begin_batch(ForwardMode.DECODE, [row], [position + 1], None, ["rid-0"])
        batch = _decode_batch([row], [position + 1], [loc])
        k, v = keys[position][None], values[position][None]
        out = backend.forward_decode(queries[position][None], k, v, layer, batch)
        backend.selector.finish_pending()
        slot, sets = backend.tier.slot_of(row), backend.working_sets
        return out[0], (sorted(sets.slot_block[slot, 0, 0].tolist()), int(sets.covered[slot, 0]))

    programs = [0]

    def guarded(*args: Any) -> Any:  # the compiled program's stand-in: decode_layer, with no host sync
        programs[0] += 1
        with SyncGuard():
            return decode_layer(*args)

    never, retracted = backend_with_request(), backend_with_request()
    alone = {position: decode(never, 0, position) for position in range(prompt, len(keys))}
    for position in range(prompt, prompt + steps_before):
        decode(retracted, 0, position)
    # SGLang retracts row 0: its prompt and output tokens (one more than its KV: the last output's KV is
    # the next step's), or with `redo` one fewer (the last forward's token dropped); backup; row freed
    # (its generation moves on); other requests run meanwhile.
    tokens = prompt + steps_before + (0 if redo else 1)
    getattr(retracted.req_to_token_pool, RETRACT_LISTENER)(0, "rid-0", tokens, True)  # hook 7 at the backup
    retracted.req_to_token_pool.req_generation[0] = 9
    retracted.step += 5
    committed = tokens - 1  # what the backup holds, restored at new pages (the page size is the block size)
    pool, new_locs = retracted.token_to_kv_pool, torch.arange(9 * BLOCK, 17 * BLOCK, dtype=torch.int32)
    moved = new_locs[:committed].long()
    pool.k[moved], pool.v[moved] = pool.k[:committed].clone(), pool.v[:committed].clone()
    retracted.req_to_token_pool.req_to_token[1, : len(new_locs)] = new_locs
    retracted.req_to_token_pool.req_generation[1] = 7
    assert retracted.stats.snapshot()["retracted_requests"] == 1
    captured = []
    for position in range(committed, len(keys)):
        before = retracted.stats.snapshot()["captured_decode_passes"]
        out, state = decode(retracted, 1, position)
        captured.append(retracted.stats.snapshot()["captured_decode_passes"] - before)
        torch.testing.assert_close(out, alone[position][0], rtol=0, atol=0)
        assert state == alone[position][1], f"position {position}: the working sets left the path"
    stats = retracted.stats.snapshot()
    assert stats["resumed_requests"] == 1 and stats["arrived_requests"] == 1, "resumed, not a new arrival"
    if step == "captured":  # the resume's pass and most others through the guarded program
        assert captured[0] == 1 and sum(captured) >= len(captured) - 1, captured
        assert (
            programs[0] == stats["captured_decode_passes"] + never.stats.snapshot()["captured_decode_passes"]
        )
    # The resume's loads are decode loads, in the counters and in the request's own figures (before, only
    # in blocks_loaded): outside the decode counters, both servers loaded the same (the first admission).
    alone_stats = never.stats.snapshot()
    assert stats["blocks_loaded"] > alone_stats["blocks_loaded"]
    assert (
        stats["blocks_loaded"] - stats["decode_blocks_loaded"]
        == alone_stats["blocks_loaded"] - alone_stats["decode_blocks_loaded"]
    )
    figures = retracted.stats.requests.take("rid-0")
    assert figures is not None and figures["decode_blocks_loaded"] == stats["decode_blocks_loaded"]


def test_a_pd_request_retracted_before_its_first_step_resumes_from_its_hand_off() -> None:
    """Retracted between its commit and its first decode step, a request holds no slot yet but holds the
    prefill node's hand-off: it is kept, and the resumed request starts from it as it would have (not a
    dense first step with a new admission)."""
    from sglang_oasis.disaggregation.decode_admission import Arrival

    prompt = 4 * BLOCK + 1
    layer = _layer()
    gen = torch.Generator().manual_seed(5)
    keys, values = (
        torch.randn(prompt + 1, DIM, generator=gen) * 3,
        torch.randn(prompt + 1, DIM, generator=gen),
    )
    query = torch.randn(DIM, generator=gen) * 4

    def first_step(retract: bool) -> tuple[torch.Tensor, list[int]]:
        pool = TinyKVPool(64)
        backend = _backend(pool, top_k=2)
        table, generations = backend.req_to_token_pool.req_to_token, backend.req_to_token_pool.req_generation
        table[0, : prompt + 1] = torch.arange(prompt + 1, dtype=torch.int32)
        table[1, : prompt + 1] = torch.arange(9 * BLOCK, 9 * BLOCK + prompt + 1, dtype=torch.int32)
        generations[:2] = torch.tensor([5, 7])
        selection = torch.tensor([[[False, True, False, True]]])  # not what the step's query would pick
        arrivals = {0: Arrival(5, selection, prompt)}
        backend.pd.remote = SimpleNamespace(take_arrival=lambda row, g: arrivals.pop(row, None))
        first = table[0, : prompt + 1].long()  # where the KV and its summaries arrived (as fetched at commit)
        pool.k[first, 0], pool.v[first, 0] = keys, values
        backend.summaries.update(0, first[:-1], pool.k[first[:-1]])
        row = 0
        if retract:  # backed up in row 0, resumed in row 1 with the same KV
            getattr(backend.req_to_token_pool, RETRACT_LISTENER)(0, "rid-0", prompt, True)
            row = 1
        locs = table[row, : prompt + 1].long()
        pool.k[locs, 0], pool.v[locs, 0] = keys, values
        backend.begin_batch(ForwardMode.DECODE, [row], [prompt + 1], None, ["rid-0"])
        batch = _decode_batch([row], [prompt + 1], locs[-1:])
        out = backend.forward_decode(query[None], keys[-1:], values[-1:], layer, batch)
        backend.selector.finish_pending()
        figures = backend.stats.requests.take("rid-0")  # the hand-off's loads: the request's admission
        assert figures is not None and figures["admission_blocks_loaded"] == 2, figures
        return out[0], sorted(backend.working_sets.slot_block[backend.tier.slot_of(row), 0, 0].tolist())

    alone, resumed = first_step(False), first_step(True)
    torch.testing.assert_close(resumed[0], alone[0], rtol=0, atol=0)
    assert resumed[1] == alone[1]


class _Request:
    """One request's random keys, values and queries at every position, driven through a backend's extend
    and decode passes on layer 0 (rows 0 and 1 of ``_retraction_backend``); ``rid`` and ``key`` are
    what SGLang's forward batch and hook 9 would hand the backend."""

    def __init__(self, total: int, seed: int, rid: str = "rid-0") -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.keys = torch.randn(total, DIM, generator=self.gen) * 3
        self.values = torch.randn(total, DIM, generator=self.gen)
        self.queries = torch.randn(total, DIM, generator=self.gen) * 4
        self.layer = _layer()
        self.rid, self.key = rid, rid

    def extend(
        self,
        backend: OasisAttnBackend,
        row: int,
        length: int,
        recomputed: int = 0,
        start: int = 0,
        last: int = 1,
    ) -> torch.Tensor:
        """Positions ``[start, length)`` after a prefix of ``start`` (an earlier chunk's). ``recomputed``:
        positions from there on get other K and V than the decode steps had, but the ``last`` one (the
        redone step: computed here as the decode step would compute it; 0 for an earlier chunk)."""
        locs = backend.req_to_token_pool.req_to_token[row, start:length].long()
        k, v = self.keys[:length].clone(), self.values[:length].clone()
        if recomputed:
            k[recomputed : length - last] += torch.randn(length - last - recomputed, DIM, generator=self.gen)
            v[recomputed : length - last] += torch.randn(length - last - recomputed, DIM, generator=self.gen)
        new = length - start
        backend.begin_batch(ForwardMode.EXTEND, [row], [length], [start], [self.rid], None, [self.key])
        batch = SimpleNamespace(
            forward_mode=ForwardMode.EXTEND, req_pool_indices=torch.tensor([row]), seq_lens=torch.tensor([length]),
            out_cache_loc=locs, extend_prefix_lens=torch.tensor([start]), extend_seq_lens=torch.tensor([new]),
            extend_prefix_lens_cpu=[start], extend_seq_lens_cpu=[new], encoder_lens=None,
        )  # fmt: skip
        out = backend.forward_extend(self.queries[start:length], k[start:], v[start:], self.layer, batch)
        backend.selector.finish_pending()
        return out[-1]

    def decode(self, backend: OasisAttnBackend, row: int, position: int) -> torch.Tensor:
        loc = backend.req_to_token_pool.req_to_token[row, position : position + 1].long()
        backend.begin_batch(ForwardMode.DECODE, [row], [position + 1], None, [self.rid], None, [self.key])
        batch = _decode_batch([row], [position + 1], loc)
        q, k, v = self.queries[position][None], self.keys[position][None], self.values[position][None]
        out = backend.forward_decode(q, k, v, self.layer, batch)
        backend.selector.finish_pending()
        return out[0]


def _retraction_backend() -> OasisAttnBackend:
    backend = _backend(TinyKVPool(96), top_k=2, fetch_ratio=0.5)  # K = 2, one load per step
    table = backend.req_to_token_pool.req_to_token
    table[0, :48] = torch.arange(48, dtype=torch.int32)
    table[1, :48] = torch.arange(48, 96, dtype=torch.int32)  # a new row's pages
    return backend


def _state(backend: OasisAttnBackend, row: int) -> tuple[list[int], int]:
    slot = backend.tier.slot_of(row)
    sets = backend.working_sets
    return sorted(sets.slot_block[slot, 0, 0].tolist()), int(sets.covered[slot, 0])


@pytest.mark.parametrize(("redo", "chunked"), [(False, False), (True, False), (False, True)])
def test_a_retracted_request_re_prefilled_goes_on_as_it_would_have(redo: bool, chunked: bool) -> None:
    """Without PD, SGLang frees a retracted request's KV and later re-prefills its prompt and output in a
    new row. With its selection state kept (hook 8 at the release), the extend that reaches its length
    loads the kept working sets from the pages it just wrote and its last row attends as the decode step
    the request would have taken: that row, the next working sets and every later step equal the
    never-retracted request's, bit for bit. The re-prefill's K and V of the output positions here differ
    from the decode steps' (a real extend computes them by dense attention): the kept ones are put back
    (``retracted_kv.py``), also when chunked prefill splits the re-prefill after an output position (the
    first chunk, an ordinary admission, writes some of them). Before, the last row attended densely and
    the working sets were chosen afresh; then the recomputed K and V stood (then an earlier chunk's)."""
    prompt, steps_before, steps_after = 6 * BLOCK + 1, 3, 4
    total = prompt + steps_before + 1 + steps_after
    request = _Request(total, seed=11)
    never, retracted = _retraction_backend(), _retraction_backend()
    request.extend(never, 0, prompt)
    alone = {}
    for position in range(prompt, total):
        alone[position] = request.decode(never, 0, position), _state(never, 0)
    request.extend(retracted, 0, prompt)
    for position in range(prompt, prompt + steps_before):
        request.decode(retracted, 0, position)
    # Retracted now: its output holds one token more than its KV (the next step would compute it), or
    # with `redo` as many (the last forward's token dropped: its step is redone).
    tokens = prompt + steps_before + (0 if redo else 1)
    getattr(retracted.req_to_token_pool, RETRACT_LISTENER)(0, "rid-0", tokens, False)  # hook 8 at the release
    retracted.req_to_token_pool.req_generation[0] += 1  # SGLang freed the row
    retracted.step += 3  # other requests decoded meanwhile
    assert retracted.stats.snapshot()["retracted_requests"] == 1
    # The extend's own row for the redone step (tokens - 1) is computed afresh, as the step would be.
    if chunked:  # the first chunk ends after the first output position (its K and V recomputed too)
        request.extend(retracted, 1, prompt + 2, recomputed=prompt, last=0)
        assert retracted.stats.snapshot()["resumed_requests"] == 0  # not yet: an admission
    redone = request.extend(retracted, 1, tokens, recomputed=prompt, start=prompt + 2 if chunked else 0)
    assert retracted.stats.snapshot()["resumed_kv_tokens"] == tokens - 1 - prompt
    torch.testing.assert_close(redone, alone[tokens - 1][0], rtol=0, atol=0)
    assert _state(retracted, 1) == alone[tokens - 1][1], "the re-prefill's selection left the path"
    for position in range(tokens, total):
        torch.testing.assert_close(request.decode(retracted, 1, position), alone[position][0], rtol=0, atol=0)
        assert _state(retracted, 1) == alone[position][1], (
            f"position {position}: the working sets left the path"
        )
    assert retracted.stats.snapshot()["resumed_requests"] == 1


def test_a_new_request_with_a_retracted_requests_rid_answers_as_alone() -> None:
    """A retracted request SGLang never resumes (aborted while it waited) leaves its kept state behind; a
    new request with the same (client-chosen) rid and the length the old one would have been re-prefilled
    to must not get it. Hooks 8 and 9 as SGLang calls them: the kept state is found by a key stamped on
    the retracted request object, which the new request does not carry. Before, it was found by rid: the
    new request resumed the old one's working sets and decode K and V. The stamped request still resumes."""
    prompt, steps = 6 * BLOCK + 1, 3
    tokens, total = prompt + steps + 1, prompt + steps + 6
    old, new = _Request(total, seed=12, rid="same"), _Request(total, seed=13, rid="same")
    backend, fresh = _retraction_backend(), _retraction_backend()
    old.extend(backend, 0, prompt)
    for position in range(prompt, prompt + steps):
        old.decode(backend, 0, position)
    retracted = SimpleNamespace(
        rid="same", kv=SimpleNamespace(req_pool_idx=0), origin_input_ids=[0] * prompt, output_ids=[0] * (steps + 1),
        sampling_params=SimpleNamespace(custom_params=None), finished=lambda: False,
    )  # fmt: skip
    keep_retracted(backend.req_to_token_pool, retracted, backed_up=False)  # hook 8 at the release
    backend.req_to_token_pool.req_generation[0] += 1  # SGLang freed the row; the request is aborted
    assert backend.stats.snapshot()["retracted_requests"] == 1

    def noted(req: SimpleNamespace) -> str | None:
        """The key hook 9 hands the backend for ``req``, as SGLang builds its forward batch."""
        hooks.carry_request_params(lambda cls, batch: None, None, SimpleNamespace(reqs=[req]))
        return retraction_keys([req.rid])[0]  # type: ignore[index]

    arriving = SimpleNamespace(rid="same", sampling_params=SimpleNamespace(custom_params=None))
    new.key = noted(arriving)  # type: ignore[assignment]
    assert new.key is None and noted(retracted) is not None
    outputs = [new.extend(backend, 1, tokens)]
    expected = [new.extend(fresh, 0, tokens)]
    for position in range(tokens, total):
        outputs.append(new.decode(backend, 1, position))
        expected.append(new.decode(fresh, 0, position))
    torch.testing.assert_close(torch.stack(outputs), torch.stack(expected), rtol=0, atol=0)
    assert (
        backend.stats.snapshot()["resumed_requests"] == 0
        and backend.stats.snapshot()["resumed_kv_tokens"] == 0
    )


def test_an_extend_mixing_a_re_prefilled_request_with_new_ones_selects_each_part() -> None:
    """A re-prefilled retracted request (not an admission) in one extend with a shorter new request: the
    prefill window's prior spans the batch's widest request; the new request's admission uses its own
    blocks of it, the resumed request a decode step's selection (seen on a server: the prior's width
    did not match the admission part's blocks and every selection job of the batch failed)."""
    pool = TinyKVPool(64)
    backend = _backend(pool, top_k=1, prefill_window=2)
    long, short = 6 * BLOCK + 1, 2 * BLOCK + 1
    table = backend.req_to_token_pool.req_to_token
    table[0, :long], table[1, :short] = torch.arange(long), torch.arange(32, 32 + short)
    pool.k[:, 0] = torch.randn(pool.k.shape[0], DIM, generator=torch.Generator().manual_seed(2))
    for row in (0, 1):
        backend.slots.claim(row, 0)
    backend.set_batch([0, 1], admission=torch.tensor([False, True]))
    backend.intake.catch_up(backend.batch, 0, torch.tensor([long, short]))
    prior = torch.zeros((2, 1, long // BLOCK))
    prior[1, 0, 1] = 1.0  # the window's attention points at the new request's block 1
    backend.selector.select(backend.batch, 0, torch.randn(2, 1, DIM), [long, short], prior)
    backend.selector.finish_pending()
    assert backend.failures.take(0, 0) is None and backend.failures.take(1, 0) is None
    assert 1 in backend.working_sets.slot_block[backend.tier.slot_of(1), 0, 0].tolist()


def test_a_requests_own_top_k_takes_the_steps_of_a_server_with_that_k() -> None:
    """``custom_params`` ``oasis_top_k`` (request_options.py): a request asking for K = 4 on a server of
    K = 2 (that lets requests take up to 4) takes the decode steps a server of K = 4 takes: the same
    working sets after every step, its fetch cap ceil(0.5 x 4) = 2 blocks rather than the server's 1,
    and the same output (up to summation order: its working set's slots may sit in another order). A K
    beyond what the server reserves fails the request, naming the option."""
    prompt, steps = 10 * BLOCK + 1, 8
    layer = _layer()
    gen = torch.Generator().manual_seed(11)
    keys = torch.randn(prompt + steps, DIM, generator=gen) * 3
    values = torch.randn(len(keys), DIM, generator=gen)
    queries = torch.randn(len(keys), DIM, generator=gen) * 4

    def run(server_k: int, params: list | None, **config: int) -> tuple[list, OasisAttnBackend]:
        pool = TinyKVPool(64)
        pool.k[:prompt, 0], pool.v[:prompt, 0] = keys[:prompt], values[:prompt]
        backend = _backend(pool, top_k=server_k, fetch_ratio=0.5, **config)
        backend.req_to_token_pool.req_to_token[0, :60] = torch.arange(60, dtype=torch.int32)
        backend.req_to_token_pool.req_generation[0] = 5  # arrives without a hand-off: a dense first step
        trace = []
        for position in range(prompt, len(keys)):
            backend.begin_batch(ForwardMode.DECODE, [0], [position + 1], None, None, params)
            batch = _decode_batch([0], [position + 1], [position])
            k, v = keys[position][None], values[position][None]
            out = backend.forward_decode(queries[position][None], k, v, layer, batch)
            backend.selector.finish_pending()
            slot, sets = backend.tier.slot_of(0), backend.working_sets
            trace.append((out[0], sorted(sets.slot_block[slot, 0, 0].tolist()), int(sets.top_k[slot, 0])))
        return trace, backend

    asked, _ = run(2, [{"oasis_top_k": 4}], recall_max_top_k=4)
    server, _ = run(4, None)
    for position, ((out, held, k), (ref_out, ref_held, ref_k)) in enumerate(zip(asked, server, strict=True)):
        assert held == ref_held and k == ref_k == 4, f"step {position}: {held} vs {ref_held}"
        torch.testing.assert_close(out, ref_out)
    assert [held for _, held, _ in run(2, None)[0]] != [held for _, held, _ in server]  # K matters here
    _, refused = run(2, [{"oasis_top_k": 5}], recall_max_top_k=4)
    message = refused.failures.take(0, 5)
    assert message is not None and "oasis_top_k=5: must be an integer from 1 to 4" in message


def test_a_working_set_a_recall_target_grew_fills_at_the_pace_of_its_new_k() -> None:
    """The fetch cap is ``--oasis-fetch-ratio`` x the working set's top-K at the layer: when a recall target
    doubles K = 2 to 8, the next step may load ceil(0.5 x 8) = 4 missing blocks per head, not the
    server's ceil(0.5 x 2) = 1 (before, a grown working set took one block per step to fill)."""
    prompt = 10 * BLOCK + 1
    layer = _layer()
    gen = torch.Generator().manual_seed(12)
    keys = torch.randn(prompt + 2, DIM, generator=gen) * 3
    values = torch.randn(len(keys), DIM, generator=gen)
    pool = TinyKVPool(64)
    pool.k[:prompt, 0], pool.v[:prompt, 0] = keys[:prompt], values[:prompt]
    backend = _backend(pool, top_k=2, fetch_ratio=0.5, recall_max_top_k=8)
    backend.req_to_token_pool.req_to_token[0, :60] = torch.arange(60, dtype=torch.int32)
    backend.req_to_token_pool.req_generation[0] = 5  # arrives without a hand-off: a dense first step
    loaded, held = [], []
    for position in range(prompt, prompt + 2):
        backend.begin_batch(ForwardMode.DECODE, [0], [position + 1], None)
        batch = _decode_batch([0], [position + 1], [position])
        query = torch.ones(1, DIM) * 4  # the same query both steps: the selection changes only by K
        backend.forward_decode(query, keys[position][None], values[position][None], layer, batch)
        backend.selector.finish_pending()
        loaded.append(backend.stats.snapshot()["decode_blocks_loaded"])
        slot = backend.tier.slot_of(0)
        held.append(int((backend.working_sets.slot_block[slot, 0, 0] >= 0).sum()))
        assert int(backend.working_sets.top_k[slot, 0]) == (2 if position == prompt else 8)
        backend.working_sets.top_k[slot, 0] = 8  # what RecallProbe.hold_target does twice below target
    assert loaded[1] - loaded[0] == 4, loaded  # 1 with the server's cap
    assert held[1] == held[0] + 4, held
