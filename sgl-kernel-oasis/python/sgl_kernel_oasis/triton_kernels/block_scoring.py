"""Triton ``score_paged_blocks``: one program per (request, KV head, tile of blocks).

Per query row the G query heads of the group fold into one positive and one negative vector
(``sum_g relu(q_g)`` and ``sum_g min(q_g, 0)``, see ``score_blocks_batched``); each block's score is
``positive . kmax[page] + negative . kmin[page]``, the summaries read in place through the page table::

    program (b, h, tile): pages[b, tile] -> kmin/kmax rows [BLOCK_N, D] -> one score per row and block
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _score_kernel(
    query,
    kmin,
    kmax,
    pages,
    out,
    num_blocks,
    head_dim,
    stride_qb,
    stride_qr,
    stride_qh,
    stride_pb,
    stride_sp,
    stride_sh,
    stride_ob,
    stride_or,
    stride_oh,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    g = tl.arange(0, BLOCK_G)
    n_ok = n < num_blocks
    d_ok = d < head_dim
    page = tl.load(pages + b * stride_pb + n, mask=n_ok, other=0).to(tl.int64)
    summary = page[:, None] * stride_sp + h * stride_sh + d[None, :]
    box = n_ok[:, None] & d_ok[None, :]
    low = tl.load(kmin + summary, mask=box, other=0.0).to(tl.float32)
    high = tl.load(kmax + summary, mask=box, other=0.0).to(tl.float32)
    q_mask = (g < GROUP)[:, None] & d_ok[None, :]
    for r in tl.static_range(ROWS):
        q_ptr = query + b * stride_qb + r * stride_qr + (h * GROUP + g)[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr, mask=q_mask, other=0.0).to(tl.float32)
        positive = tl.sum(tl.maximum(q, 0.0), axis=0)
        negative = tl.sum(tl.minimum(q, 0.0), axis=0)
        score = tl.sum(high * positive[None, :] + low * negative[None, :], axis=1)
        tl.store(out + b * stride_ob + r * stride_or + h * stride_oh + n, score, mask=n_ok)


def score_paged_blocks(
    query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, pages: torch.Tensor
) -> torch.Tensor:
    """Same contract as ``sgl_kernel_oasis.score_paged_blocks``."""
    batch, rows, num_q_heads, head_dim = query.shape
    num_kv_heads = kmin.shape[1]
    num_blocks = pages.shape[1]
    assert num_q_heads % num_kv_heads == 0 and query.stride(-1) == 1 and kmin.stride(-1) == 1
    assert kmax.stride() == kmin.stride() and pages.stride(-1) == 1
    group = num_q_heads // num_kv_heads
    out = torch.empty((batch, rows, num_kv_heads, num_blocks), dtype=torch.float32, device=query.device)
    if out.numel() == 0:
        return out
    block_n = 64
    grid = (batch, num_kv_heads, triton.cdiv(num_blocks, block_n))
    _score_kernel[grid](
        query, kmin, kmax, pages, out, num_blocks, head_dim,
        query.stride(0), query.stride(1), query.stride(2), pages.stride(0), kmin.stride(0), kmin.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        GROUP=group, ROWS=rows, BLOCK_G=triton.next_power_of_2(group), BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
    return out
