"""The active blocks: each running request's newest tokens, kept in the device tier.

A decode step attends to the working set (selected covered blocks) plus the *active tail*: the tokens
after the blocks the last selection covered, less than one block since every step's selection covers
every full block. The device tier keeps them, and one step's new tokens, in a ring of ``span`` token
positions per request slot and layer (``device_layout.active_span``)::

    k[layer][slot * span + position % span] : [kv_heads, head_dim]      (v alike)
    start[slot, layer], end[slot, layer]      the positions held: [start, end), end - start <= span

Every forward pass stores its new tokens here as well as in the host tier: an extend its last ``span``
tokens, a decode its token, a verify its rows (the drafts at the positions they would take, so the
accepted ones are already in place). So in the steady state the tail needs no host read, and a block
that fills up is copied from here into the working sets as one page (``pages``). What is not held (a PD
arrival's prompt tail) is loaded from the host tier by the caller, counted.
"""

from __future__ import annotations

import torch


def concat_ranges(starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``[starts[0], ends[0]) ++ [starts[1], ends[1]) ++ ...`` as one int64 tensor (empty ranges add none)."""
    counts = (ends - starts).clamp(min=0)
    offsets = torch.arange(int(counts.sum())) - torch.repeat_interleave(
        torch.cumsum(counts, 0) - counts, counts
    )
    return torch.repeat_interleave(starts, counts) + offsets


class ActiveBlocks:
    def __init__(
        self,
        max_requests: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        span: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if span % block_size:
            raise ValueError(f"active span {span} is not a whole number of {block_size}-token blocks")
        self.span = span
        self.block_size = block_size
        shape = (num_layers, max_requests * span, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.start = torch.zeros((max_requests, num_layers), dtype=torch.int64)
        self.end = torch.zeros((max_requests, num_layers), dtype=torch.int64)

    def reset(self, slot: int) -> None:
        """A newly claimed request slot holds no tokens."""
        self.start[slot] = 0
        self.end[slot] = 0

    def rows(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rows of ``k[layer]`` holding ``positions`` (``[bs, n]``) of the request slots ``slots`` (``[bs]``)."""
        return slots[:, None] * self.span + positions % self.span

    def range_rows(self, slots: torch.Tensor, first: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
        """Rows of ``k[layer]`` holding positions ``[first[i], end[i])`` of each slot ``slots[i]``,
        concatenated slot by slot in position order."""
        counts = (end - first).clamp(min=0)
        return torch.repeat_interleave(slots, counts) * self.span + concat_ranges(first, end) % self.span

    def pages(self, slots: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """Pages (``block_size`` rows of ``k[layer]``) holding logical ``blocks`` of ``slots`` (``[n]``)."""
        per_slot = self.span // self.block_size
        return slots * per_slot + blocks % per_slot

    def holds(
        self, slots: torch.Tensor, layer: int | torch.Tensor, first: torch.Tensor, end: torch.Tensor
    ) -> torch.Tensor:
        """``[bs]`` bool: positions ``[first, end)`` of each slot are held (an empty range always is); with
        ``slots`` ``[bs, 1]`` and ``layer`` a ``[layers]`` tensor, ``[bs, layers]`` for every layer at once."""
        held = (first >= self.start[slots, layer]) & (end <= self.end[slots, layer])
        return held | (first >= end)

    def store(
        self,
        layer: int,
        slots: torch.Tensor,
        first: torch.Tensor,
        end: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store positions ``[first[i], end[i])`` of each slot ``slots[i]`` (at most ``span`` of them):
        ``k``, ``v`` ``[tokens, kv_heads, head_dim]`` hold those tokens, slot by slot in position order.
        A range that starts inside (or right after) the held one extends it; one after a gap replaces it.
        """
        counts = end - first
        if len(counts) and int(counts.max()) > self.span:
            raise ValueError(f"cannot store {int(counts.max())} positions in an active span of {self.span}")
        total = int(counts.sum())
        if total != k.shape[0]:
            raise ValueError(f"{k.shape[0]} tokens given for {total} positions")
        if total:
            rows = self.range_rows(slots, first, end).to(self.k.device, non_blocking=True)
            self.k[layer].index_copy_(0, rows, k.to(self.k.dtype))
            self.v[layer].index_copy_(0, rows, v.to(self.v.dtype))
        start, held_end = self.start[slots, layer], self.end[slots, layer]
        wrote = counts > 0
        joins = (first >= start) & (first <= held_end)
        new_end = torch.where(joins, torch.maximum(held_end, end), end)
        new_start = torch.maximum(torch.where(joins, start, first), new_end - self.span)
        self.start[slots, layer] = torch.where(wrote, new_start, start)
        self.end[slots, layer] = torch.where(wrote, new_end, held_end)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.start, self.end))
