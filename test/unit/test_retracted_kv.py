"""``retracted_kv``: a retracted request's decode K and V, kept and put back in its re-prefill's rows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_oasis.attention import retracted_kv
from sglang_oasis.attention.retracted_kv import SavedKV, put_back

LAYERS, HEADS, DIM = 3, 2, 5


class Pool:
    """SGLang's KV pool interface as ``SavedKV.of`` reads it: per-layer buffers [tokens, heads, dim]."""

    def __init__(self, size: int) -> None:
        self.layer_num = LAYERS
        self.k = [torch.randn(size, HEADS, DIM) for _ in range(LAYERS)]
        self.v = [torch.randn(size, HEADS, DIM) for _ in range(LAYERS)]

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v[layer]


def test_kept_positions_are_copies_of_the_requests_own_slots() -> None:
    pool = Pool(64)
    row = torch.randperm(64)[:20].to(torch.int32)  # position -> pool slot
    saved = SavedKV.of(pool, row, 7, 15, kept=0, rid="r")
    assert saved is not None and saved.start == 7
    for layer in range(LAYERS):
        assert torch.equal(saved.keys[layer], pool.k[layer][row[7:15].long()])
        assert torch.equal(saved.values[layer], pool.v[layer][row[7:15].long()])
    pool.k[0].zero_()  # SGLang frees and reuses the slots: the copies stay
    assert saved.keys[0].abs().sum() > 0
    assert saved.nbytes == 2 * LAYERS * 8 * HEADS * DIM * 4
    assert SavedKV.of(pool, row, 7, 7, kept=0, rid="r") is None  # retracted right after its prefill


def test_over_the_byte_cap_nothing_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = Pool(32)
    row = torch.arange(32)
    one = SavedKV.of(pool, row, 0, 4, kept=0, rid="a")
    assert one is not None
    monkeypatch.setattr(retracted_kv, "SAVED_KV_BYTES", 2 * one.nbytes)
    assert SavedKV.of(pool, row, 0, 4, kept=one.nbytes, rid="b") is not None
    assert SavedKV.of(pool, row, 0, 5, kept=one.nbytes, rid="c") is None


def _extend(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An extend's new K and V as a model hands them over: ``[rows, heads x dim]``."""
    return torch.randn(rows, HEADS * DIM), torch.randn(rows, HEADS * DIM)


def test_put_back_replaces_exactly_the_kept_positions_of_the_extend() -> None:
    # Three requests: row 4 is not resumed; row 9 (generation 2) resumed with positions 10..17 kept and a
    # prefix of 12 matched (positions 10 and 11 are the cache's); row 1 resumed, prefix 0, positions 3..5.
    pool = Pool(64)
    kept_9 = SavedKV.of(pool, torch.arange(64), 10, 18, kept=0, rid="b")
    kept_1 = SavedKV.of(pool, torch.arange(64), 3, 6, kept=0, rid="c")
    assert kept_9 is not None and kept_1 is not None
    saved = {(9, 2): kept_9, (1, 0): kept_1, (4, 1): kept_1}  # (4, 1): an earlier owner of row 4
    batch = SimpleNamespace(reqs=[4, 9, 1], generations=[2, 2, 0])
    prefix_lens, extend_lens = [0, 12, 0], [5, 7, 7]  # row 9: positions 12..18 (18: the redone step)
    k, v = _extend(sum(extend_lens))
    for layer in range(LAYERS):
        new_k, new_v, count = put_back(saved, batch, layer, prefix_lens, extend_lens, k, v, HEADS)
        assert count == 6 + 3
        expected_k, expected_v = k.clone().view(-1, HEADS, DIM), v.clone().view(-1, HEADS, DIM)
        expected_k[5:11], expected_v[5:11] = kept_9.keys[layer][2:8], kept_9.values[layer][2:8]
        expected_k[15:18], expected_v[15:18] = kept_1.keys[layer], kept_1.values[layer]
        assert torch.equal(new_k.view(-1, HEADS, DIM), expected_k)
        assert torch.equal(new_v.view(-1, HEADS, DIM), expected_v)
        assert not torch.equal(new_k, k)  # copies: the model's own tensors are left as they were


def test_put_back_without_kept_requests_returns_the_same_tensors() -> None:
    k, v = _extend(4)
    batch = SimpleNamespace(reqs=[3], generations=[0])
    assert put_back({}, batch, 0, [0], [4], k, v, HEADS) == (k, v, 0)
    other = SavedKV.of(Pool(8), torch.arange(8), 0, 2, kept=0, rid="x")
    assert other is not None
    got = put_back({(3, 1): other}, batch, 0, [0], [4], k, v, HEADS)  # another generation of the row
    assert got[0] is k and got[1] is v and got[2] == 0


def test_put_back_works_on_a_non_contiguous_slice_of_a_fused_projection() -> None:
    qkv = torch.randn(6, 3 * HEADS * DIM)
    k, v = qkv[:, HEADS * DIM : 2 * HEADS * DIM], qkv[:, 2 * HEADS * DIM :]
    kept = SavedKV.of(Pool(16), torch.arange(16), 2, 4, kept=0, rid="x")
    assert kept is not None
    batch = SimpleNamespace(reqs=[0], generations=[0])
    before = qkv.clone()
    new_k, new_v, count = put_back({(0, 0): kept}, batch, 1, [0], [6], k, v, HEADS)
    assert count == 2
    assert torch.equal(new_k.view(-1, HEADS, DIM)[2:4], kept.keys[1])
    assert torch.equal(new_v.view(-1, HEADS, DIM)[2:4], kept.values[1])
    assert torch.equal(new_k.view(-1, HEADS, DIM)[[0, 1, 4, 5]], k.reshape(-1, HEADS, DIM)[[0, 1, 4, 5]])
    assert torch.equal(qkv, before)
