"""The oracle arm (``attention/oracle.py``, ``--oasis-selector oracle``, evaluation only) against a
reference written another way (a loop over requests and KV heads, Python sorting), on random inputs with
awkward sizes; with K covering every block it is dense attention; through the oasis backend it attends
what the reference picks from SGLang's pool, this step's token included, at each request's own K."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_decode_program import (
    BLOCK,
    CONTEXTS,
    KV_HEADS,
    REQS,
    SCALE,
    SPARSE_LAYER,
    admitted,
    configs,
    eager_step,
    step_inputs,
    stop,
)  # fmt: skip

from sgl_kernel_oasis.sparse_attention import sparse_decode_attention
from sglang_oasis.attention.oracle import OracleAttention, oracle_attention, oracle_positions
from sglang_oasis.config import OasisConfig, OasisConfigError


def reference_positions(
    q: torch.Tensor, keys: torch.Tensor, seq_lens: list[int], top_k: list[int], block: int, sinks: int,
    scale: float, pooled: bool = False,
) -> torch.Tensor:  # fmt: skip
    bs, q_heads = q.shape[:2]
    heads, length = keys.shape[1], keys.shape[2]
    group = q_heads // heads
    attended = torch.zeros((bs, heads, length), dtype=torch.bool)
    for b in range(bs):
        n, full = seq_lens[b], seq_lens[b] // block
        mass = {}
        for h in range(heads):
            probs = torch.softmax((q[b, h * group : (h + 1) * group] @ keys[b, h, :n].T) * scale, dim=-1)
            for i in range(sinks, full):
                mass[h, i] = float(probs[:, i * block : (i + 1) * block].sum())
        if full <= top_k[b] + sinks:
            chosen = {(h, i) for h in range(heads) for i in range(full)}
        elif pooled:  # the order the flattened [H, N] ranks take: head, then block
            ranked = sorted(mass, key=lambda hi: (-mass[hi], hi[0] * length + hi[1]))
            chosen = set(ranked[: heads * top_k[b]]) | {(h, i) for h in range(heads) for i in range(sinks)}
        else:
            chosen = {(h, i) for h in range(heads) for i in range(sinks)}
            for h in range(heads):
                candidates = sorted(range(sinks, full), key=lambda i, h=h: (-mass[h, i], i))
                chosen |= {(h, i) for i in candidates[: top_k[b]]}
        for h, i in chosen:
            attended[b, h, i * block : (i + 1) * block] = True
        attended[b, :, full * block : n] = True
    return attended


@pytest.mark.parametrize("pooled", [False, True], ids=["per_head", "pooled"])
@pytest.mark.parametrize("block,sinks", [(16, 1), (7, 0), (5, 2)])
def test_positions_equal_the_reference(block: int, sinks: int, pooled: bool) -> None:
    generator = torch.Generator().manual_seed(block)
    seq_lens, top_k = [37, 101, 5, 64], [1, 3, 2, 4]
    q = torch.randn(len(seq_lens), 6, 8, generator=generator) * 2
    keys = torch.randn(len(seq_lens), 2, 103, 8, generator=generator)
    got = oracle_positions(q, keys, torch.tensor(seq_lens), torch.tensor(top_k), block, sinks, 0.3, pooled)
    assert torch.equal(got, reference_positions(q, keys, seq_lens, top_k, block, sinks, 0.3, pooled))
    assert not got[0, :, 37:].any()  # nothing past a row's tokens
    full = torch.tensor(seq_lens) // block
    blocks = got[..., : (103 // block) * block].unflatten(-1, (-1, block)).all(dim=-1)  # [bs, H, N]
    over = full > torch.tensor(top_k) + sinks
    chosen = (blocks & (torch.arange(103 // block) < full[:, None, None])).sum(dim=(1, 2))
    budget = (torch.tensor(top_k) + min(sinks, 1) * sinks) * 2  # K + sinks per head, 2 heads
    assert torch.equal(chosen[over], budget[over])  # per head or pooled: the same bytes


def test_a_pooled_budget_goes_to_the_head_that_needs_it() -> None:
    """Head 0's mass in one block, head 1's spread over three: K = 2 per head misses one of head 1's, the
    pooled 4 blocks hold all three (head 0 gets one)."""
    q = torch.zeros(1, 2, 4)
    q[0, :, 0] = 1.0
    keys = torch.zeros(1, 2, 8 * 16, 4)
    keys[0, 0, 16:32, 0] = 8.0  # head 0: block 1
    for i in (2, 4, 7):  # head 1: three blocks alike
        keys[0, 1, i * 16 : (i + 1) * 16, 0] = 8.0
    seq_lens, top_k = torch.tensor([8 * 16 + 1]), torch.tensor([2])
    keys = torch.cat([keys, torch.zeros(1, 2, 1, 4)], dim=2)
    per_head = (
        oracle_positions(q, keys, seq_lens, top_k, 16, 0, 1.0)[0, :, :128].unflatten(-1, (8, 16)).all(-1)
    )
    pooled = (
        oracle_positions(q, keys, seq_lens, top_k, 16, 0, 1.0, True)[0, :, :128]
        .unflatten(-1, (8, 16))
        .all(-1)
    )
    assert per_head[1].sum() == 2 and pooled[1].nonzero().flatten().tolist() == [2, 4, 7]
    assert pooled[0].nonzero().flatten().tolist() == [1]


def test_contexts_shorter_than_a_block_attend_every_token() -> None:
    q, keys = torch.randn(2, 4, 8), torch.randn(2, 2, 11, 8)
    got = oracle_positions(q, keys, torch.tensor([11, 3]), torch.tensor([1, 1]), 16, 1, 0.3)
    assert got[0].all() and got[1, :, :3].all() and not got[1, :, 3:].any()


def test_the_top_block_is_the_one_the_query_points_at() -> None:
    """A needle: one block's keys aligned with the query; K = 1 attends it (and the partial block)."""
    q = torch.zeros(1, 3, 4)
    q[..., 0] = 1.0
    keys = torch.randn(1, 1, 90, 4, generator=torch.Generator().manual_seed(0)) * 0.1
    keys[0, 0, 48:64, 0] = 5.0  # block 3 of 16
    got = oracle_positions(q, keys, torch.tensor([90]), torch.tensor([1]), 16, 0, 1.0)[0, 0]
    assert got.nonzero().flatten().tolist() == [*range(48, 64), *range(80, 90)]


