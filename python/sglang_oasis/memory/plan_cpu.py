"""``WorkingSetPool.plan_selections`` on the host tables in one numba call (``plan_tables``).

The torch form (``working_set.plan_in_torch``) is some thirty tensor ops per layer and batch, each taking
the GIL back when it ends; in the eager step the prefetch pipeline's thread runs it beside the model's
thread. Here each (request, KV head) is planned in a loop that holds no GIL: the same plan, slot for slot
(tested against the torch form and the per-head reference on random tables, caps, priorities and
capacities). At 4 requests x 3 KV heads x 18 slots x 192 blocks: 64 us against the torch form's 242 (one
thread, AMD EPYC); in the default server at 4 x 3K with the job inline (``--oasis-prefetch sync``), its
transfer stage 32 -> 22 ms per step.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from numba import njit

EMPTY = -1  # a slot that holds no block (in slot tables and selections)
# Block ids are below this (2**24 blocks: contexts of 268M tokens at 16 per block), so victims order by
# last_selected * BLOCK_ID_SPAN + block id: by last selection, ties by block id.
BLOCK_ID_SPAN = 1 << 24
INT64_MAX = np.iinfo(np.int64).max


@njit(cache=True, nogil=True, boundscheck=False)
def _missing(blocks, selected, missing):
    """One head's selected blocks it does not hold (``blocks`` ``[S]``, ``selected``/``missing`` ``[N]``)."""
    missing[:] = selected
    for block in blocks:
        if 0 <= block < len(missing):  # (the torch form refuses a block past N; never planned)
            missing[block] = False


@njit(cache=True, nogil=True, boundscheck=False)
def _under_cap(missing, priority, cap, fresh_from, order_key):
    """Keep of one head's ``missing`` blocks below ``fresh_from`` only the ``cap`` best by ``priority``
    (ties: block id); returns how many it deferred."""
    for n in range(len(missing)):
        order_key[n] = -priority[n] if missing[n] and n < fresh_from else np.inf
    deferred = 0
    order = np.argsort(order_key, kind="mergesort")
    for rank in range(cap, len(missing)):
        n = order[rank]
        if missing[n] and n < fresh_from:
            missing[n] = False
            deferred += 1
    return deferred


@njit(cache=True, nogil=True, boundscheck=False)
def _holds_selected(blocks, selected, held):
    """Which of one head's slots (``blocks`` ``[S]``) hold a block it selected (``selected`` ``[N]``)."""
    for s in range(len(blocks)):
        held[s] = blocks[s] != EMPTY and selected[min(max(blocks[s], 0), len(selected) - 1)]


@njit(cache=True, nogil=True, boundscheck=False)
def _rank_by_last(blocks, last, keep, key):
    """One head's slots in eviction order: free slots first, then blocks not ``keep`` (``[S]``) by last
    selection (ties: block id), the kept last."""
    for s in range(len(blocks)):
        if blocks[s] == EMPTY:
            key[s] = -1
        else:
            key[s] = INT64_MAX if keep[s] else last[s] * BLOCK_ID_SPAN + blocks[s]
    return np.argsort(key, kind="mergesort")


@njit(cache=True, nogil=True, boundscheck=False)
def _plan(blocks, last, selected, step, cap, fresh_from, priority, capacity, out):
    """Plan every (row, head) in place: ``blocks``/``last`` ``[bs, H, S]`` become the new tables; load i
    is ``out[:, i]`` (row, head, slot, block), in (row, head) order. ``cap``: ``[bs]``, negative for no
    cap; ``fresh_from`` ``[bs]`` (N: none fresh); ``capacity`` ``[bs]`` (negative: none). Returns
    (loads, deferred)."""
    bs, heads, slots = blocks.shape
    num_blocks = selected.shape[2]
    missing = np.zeros(num_blocks, np.bool_)
    order_key = np.empty(num_blocks, np.float32)
    key = np.empty(slots, np.int64)
    held = np.zeros(slots, np.bool_)
    loads, deferred = 0, 0
    for b in range(bs):
        for h in range(heads):
            row, row_last, wanted = blocks[b, h], last[b, h], selected[b, h]
            _missing(row, wanted, missing)
            if cap[b] >= 0:
                deferred += _under_cap(missing, priority[b, h], cap[b], fresh_from[b], order_key)
            _holds_selected(row, wanted, held)
            victims = _rank_by_last(row, row_last, held, key)
            taken = 0
            for n in range(num_blocks):  # missing blocks in ascending order, into the victims in order
                if missing[n] and taken < min(slots, num_blocks):
                    row[victims[taken]] = n
                    out[0, loads], out[1, loads], out[2, loads], out[3, loads] = b, h, victims[taken], n
                    taken, loads = taken + 1, loads + 1
            _holds_selected(row, wanted, held)  # after the loads
            excess = (row != EMPTY).sum() - capacity[b]
            if capacity[b] >= 0 and excess > 0:  # unselected blocks leave, least recently selected first
                for s in _rank_by_last(row, row_last, held, key):
                    if excess and row[s] != EMPTY and not held[s]:
                        row[s], row_last[s], excess = EMPTY, EMPTY, excess - 1
            for s in range(slots):
                if held[s]:
                    row_last[s] = step
    return loads, deferred


class PlanLimits(NamedTuple):
    """What bounds a plan besides the selection (``WorkingSetPool.plan_selections``' arguments)."""

    cap: int | torch.Tensor | None = None
    fresh_from: torch.Tensor | None = None
    priority: torch.Tensor | None = None
    capacity: torch.Tensor | None = None


def plan_tables(
    blocks: torch.Tensor, last: torch.Tensor, selected: torch.Tensor, step: int, limits: PlanLimits
) -> tuple[torch.Tensor, int]:
    """``plan_in_torch``'s plan for the batch's ``blocks``/``last`` ``[bs, H, S]`` (int64, contiguous,
    CPU; rewritten in place to the new tables) and ``selected`` ``[bs, H, N]`` (CPU): ``[4, loads]``
    int64 (row, head, slot, block of each load) and how many blocks the cap deferred."""
    cap, fresh_from, priority, capacity = limits
    bs, heads, slots = blocks.shape
    num_blocks = selected.shape[2]
    none = torch.full((bs,), -1, dtype=torch.int64)
    if cap is None:
        caps = none
    else:
        caps = (
            cap.to(torch.int64)
            if isinstance(cap, torch.Tensor)
            else torch.full((bs,), cap, dtype=torch.int64)
        )
    fresh = torch.full((bs,), num_blocks, dtype=torch.int64) if fresh_from is None else fresh_from
    order = torch.zeros(selected.shape) if priority is None else priority.float().contiguous()
    out = torch.empty((4, bs * heads * min(slots, num_blocks)), dtype=torch.int64)
    loads, deferred = _plan(
        blocks.numpy(),
        last.numpy(),
        selected.contiguous().numpy(),
        step,
        caps.contiguous().numpy(),
        fresh.to(torch.int64).contiguous().numpy(),
        order.numpy(),
        (none if capacity is None else capacity.to(torch.int64).contiguous()).numpy(),
        out.numpy(),
    )
    return out[:, :loads], int(deferred)
