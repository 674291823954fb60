"""``SparseAttention``'s tails on constructed cases: a row whose tail the active blocks hold attends it
from there; a PD arrival's dense first step (a tail longer than they hold) reads the host tier, in a call
of its own so that the batch's other rows are not padded to its whole context (issue 25 item 7); a
request's attention reads the same keys in the same shape alone or in any batch (issue 25 item 13), its
working set up to its own last occupied slot whatever the batch's others hold."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_oasis.attention import sparse_attention
from sglang_oasis.attention.batch_view import BatchView
from sglang_oasis.attention.sparse_attention import SparseAttention, slot_spans
from sglang_oasis.memory.device_layout import TierShape, layout
from sglang_oasis.memory.device_tier import DeviceTier
from sglang_oasis.stats import OasisStats

BLOCK, HEADS, DIM, Q_HEADS = 4, 2, 3, 4


class Pool:
    head_num, head_dim, layer_num = HEADS, DIM, 1

    def __init__(self, gen: torch.Generator) -> None:
        self.k = torch.randn(64, HEADS, DIM, generator=gen)
        self.v = torch.randn(64, HEADS, DIM, generator=gen)

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """``[q_heads, dim]`` dense attention of one token over ``keys``/``values`` ``[T, kv_heads, dim]``."""
    group = Q_HEADS // HEADS
    k, v = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    weights = torch.softmax(torch.einsum("hd,thd->ht", q, k) * scale, dim=-1)
    return torch.einsum("ht,thd->hd", weights, v)


def recorded(monkeypatch: pytest.MonkeyPatch, arg: int, dim: int) -> list[int]:
    """Record ``shape[dim]`` of argument ``arg`` of every ``headwise_decode_attention`` call."""
    seen: list[int] = []
    real = sparse_attention.ops.headwise_decode_attention

    def recording(*args: torch.Tensor) -> torch.Tensor:
        seen.append(args[arg].shape[dim])
        return real(*args)

    monkeypatch.setattr(sparse_attention.ops, "headwise_decode_attention", recording)
    return seen


def decode_rows(
    attention: SparseAttention,
    pool: Pool,
    q: torch.Tensor,
    rows: list[int],
    seq_lens: list[int],
    new: list[int],
) -> torch.Tensor:
    """A decode step of request ``rows`` (of requests 0 and 1: ``seq_lens`` with the step's token, whose
    K and V sit at pool location ``new``), no admission."""
    index = torch.tensor(rows)
    batch = BatchView(
        rows, index, index, [0] * len(rows), step=1, admitting=torch.zeros(len(rows), dtype=torch.bool)
    )
    locs = torch.tensor(new)[index]
    layer = SimpleNamespace(layer_id=0, scaling=0.5)
    return attention.decode(batch, q[index], layer, torch.tensor(seq_lens)[index], pool.k[locs], pool.v[locs])


def _setup(gen: torch.Generator) -> tuple[SparseAttention, Pool]:
    shape = TierShape(1, HEADS, DIM, 4, host_pages=18, block_size=BLOCK, slots_per_head=2, window_blocks=0,
                      active_tokens=BLOCK)  # fmt: skip
    tier = DeviceTier(shape, layout(10**9, shape, max_request_slots=2), torch.float32, "cpu")
    pool = Pool(gen)
    req_to_token = torch.zeros(2, 64, dtype=torch.int32)
    req_to_token[0, :10] = torch.arange(40, 50, dtype=torch.int32)  # request 0: 10 tokens at 40..49
    req_to_token[1, :30] = torch.arange(30, dtype=torch.int32)  # request 1 (an arrival): 30 tokens at 0..29
    attention = SparseAttention(
        tier, SimpleNamespace(req_to_token=req_to_token), pool, BLOCK, OasisStats(None, False)
    )
    # Request 0 covers 2 blocks and its active blocks hold position 8 (its tail); the working sets are
    # empty, so each row attends its tail and its new token only. Request 1 covers nothing yet.
    tier.working_sets.covered[0, 0] = 2
    tier.active.store(
        0, torch.tensor([0]), torch.tensor([8]), torch.tensor([9]), pool.k[48:49], pool.v[48:49]
    )
    return attention, pool


def test_a_dense_first_step_attends_apart_from_the_rest_of_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(0)
    attention, pool = _setup(gen)
    batch = BatchView(
        [0, 1],
        torch.tensor([0, 1]),
        torch.tensor([0, 1]),
        [0, 0],
        step=1,
        admitting=torch.ones(2, dtype=torch.bool),
    )
    seq_lens = torch.tensor([10, 30])
    q = torch.randn(2, Q_HEADS, DIM, generator=gen)
    k, v = pool.k[[49, 29]], pool.v[[49, 29]]  # the step's new tokens (positions 9 and 29)
    widths = recorded(monkeypatch, arg=6, dim=1)  # tail_locs: [rows of the call, tail + new tokens]
    out = attention.decode(batch, q, SimpleNamespace(layer_id=0, scaling=0.5), seq_lens, k, v)
    # One call per kind of row; request 0's tail is padded to the active span (its width alone or in
    # any batch), not to request 1's 30 tokens.
    assert sorted(widths) == [attention.active.span, 30]
    torch.testing.assert_close(out[0], reference(q[0], pool.k[48:50], pool.v[48:50], 0.5))
    torch.testing.assert_close(out[1], reference(q[1], pool.k[:30], pool.v[:30], 0.5))
    stats = attention.stats.snapshot()
    assert stats["tail_bytes_host_to_device"] == 29 * HEADS * DIM * 4 * 2  # request 1's tail, K and V


def test_verify_rows_of_a_mixed_batch_equal_each_request_alone() -> None:
    """Verify with 2 rows per request (the real token at ``seq_len``, a draft after it): the batch split
    into a dense-first-step part and the rest gives each request what it gets alone."""
    q = torch.randn(2, 2, Q_HEADS, DIM, generator=torch.Generator().manual_seed(1))
    tree = torch.tril(torch.ones(2, 2, dtype=torch.bool)).expand(2, -1, -1)
    layer = SimpleNamespace(layer_id=0, scaling=0.5)

    def run(rows: list[int]) -> torch.Tensor:
        attention, pool = _setup(torch.Generator().manual_seed(0))
        index = torch.tensor(rows)
        batch = BatchView(
            rows, index, index, [0] * len(rows), step=1, admitting=torch.ones(len(rows), dtype=torch.bool)
        )
        seq_lens = torch.tensor([9, 29])[index]  # committed tokens; the rows sit at seq_len, seq_len + 1
        new = torch.tensor([[49, 50], [29, 30]])[index].flatten()
        return attention.verify(batch, q[index], layer, seq_lens, pool.k[new], pool.v[new], tree[index])

    together = run([0, 1])
    torch.testing.assert_close(together[0], run([0])[0])
    torch.testing.assert_close(together[1], run([1])[0])


def test_a_request_attends_the_same_alone_as_in_a_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy output must not depend on what else runs: request 0 (a 1-token tail) decodes bitwise the
    same alone as beside request 1 (a 3-token tail), in a call of the same width."""
    q = torch.randn(2, Q_HEADS, DIM, generator=torch.Generator().manual_seed(2))
    widths = recorded(monkeypatch, arg=6, dim=1)  # tail_locs: [rows of the call, tail + new tokens]

    def run(rows: list[int]) -> torch.Tensor:
        attention, pool = _setup(torch.Generator().manual_seed(0))
        attention.req_to_token_pool.req_to_token[1, :32] = torch.arange(32, dtype=torch.int32)
        attention.working_sets.covered[1, 0] = 7  # request 1: tail 28..30 held, its new token at 31
        attention.active.store(
            0, torch.tensor([1]), torch.tensor([28]), torch.tensor([31]), pool.k[28:31], pool.v[28:31]
        )
        return decode_rows(attention, pool, q, rows, [10, 32], [49, 31])

    together, alone = run([0, 1]), run([0])
    assert widths[0] == widths[1]  # the batch's call and request 0's own: the same tail width
    assert torch.equal(together[0], alone[0])
    torch.testing.assert_close(together[1], run([1])[0])


