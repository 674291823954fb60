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
    scale: float,
) -> torch.Tensor:  # fmt: skip
    bs, q_heads = q.shape[:2]
    heads, length = keys.shape[1], keys.shape[2]
    group = q_heads // heads
    attended = torch.zeros((bs, heads, length), dtype=torch.bool)
    for b in range(bs):
        n, full = seq_lens[b], seq_lens[b] // block
        for h in range(heads):
            probs = torch.softmax((q[b, h * group : (h + 1) * group] @ keys[b, h, :n].T) * scale, dim=-1)
            mass = [float(probs[:, i * block : (i + 1) * block].sum()) for i in range(full)]
            if full > top_k[b] + sinks:
                candidates = sorted(range(sinks, full), key=lambda i: (-mass[i], i))
                blocks = set(range(min(sinks, full))) | set(candidates[: top_k[b]])
            else:
                blocks = set(range(full))
            for i in blocks:
                attended[b, h, i * block : (i + 1) * block] = True
            attended[b, h, full * block : n] = True
    return attended


@pytest.mark.parametrize("block,sinks", [(16, 1), (7, 0), (5, 2)])
def test_positions_equal_the_reference(block: int, sinks: int) -> None:
    generator = torch.Generator().manual_seed(block)
    seq_lens, top_k = [37, 101, 5, 64], [1, 3, 2, 4]
    q = torch.randn(len(seq_lens), 6, 8, generator=generator)
    keys = torch.randn(len(seq_lens), 2, 103, 8, generator=generator)
    got = oracle_positions(q, keys, torch.tensor(seq_lens), torch.tensor(top_k), block, sinks, 0.3)
    assert torch.equal(got, reference_positions(q, keys, seq_lens, top_k, block, sinks, 0.3))
    assert not got[:, :, 103:].any() and not got[0, :, 37:].any()  # nothing past a row's tokens


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


def test_through_the_backend_it_attends_what_the_reference_picks() -> None:
    """A decode step of the oasis backend with ``--oasis-selector oracle``: each request at its own K (4
    / 8 / 12, as ``oasis_top_k`` sets it), its keys read from SGLang's pool, this step's token included;
    the eager step runs beneath it (its working sets change as a summaries server's would)."""
    config, _, _ = configs("k_sparse_uncapped")
    oasis = admitted(
        dataclasses.replace(config, selector="oracle", evaluation_only=True, sink_blocks=1), {}, {}
    )
    assert isinstance(oasis.attention, OracleAttention) and oasis.attention.sink_blocks == 1
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
        picked = reference_positions(q[row : row + 1], keys, [n], [top_k[row]], BLOCK, 1, SCALE)
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
    with pytest.raises(OasisConfigError, match="is not one of"):
        OasisConfig(selector="exact")
