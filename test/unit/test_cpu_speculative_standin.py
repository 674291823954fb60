"""The speculative-decoding helpers of the CPU stand-in: against loops on random inputs, and on small
constructed trees with exact expected links, masks, positions and verification results."""

from __future__ import annotations

import pytest
import torch

from sglang_oasis.platform.cpu.sgl_kernel_ops import (
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    build_tree_kernel_efficient_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    verify_tree_greedy_cpu,
)


@pytest.mark.parametrize("batch", [1, 3, 7])
def test_assign_extend_cache_locs_matches_loop(batch: int) -> None:
    gen = torch.Generator().manual_seed(batch)
    pool_len = 61
    req_to_token = torch.randint(0, 5000, (9, pool_len), generator=gen, dtype=torch.int32)
    rows = torch.randperm(9, generator=gen)[:batch]
    start = torch.randint(0, 40, (batch,), generator=gen)
    end = start + torch.randint(0, 21, (batch,), generator=gen)
    expected = [
        int(req_to_token[r, c]) for r, s, e in zip(rows, start, end, strict=True) for c in range(s, e)
    ]
    out = torch.full((len(expected) + 3,), -7, dtype=torch.int64)
    assign_extend_cache_locs_cpu(rows, req_to_token, start, end, out, pool_len)
    assert out[: len(expected)].tolist() == expected
    assert out[len(expected) :].tolist() == [-7, -7, -7]  # nothing written past the ranges


@pytest.mark.parametrize(("topk", "cols"), [(1, 1), (1, 3), (2, 2)])
def test_assign_draft_cache_locs_contiguous_matches_loop(topk: int, cols: int) -> None:
    gen = torch.Generator().manual_seed(topk * 10 + cols)
    pool_len, batch = 47, 4
    req_to_token = torch.randint(0, 5000, (6, pool_len), generator=gen, dtype=torch.int32)
    rows = torch.tensor([5, 0, 3, 2])
    seq_lens = torch.tensor([10, 1, 33, 40])
    out = torch.empty(batch * topk * cols, dtype=torch.int64)
    assign_draft_cache_locs_contiguous_cpu(rows, req_to_token, seq_lens, out, pool_len, topk, cols)
    width = topk * cols
    for i, (r, s) in enumerate(zip(rows.tolist(), seq_lens.tolist(), strict=True)):
        assert out[i * width : (i + 1) * width].tolist() == req_to_token[r, s : s + width].tolist()


def test_fill_bonus_tokens_takes_the_last_accepted() -> None:
    accept_tokens = torch.tensor([[11, 12, 13], [21, 22, 23], [31, 32, 33]])
    accept_lens = torch.tensor([1, 3, 2], dtype=torch.int32)
    bonus = torch.zeros(3, dtype=torch.int64)
    fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus, 3)
    assert bonus.tolist() == [11, 23, 32]


def test_fill_accept_out_cache_loc_compacts_in_order() -> None:
    accept_index = torch.tensor([[0, 2, -1], [3, -1, -1], [6, 7, 8]], dtype=torch.int32)
    out_cache_loc = torch.arange(100, 109)
    accepted = torch.full((9,), -1, dtype=torch.int64)
    fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accepted)
    assert accepted.tolist() == [100, 102, 103, 106, 107, 108, -1, -1, -1]


def _tree(selected: list[int], parents: list[int], topk: int, depth: int, seq_len: int, mode: int):
    n = len(selected) + 1
    mask = torch.full((n * n,) if mode == 1 else (n * (seq_len + n),), True)
    positions = torch.empty(n, dtype=torch.int64)
    links = torch.full((3, 1, n), -1, dtype=torch.int64)
    build_tree_kernel_efficient_cpu(
        torch.tensor([parents]), torch.tensor([selected]), torch.tensor([seq_len]), mask, positions,
        links[0], links[1], links[2], topk, depth, n, mode,
    )  # fmt: skip
    return mask, positions, links


def test_build_tree_chain_is_causal() -> None:
    """top-k 1: the draft tokens form a chain; the qlen-only mask is lower triangular."""
    mask, positions, (index, first_child, sibling) = _tree(
        [0, 1], [-1, 0], topk=1, depth=2, seq_len=7, mode=1
    )
    assert torch.equal(mask.view(3, 3), torch.tril(torch.ones(3, 3, dtype=torch.bool)))
    assert positions.tolist() == [7, 8, 9]
    assert index.tolist() == [[0, 1, 2]]
    assert first_child.tolist() == [[1, 2, -1]]
    assert sibling.tolist() == [[-1, -1, -1]]


