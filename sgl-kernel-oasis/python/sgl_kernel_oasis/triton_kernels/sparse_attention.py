"""Triton ``headwise_decode_attention``: one program per (request, KV head), all its query rows at once.

The program holds the group's query heads of every row (rows x G, padded to 16 for ``tl.dot``) and
runs one online softmax over two sources, read in place (nothing is gathered first)::

    1. working set: slot s's block is row slot_rows[b, h, s] of ws_k / ws_v; empty slots (-1) masked
    2. tail: pool tokens tail_locs[b, t] (KV head h), row r masked by tail_valid[b, r, t]

so a decode step (1 row) and a verify step (the real row plus draft rows, the drafts' own tokens in
the tail) are the same launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _online_softmax_step(q, k, v, allowed, row_max, denom, acc, scale, IEEE: tl.constexpr):
    """Fold one tile of keys/values into the running (max, denominator, weighted sum) of each query."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee") if IEEE else tl.dot(q, tl.trans(k))
    s = tl.where(allowed, s * scale, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(s, axis=1))
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row with nothing seen yet
    alpha = tl.exp(row_max - safe_max)
    p = tl.exp(s - safe_max[:, None])
    denom = denom * alpha + tl.sum(p, axis=1)
    pv = tl.dot(p, v, input_precision="ieee") if IEEE else tl.dot(p.to(v.dtype), v)
    return new_max, denom, acc * alpha[:, None] + pv


@triton.jit
def _headwise_kernel(
    query,
    ws_k,
    ws_v,
    slot_rows,
    tail_k,
    tail_v,
    tail_locs,
    tail_valid,
    out,
    scale,
    num_slots,
    tail_len,
    head_dim,
    stride_qb,
    stride_qr,
    stride_qh,
    stride_wr,
    stride_wt,
    stride_sb,
    stride_sh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_lb,
    stride_mb,
    stride_mr,
    stride_ob,
    stride_or,
    stride_oh,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, BLOCK_Q)  # i = row * GROUP + g
    row = i // GROUP
    q_head = h * GROUP + i % GROUP
    q_ok = i < ROWS * GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(
        query + b * stride_qb + row[:, None] * stride_qr + q_head[:, None] * stride_qh + d[None, :],
        mask=q_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    compute = tl.float32 if IEEE else ws_k.dtype.element_ty
    q = q.to(compute)
    row_max = tl.full((BLOCK_Q,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_Q,), tl.float32)
    acc = tl.zeros((BLOCK_Q, BLOCK_D), tl.float32)
    t = tl.arange(0, BLOCK_T)
    # 1. working-set blocks (every row sees them)
    ws_tokens = num_slots * BLOCK
    for start in range(0, ws_tokens, BLOCK_T):
        token = start + t
        slot = token // BLOCK
        in_range = token < ws_tokens
        block_row = tl.load(slot_rows + b * stride_sb + h * stride_sh + slot, mask=in_range, other=-1)
        present = in_range & (block_row >= 0)
        where = block_row.to(tl.int64) * stride_wr + (token % BLOCK) * stride_wt
        box = present[:, None] & d_ok[None, :]
        k = tl.load(ws_k + where[:, None] + d[None, :], mask=box, other=0.0).to(compute)
        v = tl.load(ws_v + where[:, None] + d[None, :], mask=box, other=0.0).to(compute)
        allowed = q_ok[:, None] & present[None, :]
        row_max, denom, acc = _online_softmax_step(q, k, v, allowed, row_max, denom, acc, scale, IEEE)
    # 2. tail tokens from the pool (per-row visibility)
    for start in range(0, tail_len, BLOCK_T):
        token = start + t
        in_range = token < tail_len
        loc = tl.load(tail_locs + b * stride_lb + token, mask=in_range, other=0).to(tl.int64)
        seen = tl.load(
            tail_valid + b * stride_mb + row[:, None] * stride_mr + token[None, :],
            mask=q_ok[:, None] & in_range[None, :],
            other=0,
        )
        box = in_range[:, None] & d_ok[None, :]
        k = tl.load(tail_k + loc[:, None] * stride_kn + h * stride_kh + d[None, :], mask=box, other=0.0)
        v = tl.load(tail_v + loc[:, None] * stride_vn + h * stride_vh + d[None, :], mask=box, other=0.0)
        allowed = seen != 0
        k, v = k.to(compute), v.to(compute)
        row_max, denom, acc = _online_softmax_step(q, k, v, allowed, row_max, denom, acc, scale, IEEE)
    result = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    tl.store(
        out + b * stride_ob + row[:, None] * stride_or + q_head[:, None] * stride_oh + d[None, :],
        result.to(out.dtype.element_ty),
        mask=q_ok[:, None] & d_ok[None, :],
    )


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
    """Same contract as ``sgl_kernel_oasis.headwise_decode_attention``."""
    batch, rows, num_q_heads, head_dim = query.shape
    _, num_kv_heads, num_slots = slot_rows.shape
    group = num_q_heads // num_kv_heads
    assert num_q_heads % num_kv_heads == 0 and query.stride(-1) == 1
    assert ws_k.stride() == ws_v.stride() and ws_k.stride(-1) == 1
    assert tail_k.stride(-1) == 1 and tail_v.stride(-1) == 1 and slot_rows.stride(-1) == 1
    assert tail_locs.stride(-1) == 1 and tail_valid.stride(-1) == 1
    out = torch.empty_like(query)
    if out.numel() == 0:
        return out
    valid = tail_valid.to(torch.int8) if tail_valid.dtype == torch.bool else tail_valid
    ieee = ws_k.dtype == torch.float32 or query.dtype == torch.float32
    _headwise_kernel[(batch, num_kv_heads)](
        query, ws_k, ws_v, slot_rows, tail_k, tail_v, tail_locs, valid, out, scale,
        num_slots, tail_locs.shape[1], head_dim,
        query.stride(0), query.stride(1), query.stride(2), ws_k.stride(0), ws_k.stride(1),
        slot_rows.stride(0), slot_rows.stride(1), tail_k.stride(0), tail_k.stride(1),
        tail_v.stride(0), tail_v.stride(1), tail_locs.stride(0), valid.stride(0), valid.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        GROUP=group, ROWS=rows, BLOCK=ws_k.shape[1], BLOCK_Q=max(16, triton.next_power_of_2(rows * group)),
        BLOCK_T=64, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), IEEE=ieee,
    )  # fmt: skip
    return out
