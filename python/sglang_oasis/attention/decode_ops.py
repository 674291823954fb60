"""The captured decode program's three data-moving ops, in two forms chosen by the tensors' device.

``decode_program.decode_layer`` writes this step's key into its page's summary, attends over each KV
head's working set and the active tail, and copies the next step's blocks. On CPU these are torch ops
(what ``torch.compile`` fuses; the torch references in ``sgl_kernel_oasis`` size their work by the data
and could not be captured). On CUDA they are sgl-kernel-oasis's Triton kernels, launched with grids
from the shapes and no host sync, so a CUDA graph records them (``graphed_step.py``). Both forms read
the working sets in place as block rows::

    ws_k (one layer's view): [slots, H, S, B, D]  ->  block rows [n, B, D] (``block_rows``)
    row of (slot, h, s) = slot * per_slot + h * S + s     (per_slot: the rows between two slots, every
                                                            layer's included when the view is a layer's)

The Triton forms are tested on CPU under Triton's interpreter against the torch forms
(``test/unit/test_decode_program.py``); on a GPU they have never run (docs/gpu.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from sgl_kernel_oasis import ops, sparse_decode_attention
from sglang_oasis.memory.working_set import EMPTY

if TYPE_CHECKING:
    from sglang_oasis.attention.layer_state import LayerState

INT64_MAX = torch.iinfo(torch.int64).max


class Copies(NamedTuple):
    """A layer's copies of next-step blocks (``[bs, H, M]``; tokens ``[bs, H, M, B]``): on CUDA what a side
    stream carries while later layers compute (``benchmark/gpu_step.py``), joined before the next step."""

    slot: torch.Tensor  # request slot (masked copies: the padding slot)
    head: torch.Tensor
    target: torch.Tensor  # working-set slot
    from_active: torch.Tensor  # bool: from the active blocks' ring, else the host tier
    host_tokens: torch.Tensor
    ring_tokens: torch.Tensor
    padding_slot: int  # where a copy the Triton form does not make in one of its two launches goes


def at_most(bound: int, blocks: int) -> int:
    """``min(bound, blocks)`` for the symbolic block count: a branch (torch guards once on which side the
    block bucket is, the same for every larger bucket) where ``min`` would trace ``sym_min`` and a slice
    by it would guard on the count itself, a graph per bucket."""
    return bound if blocks >= bound else blocks


def block_rows(ws: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``ws`` ``[slots, H, S, B, D]`` (each slot's ``[H, S, B, D]`` contiguous, as a layer's view of
    ``WorkingSetPool.k`` is) as block rows ``[n, B, D]`` over the same memory, and ``per_slot``."""
    slots, heads, per_head, block, dim = ws.shape
    inner = (per_head * block * dim, block * dim, dim, 1)
    if ws.stride()[1:] != inner or ws.stride(0) % (block * dim):
        raise ValueError(f"working sets of strides {ws.stride()} are not block rows")
    per_slot = ws.stride(0) // (block * dim)
    rows = (slots - 1) * per_slot + heads * per_head
    return ws.as_strided((rows, block, dim), (block * dim, dim, 1)), per_slot


def row_of(
    slot: torch.Tensor | int, head: torch.Tensor, index: torch.Tensor, per_slot: int, per_head: int
) -> torch.Tensor:
    """The block row (in ``block_rows``) of working-set slot ``index`` of KV head ``head`` of ``slot``."""
    return slot * per_slot + head * per_head + index


def fold_summaries(state: LayerState, locs: torch.Tensor, key: torch.Tensor, block: int) -> None:
    """This step's keys ``[bs, H, D]`` (at host locations ``locs``) into their pages' min/max summaries; a
    page restarts at its first token."""
    if ops.uses_triton(state.kmin):
        ops.update_page_summaries(state.kmin, state.kmax, locs, key, block)
        return
    page = locs // block
    restart = (locs % block == 0)[:, None, None]
    state.kmin.index_put_((page,), torch.where(restart, key, torch.minimum(state.kmin[page], key)))
    state.kmax.index_put_((page,), torch.where(restart, key, torch.maximum(state.kmax[page], key)))


