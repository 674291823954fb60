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
