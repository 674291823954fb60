"""Decode attention over per-KV-head token sets (the working set plus the active tail).

Every (request, KV head) attends over its own gathered keys; positions that are padding are masked::

    keys[b, h]:  | slot 0: B tokens | slot 1: B tokens | ... | tail: active-block tokens | padding |
    valid[b, h]: |  1 ... 1         |  0 ... 0 (empty) | ... |  1 ... 1                  | 0 ... 0 |

The G = num_q_heads / num_kv_heads query heads of a group (contiguous, query head j -> KV head j // G)
share their KV head's token set.
"""

from __future__ import annotations

import torch


def sparse_decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of ``rows`` query rows per request over each KV head's own token set.

    Args:
        query: ``[batch, rows, num_q_heads, head_dim]`` (rows: 1 for plain decode, 2 with a draft row).
        keys, values: ``[batch, num_kv_heads, tokens, head_dim]``.
        valid: ``[batch, num_kv_heads, tokens]`` bool, shared by the rows, or ``[batch, num_kv_heads,
            rows, tokens]`` per row (a draft row sees the real row's token, not the reverse); every
            row needs at least one valid token.
        scale: softmax scale (usually head_dim ** -0.5).

    Returns:
        ``[batch, rows, num_q_heads, head_dim]`` in the query's dtype.
    """
    assert query.dim() == 4 and keys.dim() == 4, (query.shape, keys.shape)
    batch, rows, num_q_heads, head_dim = query.shape
    _, num_kv_heads, tokens, _ = keys.shape
    assert values.shape == keys.shape, (values.shape, keys.shape)
    assert valid.shape in ((batch, num_kv_heads, tokens), (batch, num_kv_heads, rows, tokens)), valid.shape
    assert num_q_heads % num_kv_heads == 0
    group = num_q_heads // num_kv_heads
    # [batch, kv_heads, rows * group, head_dim]: a KV head's query rows side by side.
    q = query.view(batch, rows, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
    q = q.reshape(batch, num_kv_heads, rows * group, head_dim)
    # A shared mask broadcasts over the rows; per-row masks repeat for each row's group of query heads.
    mask = valid[:, :, None, :] if valid.dim() == 3 else valid.repeat_interleave(group, dim=2)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, scale=scale
    )
    out = out.view(batch, num_kv_heads, rows, group, head_dim).permute(0, 2, 1, 3, 4)
    return out.reshape(batch, rows, num_q_heads, head_dim)


def headwise_decode_attention(
    query: torch.Tensor,
    ws_k: torch.Tensor,
    ws_v: torch.Tensor,
    slot_rows: torch.Tensor,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    tail_locs: torch.Tensor,
    tail_valid: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention straight over the head-wise mapping: each KV head's working-set blocks, then
    tail tokens read from the KV pool (the active block's tokens, and in a verify step the draft rows'
    own tokens), for every query row in one call::

        (request b, KV head h):  | block slot_rows[b,h,0] | ... | slot_rows[b,h,S-1] | tail_locs[b, :] |
        row r sees:              |      every non-empty slot (all rows alike)         | tail_valid[b, r] |

    Args:
        query: ``[batch, rows, num_q_heads, head_dim]``.
        ws_k, ws_v: ``[num_block_rows, B, head_dim]``, the working-set pool's blocks flattened.
        slot_rows: ``[batch, num_kv_heads, slots]`` int, the row of ``ws_k`` each slot holds, -1 if empty.
        tail_k, tail_v: ``[num_tokens, num_kv_heads, head_dim]``, one layer of SGLang's KV pool.
        tail_locs: ``[batch, tail]`` int pool locations (any valid location where no row reads it).
        tail_valid: ``[batch, rows, tail]`` bool.
        scale: softmax scale.

    Every row must see at least one token. Returns ``[batch, rows, num_q_heads, head_dim]`` in the
    query's dtype; the same as ``sparse_decode_attention`` over the gathered tokens.
    """
    batch, rows, _, head_dim = query.shape
    _, heads, slots = slot_rows.shape
    block = ws_k.shape[1]
    slot_rows = slot_rows.to(torch.int64)
    empty = slot_rows < 0
    shape = (batch, heads, slots * block, head_dim)
    flat_rows = slot_rows.clamp(min=0).flatten()
    keys = ws_k.index_select(0, flat_rows).view(shape)  # index_select: far faster than x[index] on CPU
    values = ws_v.index_select(0, flat_rows).view(shape)
    tail = tail_locs.shape[1]
    flat_locs = tail_locs.to(torch.int64).flatten()
    tail_shape = (batch, tail, heads, head_dim)
    tail_keys = tail_k.index_select(0, flat_locs).view(tail_shape).transpose(1, 2)
    tail_values = tail_v.index_select(0, flat_locs).view(tail_shape).transpose(1, 2)
    keys = torch.cat([keys, tail_keys.to(keys.dtype)], dim=2)
    values = torch.cat([values, tail_values.to(values.dtype)], dim=2)
    ws_valid = (~empty)[..., None].expand(-1, -1, -1, block).reshape(batch, heads, 1, slots * block)
    if rows == 1:  # one row: a mask shared by the group's query heads (broadcast, not repeated)
        valid = torch.cat([ws_valid[:, :, 0], tail_valid[:, 0, None, :].expand(-1, heads, -1)], dim=2)
    else:
        valid = torch.cat(
            [ws_valid.expand(-1, -1, rows, -1), tail_valid[:, None, :, :].expand(-1, heads, -1, -1)], dim=3
        )
    return sparse_decode_attention(query, keys, values, valid, scale)
