"""Batched copies of whole blocks from the host tier (SGLang's paged KV pool) into working-set slots.

    source (one layer of the pool):   k_buffer[page * B + i, head, :]   for i in 0..B-1
    destination (working-set blocks): ws_k[dst_row, i, :]

Load j copies page ``src_pages[j]``'s tokens of KV head ``heads[j]`` into block row ``dst_rows[j]``
(K and V alike). Destination rows are distinct within one call.
"""

from __future__ import annotations

import torch


def copy_blocks_to_slots(
    ws_k: torch.Tensor,
    ws_v: torch.Tensor,
    dst_rows: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    src_pages: torch.Tensor,
    heads: torch.Tensor,
) -> None:
    """Copy ``len(dst_rows)`` blocks, in place.

    Args:
        ws_k, ws_v: ``[num_block_rows, B, head_dim]``.
        dst_rows, src_pages, heads: ``[n]`` int.
        k_buffer, v_buffer: ``[num_tokens, num_kv_heads, head_dim]`` (converted to the working sets'
            dtype on the way).
    """
    if dst_rows.numel() == 0:
        return
    block = ws_k.shape[1]
    offsets = torch.arange(block, device=src_pages.device)
    tokens = src_pages.to(torch.int64)[:, None] * block + offsets  # [n, B]
    heads = heads.to(torch.int64)[:, None]
    dst_rows = dst_rows.to(torch.int64)
    ws_k[dst_rows] = k_buffer[tokens, heads].to(ws_k.dtype)
    ws_v[dst_rows] = v_buffer[tokens, heads].to(ws_v.dtype)