def attend(
    state: LayerState, q: torch.Tensor, slots: torch.Tensor, blocks: torch.Tensor, tail_rows: torch.Tensor,
    tail_valid: torch.Tensor, scale: float, width: int | torch.SymInt | None = None,
) -> torch.Tensor:  # fmt: skip
    """Attention of ``q`` ``[bs, q_heads, D]`` over each KV head's working set (``blocks`` ``[bs, H, S]``
    the block each slot holds, EMPTY masked) and its active tail (``tail_rows`` ``[bs, T]`` rows of the
    active ring, ``tail_valid`` ``[bs, T]``); a verify pass's rows: ``q`` ``[bs, R, q_heads, D]`` and
    ``tail_valid`` ``[bs, R, T]`` (every row sees the whole working set). The torch form reads the slots in
    block order (the eager step's summation order), only the first ``width`` when given (no block above
    them: a short context's working sets fill the lowest slots, and their empty rest costs nothing); the
    Triton form every slot in slot order, online, skipping empty ones."""
    if ops.uses_triton(q):
        rows_q = q if q.dim() == 4 else q[:, None]  # [bs, R, q_heads, D]
        rows_valid = tail_valid if tail_valid.dim() == 3 else tail_valid[:, None]  # [bs, R, T]
        rows_k, per_slot = block_rows(state.ws_k)
        rows_v, _ = block_rows(state.ws_v)
        heads, num_slots = blocks.shape[1:]
        head, index = torch.arange(heads, device=q.device)[:, None], torch.arange(num_slots, device=q.device)
        held = row_of(slots[:, None, None], head, index, per_slot, num_slots)  # [bs, H, S]
        slot_rows = torch.where(blocks == EMPTY, -1, held)
        out = ops.headwise_decode_attention(
            rows_q, rows_k, rows_v, slot_rows, state.active_k, state.active_v, tail_rows, rows_valid, scale
        )
        return out if q.dim() == 4 else out[:, 0]
    if width is not None:
        blocks = blocks[..., :width]
    bs, heads = blocks.shape[:2]
    order = torch.where(blocks == EMPTY, INT64_MAX, blocks).argsort(dim=-1)
    head = torch.arange(heads, device=q.device)[None, :, None]
    ws_keys = state.ws_k[slots[:, None, None], head, order]  # [bs, H, S, B, D]
    ws_values = state.ws_v[slots[:, None, None], head, order]
    num_slots, block, dim = ws_keys.shape[2:]
    tail_keys = state.active_k[tail_rows].transpose(1, 2)  # [bs, H, T, D]
    tail_values = state.active_v[tail_rows].transpose(1, 2)
    keys = torch.cat([ws_keys.reshape(bs, heads, num_slots * block, dim), tail_keys], dim=2)
    values = torch.cat([ws_values.reshape(bs, heads, num_slots * block, dim), tail_values], dim=2)
    ws_valid = (blocks.gather(-1, order) != EMPTY)[..., None].expand(-1, -1, -1, block)
    ws_valid = ws_valid.reshape(bs, heads, num_slots * block)
    if q.dim() == 3:  # one row: a mask shared by the group's query heads
        valid = torch.cat([ws_valid, tail_valid[:, None].expand(-1, heads, -1)], dim=2)
        return sparse_decode_attention(q[:, None], keys, values, valid, scale)[:, 0]
    rows = q.shape[1]
    valid = torch.cat([ws_valid[:, :, None].expand(-1, -1, rows, -1), tail_valid[:, None].expand(-1, heads, -1, -1)],
                      dim=3)  # fmt: skip
    return sparse_decode_attention(q, keys, values, valid, scale)


def copy_blocks(state: LayerState, copies: Copies) -> None:
    """The planned copies into the working sets (``attend_and_plan`` wrote the tables they match). The
    Triton form is two launches of ``copy_blocks_to_slots``, one per source (host tier pages, active
    ring pages); a copy the launch does not make lands in the padding slot."""
    if ops.uses_triton(state.ws_k):
        rows_k, per_slot = block_rows(state.ws_k)
        rows_v, _ = block_rows(state.ws_v)
        per_head = state.ws_k.shape[2]
        unused = row_of(copies.padding_slot, copies.head, copies.target, per_slot, per_head)
        used = row_of(copies.slot, copies.head, copies.target, per_slot, per_head)
        block = rows_k.shape[1]
        for source_k, source_v, tokens, mine in (
            (state.host_k, state.host_v, copies.host_tokens, ~copies.from_active),
            (state.active_k, state.active_v, copies.ring_tokens, copies.from_active),
        ):
            rows = torch.where(mine, used, unused).flatten()
            pages, heads = (tokens[..., 0] // block).flatten(), copies.head.flatten()
            ops.copy_blocks_to_slots(rows_k, rows_v, rows, source_k, source_v, pages, heads)
        return
    head = copies.head[..., None].expand_as(copies.host_tokens)  # [bs, H, M, B]
    for ws, host, ring in ((state.ws_k, state.host_k, state.active_k), (state.ws_v, state.host_v, state.active_v)):  # fmt: skip
        data = torch.where(
            copies.from_active[..., None, None],
            ring[copies.ring_tokens, head].to(ws.dtype),
            host[copies.host_tokens, head].to(ws.dtype),
        )  # [bs, H, M, B, D]
        ws.index_put_((copies.slot, copies.head, copies.target), data)
