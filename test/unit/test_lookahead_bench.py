"""The pure pieces of benchmark/bench_lookahead.py: the n-gram proposer, the server's block selection,
agreement and attention mass, on constructed cases with exact expected values."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

from bench_lookahead import (
    agreement,
    block_attention_mass,
    mass_captured,
    ngram_propose,
    select_blocks,
)


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        pytest.param([1, 2, 3, 9, 1, 2, 3], 9, id="trigram-match"),
        pytest.param([1, 2, 5, 1, 2, 6, 1, 2], 6, id="most-recent-occurrence"),
        pytest.param([7, 2, 3, 8, 4, 3, 9, 2, 3], 8, id="longer-match-wins"),
        pytest.param([4, 3, 9, 5, 3], 9, id="unigram-match"),
        pytest.param([1, 2, 3], 3, id="no-match-repeats-last"),
        pytest.param([5], 5, id="single-token"),
        pytest.param([3, 3, 3], 3, id="overlapping-run"),
    ],
)
def test_ngram_propose(tokens: list[int], expected: int) -> None:
    assert ngram_propose(tokens) == expected


def test_ngram_propose_respects_max_n() -> None:
    tokens = [1, 2, 3, 4, 9, 3, 4, 5, 1, 2, 3, 4]
    assert ngram_propose(tokens, max_n=4) == 9  # [1, 2, 3, 4] occurred at 0, then 9
    assert ngram_propose(tokens, max_n=2) == 5  # [3, 4] most recently at 5, then 5


def test_select_blocks_sums_the_gqa_group() -> None:
    # one-token blocks (min = max = key): a block's score for a KV head is the group's summed q . k
    keys = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]], [[-1.0, 0.0]], [[0.5, 0.5]]])  # [4 blocks, 1 kv, 2]
    query = torch.tensor([[[3.0, 0.0], [-1.0, 2.5]]])  # 2 query heads, one group
    # scores: block0 3 - 1 = 2, block1 0 + 2.5 = 2.5, block2 -3 + 1 = -2, block3 1.5 + 0.75 = 2.25
    selected = select_blocks(query, keys, keys, top_k=2)
    assert selected.shape == (1, 1, 4)
    assert selected[0, 0].tolist() == [False, True, False, True]


def test_agreement_counts_the_overlap_over_k() -> None:
    predicted = torch.tensor([[True, True, False, False, True], [True, False, True, False, True]])
    true = torch.tensor([[True, False, False, True, True], [False, True, False, True, True]])
    assert agreement(predicted, true, top_k=3).tolist() == pytest.approx([2 / 3, 1 / 3])


def test_block_attention_mass_and_capture_exact() -> None:
    # head_dim 1, blocks of 2: logits q * k; block 0 keys ln 3 -> weights 3, 3; block 1 keys 0 -> 1, 1
    keys = torch.tensor([math.log(3), math.log(3), 0.0, 0.0]).view(4, 1, 1)
    query = torch.tensor([[1.0], [0.0]])  # head 0 as above; head 1 uniform
    mass = block_attention_mass(query, keys, block_size=2)
    assert mass.tolist() == [pytest.approx([0.75, 0.25]), pytest.approx([0.5, 0.5])]
    # both query heads share the one KV head: capture is their mean
    captured = mass_captured(mass, torch.tensor([[True, False]]))
    assert captured.tolist() == pytest.approx([(0.75 + 0.5) / 2])
    assert mass_captured(mass, torch.tensor([[True, True]])).tolist() == pytest.approx([1.0])
    # a batch of selections
    both = mass_captured(mass, torch.tensor([[[True, False]], [[False, True]]]))
    assert both.tolist() == [pytest.approx([0.625]), pytest.approx([0.375])]