def test_slot_spans_reach_each_requests_last_occupied_slot() -> None:
    empty = -1
    slot_rows = torch.tensor(
        [
            [[empty] * 6, [empty] * 6],  # nothing resident: the smallest span
            [[4, empty, empty, empty, empty, empty], [7, 8, 9, empty, empty, empty]],  # 3 on head 1
            [[1, 2, 3, 4, 5, 6], [empty] * 6],  # every slot
        ]
    )
    assert slot_spans(slot_rows, step=2).tolist() == [2, 4, 6]
    assert slot_spans(slot_rows, step=4).tolist() == [4, 4, 6]  # rounded up, at most every slot


def test_a_request_attends_its_own_span_alone_and_beside_a_fuller_working_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Request 0 (no resident block) beside request 1 (both slots of each head full): one call per span,
    and each request's output is bitwise what it gets alone."""
    monkeypatch.setattr(sparse_attention, "SPAN_STEP", 1)
    q = torch.randn(2, Q_HEADS, DIM, generator=torch.Generator().manual_seed(3))
    spans = recorded(monkeypatch, arg=3, dim=2)  # slot_rows: [rows of the call, kv_heads, slots read]

    def run(rows: list[int]) -> torch.Tensor:
        attention, pool = _setup(torch.Generator().manual_seed(0))
        attention.req_to_token_pool.req_to_token[1, :12] = torch.arange(12, dtype=torch.int32)
        sets = attention.working_sets  # request 1 holds blocks 0 and 1 (positions 0..7), tail 8..10
        sets.covered[1, 0] = 2
        sets.slot_block[1, 0] = torch.tensor([[0, 1], [1, 0]])
        for head in range(HEADS):
            for slot, block in enumerate(sets.slot_block[1, 0, head].tolist()):
                sets.k[1, 0, head, slot] = pool.k[block * BLOCK : (block + 1) * BLOCK, head]
                sets.v[1, 0, head, slot] = pool.v[block * BLOCK : (block + 1) * BLOCK, head]
        attention.active.store(
            0, torch.tensor([1]), torch.tensor([8]), torch.tensor([11]), pool.k[8:11], pool.v[8:11]
        )
        return decode_rows(attention, pool, q, rows, [10, 12], [49, 11])

    together = run([0, 1])
    assert sorted(spans) == [1, 2]  # request 0 reads one (empty) slot, request 1 both
    alone = [run([0])[0], run([1])[0]]
    assert torch.equal(together[0], alone[0]) and torch.equal(together[1], alone[1])
    pool = _setup(torch.Generator().manual_seed(0))[1]  # request 1 sees all its 12 tokens: dense
    torch.testing.assert_close(together[1], reference(q[1], pool.k[:12], pool.v[:12], 0.5))
