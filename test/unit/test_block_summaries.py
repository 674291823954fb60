"""Block summaries, scoring and top-K selection against plain loops, on awkward sizes."""

from __future__ import annotations

import pytest
import torch

from sgl_kernel_oasis import (
    append_block_summaries,
    build_block_summaries,
    score_blocks,
    select_top_blocks,
    window_block_mass,
)


def summaries_loop(keys: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    mins, maxs = [], []
    for start in range(0, keys.shape[0], block_size):
        block = keys[start : start + block_size]
        mins.append(block.min(dim=0).values)
        maxs.append(block.max(dim=0).values)
    return torch.stack(mins), torch.stack(maxs)


def scores_loop(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    rows, num_q, _ = query.shape
    num_blocks, num_kv, _ = kmin.shape
    group = num_q // num_kv
    out = torch.zeros(rows, num_kv, num_blocks)
    for r in range(rows):
        for qh in range(num_q):
            kv = qh // group
            for b in range(num_blocks):
                q = query[r, qh].float()
                out[r, kv, b] += torch.maximum(q * kmin[b, kv].float(), q * kmax[b, kv].float()).sum()
    return out


@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 63, 500])
@pytest.mark.parametrize("block_size", [16, 5])
def test_build_matches_loop(num_tokens: int, block_size: int) -> None:
    keys = torch.randn(num_tokens, 3, 7, generator=torch.Generator().manual_seed(num_tokens))
    got = build_block_summaries(keys, block_size)
    want = summaries_loop(keys, block_size)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize(
    ("before", "appended"), [(0, 1), (5, 1), (15, 1), (16, 1), (7, 40), (0, 33), (31, 2)]
)
def test_append_matches_rebuilding(before: int, appended: int) -> None:
    block_size = 16
    keys = torch.randn(
        before + appended, 2, 8, generator=torch.Generator().manual_seed(before * 100 + appended)
    )
    capacity = -(-(before + appended) // block_size) + 2
    kmin = torch.full((capacity, 2, 8), float("nan"))
    kmax = torch.full((capacity, 2, 8), float("nan"))
    if before:
        built = build_block_summaries(keys[:before], block_size)
        kmin[: built[0].shape[0]], kmax[: built[1].shape[0]] = built
    append_block_summaries(kmin, kmax, before, keys[before:], block_size)
    want_min, want_max = summaries_loop(keys, block_size)
    n = want_min.shape[0]
    assert torch.equal(kmin[:n], want_min) and torch.equal(kmax[:n], want_max)


@pytest.mark.parametrize(("num_q", "num_kv"), [(4, 4), (9, 3), (7, 1), (6, 2)])
def test_scores_match_loop(num_q: int, num_kv: int) -> None:
    gen = torch.Generator().manual_seed(num_q)
    keys = torch.randn(37, num_kv, 16, generator=gen)
    kmin, kmax = build_block_summaries(keys, 16)
    query = torch.randn(2, num_q, 16, generator=gen)
    torch.testing.assert_close(score_blocks(query, kmin, kmax), scores_loop(query, kmin, kmax))


def test_score_is_an_upper_bound_of_every_key_in_the_block() -> None:
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(64, 1, 8, generator=gen)
    kmin, kmax = build_block_summaries(keys, 16)
    query = torch.randn(1, 1, 8, generator=gen)
    scores = score_blocks(query, kmin, kmax)[0, 0]
    dots = (keys[:, 0] @ query[0, 0]).view(4, 16)
    assert torch.all(scores >= dots.max(dim=1).values - 1e-5)


@pytest.mark.parametrize("k", [1, 3, 10, 50])
def test_top_k_takes_the_best_score_sum(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    scores = torch.randn(2, 3, 23, generator=gen)
    always = torch.zeros(23, dtype=torch.bool)
    always[[0, 22]] = True  # a sink and the active block
    selected = select_top_blocks(scores, k, always)
    assert torch.all(selected[..., always])
    for r in range(2):
        for h in range(3):
            free_scores = scores[r, h][~always]
            chosen = selected[r, h][~always]
            take = min(k, free_scores.numel())
            assert int(chosen.sum()) == take
            # Compare score sums, not indices: ties may pick either block.
            assert torch.isclose(free_scores[chosen].sum(), free_scores.topk(take).values.sum())


def dense_attention_loop(query, keys, values, valid, scale):
    batch, rows, num_q, _ = query.shape
    num_kv = keys.shape[1]
    out = torch.zeros_like(query)
    for b in range(batch):
        for r in range(rows):
            for qh in range(num_q):
                kv = qh // (num_q // num_kv)
                row_valid = valid[b, kv] if valid.dim() == 3 else valid[b, kv, r]
                k = keys[b, kv][row_valid]
                v = values[b, kv][row_valid]
                p = torch.softmax((k @ query[b, r, qh]) * scale, dim=0)
                out[b, r, qh] = p @ v
    return out


@pytest.mark.parametrize(("num_q", "num_kv", "rows"), [(4, 4, 1), (9, 3, 2), (7, 1, 1)])
def test_sparse_decode_attention_matches_loop(num_q: int, num_kv: int, rows: int) -> None:
    from sgl_kernel_oasis import sparse_decode_attention

    gen = torch.Generator().manual_seed(num_q * 10 + rows)
    batch, tokens, dim = 3, 37, 16
    query = torch.randn(batch, rows, num_q, dim, generator=gen)
    keys = torch.randn(batch, num_kv, tokens, dim, generator=gen)
    values = torch.randn(batch, num_kv, tokens, dim, generator=gen)
    valid = torch.rand(batch, num_kv, tokens, generator=gen) > 0.4
    valid[..., 0] = True
    got = sparse_decode_attention(query, keys, values, valid, dim**-0.5)
    torch.testing.assert_close(got, dense_attention_loop(query, keys, values, valid, dim**-0.5))


@pytest.mark.parametrize(("num_q", "num_kv"), [(9, 3), (7, 7), (6, 1)])
def test_per_row_masks_match_loop_and_two_separate_calls(num_q: int, num_kv: int) -> None:
    """A real row and a draft row stacked in one call: the draft row also sees the real row's token
    (the last key), the real row does not see the draft's. Same as two one-row calls."""
    from sgl_kernel_oasis import sparse_decode_attention

    gen = torch.Generator().manual_seed(num_q + num_kv)
    batch, tokens, dim = 3, 29, 8
    query = torch.randn(batch, 2, num_q, dim, generator=gen)
    keys = torch.randn(batch, num_kv, tokens + 2, dim, generator=gen)
    values = torch.randn(batch, num_kv, tokens + 2, dim, generator=gen)
    shared = torch.rand(batch, num_kv, tokens, generator=gen) > 0.3
    valid = torch.zeros(batch, num_kv, 2, tokens + 2, dtype=torch.bool)
    valid[:, :, :, :tokens] = shared[:, :, None, :]
    valid[:, :, 0, tokens] = True  # real row: itself
    valid[:, :, 1, tokens:] = True  # draft row: the real token and itself
    got = sparse_decode_attention(query, keys, values, valid, dim**-0.5)
    torch.testing.assert_close(got, dense_attention_loop(query, keys, values, valid, dim**-0.5))
    for row in range(2):
        alone = sparse_decode_attention(query[:, row : row + 1], keys, values, valid[:, :, row], dim**-0.5)
        torch.testing.assert_close(got[:, row], alone[:, 0])


@pytest.mark.parametrize(
    ("batch", "q_heads", "kv_heads", "blocks", "dim", "dtype"),
    [
        (3, 9, 3, 11, 16, torch.float32),  # GQA 3
        (1, 7, 1, 63, 5, torch.float32),  # GQA 7, one request
        (5, 4, 4, 500, 64, torch.float32),  # GQA 1, many blocks
        (2, 6, 2, 37, 32, torch.bfloat16),
    ],
    ids=["gqa3", "gqa7-one-request", "gqa1-500-blocks", "bf16"],
)
def test_batched_scores_match_one_request_at_a_time(
    batch: int, q_heads: int, kv_heads: int, blocks: int, dim: int, dtype: torch.dtype
) -> None:
    """The grouped form equals the elementwise Quest bound (``score_blocks``) per request."""
    from sgl_kernel_oasis import score_blocks_batched

    gen = torch.Generator().manual_seed(5)
    query = torch.randn(batch, q_heads, dim, generator=gen).to(dtype)
    kmin = torch.randn(batch, blocks, kv_heads, dim, generator=gen).to(dtype)
    kmax = (kmin.float() + torch.rand(batch, blocks, kv_heads, dim, generator=gen)).to(dtype)
    got = score_blocks_batched(query, kmin, kmax)
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    for b in range(batch):
        torch.testing.assert_close(got[b], score_blocks(query[b : b + 1], kmin[b], kmax[b])[0], **tolerance)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_requests_scores_do_not_depend_on_its_batch(threads: int) -> None:
    """Issue 25 item 13: a request's block scores are bitwise the same alone and in a batch padded to a
    longer request's blocks (a matmul's tiling changed the last bit, flipping top-K ties)."""
    from sgl_kernel_oasis import score_paged_blocks

    gen = torch.Generator().manual_seed(9)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for own, longest, batch in [(5, 300, 8), (37, 64, 3), (130, 515, 32), (1, 2, 2)]:
            kmin = torch.randn(600, 2, 64, generator=gen)
            kmax = kmin + torch.rand(600, 2, 64, generator=gen)
            query = torch.randn(batch, 1, 4, 64, generator=gen)
            pages = torch.randint(0, 600, (batch, longest), generator=gen)
            together = score_paged_blocks(query, kmin, kmax, pages)[0, :, :, :own]
            alone = score_paged_blocks(query[:1], kmin, kmax, pages[:1, :own])[0]
            assert torch.equal(together, alone), (own, longest, batch)
    finally:
        torch.set_num_threads(previous)


def test_top_k_respects_padding_and_short_rows() -> None:
    scores = torch.tensor(
        [[[5.0, 1.0, 9.0, 7.0, 8.0]], [[3.0, 2.0, 1.0, 99.0, 99.0]]]
    )  # [2 requests, 1 head, 5]
    valid = torch.tensor([[True] * 5, [True, True, True, False, False]])[:, None, :]
    sinks = torch.tensor([True, False, False, False, False])
    selected = select_top_blocks(scores, 2, sinks, valid)
    assert selected[0, 0].tolist() == [True, False, True, False, True]  # sink + 9 and 8
    assert selected[1, 0].tolist() == [True, True, True, False, False]  # padding never wins


def window_mass_loop(
    queries: torch.Tensor, keys: torch.Tensor, block_size: int, scale: float
) -> torch.Tensor:
    window, num_q, _ = queries.shape
    tokens, num_kv, _ = keys.shape
    group = num_q // num_kv
    out = torch.zeros(num_kv, tokens // block_size, dtype=torch.float64)
    for i in range(window):
        position = tokens - window + i
        for qh in range(num_q):
            kv = qh // group
            logits = [
                float(queries[i, qh].double() @ keys[t, kv].double()) * scale for t in range(position + 1)
            ]
            probs = torch.tensor(logits, dtype=torch.float64).softmax(dim=0)
            for t in range(min(position + 1, out.shape[1] * block_size)):
                out[kv, t // block_size] += probs[t]
    return out


@pytest.mark.parametrize(
    ("tokens", "block_size", "window"), [(17, 16, 1), (63, 16, 7), (40, 5, 40), (101, 5, 32)]
)
@pytest.mark.parametrize(("num_q", "num_kv"), [(2, 2), (3, 1), (14, 2)])
def test_window_block_mass_matches_loop(
    tokens: int, block_size: int, window: int, num_q: int, num_kv: int
) -> None:
    g = torch.Generator().manual_seed(tokens * 100 + window + num_q)
    queries = torch.randn(window, num_q, 8, generator=g) * 2
    keys = torch.randn(tokens, num_kv, 8, generator=g)
    got = window_block_mass(queries, keys, block_size, scale=0.3)
    want = window_mass_loop(queries, keys, block_size, scale=0.3)
    assert got.shape == (num_kv, tokens // block_size) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_window_block_mass_is_all_the_mass_without_a_tail_and_finds_a_planted_key() -> None:
    """Every window row's softmax sums to one per query head, so with no partial tail the blocks hold
    group x window in all; a key equal to the window's query direction draws most of it."""
    g = torch.Generator().manual_seed(7)
    queries = torch.randn(4, 6, 16, generator=g)
    keys = torch.randn(64, 2, 16, generator=g) * 0.1
    keys[37, 0] = queries[:, :3].mean(dim=(0, 1)) * 4  # block 9 of KV head 0
    mass = window_block_mass(queries, keys, block_size=4, scale=1.0)
    torch.testing.assert_close(mass.sum(dim=1), torch.full((2,), 3.0 * 4))
    assert int(mass[0].argmax()) == 9