def test_k_covering_every_block_is_dense_attention() -> None:
    generator = torch.Generator().manual_seed(3)
    seq_lens = torch.tensor([50, 33, 9])
    q = torch.randn(3, 6, 8, generator=generator)
    keys, values = (torch.randn(3, 2, 50, 8, generator=generator) for _ in range(2))
    valid = torch.arange(50)[None, :] < seq_lens[:, None]
    dense = sparse_decode_attention(q[:, None], keys, values, valid[:, None, :].expand(-1, 2, -1), 0.25)[:, 0]
    got = oracle_attention(q, keys, values, seq_lens, torch.tensor([4, 3, 1]), 16, 0, 0.25)
    torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("selector", ["oracle", "oracle-pooled"])
def test_through_the_backend_it_attends_what_the_reference_picks(selector: str) -> None:
    """A decode step of the oasis backend with ``--oasis-selector oracle`` (``oracle-pooled``): each request at its own K (4
    / 8 / 12, as ``oasis_top_k`` sets it), its keys read from SGLang's pool, this step's token included;
    the eager step runs beneath it (its working sets change as a summaries server's would)."""
    config, _, _ = configs("k_sparse_uncapped")
    oasis = admitted(
        dataclasses.replace(config, selector=selector, evaluation_only=True, sink_blocks=1), {}, {}
    )
    assert isinstance(oasis.attention, OracleAttention) and oasis.attention.sink_blocks == 1
    assert oasis.attention.pooled == (selector == "oracle-pooled")
    top_k = [4, 8, 12]
    for req, k in zip(REQS, top_k, strict=True):
        oasis.tier.working_sets.top_k[oasis.tier.slot(req), SPARSE_LAYER] = k
    before = oasis.tier.working_sets.slot_block.clone()
    out = eager_step(oasis, 0)
    assert not torch.equal(before, oasis.tier.working_sets.slot_block)  # the eager step ran beneath
    q, k, _ = step_inputs(0)
    pool, req_to_token = oasis.token_to_kv_pool, oasis.req_to_token_pool.req_to_token
    for row, (req, context) in enumerate(zip(REQS, CONTEXTS, strict=True)):
        n = context + 1
        at = req_to_token[req, :n].long()
        keys = pool.k[SPARSE_LAYER][at].transpose(0, 1)[None]  # [1, H, n, D]
        values = pool.v[SPARSE_LAYER][at].transpose(0, 1)[None]
        assert torch.equal(keys[0, :, n - 1], k[row])  # this step's token is attended
        pooled = selector == "oracle-pooled"
        picked = reference_positions(q[row : row + 1], keys, [n], [top_k[row]], BLOCK, 1, SCALE, pooled)
        assert picked.sum() < KV_HEADS * n  # a selection, not every position
        expected = sparse_decode_attention(q[row : row + 1, None], keys, values, picked, SCALE)[:, 0]
        torch.testing.assert_close(out[row : row + 1], expected, rtol=1e-5, atol=1e-6)
    stop(oasis)


def test_the_oracle_is_refused_where_it_would_serve() -> None:
    with pytest.raises(OasisConfigError, match="--oasis-evaluation-only"):
        OasisConfig(selector="oracle")
    with pytest.raises(OasisConfigError, match="--oasis-decode-step eager"):
        OasisConfig(selector="oracle", evaluation_only=True, decode_step="captured")
    with pytest.raises(OasisConfigError, match="--oasis-lookahead previous"):
        OasisConfig(selector="oracle", evaluation_only=True, lookahead="ngram")
    with pytest.raises(OasisConfigError, match=r"--oasis-selector oracle-pooled: .*--oasis-evaluation-only"):
        OasisConfig(selector="oracle-pooled")
    with pytest.raises(OasisConfigError, match="is not one of"):
        OasisConfig(selector="exact")
