"""The active blocks (``memory/active_blocks.py``): what a ring of ``span`` positions per request slot and
layer holds through extends, decode steps and verify steps with accepted and rejected drafts, checked
against a reference that keeps every token."""

from __future__ import annotations

import pytest
import torch

from sglang_oasis.memory.active_blocks import ActiveBlocks, concat_ranges
from sglang_oasis.memory.device_layout import active_span

BLOCK, HEADS, DIM = 4, 2, 3


def _tokens(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, HEADS, DIM, generator=gen), torch.randn(n, HEADS, DIM, generator=gen)


def test_concat_ranges() -> None:
    got = concat_ranges(torch.tensor([3, 7, 0]), torch.tensor([5, 7, 2]))
    assert got.tolist() == [3, 4, 0, 1]


@pytest.mark.parametrize("rows", [0, 2, 3])
def test_the_span_holds_the_tail_and_a_step(rows: int) -> None:
    span = active_span(BLOCK, rows)
    assert span % BLOCK == 0 and span >= BLOCK + 2 * rows - 1


def test_a_gap_or_a_reset_replaces_what_is_held() -> None:
    active = ActiveBlocks(2, 1, HEADS, DIM, BLOCK, 8, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(0)
    slots = torch.tensor([0, 1])
    k, v = _tokens(37 + 5, gen)
    # An extend of 37 tokens for slot 0 (its last 8 stored) and 5 for slot 1.
    active.store(0, slots, torch.tensor([29, 0]), torch.tensor([37, 5]), torch.cat([k[29:37], k[37:]]),
                 torch.cat([v[29:37], v[37:]]))  # fmt: skip
    assert active.start[:, 0].tolist() == [29, 0] and active.end[:, 0].tolist() == [37, 5]
    assert active.holds(slots, 0, torch.tensor([32, 2]), torch.tensor([37, 5])).tolist() == [True, True]
    assert active.holds(slots, 0, torch.tensor([28, 0]), torch.tensor([37, 6])).tolist() == [False, False]
    rows = active.rows(torch.tensor([0]), torch.arange(29, 37)[None])[0]
    torch.testing.assert_close(active.k[0][rows], k[29:37])
    # Slot 1 jumps ahead (a gap): only the new positions are held.
    k2, v2 = _tokens(1, gen)
    active.store(0, torch.tensor([1]), torch.tensor([9]), torch.tensor([10]), k2, v2)
    assert (int(active.start[1, 0]), int(active.end[1, 0])) == (9, 10)
    active.reset(0)
    assert not active.holds(torch.tensor([0]), 0, torch.tensor([30]), torch.tensor([31])).item()
    with pytest.raises(ValueError, match="cannot store 9 positions"):
        active.store(0, torch.tensor([0]), torch.tensor([0]), torch.tensor([9]), *_tokens(9, gen))


@pytest.mark.parametrize("rows", [0, 2])
def test_steps_keep_every_tail_a_step_needs(rows: int) -> None:
    """Random decode (rows 0) or verify steps (rows 2: the real token and a draft, accepted or not) over
    three requests; before each step the tail after the covered blocks is held with the right K and V,
    and at each selection the block that just filled is held whole, in its page."""
    span = active_span(BLOCK, rows)
    active = ActiveBlocks(3, 2, HEADS, DIM, BLOCK, span, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(rows)
    layer, slots = 1, torch.tensor([2, 0, 1])
    seq = torch.tensor([13, 4, 30])  # committed tokens after the extend
    truth_k, truth_v = _tokens(200, gen)  # K/V of the committed token at each position (same per slot)
    first = torch.maximum(torch.zeros(3, dtype=torch.int64), seq - span)
    idx = concat_ranges(first, seq)
    active.store(layer, slots, first, seq, truth_k[idx], truth_v[idx])
    covered = seq // BLOCK
    for _ in range(40):
        assert bool(active.holds(slots, layer, covered * BLOCK, seq).all())
        tail = concat_ranges(covered * BLOCK, seq)
        counts = seq - covered * BLOCK
        ring = torch.repeat_interleave(slots, counts) * span + tail % span
        torch.testing.assert_close(active.k[layer][ring], truth_k[tail])
        torch.testing.assert_close(active.v[layer][ring], truth_v[tail])
        new = max(rows, 1)  # a decode's token, or a verify's rows: the real token, then drafts
        positions = concat_ranges(seq, seq + new)
        k, v = truth_k[positions].clone(), truth_v[positions].clone()
        accepted = torch.zeros(3, dtype=torch.int64)
        if rows:  # a rejected draft has other K/V than the token that later takes its position
            accepted = torch.randint(0, rows, (3,), generator=gen)
            offsets = positions - torch.repeat_interleave(seq, new)
            rejected = offsets > torch.repeat_interleave(accepted, new)
            k[rejected] += 5.0
            v[rejected] += 5.0
        active.store(layer, slots, seq, seq + new, k, v)
        seq = seq + 1 + accepted
        full = seq // BLOCK
        for row in range(3):  # a selection now covers every full block: just-filled blocks are held whole
            for block in range(int(covered[row]), int(full[row])):
                s = slots[row : row + 1]
                assert active.holds(
                    s, layer, torch.tensor([block * BLOCK]), torch.tensor([(block + 1) * BLOCK])
                ).item()
                page = int(active.pages(s, torch.tensor([block])))
                got = active.k[layer][page * BLOCK : (page + 1) * BLOCK]
                torch.testing.assert_close(got, truth_k[block * BLOCK : (block + 1) * BLOCK])
        covered = full