def test_build_tree_branching_links_masks_positions() -> None:
    """top-k 2: tokens 1 and 2 are children of the verified token, token 3 a child of token 1."""
    mask, positions, (_index, first_child, sibling) = _tree(
        [0, 1, 2], [-1, 0], topk=2, depth=2, seq_len=5, mode=1
    )
    assert first_child.tolist() == [[1, 3, -1, -1]]
    assert sibling.tolist() == [[-1, 2, -1, -1]]
    assert positions.tolist() == [5, 6, 6, 7]
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(mask.view(4, 4), expected)
    # The full mask holds the same pattern after each row's seq_len prefix columns (left as set).
    full, _, _ = _tree([0, 1, 2], [-1, 0], topk=2, depth=2, seq_len=5, mode=0)
    rows = full.view(4, 9)
    assert bool(rows[:, :5].all())
    assert torch.equal(rows[:, 5:], expected)


def _verify(candidates, first_child, sibling, target, max_accept):
    batch, n = candidates.shape
    predicts = torch.full((batch * n,), -5, dtype=torch.int64)
    accept_index = torch.full((batch, max_accept), -1, dtype=torch.int64)
    accept_num = torch.full((batch,), -9, dtype=torch.int64)
    index = torch.arange(batch * n).view(batch, n)
    verify_tree_greedy_cpu(
        predicts=predicts, accept_index=accept_index, accept_token_num=accept_num, candidates=candidates,
        retrive_index=index, retrive_next_token=first_child, retrive_next_sibling=sibling,
        target_predict=target,
    )  # fmt: skip
    return predicts, accept_index, accept_num


def test_verify_tree_greedy_follows_matching_siblings() -> None:
    # Tree of the branching test; request 0: the target wants token 2's draft (b) then nothing matches;
    # request 1: the target wants a (token 1) then c (token 3): the whole depth-2 path is accepted.
    candidates = torch.tensor([[100, 10, 20, 30], [100, 10, 20, 30]])
    first_child = torch.tensor([[1, 3, -1, -1]] * 2)
    sibling = torch.tensor([[-1, 2, -1, -1]] * 2)
    target = torch.tensor([[20, 77, 55, 66], [10, 30, 88, 44]])
    predicts, accept_index, accept_num = _verify(candidates, first_child, sibling, target, max_accept=3)
    assert accept_num.tolist() == [1, 2]
    assert accept_index.tolist() == [[0, 2, -1], [4, 5, 7]]
    assert predicts.tolist() == [20, -5, 55, -5, 10, 30, -5, 44]


def test_verify_tree_greedy_rejects_everything_when_nothing_matches() -> None:
    candidates = torch.tensor([[1, 2]])
    predicts, accept_index, accept_num = _verify(
        candidates, torch.tensor([[1, -1]]), torch.tensor([[-1, -1]]), torch.tensor([[9, 8]]), max_accept=2
    )
    assert accept_num.tolist() == [0]
    assert accept_index.tolist() == [[0, -1]]
    assert predicts.tolist() == [9, -5]


def test_reconstruct_indices_from_tree_mask_matches_build_tree() -> None:
    """NGRAM's mask-driven reconstruction gives the links, positions and indices of the tree built from
    the drafter's selection (the branching tree above, and a chain), two requests at once."""
    from sglang_oasis.platform.cpu.sgl_kernel_ops import reconstruct_indices_from_tree_mask

    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    chain = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    mask = torch.stack([tree, chain]).flatten()
    positions = torch.empty(8, dtype=torch.int64)
    links = torch.full((3, 8), -9, dtype=torch.int64)
    reconstruct_indices_from_tree_mask(mask, torch.tensor([5, 11]), positions, *links, 2, 4)
    assert positions.tolist() == [5, 6, 6, 7, 11, 12, 13, 14]
    assert links[0].tolist() == list(range(8))
    assert links[1].tolist() == [1, 3, -1, -1, 1, 2, 3, -1]
    assert links[2].tolist() == [-1, 2, -1, -1, -1, -1, -1, -1]
